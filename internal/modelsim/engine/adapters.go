package engine

import "slices"

// AdapterRequests follows requests by LoRA adapter as vLLM's output
// processor does (LoRARequestStates in vllm/v1/metrics/stats.py), for
// vllm:lora_requests_info. A request is waiting from its arrival until its
// first token and running from then until it leaves: vLLM learns that a
// request was scheduled from the events sent with its first output, and the
// engine sends no output for a prefill chunk. Requests of the base model
// (adapter "") are not counted. The zero value is ready to use.
type AdapterRequests struct {
	// order lists adapters as first requested: vLLM joins the names in
	// that order (a dict's insertion order).
	order            []string
	waiting, running map[string]int
}

// Add counts a request of adapter arriving.
func (l *AdapterRequests) Add(adapter string) {
	if adapter == "" {
		return
	}
	if l.waiting == nil {
		l.waiting, l.running = map[string]int{}, map[string]int{}
	}
	if !slices.Contains(l.order, adapter) {
		l.order = append(l.order, adapter)
	}
	l.waiting[adapter]++
}

// Started moves a request from waiting to running at its first token.
func (l *AdapterRequests) Started(adapter string) {
	if adapter == "" {
		return
	}
	l.waiting[adapter]--
	l.running[adapter]++
}

// Left counts a request leaving, finished or cancelled, after its first
// token or before it.
func (l *AdapterRequests) Left(adapter string, started bool) {
	switch {
	case adapter == "":
	case started:
		l.running[adapter]--
	default:
		l.waiting[adapter]--
	}
}

// Adapters returns the adapters that have running requests and those that
// have waiting ones, each in the order they were first requested.
func (l *AdapterRequests) Adapters() (running, waiting []string) {
	for _, a := range l.order {
		if l.running[a] > 0 {
			running = append(running, a)
		}
		if l.waiting[a] > 0 {
			waiting = append(waiting, a)
		}
	}
	return running, waiting
}
