package routesim

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/tallyepp/tally/picker"
)

// PDComparison is the prefill/decode comparison: the trace on a pool of
// PrefillEngines prefill-only and DecodeEngines decode-only engines, at
// each of Utilisations, under Tally (its picker's disaggregation on at
// NonCachedTokens) and LLMDLike (its decider at the same threshold),
// beside Tally on the same engines all serving both roles (no roles, so
// no split).
//
// A utilisation is the prefill the prefill engines compute under
// llm-d-like, the deployment compared against, over what they compute in
// full steps, during the arrivals. The prefill a pool computes depends on
// its cache hits, which the no-queueing bound overstates (it has one
// unbounded cache), so the arrival rate is calibrated by llm-d-like's
// runs: one at the trace's pace, then per utilisation one at the rate
// that scales it there, and the rate that scales that run's to it. Every
// run reports the utilisation it had.
type PDComparison struct {
	PrefillEngines, DecodeEngines int
	Utilisations                  []float64
	NonCachedTokens               int
}

// DefaultPDComparison is the comparison of docs/benchmarks.md: two
// prefill and two decode engines with prefill about half and four-fifths
// busy, split at 16 uncached tokens (the threshold of llm-d's guides and
// of docs/install.md).
func DefaultPDComparison() PDComparison {
	return PDComparison{PrefillEngines: 2, DecodeEngines: 2, Utilisations: []float64{0.5, 0.8}, NonCachedTokens: 16}
}

// Validate names the first field out of range and what it accepts.
func (c PDComparison) Validate() error {
	switch {
	case c.PrefillEngines < 1:
		return fmt.Errorf("prefill engines: %d is invalid: must be 1 or more", c.PrefillEngines)
	case c.DecodeEngines < 1:
		return fmt.Errorf("decode engines: %d is invalid: must be 1 or more", c.DecodeEngines)
	case len(c.Utilisations) == 0:
		return fmt.Errorf("prefill utilisations: none given: give one or more, each above 0")
	case c.NonCachedTokens < 1:
		return fmt.Errorf("non-cached tokens: %d is invalid: must be 1 or more (0 would split nothing)", c.NonCachedTokens)
	}
	for _, u := range c.Utilisations {
		if !(u > 0) || math.IsInf(u, 0) {
			return fmt.Errorf("prefill utilisation: %v is invalid: must be a positive number", u)
		}
	}
	return nil
}

// Roles are the roles of the comparison's disaggregated pool: the
// prefill engines first.
func (c PDComparison) Roles() []string {
	roles := make([]string, 0, c.PrefillEngines+c.DecodeEngines)
	for range c.PrefillEngines {
		roles = append(roles, picker.RolePrefill)
	}
	for range c.DecodeEngines {
		roles = append(roles, picker.RoleDecode)
	}
	return roles
}

// The pools of the comparison.
const (
	// PoolPD is the disaggregated pool (PDComparison.Roles).
	PoolPD = "P/D"
	// PoolShared is the same engines, every one serving both roles.
	PoolShared = "shared"
)

// PDReport is the comparison's figures.
type PDReport struct {
	Source     string
	Config     Config // the base: the engines' cache, the seed
	Comparison PDComparison
	// OfferedAtOne is the bound's prefill (after its cache hits) per
	// second of the trace at its own pace, over the prefill engines'
	// capacity; CalibrationAtOne llm-d-like's utilisation there.
	OfferedAtOne, CalibrationAtOne float64
	Loads                          []PDLoad
	Wall                           time.Duration
	// SimulatedRequests counts every run's requests, the calibration's
	// included.
	SimulatedRequests int
	Command           string
}

// PDLoad is one utilisation's runs.
type PDLoad struct {
	Utilisation, LoadFactor float64
	Runs                    []PDRun
}

// PDRun is one policy on one pool.
type PDRun struct {
	Pool, Policy string
	Summary
	// PrefillUtilisation is what the run's prefill engines (on the
	// shared pool, every engine) computed over their capacity during
	// the arrivals.
	PrefillUtilisation float64
	// TPOT is the time per output token after the first, of the
	// requests with more than one.
	TPOT Dist
	// Split counts the requests split. Of those, SplitTTFT is their TTFT,
	// ToPrefillEnd the time from arrival to their prefill leg's end, and
	// Handoff the rest of their TTFT: the decode leg's wait on its engine,
	// its KV transfer and its first step. WholeTTFT is the TTFT of the
	// requests the policy did not split.
	Split                                       int
	SplitTTFT, ToPrefillEnd, Handoff, WholeTTFT Dist
}

