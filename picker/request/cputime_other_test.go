//go:build !unix

package request

import "time"

func processCPU() (time.Duration, bool) { return 0, false }
