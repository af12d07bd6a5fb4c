package routesim

import "slices"

// LoRA adapters (Config.Adapters). Each request of the trace is for an
// adapter drawn from a Zipf mix (or stays on the base model); the engines
// run at most max_loras adapters at once and pay a load for each swap
// (package engine). What a policy sees of them is what vLLM publishes in
// vllm:lora_requests_info, on the policy's own scrape interval: the
// adapters of each engine's requests before their first token (waiting)
// and after it (running), as the model-server simulator writes them
// (internal/modelsim/server). No policy sees which adapters sit idle in a
// slot: vLLM does not say.
//
//   - Tally's picker gets them in EngineStats (its scrape every 250 ms),
//     with the base model's name and max_lora, and each request's model
//     name is its adapter's, as vLLM serves adapters.
//   - upstream-like adds the upstream picker's lora-affinity-scorer
//     (v1.5.0): 1 where the adapter is running, 0.8 where running plus
//     waiting adapters are fewer than max_lora, 0.6 where it is waiting,
//     0 elsewhere, at weight 1 (what upstream gives a scorer that its
//     profile names without a weight; its built-in default profile has no
//     LoRA scorer), from its 50 ms scrape.
//   - round-robin and least-request ignore them.

// loraObserver is a policy that reads lora_requests_info: the simulation
// calls observeLoRA with every engine's adapters just before observe, at
// the same instant. The slices are the policy's to keep.
type loraObserver interface {
	observeLoRA(engines []loraInfo)
}

// loraInfo is one engine's lora_requests_info: the adapters of its running
// and waiting requests, in the order they were first requested there.
type loraInfo struct {
	running, waiting []string
}

// loraScrape reads every engine's lora_requests_info.
func (s *sim) loraScrape() []loraInfo {
	out := make([]loraInfo, len(s.lora))
	for i := range s.lora {
		out[i].running, out[i].waiting = s.lora[i].Adapters()
	}
	return out
}

// The upstream picker's lora-affinity-scorer (v1.5.0) and the weight it
// has in a profile that names it without one.
const (
	upstreamLoRAWeight = 1
	loraScoreActive    = 1.0
	loraScoreFreeSlot  = 0.8
	loraScoreWaiting   = 0.6
)

// upstreamLoRAScore is lora-affinity-scorer's score of an engine whose
// last scrape said in, with max_lora maxLoRAs, for a request of model.
// Like upstream it scores every request, a base-model one too: the base
// model is never among the adapters, so it scores where a slot is free.
func upstreamLoRAScore(in loraInfo, maxLoRAs int, model string) float64 {
	switch {
	case slices.Contains(in.running, model):
		return loraScoreActive
	case len(in.running)+len(in.waiting) < maxLoRAs:
		return loraScoreFreeSlot
	case slices.Contains(in.waiting, model):
		return loraScoreWaiting
	}
	return 0
}
