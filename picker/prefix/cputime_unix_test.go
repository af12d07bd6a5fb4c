//go:build unix

package prefix

import (
	"syscall"
	"time"
)

// processCPU is the CPU time this process has used. BenchmarkHash reports
// throughput per CPU second next to MB/s because the machine it runs on is
// shared: wall time includes waiting for a core, CPU time does not.
func processCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
