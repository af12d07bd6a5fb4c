//go:build !unix

package benchcpu

import "time"

// ProcessCPU reports that CPU time cannot be measured on this platform.
func ProcessCPU() (time.Duration, bool) { return 0, false }
