//go:build !unix

package picker

import "time"

func processCPU() (time.Duration, bool) { return 0, false }
