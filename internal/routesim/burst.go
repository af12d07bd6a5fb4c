package routesim

import (
	"fmt"
	"strings"
	"time"
)

// Burst is the burst scenario: one request warms an engine's cache with a
// prefix, then Requests requests sharing that prefix arrive at the same
// instant, each with a tail of its own. A router that learns load from
// scrapes sees the same picture for the whole burst; one that reserves load
// as it places spreads it, and the shared prefix pulls only as much as it
// saves.
type Burst struct {
	Requests     int
	PromptTokens int
	SharedTokens int
	OutputTokens int
}

// DefaultBurst: 128 requests of 8,192 tokens, half of them shared.
func DefaultBurst() Burst {
	return Burst{Requests: 128, PromptTokens: 8192, SharedTokens: 4096, OutputTokens: 64}
}

// burstAt is when the burst arrives, after the warm-up request is done.
const burstAt = time.Second

// BurstAdapter is the LoRA adapter of the burst's requests when the pool
// serves adapters (Config.Adapters): one no engine has loaded, since the
// warm-up request is for the base model (its prefix is then no use to the
// burst: the cache is keyed by adapter).
const BurstAdapter = "lora-burst"

// burstSampleEvery is the resolution of the in-flight chart.
const burstSampleEvery = 20 * time.Millisecond

// Validate names the first field out of range.
func (b Burst) Validate() error {
	switch {
	case b.Requests < 1:
		return fmt.Errorf("burst requests: %d is invalid: must be 1 or more", b.Requests)
	case b.PromptTokens < 1:
		return fmt.Errorf("burst prompt tokens: %d is invalid: must be 1 or more", b.PromptTokens)
	case b.SharedTokens < 0 || b.SharedTokens > b.PromptTokens:
		return fmt.Errorf("burst shared tokens: %d is invalid: must be from 0 to the prompt's %d", b.SharedTokens, b.PromptTokens)
	case b.OutputTokens < 1:
		return fmt.Errorf("burst output tokens: %d is invalid: must be 1 or more", b.OutputTokens)
	}
	return nil
}

// Trace returns the warm-up request (first) and the burst.
func (b Burst) Trace() []Request {
	blocks := blocksFor(b.PromptTokens)
	shared := b.SharedTokens / traceBlockTokens // whole 512-token ids
	next := blocks                              // ids below blocks are the shared prefix's
	mk := func(at time.Duration) Request {
		ids := make([]int, blocks)
		for i := range ids {
			if i < shared {
				ids[i] = i
				continue
			}
			ids[i] = next
			next++
		}
		return Request{Arrival: at, InputTokens: b.PromptTokens, OutputTokens: b.OutputTokens, HashIDs: ids}
	}
	out := []Request{mk(0)}
	for range b.Requests {
		out = append(out, mk(burstAt))
	}
	return out
}

// BurstRun is one policy's run of the burst.
type BurstRun struct {
	Policy string
	// WarmEngine holds the shared prefix before the burst.
	WarmEngine int
	// Placed is the burst's requests per engine.
	Placed []int
	TTFT   Dist
	// Drained is when the last burst request finished, after the burst.
	Drained time.Duration
	// Refused counts the burst's requests answered 429 (flow control).
	Refused int `json:",omitempty"`
	// Prefill is the prompt tokens each engine computed for the burst
	// (not found in its cache); AdapterLoads the adapters the engines
	// loaded, the warm-up's included (none: it is for the base model).
	Prefill      []int
	AdapterLoads int64 `json:",omitempty"`
	// Samples are for the chart, not the JSON report.
	Samples []Sample `json:"-"`
}

// BurstReport is the burst scenario over every policy.
type BurstReport struct {
	Burst Burst
	Runs  []BurstRun
	// BoundTTFT is the no-queueing bound's TTFT of one burst request.
	BoundTTFT time.Duration
	// Adapter is the burst's LoRA adapter (BurstAdapter); "" for the
	// base model.
	Adapter string `json:",omitempty"`
}

// PrepareBurst prepares the burst scenario on cfg's pool: every request
// streams and goes through the policy.
func PrepareBurst(b Burst, cfg Config) (*Workload, error) {
	if err := b.Validate(); err != nil {
		return nil, err
	}
	cfg.LoadFactor, cfg.NonStreaming, cfg.Bypass = 1, 0, 0
	cfg.Priorities, cfg.FlowWeights = nil, nil
	cfg.SampleEvery = burstSampleEvery
	reqs := b.Trace()
	if cfg.lora() {
		cfg.BaseFraction = 1 // the warm-up stays on the base model
		for i := range reqs[1:] {
			reqs[1+i].Adapter = BurstAdapter
		}
	}
	return Prepare(reqs, cfg)
}

