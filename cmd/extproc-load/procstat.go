package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// clockTicksPerSecond is the unit of utime and stime in /proc/<pid>/stat
// (USER_HZ, 100 on every Linux the tool runs on).
const clockTicksPerSecond = 100

// procCPU is the CPU time (user + system, every thread) the process has
// used, from /proc/<pid>/stat.
func procCPU(pid int) (time.Duration, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("reading the picker's CPU time: %w", err)
	}
	// The command name (field 2) is in parentheses and may hold spaces:
	// fields are counted after its closing one. utime and stime are fields
	// 14 and 15, so the 12th and 13th after it.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, fmt.Errorf("parsing /proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(data[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("parsing /proc/%d/stat: %d fields after the command name, want at least 13", pid, len(f))
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("parsing /proc/%d/stat: utime %q, stime %q", pid, f[11], f[12])
	}
	return time.Duration(utime+stime) * time.Second / clockTicksPerSecond, nil
}

// procMemory returns the process's resident set now (VmRSS) and its peak
// (VmHWM), in bytes, from /proc/<pid>/status.
func procMemory(pid int) (rss, peak int64, err error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, fmt.Errorf("reading the picker's memory: %w", err)
	}
	for line := range strings.Lines(string(data)) {
		name, value, ok := strings.Cut(line, ":")
		if !ok || (name != "VmRSS" && name != "VmHWM") {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(value), " kB"), 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("parsing %s in /proc/%d/status: %q", name, pid, value)
		}
		if name == "VmRSS" {
			rss = kb << 10
		} else {
			peak = kb << 10
		}
	}
	if rss == 0 || peak == 0 {
		return 0, 0, fmt.Errorf("parsing /proc/%d/status: no VmRSS or VmHWM", pid)
	}
	return rss, peak, nil
}

// resetPeakMemory makes VmHWM start again from the current resident set
// (writing 5 to clear_refs), so a measured window's peak is its own. It
// reports whether the kernel allowed it; if not, the peak is since start.
func resetPeakMemory(pid int) bool {
	return os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0) == nil
}

// usage is what a picker process used over a measured window.
type usage struct {
	cpu time.Duration
	// peak is the largest resident set during the window (since the
	// process started if peakSinceStart).
	peak           int64
	peakSinceStart bool
}

// meter measures the usage of processes (a picker's replicas) from start
// to stop: their CPU time summed, and their peaks summed (each replica's
// memory is its own). No pids measures nothing.
type meter struct {
	pids       []int
	cpu0       time.Duration
	peakWindow bool
}

func startMeter(pids ...int) (*meter, error) {
	m := &meter{peakWindow: true}
	for _, pid := range pids {
		if pid != 0 {
			m.pids = append(m.pids, pid)
		}
	}
	for _, pid := range m.pids {
		m.peakWindow = resetPeakMemory(pid) && m.peakWindow
		cpu, err := procCPU(pid)
		if err != nil {
			return m, err
		}
		m.cpu0 += cpu
	}
	return m, nil
}

func (m *meter) stop() (usage, error) {
	if len(m.pids) == 0 {
		return usage{}, nil
	}
	var u usage
	for _, pid := range m.pids {
		cpu, err := procCPU(pid)
		if err != nil {
			return usage{}, err
		}
		_, peak, err := procMemory(pid)
		if err != nil {
			return usage{}, err
		}
		u.cpu += cpu
		u.peak += peak
	}
	u.cpu -= m.cpu0
	u.peakSinceStart = !m.peakWindow
	return u, nil
}
