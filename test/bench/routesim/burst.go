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
	// Samples are for the chart, not the JSON report.
	Samples []Sample `json:"-"`
}

// BurstReport is the burst scenario over every policy.
type BurstReport struct {
	Burst Burst
	Runs  []BurstRun
	// BoundTTFT is the no-queueing bound's TTFT of one burst request.
	BoundTTFT time.Duration
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
	return Prepare(b.Trace(), cfg)
}

// SummarizeBurst reduces a run of the burst workload.
func SummarizeBurst(r *Result) BurstRun {
	br := BurstRun{Policy: r.Policy, WarmEngine: r.Outcomes[0].Engine, Placed: make([]int, len(r.Placed)), Samples: r.Samples}
	ttft := make([]time.Duration, 0, len(r.Outcomes)-1)
	for _, o := range r.Outcomes[1:] {
		if o.Refused != "" {
			br.Refused++
			continue
		}
		br.Placed[o.Engine]++
		ttft = append(ttft, o.TTFT)
		br.Drained = max(br.Drained, o.E2E)
	}
	br.TTFT = distOf(ttft)
	return br
}

func (r *BurstReport) writeMarkdown(b *strings.Builder) {
	bu := r.Burst
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