// SummarizeBurst reduces a run of the burst workload.
func SummarizeBurst(r *Result) BurstRun {
	br := BurstRun{Policy: r.Policy, WarmEngine: r.Outcomes[0].Engine, Placed: make([]int, len(r.Placed)),
		Prefill: make([]int, len(r.Placed)), Samples: r.Samples}
	for _, e := range r.Engines {
		br.AdapterLoads += e.AdapterLoads
	}
	ttft := make([]time.Duration, 0, len(r.Outcomes)-1)
	for _, o := range r.Outcomes[1:] {
		if o.Refused != "" {
			br.Refused++
			continue
		}
		br.Placed[o.Engine]++
		br.Prefill[o.Engine] += o.PromptTokens - o.CachedTokens
		ttft = append(ttft, o.TTFT)
		br.Drained = max(br.Drained, o.E2E)
	}
	br.TTFT = distOf(ttft)
	return br
}

func (r *BurstReport) writeMarkdown(b *strings.Builder) {
	bu := r.Burst
	if r.Adapter != "" {
		r.writeAdapterMarkdown(b)
		return
	}
	fmt.Fprintf(b, "Burst: %d requests of %d tokens arrive at once, sharing their first %d tokens, which one engine (marked *) holds from an earlier request; %d output tokens each. Bound TTFT of one: %s s.\n\n",
		bu.Requests, bu.PromptTokens, bu.SharedTokens, bu.OutputTokens, secs(r.BoundTTFT))
	b.WriteString("| policy | placed per engine | TTFT p50 | p90 | p99 | mean | all done after |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|\n")
	for _, run := range r.Runs {
		placed := make([]string, len(run.Placed))
		for i, n := range run.Placed {
			placed[i] = fmt.Sprint(n)
			if i == run.WarmEngine {
				placed[i] += "*"
			}
		}
		placedList := strings.Join(placed, " / ")
		if run.Refused > 0 {
			placedList += fmt.Sprintf(" (+%d refused, 429)", run.Refused)
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s | %s |\n", run.Policy, placedList,
			secs(run.TTFT.P50), secs(run.TTFT.P90), secs(run.TTFT.P99), secs(run.TTFT.Mean), secs(run.Drained))
	}
	b.WriteString("\nSeconds from the burst's arrival.\n")
}

// writeAdapterMarkdown writes the burst for an adapter no engine has
// loaded: where it landed, and each engine's share of its prefill.
func (r *BurstReport) writeAdapterMarkdown(b *strings.Builder) {
	bu := r.Burst
	fmt.Fprintf(b, "Burst for LoRA adapter %s, which no engine has loaded: %d requests of %d tokens arrive at once, sharing their first %d tokens under the adapter; %d output tokens each. Bound TTFT of one: %s s. Prefill per engine is the prompt tokens each computed for the burst, over the even share (the total over the engines): at most 2 keeps every engine within twice it.\n\n",
		r.Adapter, bu.Requests, bu.PromptTokens, bu.SharedTokens, bu.OutputTokens, secs(r.BoundTTFT))
	b.WriteString("| policy | placed per engine | engines used | prefill per engine / even share | swaps | TTFT p50 | p99 | all done after |\n")
	b.WriteString("|---|---|---:|---|---:|---:|---:|---:|\n")
	for _, run := range r.Runs {
		used, total := 0, 0
		for i, n := range run.Placed {
			if n > 0 {
				used++
			}
			total += run.Prefill[i]
		}
		shares := make([]string, len(run.Prefill))
		for i, p := range run.Prefill {
			shares[i] = "–"
			if total > 0 {
				shares[i] = fmt.Sprintf("%.2f", float64(p)*float64(len(run.Prefill))/float64(total))
			}
		}
		placed := joinInts(run.Placed)
		if run.Refused > 0 {
			placed += fmt.Sprintf(" (+%d refused, 429)", run.Refused)
		}
		fmt.Fprintf(b, "| %s | %s | %d | %s | %d | %s | %s | %s |\n", run.Policy, placed, used, strings.Join(shares, " / "),
			run.AdapterLoads, secs(run.TTFT.P50), secs(run.TTFT.P99), secs(run.Drained))
	}
	b.WriteString("\nSeconds from the burst's arrival.\n")
}