// Run runs the comparison over reqs, base giving the engines' cache and
// the seed (its Engines, Roles, LoadFactor and disaggregation are the
// comparison's). Runs are independent; at most parallel run at once.
func (c PDComparison) Run(reqs []Request, source string, base Config, parallel int, progress func(string)) (*PDReport, error) {
	start := time.Now()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	say := func(msg string) {
		if progress != nil {
			progress(msg)
		}
	}
	base.Engines = c.PrefillEngines + c.DecodeEngines
	base.Roles = nil
	base.LoadFactor = 1
	base.Picker.Disaggregation.NonCachedTokens = c.NonCachedTokens
	base.Picker.Disaggregation.PromptTokens = 0
	rep := &PDReport{Source: source, Config: base, Comparison: c}
	// calibrate runs llm-d-like at load factor lf: its prefill
	// utilisation.
	calibrate := func(lf float64) (float64, error) {
		cfg := base
		cfg.LoadFactor = lf
		w, err := Prepare(reqs, cfg)
		if err != nil {
			return 0, err
		}
		pd := w.withRoles(c.Roles())
		res, err := pd.Run(LLMDLike)
		if err != nil {
			return 0, fmt.Errorf("calibrating at load factor %g: %w", lf, err)
		}
		rep.SimulatedRequests += w.Len()
		if lf == 1 {
			rep.OfferedAtOne = offeredLoad(w, c.PrefillEngines)
		}
		u := realisedPrefill(pd, res)
		say(fmt.Sprintf("prefill/decode: llm-d-like at load factor %.3f: prefill %.1f%% busy", lf, 100*u))
		return u, nil
	}
	atOne, err := calibrate(1)
	if err != nil {
		return nil, err
	}
	if !(atOne > 0) {
		return nil, fmt.Errorf("the trace gives the prefill engines no prefill to scale")
	}
	rep.CalibrationAtOne = atOne
	type task struct {
		w            *Workload
		load         int
		pool, policy string
		res          *Result
		err          error
	}
	var tasks []*task
	for k, u := range c.Utilisations {
		lf := u / atOne
		got, err := calibrate(lf)
		if err != nil {
			return nil, err
		}
		if got > 0 {
			lf *= u / got
		}
		cfg := base
		cfg.LoadFactor = lf
		shared, err := Prepare(reqs, cfg)
		if err != nil {
			return nil, fmt.Errorf("prefill utilisation %g: %w", u, err)
		}
		pd := shared.withRoles(c.Roles())
		rep.Loads = append(rep.Loads, PDLoad{Utilisation: u, LoadFactor: lf})
		tasks = append(tasks,
			&task{w: pd, load: k, pool: PoolPD, policy: Tally},
			&task{w: pd, load: k, pool: PoolPD, policy: LLMDLike},
			&task{w: shared, load: k, pool: PoolShared, policy: Tally})
	}
	runParallel(len(tasks), parallel, func(i int) {
		t := tasks[i]
		t.res, t.err = t.w.Run(t.policy)
	}, func(i int) {
		if t := tasks[i]; t.err == nil {
			say(fmt.Sprintf("prefill/decode at %g%%: %s on the %s pool: %d requests in %.2f s", 100*c.Utilisations[t.load], t.policy, t.pool, t.w.Len(), t.res.Wall.Seconds()))
		}
	})
	for _, t := range tasks {
		if t.err != nil {
			return nil, fmt.Errorf("prefill utilisation %g, %s pool: %w", c.Utilisations[t.load], t.pool, t.err)
		}
		rep.SimulatedRequests += t.w.Len()
		rep.Loads[t.load].Runs = append(rep.Loads[t.load].Runs, summarizePD(t.w, t.res, t.pool))
	}
	rep.Wall = time.Since(start)
	return rep, nil
}

// withRoles is w on engines with roles: the same requests (shared,
// read-only), another pool.
func (w *Workload) withRoles(roles []string) *Workload {
	v := *w
	v.cfg.Roles = slices.Clone(roles)
	return &v
}

// offeredLoad is the prefill the bound computes per second of w's
// arrivals over what engines engines compute in full steps.
func offeredLoad(w *Workload, engines int) float64 {
	d := w.jobs[len(w.jobs)-1].arrival
	if d <= 0 {
		return 0
	}
	return float64(w.BoundPrefillTokens) / d.Seconds() / prefillRate(w.cfg, engines)
}

