package routesim

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
)

// Dist is a latency distribution's percentiles (nearest rank) and mean.
type Dist struct {
	P50, P90, P99, Mean time.Duration
}

func distOf(ds []time.Duration) Dist {
	if len(ds) == 0 {
		return Dist{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	var sum float64
	for _, d := range s {
		sum += float64(d)
	}
	return Dist{
		P50:  percentile(s, 0.50),
		P90:  percentile(s, 0.90),
		P99:  percentile(s, 0.99),
		Mean: time.Duration(sum / float64(len(s))),
	}
}

// percentile of sorted values by nearest rank: the smallest value with at
// least q of the values at or below it.
func percentile(sorted []time.Duration, q float64) time.Duration {
	rank := int(q*float64(len(sorted))+0.999999999) - 1
	return sorted[min(max(rank, 0), len(sorted)-1)]
}

// Summary is one policy's (or the bound's) figures over a run.
type Summary struct {
	Policy   string
	Requests int
	TTFT     Dist
	E2E      Dist
	// PrefixHitRate is the share of prompt tokens found in the engines'
	// caches, as the engines report it (vllm:prefix_cache_hits_total over
	// queries).
	PrefixHitRate float64
	// Placed is the requests the policy placed on each engine; Bypassed
	// those sent past it.
	Placed   []int
	Bypassed int
	// PrefillSpread is the busiest engine's computed prefill tokens over
	// the mean: 1 is perfectly even work.
	PrefillSpread float64
	// End is when the last request finished (virtual); Wall is how long
	// the run took.
	End, Wall time.Duration

	ttfts []time.Duration // sorted, for the CDF chart
}

// Summarize reduces a run to its figures.
func Summarize(r *Result) Summary {
	s := Summary{Policy: r.Policy, Requests: len(r.Outcomes), Placed: r.Placed, End: r.End, Wall: r.Wall}
	ttft := make([]time.Duration, len(r.Outcomes))
	e2e := make([]time.Duration, len(r.Outcomes))
	for i, o := range r.Outcomes {
		ttft[i], e2e[i] = o.TTFT, o.E2E
		if o.Bypass {
			s.Bypassed++
		}
	}
	s.TTFT, s.E2E = distOf(ttft), distOf(e2e)
	slices.Sort(ttft)
	s.ttfts = ttft
	var queries, hits, prefill, most int64
	for _, e := range r.Engines {
		queries += e.PrefixQueryTokens
		hits += e.PrefixHitTokens
		prefill += e.PrefillTokens
		most = max(most, e.PrefillTokens)
	}
	if queries > 0 {
		s.PrefixHitRate = float64(hits) / float64(queries)
	}
	if prefill > 0 {
		s.PrefillSpread = float64(most) * float64(len(r.Engines)) / float64(prefill)
	}
	return s
}

// BoundSummary is the no-queueing bound's figures for the workload.
func (w *Workload) BoundSummary() Summary {
	ttft := make([]time.Duration, len(w.jobs))
	e2e := make([]time.Duration, len(w.jobs))
	var prompt int64
	for i := range w.jobs {
		ttft[i], e2e[i] = w.jobs[i].bound.TTFT, w.jobs[i].bound.E2E
		prompt += int64(w.jobs[i].InputTokens)
	}
	s := Summary{Policy: "bound", Requests: len(w.jobs), TTFT: distOf(ttft), E2E: distOf(e2e)}
	slices.Sort(ttft)
	s.ttfts = ttft
	if prompt > 0 {
		s.PrefixHitRate = float64(w.BoundCachedTokens) / float64(prompt)
	}
	return s
}

// Report is what a routesim invocation writes.
type Report struct {
	// Source describes the trace ("mooncake_sample.jsonl, 400 requests").
	Source string
	Config Config
	// Stats of the workload: offered prefill load against the engines'
	// capacity, mean prompt and output.
	OfferedLoad              float64
	MeanPrompt, MeanOutput   float64
	Duration                 time.Duration // of arrivals, after scaling
	Bound                    Summary
	Runs                     []Summary
	Burst                    *BurstReport
	Wall                     time.Duration
	SimulatedRequests        int
	Command                  string
	ChartTTFT, ChartInFlight string // file names of the charts, when written
}

// Describe fills the workload's statistics into the report.
func (r *Report) Describe(w *Workload) {
	var prompt, output int64
	for i := range w.jobs {
		prompt += int64(w.jobs[i].InputTokens)
		output += int64(w.jobs[i].OutputTokens)
	}
	n := float64(len(w.jobs))
	r.MeanPrompt, r.MeanOutput = float64(prompt)/n, float64(output)/n
	r.Duration = w.jobs[len(w.jobs)-1].arrival
	if r.Duration > 0 {
		// Prefill work the bound computes per second, over what the
		// engines can prefill (full steps of the budget).
		ec := w.cfg.EngineConfig()
		step := ec.StepBaseDuration + time.Duration(ec.StepBudgetTokens)*ec.PrefillDurationPerToken
		rate := float64(ec.StepBudgetTokens) / step.Seconds() * float64(w.cfg.Engines)
		r.OfferedLoad = float64(w.BoundPrefillTokens) / r.Duration.Seconds() / rate
	}
}

// Title names the run: the trace, the engines and what differs from every
// request streaming through the policy at the trace's own pace.
func (r *Report) Title() string {
	t := fmt.Sprintf("%s, %d engines", r.Source, r.Config.Engines)
	if v := variant(r.Config); v != "" {
		t += ", " + v
	}
	return t
}

func variant(c Config) string {
	var parts []string
	if c.LoadFactor != 1 {
		parts = append(parts, fmt.Sprintf("load ×%g", c.LoadFactor))
	}
	if c.Bypass > 0 {
		parts = append(parts, fmt.Sprintf("%g%% of requests past the policy", 100*c.Bypass))
	}
	if c.NonStreaming > 0 {
		parts = append(parts, fmt.Sprintf("%g%% of clients not streaming", 100*c.NonStreaming))
	}
	return strings.Join(parts, ", ")
}

// configDiff lists the fields of c that differ from the defaults, as
// `name: value` in the configuration file's terms.
func configDiff(c v1alpha1.PickerConfig) string {
	fields := func(pc v1alpha1.PickerConfig) map[string]any {
		var m map[string]any
		data, _ := json.Marshal(v1alpha1.WithDefaults(pc))
		_ = json.Unmarshal(data, &m)
		return m
	}
	got, def := fields(c), fields(v1alpha1.PickerConfig{})
	var diff []string
	for k, v := range got {
		if dv, ok := def[k]; !ok || fmt.Sprint(dv) != fmt.Sprint(v) {
			diff = append(diff, fmt.Sprintf("`%s: %v`", k, v))
		}
	}
	slices.Sort(diff)
	return strings.Join(diff, ", ")
}

func secs(d time.Duration) string { return fmt.Sprintf("%.3f", d.Seconds()) }

func ratio(a, b time.Duration) string {
	if b <= 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f×", float64(a)/float64(b))
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, " / ")
}

// WriteMarkdown writes the report's tables (and, when the charts were
// written, links to them).
func (r *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	c := r.Config
	fmt.Fprintf(&b, "Trace: %s; %d engines, %d KV blocks each (%d tokens); load factor %g; non-streaming %g; bypass %g; seed %d.\n",
		r.Source, c.Engines, c.KVBlocks, c.KVBlocks*engineBlockTokens, c.LoadFactor, c.NonStreaming, c.Bypass, c.Seed)
	fmt.Fprintf(&b, "%d requests over %.1f s of arrivals; mean prompt %.0f tokens, mean output %.0f; offered prefill load %.0f%% of the engines' capacity (after the bound's cache hits).\n\n",
		r.Bound.Requests, r.Duration.Seconds(), r.MeanPrompt, r.MeanOutput, 100*r.OfferedLoad)
	if d := configDiff(c.Picker); d != "" {
		fmt.Fprintf(&b, "Tally's picker configuration differs from the defaults in: %s.\n\n", d)
	}

	b.WriteString("| policy | TTFT p50 | p90 | p99 | mean | E2E p50 | p90 | p99 | mean | prefix hits | placed per engine | prefill max/mean |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n")
	row := func(s Summary, placed, spread string) {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %.1f%% | %s | %s |\n",
			s.Policy, secs(s.TTFT.P50), secs(s.TTFT.P90), secs(s.TTFT.P99), secs(s.TTFT.Mean),
			secs(s.E2E.P50), secs(s.E2E.P90), secs(s.E2E.P99), secs(s.E2E.Mean), 100*s.PrefixHitRate, placed, spread)
	}
	for _, s := range r.Runs {
		placed := joinInts(s.Placed)
		if s.Bypassed > 0 {
			placed += fmt.Sprintf(" (+%d bypassed)", s.Bypassed)
		}
		row(s, placed, fmt.Sprintf("%.2f", s.PrefillSpread))
	}
	row(r.Bound, "–", "–")
	b.WriteString("\nSeconds. TTFT is the engine's first token (a non-streaming client sees the whole response at E2E instead). Bound: each request alone on an idle engine whose unbounded cache has seen every earlier request.\n\n")

	b.WriteString("As multiples of the no-queueing bound:\n\n")
	b.WriteString("| policy | TTFT p50 | p90 | p99 | mean | E2E p50 | p90 | p99 | mean |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, s := range r.Runs {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", s.Policy,
			ratio(s.TTFT.P50, r.Bound.TTFT.P50), ratio(s.TTFT.P90, r.Bound.TTFT.P90),
			ratio(s.TTFT.P99, r.Bound.TTFT.P99), ratio(s.TTFT.Mean, r.Bound.TTFT.Mean),
			ratio(s.E2E.P50, r.Bound.E2E.P50), ratio(s.E2E.P90, r.Bound.E2E.P90),
			ratio(s.E2E.P99, r.Bound.E2E.P99), ratio(s.E2E.Mean, r.Bound.E2E.Mean))
	}
	if r.ChartTTFT != "" {
		fmt.Fprintf(&b, "\n![TTFT CDF per policy](%s)\n", r.ChartTTFT)
	}
	if r.Burst != nil {
		b.WriteString("\n")
		r.Burst.writeMarkdown(&b)
		if r.ChartInFlight != "" {
			fmt.Fprintf(&b, "\n![Requests per engine during the burst](%s)\n", r.ChartInFlight)
		}
	}
	rate := 0.0
	if r.Wall > 0 {
		rate = float64(r.SimulatedRequests) / r.Wall.Seconds()
	}
	fmt.Fprintf(&b, "\nSimulated %d requests in %.2f s of wall time (%.0f requests/s).\n", r.SimulatedRequests, r.Wall.Seconds(), rate)
	if r.Command != "" {
		fmt.Fprintf(&b, "Command: `%s`\n", r.Command)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
