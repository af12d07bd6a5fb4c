//go:build unix

package benchcpu

import (
	"syscall"
	"time"
)

// ProcessCPU is the CPU time (user + system) this process has used, and
// whether the platform can tell.
func ProcessCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