// prefillRate is what engines engines prefill per second in full steps.
func prefillRate(c Config, engines int) float64 {
	ec := c.EngineConfig()
	step := ec.StepBaseDuration + time.Duration(ec.StepBudgetTokens)*ec.PrefillDurationPerToken
	return float64(ec.StepBudgetTokens) / step.Seconds() * float64(engines)
}

// realisedPrefill is the prefill the prefill-capable engines of w's pool
// (every engine of a pool without roles) computed in res, over what they
// compute in full steps during the arrivals.
func realisedPrefill(w *Workload, res *Result) float64 {
	var tokens int64
	engines := 0
	for e, st := range res.Engines {
		if len(w.cfg.Roles) == 0 || w.cfg.prefills(e) {
			tokens += st.PrefillTokens
			engines++
		}
	}
	d := w.jobs[len(w.jobs)-1].arrival
	if d <= 0 || engines == 0 {
		return 0
	}
	return float64(tokens) / d.Seconds() / prefillRate(w.cfg, engines)
}

func summarizePD(w *Workload, res *Result, pool string) PDRun {
	r := PDRun{Pool: pool, Policy: res.Policy, Summary: Summarize(res), PrefillUtilisation: realisedPrefill(w, res)}
	var tpot, split, toEnd, handoff, whole []time.Duration
	for i, o := range res.Outcomes {
		if n := w.jobs[i].OutputTokens; n > 1 {
			tpot = append(tpot, (o.E2E-o.TTFT)/time.Duration(n-1))
		}
		if o.Prefiller < 0 {
			whole = append(whole, o.TTFT)
			continue
		}
		r.Split++
		split, toEnd, handoff = append(split, o.TTFT), append(toEnd, o.PrefillEnd), append(handoff, o.TTFT-o.PrefillEnd)
	}
	r.TPOT, r.SplitTTFT, r.ToPrefillEnd, r.Handoff, r.WholeTTFT = distOf(tpot), distOf(split), distOf(toEnd), distOf(handoff), distOf(whole)
	return r
}

// PDTargetRatio is the comparison's target: Tally's TTFT p99 at most this
// multiple of llm-d-like's on the P/D pool.
const PDTargetRatio = 0.7

// Title names the comparison.
func (r *PDReport) Title() string {
	c := r.Comparison
	return fmt.Sprintf("%s, %d prefill + %d decode engines", r.Source, c.PrefillEngines, c.DecodeEngines)
}

// run finds the run of policy on pool at load k.
func (l PDLoad) run(pool, policy string) (PDRun, bool) {
	for _, r := range l.Runs {
		if r.Pool == pool && r.Policy == policy {
			return r, true
		}
	}
	return PDRun{}, false
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond)) }

func pct(u float64) string { return fmt.Sprintf("%.0f%%", 100*u) }

