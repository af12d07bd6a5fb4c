package engine

import (
	"slices"
	"testing"
)

// lora_requests_info as vLLM writes it: a request waits until its first
// token and runs until it leaves; names in the order first requested.
func TestAdapterRequestsAsVLLMReportsThem(t *testing.T) {
	var l AdapterRequests
	l.Add("b")
	l.Add("a")
	l.Add("b")
	l.Add("")
	if running, waiting := l.Adapters(); running != nil || !slices.Equal(waiting, []string{"b", "a"}) {
		t.Fatalf("before any first token: running %v waiting %v", running, waiting)
	}
	l.Started("b")
	if running, waiting := l.Adapters(); !slices.Equal(running, []string{"b"}) || !slices.Equal(waiting, []string{"b", "a"}) {
		t.Fatalf("after b's first token: running %v waiting %v", running, waiting)
	}
	l.Started("b")
	l.Left("b", true)
	l.Started("a")
	if running, waiting := l.Adapters(); !slices.Equal(running, []string{"b", "a"}) || waiting != nil {
		t.Fatalf("every request running: running %v waiting %v", running, waiting)
	}
	l.Left("a", true)
	l.Left("b", true)
	l.Add("c")
	l.Left("c", false) // cancelled before its first token
	if running, waiting := l.Adapters(); running != nil || waiting != nil {
		t.Fatalf("every request gone: running %v waiting %v", running, waiting)
	}
}
