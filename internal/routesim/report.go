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
	// Flow control: Held counts the requests that waited in the policy's
	// queue, Wait is how long the placed requests waited there (0 for
	// those placed at once), Refused counts the requests answered 429
	// (RefusedShed...), which no latency figure includes.
	Held    int
	Wait    Dist
	Refused Refusals
	// LearnedRates is the range of the prefill rates Tally's picker had
	// learned at its scrapes: flow control's saturation threshold is
	// holdPrefillMilliseconds of it.
	LearnedRates RateRange
	// Bands are the figures of each priority, highest first, when the
	// workload has more than one (Config.Priorities); Flows those of each
	// fairness id (Config.FlowWeights).
	Bands []BandSummary `json:",omitempty"`
	Flows []FlowSummary `json:",omitempty"`
	// With LoRA adapters (Config.Adapters): AdapterLoads sums the engines'
	// adapter loads into a slot (the swaps), and AdaptersServed counts,
	// per engine, the distinct adapters of the requests it served.
	AdapterLoads   int64 `json:",omitempty"`
	AdaptersServed []int `json:",omitempty"`

	ttfts []time.Duration // sorted, for the CDF chart
}

// Refusals counts 429s by why.
type Refusals struct{ Shed, QueueFull, TTL int }

// Total is every refusal.
func (r Refusals) Total() int { return r.Shed + r.QueueFull + r.TTL }

func (r *Refusals) add(why string) {
	switch why {
	case RefusedShed:
		r.Shed++
	case RefusedQueueFull:
		r.QueueFull++
	case RefusedTTL:
		r.TTL++
	}
}

// BandSummary is one priority's share of a run.
type BandSummary struct {
	Priority       int
	Requests, Held int
	Refused        Refusals
	// TTFT, Wait and Queueing (Outcome.Queueing) over its placed
	// requests.
	TTFT, Wait, Queueing Dist
}

// FlowSummary is one fairness id's share of a run.
type FlowSummary struct {
	ID                string
	Requests, Refused int
	Held              int
	// Contended is its requests dispatched from the queue while every
	// flow had requests waiting, and Share its part of all of those.
	Contended int
	Share     float64
}

// Summarize reduces a run to its figures.
func Summarize(r *Result) Summary {
	s := Summary{Policy: r.Policy, Requests: len(r.Outcomes), Placed: r.Placed, End: r.End, Wall: r.Wall, LearnedRates: r.LearnedRates}
	ttft := make([]time.Duration, 0, len(r.Outcomes))
	e2e := make([]time.Duration, 0, len(r.Outcomes))
	var wait []time.Duration
	bands := map[int]*bandAcc{}
	for _, o := range r.Outcomes {
		if o.Bypass {
			s.Bypassed++
		}
		b := bands[o.Priority]
		if b == nil {
			b = &bandAcc{BandSummary: BandSummary{Priority: o.Priority}}
			bands[o.Priority] = b
		}
		b.Requests++
		if o.Held {
			s.Held++
			b.Held++
		}
		if o.Refused != "" {
			s.Refused.add(o.Refused)
			b.Refused.add(o.Refused)
			continue
		}
		ttft, e2e = append(ttft, o.TTFT), append(e2e, o.E2E)
		wait = append(wait, o.Wait)
		b.ttft, b.wait, b.queueing = append(b.ttft, o.TTFT), append(b.wait, o.Wait), append(b.queueing, o.Queueing)
	}
	s.TTFT, s.E2E, s.Wait = distOf(ttft), distOf(e2e), distOf(wait)
	slices.Sort(ttft)
	s.ttfts = ttft
	if len(bands) > 1 || bands[0] == nil {
		for _, b := range bands {
			b.TTFT, b.Wait, b.Queueing = distOf(b.ttft), distOf(b.wait), distOf(b.queueing)
			s.Bands = append(s.Bands, b.BandSummary)
		}
		slices.SortFunc(s.Bands, func(a, b BandSummary) int { return b.Priority - a.Priority })
	}
	s.Flows = summarizeFlows(r)
	var queries, hits, prefill, most int64
	for _, e := range r.Engines {
		queries += e.PrefixQueryTokens
		hits += e.PrefixHitTokens
		prefill += e.PrefillTokens
		most = max(most, e.PrefillTokens)
		s.AdapterLoads += e.AdapterLoads
	}
	s.AdaptersServed = adaptersServed(r)
	if queries > 0 {
		s.PrefixHitRate = float64(hits) / float64(queries)
	}
	if prefill > 0 {
		s.PrefillSpread = float64(most) * float64(len(r.Engines)) / float64(prefill)
	}
	return s
}

// adaptersServed counts the distinct adapters each engine served; nil
// when no request was for one.
func adaptersServed(r *Result) []int {
	type served struct {
		engine  int
		adapter string
	}
	seen := map[served]bool{}
	var counts []int
	for _, o := range r.Outcomes {
		if o.Adapter == "" || o.Engine < 0 {
			continue
		}
		if counts == nil {
			counts = make([]int, len(r.Placed))
		}
		k := served{o.Engine, o.Adapter}
		if !seen[k] {
			seen[k] = true
			counts[o.Engine]++
		}
	}
	return counts
}