// WriteMarkdown writes the comparison's tables.
func (r *PDReport) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	c, cfg := r.Comparison, r.Config
	n := c.PrefillEngines + c.DecodeEngines
	fmt.Fprintf(&b, "Trace: %s; %d prefill + %d decode engines (the shared pool: the same %d engines, every one serving both roles), %d KV blocks each (%d tokens); a request is split when its destination lacks at least %d tokens of its prompt (Tally's `disaggregation.nonCachedTokens`, llm-d-like's decider); seed %d.\n",
		r.Source, c.PrefillEngines, c.DecodeEngines, n, cfg.KVBlocks, cfg.KVBlocks*engineBlockTokens, c.NonCachedTokens, cfg.Seed)
	fmt.Fprintf(&b, "At the trace's own pace the bound's prefill (after its cache hits) is %s of the prefill engines' capacity, and llm-d-like keeps them %s busy", pct(r.OfferedAtOne), pct(r.CalibrationAtOne))
	if r.CalibrationAtOne > r.OfferedAtOne {
		fmt.Fprintf(&b, ": the bound's one unbounded cache finds more of the prompts than %d prefill engines do", c.PrefillEngines)
	}
	b.WriteString(". Each prefill load below scales the arrival rate (load factor) until llm-d-like's prefill engines compute about that share of what they could.\n\n")

	b.WriteString("| prefill load | load factor | pool | policy | TTFT p50 | p90 | p99 | mean | TPOT p50 | TPOT p99 | E2E p99 | split | prefill busy |\n")
	b.WriteString("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, l := range r.Loads {
		for _, x := range l.Runs {
			fmt.Fprintf(&b, "| %s | %.2f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d | %s |\n", pct(l.Utilisation), l.LoadFactor, x.Pool, x.Policy,
				secs(x.TTFT.P50), secs(x.TTFT.P90), secs(x.TTFT.P99), secs(x.TTFT.Mean), ms(x.TPOT.P50), ms(x.TPOT.P99), secs(x.E2E.P99), x.Split, pct(x.PrefillUtilisation))
		}
	}
	b.WriteString("\nSeconds; TPOT in milliseconds per output token after the first. TTFT runs from arrival to the first token of the decode leg (of the whole request when not split), as the client sees it through llm-d's sidecar. Prefill busy: the prompt tokens the prefill engines computed (on the shared pool, all four) over what they compute in full steps, during the arrivals.\n\n")

	fmt.Fprintf(&b, "Tally's TTFT p99 over llm-d-like's on the P/D pool (target: at most %.1f×):\n\n", PDTargetRatio)
	b.WriteString("| prefill load | Tally p99 | llm-d-like p99 | ratio | target |\n|---:|---:|---:|---:|---|\n")
	for _, l := range r.Loads {
		t, ok1 := l.run(PoolPD, Tally)
		d, ok2 := l.run(PoolPD, LLMDLike)
		if !ok1 || !ok2 {
			continue
		}
		verdict := "missed"
		if float64(t.TTFT.P99) <= PDTargetRatio*float64(d.TTFT.P99) {
			verdict = "met"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", pct(l.Utilisation), secs(t.TTFT.P99), secs(d.TTFT.P99), ratio2(t.TTFT.P99, d.TTFT.P99), verdict)
	}

	b.WriteString("\nWhere the time to first token goes on the P/D pool: a split request's, from arrival to the end of its prefill leg, then the hand-off (its decode leg's wait for a step on its engine, its KV transfer, that step); a request not split prefills whole on its decode engine.\n\n")
	b.WriteString("| prefill load | policy | split | split TTFT p50 | p99 | to prefill end p50 | p99 | hand-off p50 | p99 | not split | TTFT p50 | p99 |\n")
	b.WriteString("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, l := range r.Loads {
		for _, x := range l.Runs {
			if x.Pool != PoolPD {
				continue
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %s | %s | %s | %s | %s | %s | %d | %s | %s |\n", pct(l.Utilisation), x.Policy, x.Split,
				secs(x.SplitTTFT.P50), secs(x.SplitTTFT.P99), secs(x.ToPrefillEnd.P50), secs(x.ToPrefillEnd.P99),
				secs(x.Handoff.P50), secs(x.Handoff.P99), x.Requests-x.Split, secs(x.WholeTTFT.P50), secs(x.WholeTTFT.P99))
		}
	}

	b.WriteString("\nSplitting against sharing the engines (Tally on each pool): the P/D pool's figure over the shared pool's; below 1× splitting wins.\n\n")
	b.WriteString("| prefill load | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | E2E p99 | splitting wins on |\n|---:|---:|---:|---:|---:|---:|---|\n")
	for _, l := range r.Loads {
		p, ok1 := l.run(PoolPD, Tally)
		s, ok2 := l.run(PoolShared, Tally)
		if !ok1 || !ok2 {
			continue
		}
		var wins []string
		for _, m := range []struct {
			name     string
			pd, rest time.Duration
		}{
			{"TTFT p50", p.TTFT.P50, s.TTFT.P50}, {"TTFT p99", p.TTFT.P99, s.TTFT.P99},
			{"TPOT p50", p.TPOT.P50, s.TPOT.P50}, {"TPOT p99", p.TPOT.P99, s.TPOT.P99}, {"E2E p99", p.E2E.P99, s.E2E.P99},
		} {
			if m.pd < m.rest {
				wins = append(wins, m.name)
			}
		}
		won := strings.Join(wins, ", ")
		if won == "" {
			won = "nothing"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s |\n", pct(l.Utilisation), ratio2(p.TTFT.P50, s.TTFT.P50), ratio2(p.TTFT.P99, s.TTFT.P99),
			ratio2(p.TPOT.P50, s.TPOT.P50), ratio2(p.TPOT.P99, s.TPOT.P99), ratio2(p.E2E.P99, s.E2E.P99), won)
	}
	writeFooter(&b, r.SimulatedRequests, r.Wall, r.Command)
	_, err := io.WriteString(w, b.String())
	return err
}

// ratio2 is a over b to two decimals.
func ratio2(a, b time.Duration) string {
	if b <= 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", float64(a)/float64(b))
}
