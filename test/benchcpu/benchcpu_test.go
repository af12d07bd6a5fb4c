package benchcpu

import "testing"

func TestProcessCPUGrowsWithWork(t *testing.T) {
	start, ok := ProcessCPU()
	if !ok {
		t.Skip("CPU time is not measurable on this platform")
	}
	x := 0
	for i := range 50_000_000 {
		x += i % 7
	}
	end, _ := ProcessCPU()
	if end <= start {
		t.Fatalf("CPU time did not grow after work (%d): %v then %v", x, start, end)
	}
}
