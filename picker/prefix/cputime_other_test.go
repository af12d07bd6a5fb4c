//go:build !unix

package prefix

import "time"

func processCPU() (time.Duration, bool) { return 0, false }