type bandAcc struct {
	BandSummary
	ttft, wait, queueing []time.Duration
}

func summarizeFlows(r *Result) []FlowSummary {
	if len(r.Contended) == 0 {
		return nil
	}
	flows := make([]FlowSummary, len(r.Contended))
	contended := 0
	for k := range flows {
		flows[k].ID = FlowID(k)
		flows[k].Contended = r.Contended[k]
		contended += r.Contended[k]
	}
	for _, o := range r.Outcomes {
		if o.Flow < 0 || o.Bypass {
			continue
		}
		f := &flows[o.Flow]
		f.Requests++
		if o.Held {
			f.Held++
		}
		if o.Refused != "" {
			f.Refused++
		}
	}
	if contended > 0 {
		for k := range flows {
			flows[k].Share = float64(flows[k].Contended) / float64(contended)
		}
	}
	return flows
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
	if len(c.Priorities) > 0 {
		parts = append(parts, "priorities "+priorityList(c.Priorities))
	}
	if len(c.FlowWeights) > 0 {
		parts = append(parts, fmt.Sprintf("%d flows weighted %s", len(c.FlowWeights), weightList(c.FlowWeights)))
	}
	if c.lora() {
		parts = append(parts, fmt.Sprintf("%d LoRA adapters (Zipf %g, max_loras %d)", c.Adapters, c.AdapterZipf, c.MaxLoRAs))
	}
	return strings.Join(parts, ", ")
}

// loraText describes the adapter mix and the engines' adapter slots.
func loraText(c Config) string {
	t := fmt.Sprintf("%d LoRA adapters besides the base model, each request's drawn with weight 1/rank^%g", c.Adapters, c.AdapterZipf)
	if c.BaseFraction > 0 {
		t += fmt.Sprintf(" (%g%% stay on the base model)", 100*c.BaseFraction)
	}
	return t + fmt.Sprintf("; max_loras %d, a load %s s", c.MaxLoRAs, secs(c.LoRALoadTime))
}

// configDiff lists the fields of c that differ from the defaults, as
// `name: value` in the configuration file's terms (nested fields dotted:
// `flowControl.holdPrefillMilliseconds: 100`).
func configDiff(c v1alpha1.PickerConfig) string {
	fields := func(pc v1alpha1.PickerConfig) map[string]string {
		var m map[string]any
		data, _ := json.Marshal(v1alpha1.WithDefaults(pc))
		_ = json.Unmarshal(data, &m)
		flat := map[string]string{}
		flatten(flat, "", m)
		return flat
	}
	got, def := fields(c), fields(v1alpha1.PickerConfig{})
	var diff []string
	for k, v := range got {
		if dv, ok := def[k]; !ok || dv != v {
			diff = append(diff, fmt.Sprintf("`%s: %s`", k, v))
		}
	}
	slices.Sort(diff)
	return strings.Join(diff, ", ")
}

// flatten puts every leaf of m into dst under its dotted path.
func flatten(dst map[string]string, prefix string, m map[string]any) {
	for k, v := range m {
		if sub, ok := v.(map[string]any); ok {
			flatten(dst, prefix+k+".", sub)
			continue
		}
		dst[prefix+k] = fmt.Sprint(v)
	}
}

// priorityList writes shares as the --priorities flag takes them
// ("10=0.2,-1=0.8").
func priorityList(shares []PriorityShare) string {
	s := make([]string, len(shares))
	for i, ps := range shares {
		s[i] = fmt.Sprintf("%d=%g", ps.Priority, ps.Fraction)
	}
	return strings.Join(s, ",")
}

// weightList writes weights as the --flows flag takes them ("10,1").
func weightList(weights []float64) string {
	s := make([]string, len(weights))
	for i, w := range weights {
		s[i] = fmt.Sprint(w)
	}
	return strings.Join(s, ",")
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
	fmt.Fprintf(&b, "Trace: %s; %d engines, %d KV blocks each (%d tokens); load factor %g; non-streaming %g; bypass %g; seed %d",
		r.Source, c.Engines, c.KVBlocks, c.KVBlocks*engineBlockTokens, c.LoadFactor, c.NonStreaming, c.Bypass, c.Seed)
	if len(c.Priorities) > 0 {
		fmt.Fprintf(&b, "; priorities %s (the rest 0)", priorityList(c.Priorities))
	}
	if len(c.FlowWeights) > 0 {
		fmt.Fprintf(&b, "; flows weighted %s", weightList(c.FlowWeights))
	}
	if c.lora() {
		b.WriteString("; " + loraText(c))
	}
	b.WriteString(".\n")
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
	r.writeFlowControl(&b)
	r.writeLoRA(&b)
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
	writeFooter(&b, r.SimulatedRequests, r.Wall, r.Command)
	_, err := io.WriteString(w, b.String())
	return err
}

// queued reports whether a run met flow control: it held or refused
// requests, or its policy has a queue.
func (s Summary) queued() bool {
	return s.Held > 0 || s.Refused.Total() > 0 || s.Policy == TallyFlow
}

