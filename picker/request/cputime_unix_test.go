//go:build unix

package request

import (
	"syscall"
	"time"
)

// processCPU is the CPU time this process has used. The benchmark reports it
// per operation next to ns/op because the machines it runs on are shared:
// wall time includes waiting for a core, CPU time does not.
func processCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
