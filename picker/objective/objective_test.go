package objective

import (
	"sync"
	"testing"
)

func TestPrioritiesAreReplacedWhole(t *testing.T) {
	var o Priorities
	if p, ok := o.Priority("critical"); ok || p != 0 || o.Len() != 0 {
		t.Fatalf("zero value: Priority = %d, %v; Len = %d, want 0, false; 0", p, ok, o.Len())
	}
	in := map[string]int{"critical": 10, "batch": 0, "best-effort": -1}
	o.ReplaceObjectives(in)
	in["critical"] = 99 // the caller's map is copied
	for name, want := range map[string]int{"critical": 10, "batch": 0, "best-effort": -1} {
		if p, ok := o.Priority(name); !ok || p != want {
			t.Errorf("Priority(%q) = %d, %v, want %d, true", name, p, ok, want)
		}
	}
	if o.Len() != 3 {
		t.Errorf("Len = %d, want 3", o.Len())
	}
	o.ReplaceObjectives(map[string]int{"batch": 5})
	if _, ok := o.Priority("critical"); ok {
		t.Error("an objective left out of the new set is still known")
	}
	if p, _ := o.Priority("batch"); p != 5 || o.Len() != 1 {
		t.Errorf("after the replacement: batch %d, Len %d, want 5, 1", p, o.Len())
	}
}

// Readers run beside a writer without a lock (run with -race): each sees
// one whole version.
func TestReadersSeeOneVersion(t *testing.T) {
	var o Priorities
	o.ReplaceObjectives(map[string]int{"a": 0, "b": 0})
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range 1000 {
			o.ReplaceObjectives(map[string]int{"a": i, "b": i})
		}
	})
	for range 1000 {
		if n := o.Len(); n != 2 {
			t.Fatalf("Len = %d, want 2 in every version", n)
		}
		if _, ok := o.Priority("a"); !ok {
			t.Fatal("an objective every version has is unknown")
		}
	}
	wg.Wait()
}
