package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/tallyepp/tally/internal/chart"
	"github.com/tallyepp/tally/internal/docsection"
)

// plan is what `bench` runs.
type plan struct {
	name        string
	bursts      []string
	burstN      int
	burstTokens int
	// loads run at basePods endpoints; scaleLoad at each of scalePods.
	loads     []loadCase
	scaleLoad loadCase
	scalePods []int
	warmup    time.Duration
	window    time.Duration
	// idle is how long a picker's background CPU is measured.
	idle   time.Duration
	churnN int
}

type loadCase struct{ concurrency, tokens int }

// basePods is the pool of the bursts and of most loads: three pods, as in
// the measurements of the upstream picker in docs/benchmarks.md.
const basePods = 3

var (
	fullPlan = plan{
		name:   "full",
		bursts: burstKinds, burstN: 128, burstTokens: 32_000,
		loads:     []loadCase{{1, 8_000}, {16, 8_000}, {64, 8_000}, {1, 32_000}, {16, 32_000}, {64, 32_000}},
		scaleLoad: loadCase{16, 8_000}, scalePods: []int{16, 128, 1_000},
		warmup: 2 * time.Second, window: 10 * time.Second, idle: 3 * time.Second, churnN: 500,
	}
	quickPlan = plan{
		name:   "quick",
		bursts: []string{kindFresh, kindShared, kindLong}, burstN: 128, burstTokens: 32_000,
		loads:     []loadCase{{1, 8_000}, {16, 8_000}, {64, 8_000}, {16, 32_000}},
		scaleLoad: loadCase{16, 8_000}, scalePods: []int{128, 1_000},
		warmup: time.Second, window: 3 * time.Second, idle: time.Second, churnN: 200,
	}
)

// loadKey names one load measurement.
type loadKey struct{ pods, concurrency, tokens int }

// results are one picker's measurements.
type results struct {
	bursts map[string]burstResult
	// loads are the medians of runs.
	loads   map[loadKey]loadResult
	runs    map[loadKey][]loadResult
	churn   *churnResult
	idleRSS map[int]int64 // by endpoints, once ready
	// idleCPU is the picker's CPU time per second of wall time with no
	// request in flight (its scrapes, its housekeeping), by endpoints.
	idleCPU map[int]time.Duration
}

func newResults() *results {
	return &results{bursts: map[string]burstResult{}, loads: map[loadKey]loadResult{}, runs: map[loadKey][]loadResult{}, idleRSS: map[int]int64{}, idleCPU: map[int]time.Duration{}}
}

// bench runs every scenario of a plan for each picker, one picker at a
// time against the same pool, growing the pool for the endpoint scale.
type bench struct {
	o       options
	plan    plan
	pickers []string
	env     *benchEnv
	res     map[string]*results
	log     io.Writer
	began   time.Time
	machine machine
}

func runBench(ctx context.Context, o options, stdout, stderr io.Writer) (err error) {
	b := &bench{o: o, plan: fullPlan, log: stderr, began: time.Now(), res: map[string]*results{}, machine: describeMachine()}
	if o.quick {
		b.plan = quickPlan
	}
	for _, p := range strings.Split(o.only, ",") {
		p = strings.TrimSpace(p)
		if p != pickerTally && p != pickerUpstream {
			return fmt.Errorf("flag --pickers: %q is invalid: want tally and/or upstream", p)
		}
		b.pickers = append(b.pickers, p)
		b.res[p] = newResults()
	}
	b.progress("%s plan for %s on %d CPUs (%s), load average %s", b.plan.name, strings.Join(b.pickers, " and "), b.machine.cpus, b.machine.cpuModel, b.machine.loadAvg)
	if b.env, err = startEnv(ctx, basePods, nil, b.o.firstPodIP, o.keepLogs, stderr); err != nil {
		return err
	}
	defer func() { err = errors.Join(err, b.env.stop()) }()

	for _, p := range b.pickers {
		for _, kind := range b.plan.bursts {
			if err := b.burst(ctx, p, kind); err != nil {
				return err
			}
		}
	}
	// Runs alternate between the pickers, so that a change in the machine's
	// load during the run falls on both.
	for run := range max(o.runs, 1) {
		for _, p := range b.pickers {
			if o.runs > 1 {
				b.progress("%s: run %d of %d of the loads at %d endpoints", p, run+1, o.runs, basePods)
			}
			if err := b.baseLoads(ctx, p); err != nil {
				return err
			}
		}
	}
	for _, pods := range b.plan.scalePods {
		if err := b.env.grow(ctx, pods); err != nil {
			return err
		}
		for _, p := range b.pickers {
			if err := b.scale(ctx, p, pods); err != nil {
				return err
			}
		}
	}
	b.machine.loadAvgEnd = loadAverage()
	b.progress("done in %v", time.Since(b.began).Round(time.Second))
	return b.write(stdout)
}

