// Package routesim replays an LLM-serving trace against simulated vLLM
// engines (package internal/modelsim/engine) in virtual time, routed by one of
// several policies, one of them the real picker package, and reports the
// latency each policy gives beside the no-queueing bound: each request
// alone on an idle engine whose unbounded cache has seen every earlier
// request (bound.go).
//
// A run is a discrete-event simulation in one goroutine: the next event is
// the earliest of the next arrival, the end of an engine's step and the
// policy's next metrics observation, and nothing reads the wall clock but
// the report of how long the run took. The picker's clock (picker.Options.Now)
// is the simulation's. Runs of different policies share only read-only
// data, so a Suite runs them in parallel.
//
// What a policy sees is what a router in a cluster would: round-robin
// nothing; least-request and upstream-like the engines' gauges every 50 ms
// (running and waiting requests, KV-cache usage); Tally the prompt text,
// each response's first bytes (at the first token when the client streams,
// at the end otherwise), its usage (cached tokens) before the release, and
// every engine's scrape every 250 ms (picker.ObserveScrapes: running,
// waiting, cache size), through which requests that bypass it appear as
// foreign load. Not modelled: the network and the gateway (no latency, no
// failures), and scrapes take no time.
//
// Tally with flow control (policy tally-flow, or flowControl enabled in the
// picker's configuration) is the picker's non-blocking Enqueue: a request it
// holds reaches no engine until its ticket says it was placed, and then the
// engine its reservation names, at that virtual instant. The picker runs its
// dispatch cycles inside the calls the simulation makes (first bytes,
// releases, scrapes, arrivals); the simulation runs the others at
// NextDispatch, as the picker's timer would in real time. Requests can carry
// priorities and fairness ids (Config.Priorities, Config.FlowWeights), and
// the requests it refuses (429) are counted apart, in no latency figure.
//
// LoRA adapters (Config.Adapters, lora.go): each request is for an
// adapter drawn from a Zipf mix, the engines run at most max_loras at once
// and pay for each swap, and the policies that read metrics see vLLM's
// lora_requests_info in their scrapes (Tally's picker, and upstream-like
// through the upstream lora-affinity-scorer); the report counts the swaps.
//
// Prefill/decode disaggregation (Config.Roles, pd.go): engines carry
// llm-d's roles, and a policy that splits a request (Tally with the
// picker's disaggregation on, llm-d-like in llmd.go) runs it as llm-d's
// sidecar does, in virtual time: a prefill leg of one output token on the
// prefill engine, then, at the instant it ends, the decode leg on the
// destination, which pulls the blocks it does not cache (the engine's
// RemotePrefill) and frees them on the prefill engine. TTFT is the decode
// leg's first token; the policy hears of nothing before it.
//
// The prompts: each 512-token Mooncake hash_id expands into the same text
// as internal/stack's (32 chunks of 64 characters), and the engines' block
// hashes are the model server's (chained xxhash of each 64-character,
// 16-token block), so prefixes are shared exactly as in the demo stack.
// Azure traces, which carry no prefix data, get a system prompt per tenant.
//
// The invariant not to break: a run is a function of the workload, the
// configuration and the seed. Same inputs, same numbers, to the
// nanosecond of virtual time; nothing may depend on map order, goroutine
// scheduling or the wall clock.
package routesim
