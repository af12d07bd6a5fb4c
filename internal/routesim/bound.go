package routesim

import (
	"time"

	"github.com/tallyepp/tally/internal/modelsim/engine"
)

// Bound is the no-queueing bound of one request: its latency alone on an
// idle engine whose cache is unbounded and has seen every earlier request
// of the trace. No placement can do better: on a real engine the request
// finds at most those blocks cached (only earlier requests can have put
// them there), computes at least the rest in steps of at most the step
// budget, each step costing at least its base and its own tokens, and may
// wait for steps ahead of it.
type Bound struct {
	TTFT, E2E     time.Duration
	PrefillTokens int // prompt tokens it computes
}

// leadingHits counts the leading blocks of hashes that seen holds.
func leadingHits(seen map[uint64]struct{}, hashes []uint64) int {
	n := 0
	for _, h := range hashes {
		if _, ok := seen[h]; !ok {
			break
		}
		n++
	}
	return n
}

// boundOf is the step model of package engine for one request alone: the
// prompt's cached leading blocks are skipped, never its last token; the
// rest is prefilled in chunks of the step budget, and the step that
// finishes the prompt produces the first token; each later step produces
// one more, with one sequence decoding.
func boundOf(c engine.Config, promptTokens, outputTokens, hits int) Bound {
	hits = min(hits, (promptTokens-1)/c.BlockSizeTokens)
	prefill := promptTokens - hits*c.BlockSizeTokens
	steps := (prefill + c.StepBudgetTokens - 1) / c.StepBudgetTokens
	ttft := time.Duration(steps)*c.StepBaseDuration + time.Duration(prefill)*c.PrefillDurationPerToken
	decode := time.Duration(outputTokens-1) * (c.StepBaseDuration + c.DecodeDurationPerSequence)
	return Bound{TTFT: ttft, E2E: ttft + decode, PrefillTokens: prefill}
}