// write puts the tables into --out's generated section and the chart
// beside it (into bench/ next to the file, linked relatively), or the
// tables alone on stdout when there is no --out.
func (b *bench) write(stdout io.Writer) error {
	if b.o.out == "" {
		_, err := io.WriteString(stdout, b.markdown(""))
		return err
	}
	chartPath := filepath.Join(filepath.Dir(b.o.out), filepath.FromSlash(cpuChartFile))
	if err := os.MkdirAll(filepath.Dir(chartPath), 0o755); err != nil {
		return fmt.Errorf("creating the chart's directory: %w", err)
	}
	var svg bytes.Buffer
	if err := cpuChart(b.plan, b.res).Write(&svg); err != nil {
		return err
	}
	if err := os.WriteFile(chartPath, svg.Bytes(), 0o644); err != nil {
		return fmt.Errorf("writing the chart: %w", err)
	}
	if err := docsection.WriteFile(b.o.out, sectionName, b.markdown(cpuChartFile)); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote the benchmark tables into %s and the chart into %s\n", b.o.out, chartPath)
	return nil
}

func (b *bench) progress(format string, args ...any) {
	fmt.Fprintf(b.log, "[bench %v] "+format+"\n", append([]any{time.Since(b.began).Round(time.Second)}, args...)...)
}

func (b *bench) bin(kind string) string {
	if kind == pickerUpstream {
		return b.o.upstreamBin
	}
	return b.o.tallyBin
}

func (b *bench) start(ctx context.Context, kind string) (*pickerTarget, error) {
	pt, err := b.env.startTarget(ctx, kind, b.bin(kind), b.o.useTLS, b.o.conns, 0, b.o.pickerArgs)
	if err != nil {
		return nil, err
	}
	pt.log = nil // the bench reports progress itself
	return pt, nil
}

// burst runs one burst against a freshly started picker: what a picker
// learnt from an earlier burst (prefixes, engine speeds) must not decide
// this one.
func (b *bench) burst(ctx context.Context, kind, prompt string) (err error) {
	pt, err := b.start(ctx, kind)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pt.stop()) }()
	r, err := runBurst(ctx, pt.target, prompt, b.plan.burstN, b.plan.burstTokens)
	if err != nil {
		return fmt.Errorf("%s: burst %s: %w", kind, prompt, err)
	}
	b.res[kind].bursts[prompt] = r
	b.progress("%s: burst %s of %d × %d tokens: %s in %v%s", kind, prompt, r.n, r.tokens, r.placement.spread(), r.placedInWindow.Round(time.Millisecond), failures(r.errors+r.refused, r.firstError))
	return nil
}

func (b *bench) baseLoads(ctx context.Context, kind string) (err error) {
	pt, err := b.start(ctx, kind)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pt.stop()) }()
	if err := b.idle(ctx, pt, basePods); err != nil {
		return err
	}
	for _, lc := range b.plan.loads {
		if err := b.load(ctx, pt, basePods, lc); err != nil {
			return err
		}
	}
	r, err := runChurn(ctx, pt.target, b.plan.churnN, 16, 8_000)
	if err != nil {
		return fmt.Errorf("%s: churn: %w", kind, err)
	}
	b.res[kind].churn = &r
	ledger := "no ledger to check"
	if r.checked {
		ledger = "ledger empty"
		if !r.empty {
			ledger = "ledger NOT empty: " + r.state
		}
	}
	b.progress("%s: churn of %d requests: %s%s", kind, r.requests, ledger, failures(r.errors, r.firstError))
	return nil
}

func (b *bench) scale(ctx context.Context, kind string, pods int) (err error) {
	pt, err := b.start(ctx, kind)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pt.stop()) }()
	if err := b.idle(ctx, pt, pods); err != nil {
		return err
	}
	return b.load(ctx, pt, pods, b.plan.scaleLoad)
}