// writeFlowControl writes, for the runs that met flow control, what their
// queue did (requests held and refused) and what each flow got; and, when
// the workload has priorities, every run's figures per priority.
func (r *Report) writeFlowControl(b *strings.Builder) {
	var runs []Summary
	for _, s := range r.Runs {
		if s.queued() {
			runs = append(runs, s)
		}
	}
	if len(runs) > 0 {
		r.writeQueues(b, runs)
	}
	if len(r.Config.Priorities) > 0 {
		b.WriteString("\nPer priority (latency of the placed requests, TTFT from arrival; queueing: TTFT beyond the request's own prefill alone on an idle engine with the cache it found, its wait in the policy's queue included):\n\n")
		b.WriteString("| policy | priority | requests | held | 429 | wait mean | TTFT p50 | p90 | p99 | mean | queueing p50 | p90 | p99 |\n")
		b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, s := range r.Runs {
			for _, band := range s.Bands {
				fmt.Fprintf(b, "| %s | %d | %d | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s |\n", s.Policy, band.Priority, band.Requests,
					band.Held, band.Refused.Total(), secs(band.Wait.Mean),
					secs(band.TTFT.P50), secs(band.TTFT.P90), secs(band.TTFT.P99), secs(band.TTFT.Mean),
					secs(band.Queueing.P50), secs(band.Queueing.P90), secs(band.Queueing.P99))
			}
		}
	}
	if len(r.Config.FlowWeights) > 0 && len(runs) > 0 {
		b.WriteString("\nPer flow: its share of the requests dispatched from the queue while every flow had requests waiting.\n\n")
		b.WriteString("| policy | flow | weight | requests | held | 429 | dispatched while all waited | share |\n")
		b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|\n")
		for _, s := range runs {
			for k, f := range s.Flows {
				fmt.Fprintf(b, "| %s | %s | %g | %d | %d | %d | %d | %.1f%% |\n", s.Policy, f.ID, r.Config.FlowWeights[k],
					f.Requests, f.Held, f.Refused, f.Contended, 100*f.Share)
			}
		}
	}
}

// writeQueues writes what the queues of runs did: requests held and
// refused, and the range of the prefill rates their threshold came from.
func (r *Report) writeQueues(b *strings.Builder, runs []Summary) {
	ec := r.Config.EngineConfig()
	peak := float64(ec.StepBudgetTokens) / (ec.StepBaseDuration + time.Duration(ec.StepBudgetTokens)*ec.PrefillDurationPerToken).Seconds()
	fmt.Fprintf(b, "\nFlow control: requests held in the policy's queue (sent to no engine until dispatched) and refused (429); latency figures are of the placed requests, TTFT from arrival, wait included. Learned rates: the lowest and highest prefill rate the picker held at its scrapes, from its starting value on (its saturation threshold is holdPrefillMilliseconds of it); an engine prefills at most %.0f tokens/s.\n\n", peak)
	b.WriteString("| policy | requests | held | wait mean | wait p99 | 429 | shed | queue full | TTL | learned rates (tokens/s) |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, s := range runs {
		fmt.Fprintf(b, "| %s | %d | %d | %s | %s | %d | %d | %d | %d | %.0f–%.0f |\n", s.Policy, s.Requests, s.Held,
			secs(s.Wait.Mean), secs(s.Wait.P99), s.Refused.Total(), s.Refused.Shed, s.Refused.QueueFull, s.Refused.TTL,
			s.LearnedRates.Min, s.LearnedRates.Max)
	}
}

// writeLoRA writes, with adapters, each run's adapter swaps beside its TTFT.
func (r *Report) writeLoRA(b *strings.Builder) {
	if !r.Config.lora() {
		return
	}
	b.WriteString("\nLoRA adapters: swaps are the adapters the engines loaded into a slot (a free one, or one whose idle adapter they evicted), each costing the whole batch the load time; adapters served is, per engine, how many distinct adapters its requests were for. The bound loads no adapter.\n\n")
	b.WriteString("| policy | TTFT p50 | p99 | p50 ×bound | p99 ×bound | swaps | per 1,000 requests | adapters served per engine |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---|\n")
	for _, s := range r.Runs {
		per := 0.0
		if s.Requests > 0 {
			per = 1000 * float64(s.AdapterLoads) / float64(s.Requests)
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %d | %.1f | %s |\n", s.Policy, secs(s.TTFT.P50), secs(s.TTFT.P99),
			ratio(s.TTFT.P50, r.Bound.TTFT.P50), ratio(s.TTFT.P99, r.Bound.TTFT.P99), s.AdapterLoads, per, joinInts(s.AdaptersServed))
	}
}

// writeFooter ends a report: how many requests it simulated in how much
// wall time (the one figure that is the machine's), and its command.
func writeFooter(b *strings.Builder, requests int, wall time.Duration, command string) {
	rate := 0.0
	if wall > 0 {
		rate = float64(requests) / wall.Seconds()
	}
	fmt.Fprintf(b, "\nSimulated %d requests in %.2f s of wall time (%.0f requests/s).\n", requests, wall.Seconds(), rate)
	if command != "" {
		fmt.Fprintf(b, "Command: `%s`\n", command)
	}
}