// idle records a just-started picker's resident set and its CPU use with
// nothing in flight.
func (b *bench) idle(ctx context.Context, pt *pickerTarget, pods int) error {
	m, err := startMeter(pt.pids...)
	if err != nil {
		return err
	}
	began := time.Now()
	sleepCtx(ctx, b.plan.idle)
	u, err := m.stop()
	if err != nil {
		return err
	}
	perSecond := time.Duration(float64(u.cpu) / time.Since(began).Seconds())
	b.res[pt.name].idleRSS[pods] = pt.idleRSS
	b.res[pt.name].idleCPU[pods] = perSecond
	b.progress("%s: idle at %d endpoints: RSS %s MB, CPU %.1f%% of a core", pt.name, pods, mb(pt.idleRSS), 100*perSecond.Seconds())
	return ctx.Err()
}

func (b *bench) load(ctx context.Context, pt *pickerTarget, pods int, lc loadCase) error {
	r, err := runLoad(ctx, pt.target, lc.concurrency, 0, lc.tokens, b.plan.warmup, b.plan.window)
	if err != nil {
		return fmt.Errorf("%s: load of %d clients × %d tokens at %d endpoints: %w", pt.name, lc.concurrency, lc.tokens, pods, err)
	}
	k := loadKey{pods, lc.concurrency, lc.tokens}
	res := b.res[pt.name]
	res.runs[k] = append(res.runs[k], r)
	res.loads[k] = medianLoad(res.runs[k])
	b.progress("%s: %d endpoints, %d clients × %d tokens: %.0f req/s, pick p50 %s p99 %s ms, CPU %s ms/req, peak RSS %s MB%s",
		pt.name, pods, lc.concurrency, lc.tokens, r.rps, ms(r.pickP50), ms(r.pickP99), ms(r.cpuPerRequest()), mb(r.use.peak), failures(r.errors+r.refused, r.firstError))
	return nil
}

func failures(n int, first string) string {
	if n == 0 {
		return ""
	}
	if first == "" {
		return fmt.Sprintf(" (%d refused)", n)
	}
	return fmt.Sprintf(" (%d failed or refused; first: %s)", n, first)
}

// machine is what the tables were measured on.
type machine struct {
	cpus       int
	cpuModel   string
	goVersion  string
	kernel     string
	loadAvg    string
	loadAvgEnd string
	commit     string
}

// sectionName names the generated section of the --out file (its markers:
// docsection.Markers).
const sectionName = "extproc-load bench"

// cpuChartFile is the CPU chart's path relative to the --out file.
const cpuChartFile = "bench/cpu-per-request.svg"

// cpuChart is the pickers' CPU time per request at basePods endpoints by
// concurrency: one line per picker and prompt size, dashed for the larger
// prompts.
func cpuChart(p plan, res map[string]*results) chart.Lines {
	var clients, tokens []int
	for _, lc := range p.loads {
		if !slices.Contains(clients, lc.concurrency) {
			clients = append(clients, lc.concurrency)
		}
		if !slices.Contains(tokens, lc.tokens) {
			tokens = append(tokens, lc.tokens)
		}
	}
	slices.Sort(clients)
	slices.Sort(tokens)
	c := chart.Lines{
		Title:  fmt.Sprintf("Picker CPU per request by concurrency, %d endpoints", basePods),
		XLabel: "concurrent clients",
		YLabel: "picker CPU per request (ms)",
	}
	for _, n := range clients {
		c.X = append(c.X, fmt.Sprint(n))
	}
	for k, name := range []string{pickerTally, pickerUpstream} {
		r := res[name]
		if r == nil {
			continue
		}
		for j, t := range tokens {
			s := chart.Series{Name: fmt.Sprintf("%s, %s-token prompts", pickerLabel(name), thousands(t)), Color: chart.Color(k), Dashed: j > 0}
			measured := false
			for _, n := range clients {
				lr, ok := r.loads[loadKey{basePods, n, t}]
				if !ok {
					s.Y = append(s.Y, math.NaN())
					continue
				}
				s.Y = append(s.Y, msf(lr.cpuPerRequest()))
				measured = true
			}
			if measured {
				c.Series = append(c.Series, s)
			}
		}
	}
	return c
}

func pickerLabel(name string) string {
	if name == pickerTally {
		return "Tally"
	}
	return name
}
