package routesim

import (
	"bytes"
	"encoding/xml"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/internal/testtier"
)

const sampleTrace = "../../test/data/mooncake_sample.jsonl"

func loadSample(t *testing.T, n int) []Request {
	t.Helper()
	reqs, err := LoadMooncakeFile(sampleTrace)
	if err != nil {
		t.Fatal(err)
	}
	return reqs[:n]
}

// The smoke test of make test: over a hundred requests of the sample trace
// through every policy, with non-streaming and bypassing clients. Every
// request completes, none beats its own no-queueing bound, and the real
// picker (random tie-breaking, learned rates) gives the same numbers twice.
func TestPoliciesOnTheSampleTrace(t *testing.T) {
	testtier.SkipIfShort(t, "every policy over the sample trace, twice for the real picker, tens of seconds of CPU under -race")
	w, err := Prepare(loadSample(t, 120), Config{Engines: 4, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 2, NonStreaming: 0.3, Bypass: 0.2, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	bounds := w.Bounds()
	bound := w.BoundSummary()
	for _, p := range KnownPolicies() {
		res, err := w.Run(p)
		if err != nil {
			t.Fatal(err)
		}
		for i, o := range res.Outcomes {
			if o.TTFT < bounds[i].TTFT || o.E2E < bounds[i].E2E || o.TTFT > o.E2E || o.TTFT <= 0 {
				t.Fatalf("%s: request %d: TTFT %v, E2E %v; bound %v, %v", p, i, o.TTFT, o.E2E, bounds[i].TTFT, bounds[i].E2E)
			}
		}
		s := Summarize(res)
		placed := s.Bypassed
		for _, n := range s.Placed {
			placed += n
		}
		if s.Requests != w.Len() || placed != w.Len() || s.Bypassed == 0 {
			t.Errorf("%s: %d requests, placed %v + %d bypassed, want %d in all, some bypassed", p, s.Requests, s.Placed, s.Bypassed, w.Len())
		}
		for _, c := range []struct {
			what       string
			got, bound time.Duration
		}{
			{"TTFT p50", s.TTFT.P50, bound.TTFT.P50}, {"TTFT p90", s.TTFT.P90, bound.TTFT.P90},
			{"TTFT p99", s.TTFT.P99, bound.TTFT.P99}, {"TTFT mean", s.TTFT.Mean, bound.TTFT.Mean},
			{"E2E p50", s.E2E.P50, bound.E2E.P50}, {"E2E p99", s.E2E.P99, bound.E2E.P99},
		} {
			if c.got < c.bound || c.bound <= 0 {
				t.Errorf("%s: %s %v is below the bound %v", p, c.what, c.got, c.bound)
			}
		}
		if s.PrefixHitRate <= 0 || s.PrefixHitRate > bound.PrefixHitRate {
			t.Errorf("%s: prefix hit rate %.3f, want in (0, bound %.3f]", p, s.PrefixHitRate, bound.PrefixHitRate)
		}
		if p == Tally || p == TallyFlow {
			again, err := w.Run(p)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(res.Outcomes, again.Outcomes) || !reflect.DeepEqual(res.Engines, again.Engines) {
				t.Errorf("%s: two runs of one workload differ", p)
			}
		}
	}
}

// withoutWall zeroes what the wall clock decides, leaving what the
// simulation does.
func withoutWall(r *Report) Report {
	c := *r
	c.Wall = 0
	c.Runs = append([]Summary(nil), r.Runs...)
	for i := range c.Runs {
		c.Runs[i].Wall = 0
	}
	return c
}

// A whole invocation, small: the same numbers whatever the parallelism,
// and a report directory with well-formed charts.
func TestSuiteReport(t *testing.T) {
	reqs := loadSample(t, 40)
	cfg := Config{Engines: 3, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 1, Bypass: 0.1, Seed: 7}
	var reps []*Report
	for _, parallel := range []int{1, 3} {
		s := Suite{Config: cfg, Burst: &Burst{Requests: 24, PromptTokens: 2048, SharedTokens: 1024, OutputTokens: 8}, Parallel: parallel}
		rep, err := s.Run(reqs, "sample")
		if err != nil {
			t.Fatal(err)
		}
		reps = append(reps, rep)
	}
	a := reps[0]
	if !reflect.DeepEqual(withoutWall(a), withoutWall(reps[1])) {
		t.Fatalf("two runs with the same seed differ:\n%+v\n%+v", withoutWall(a).Runs, withoutWall(reps[1]).Runs)
	}
	if len(a.Runs) != len(Policies()) || len(a.Burst.Runs) != len(Policies()) || a.SimulatedRequests != 4*(40+25) {
		t.Fatalf("%d runs, %d burst runs, %d requests simulated", len(a.Runs), len(a.Burst.Runs), a.SimulatedRequests)
	}
	for _, r := range a.Burst.Runs {
		total := 0
		for _, n := range r.Placed {
			total += n
		}
		if total != 24 || len(r.Samples) == 0 || r.TTFT.P50 < a.Burst.BoundTTFT {
			t.Errorf("burst %s: placed %v, %d samples, TTFT p50 %v (bound %v)", r.Policy, r.Placed, len(r.Samples), r.TTFT.P50, a.Burst.BoundTTFT)
		}
	}

	dir := t.TempDir()
	if err := a.WriteDir(dir, "sample"); err != nil {
		t.Fatal(err)
	}
	files := FilesNamed("sample")
	md, err := os.ReadFile(filepath.Join(dir, files.Report))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range append(Policies(), "](sample-ttft-cdf.svg)", "](sample-burst-inflight.svg)", "| bound |") {
		if !bytes.Contains(md, []byte(want)) {
			t.Errorf("%s does not mention %q", files.Report, want)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, files.JSON)); err != nil {
		t.Error(err)
	}
	for _, name := range []string{files.TTFTChart, files.BurstChart} {
		f, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if err := wellFormed(f); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func wellFormed(doc []byte) error {
	d := xml.NewDecoder(bytes.NewReader(doc))
	for {
		if _, err := d.Token(); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
	}
}

// The analytic bound is the engine model's own latency for a request alone
// on an idle engine that holds its cached prefix.
func TestBoundMatchesTheEngineAlone(t *testing.T) {
	cfg := Config{Engines: 1, KVBlocks: 10_000, LoadFactor: 1}
	ec := cfg.EngineConfig()
	warm := Request{InputTokens: 20_000, OutputTokens: 3, HashIDs: seq(0, blocksFor(20_000))}
	for _, tc := range []struct {
		name string
		r    Request
	}{
		{"shares 10 ids", Request{InputTokens: 30_000, OutputTokens: 17, HashIDs: append(seq(0, 10), seq(100, blocksFor(30_000)-10)...)}},
		{"inside the warm prompt", Request{InputTokens: 5_000, OutputTokens: 1, HashIDs: seq(0, blocksFor(5_000))}},
		{"all of the warm prompt", warm},
		{"nothing shared", Request{InputTokens: 9_000, OutputTokens: 5, HashIDs: seq(500, blocksFor(9_000))}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := engine.New(ec)
			if err != nil {
				t.Fatal(err)
			}
			seen := map[uint64]struct{}{}
			wh := engine.TextBlockHashes(string(warm.AppendPromptText(nil)), chunkChars)
			run(t, e, "warm", warm, wh)
			for _, h := range wh {
				seen[h] = struct{}{}
			}
			h := engine.TextBlockHashes(string(tc.r.AppendPromptText(nil)), chunkChars)
			start := e.Now()
			ttft, e2e := run(t, e, "r", tc.r, h)
			want := boundOf(ec, tc.r.InputTokens, tc.r.OutputTokens, leadingHits(seen, h))
			if ttft-start != want.TTFT || e2e-start != want.E2E {
				t.Fatalf("engine: TTFT %v, E2E %v; bound %v, %v", ttft-start, e2e-start, want.TTFT, want.E2E)
			}
		})
	}
}

func seq(from, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = from + i
	}
	return s
}

func run(t *testing.T, e *engine.Engine, id string, r Request, hashes []uint64) (firstToken, finished time.Duration) {
	t.Helper()
	if err := e.Add(engine.Request{ID: id, PromptTokens: r.InputTokens, OutputTokens: r.OutputTokens, BlockHashes: hashes}); err != nil {
		t.Fatal(err)
	}
	for e.Busy() {
		_, evs := e.Step()
		for _, ev := range evs {
			switch ev.Kind {
			case engine.FirstToken:
				firstToken = ev.At
			case engine.Finished:
				finished = ev.At
			}
		}
	}
	return firstToken, finished
}

// Picks at one instant do not see each other's prefix records under the
// upstream-like policy; a later pick does.
func TestUpstreamLikeRecordsAfterThePick(t *testing.T) {
	var now time.Duration
	p, err := newPolicy(UpstreamLike, Config{Engines: 4, Seed: 1}, &now, &idText{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	j := &job{upstreamHashes: []uint64{1, 2, 3}}
	first, _ := p.pick(0, j)
	u := p.(*upstreamLike)
	if got := u.lrus[first].leading(j.upstreamHashes); got != 0 {
		t.Fatalf("the record is visible at the same instant: %d blocks", got)
	}
	now = time.Millisecond
	if e, _ := p.pick(1, j); e != first {
		t.Fatalf("a later pick went to %d, not to the prefix's holder %d", e, first)
	}
}

func TestConfigValidate(t *testing.T) {
	good := Config{Engines: 1, KVBlocks: 1, LoadFactor: 1}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []Config{
		{KVBlocks: 1, LoadFactor: 1},
		{Engines: 1, LoadFactor: 1},
		{Engines: 1, KVBlocks: 1},
		{Engines: 1, KVBlocks: 1, LoadFactor: 1, NonStreaming: 1.5},
		{Engines: 1, KVBlocks: 1, LoadFactor: 1, Bypass: -0.1},
	} {
		if err := bad.Validate(); err == nil {
			t.Errorf("%+v was accepted", bad)
		}
	}
	reqs := []Request{{InputTokens: 10_000, OutputTokens: 1, HashIDs: seq(0, blocksFor(10_000))}}
	if _, err := Prepare(reqs, Config{Engines: 1, KVBlocks: 100, LoadFactor: 1}); err == nil || !strings.Contains(err.Error(), "--kv-blocks") {
		t.Errorf("a request larger than the cache: %v", err)
	}
}

// Requests that bypass the policy reach Tally's picker only as the engines'
// scraped counts: foreign load beyond its ledger.
func TestTallySeesBypassAsForeignLoad(t *testing.T) {
	var now time.Duration
	p, err := newPolicy(Tally, Config{Engines: 2, KVBlocks: 1000, LoadFactor: 1}, &now, &idText{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	j := &job{Request: Request{InputTokens: 600, OutputTokens: 1, HashIDs: []int{1, 2}}, stream: true}
	e, err := p.pick(0, j)
	if err != nil {
		t.Fatal(err)
	}
	stats := make([]engine.Stats, 2)
	stats[e].RunningRequests = 1                                  // the picked request
	stats[1-e].RunningRequests, stats[1-e].WaitingRequests = 2, 1 // bypassing ones
	p.observe(stats)
	for _, s := range p.(*tally).p.Snapshot().Endpoints {
		want := 0
		if s.Endpoint.Address == p.(*tally).addrs[1-e] {
			want = 3
		}
		cfg := v1alpha1.Default()
		wantCap := 1000 * 16 * cfg.CharsPerToken / cfg.BlockSizeChars // the engine's KV size, in index blocks
		if s.ForeignRequests != want || s.PrefixCapacityBlocks != wantCap {
			t.Errorf("%v: %d foreign requests, prefix capacity %d; want %d, %d", s.Endpoint.Address, s.ForeignRequests, s.PrefixCapacityBlocks, want, wantCap)
		}
	}
	p.firstByte(0)
	p.done(0, 600, 0)
	if inFlight := p.(*tally).p.Snapshot().InFlight; inFlight != 0 {
		t.Errorf("%d in flight after the release", inFlight)
	}
}

// The picker's learned prefill rate stays near what the engines can do
// (within the 1.25x an endpoint's own factor may move it by with little
// evidence).
// At 3.3 times the sample trace's pace the engines queue work the drain
// model does not see, so first bytes come later than their modelled queue
// says (one of 440 modelled tokens took 1.6 s). With the fit's overhead
// unbounded, that wait went into the overhead, the slope flattened and the
// rate rose to 154,120 tokens/s against the engines' peak of 48,559.
func TestLearnedRatesStayWithinTheEngines(t *testing.T) {
	reqs, err := LoadMooncakeFile(sampleTrace)
	if err != nil {
		t.Fatal(err)
	}
	w, err := Prepare(reqs, Config{Engines: 4, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 3.3, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	res, err := w.Run(Tally)
	if err != nil {
		t.Fatal(err)
	}
	ec := w.cfg.EngineConfig()
	step := ec.StepBaseDuration + time.Duration(ec.StepBudgetTokens)*ec.PrefillDurationPerToken
	peak := float64(ec.StepBudgetTokens) / step.Seconds()
	if got := res.LearnedRates.Max; got > 1.25*peak {
		t.Errorf("the picker learned up to %.0f tokens/s; the engines prefill at most %.0f", got, peak)
	}
}

// The exact-greedy policy reads the engines' caches: a request goes where
// its prompt is cached, whatever the seed, and one that no engine holds
// goes where no prefill is queued ahead of it.
func TestExactGreedyGoesWhereThePromptIsCached(t *testing.T) {
	reqs := []Request{
		{Arrival: 0, InputTokens: 20_000, OutputTokens: 2, HashIDs: seq(0, blocksFor(20_000))},
		{Arrival: 5 * time.Second, InputTokens: 21_000, OutputTokens: 2, HashIDs: seq(0, blocksFor(21_000))},
		// Arrives while the first request of this instant still prefills.
		{Arrival: 10 * time.Second, InputTokens: 30_000, OutputTokens: 2, HashIDs: seq(1000, blocksFor(30_000))},
		{Arrival: 10*time.Second + time.Millisecond, InputTokens: 30_000, OutputTokens: 2, HashIDs: seq(2000, blocksFor(30_000))},
	}
	for seed := uint64(1); seed <= 20; seed++ {
		w, err := Prepare(reqs, Config{Engines: 3, KVBlocks: 10_000, LoadFactor: 1, Seed: seed})
		if err != nil {
			t.Fatal(err)
		}
		res, err := w.Run(ExactGreedy)
		if err != nil {
			t.Fatal(err)
		}
		o := res.Outcomes
		if o[1].Engine != o[0].Engine || o[1].CachedTokens < 19_000 {
			t.Fatalf("seed %d: a prompt cached on engine %d went to %d (%d tokens cached)", seed, o[0].Engine, o[1].Engine, o[1].CachedTokens)
		}
		if o[3].Engine == o[2].Engine {
			t.Fatalf("seed %d: the second uncached prompt queued behind the first on engine %d", seed, o[2].Engine)
		}
	}
}

// A request's queueing is its TTFT beyond its own prefill alone with the
// cache it found: none for a request alone, the prefill ahead of it for
// one that arrives behind another on the same engine, and for that other
// only the tokens the two share a step with.
func TestQueueingIsTheWaitBeyondTheRequestsOwnPrefill(t *testing.T) {
	reqs := []Request{
		{Arrival: 0, InputTokens: 20_000, OutputTokens: 2, HashIDs: seq(0, blocksFor(20_000))},
		{Arrival: 0, InputTokens: 4_000, OutputTokens: 2, HashIDs: seq(1000, blocksFor(4_000))},
		{Arrival: 10 * time.Second, InputTokens: 20_000, OutputTokens: 2, HashIDs: seq(0, blocksFor(20_000))},
	}
	cfg := Config{Engines: 1, KVBlocks: 10_000, LoadFactor: 1, Priorities: []PriorityShare{{10, 0.5}}}
	w, err := Prepare(reqs, cfg)
	if err != nil {
		t.Fatal(err)
	}
	res, err := w.Run(RoundRobin)
	if err != nil {
		t.Fatal(err)
	}
	o := res.Outcomes
	ec := cfg.EngineConfig()
	if shared := 4_000 * ec.PrefillDurationPerToken; o[0].Queueing <= 0 || o[0].Queueing > shared {
		t.Errorf("the first request, sharing its last step with 4,000 tokens (%v): queueing %v", shared, o[0].Queueing)
	}
	if first := boundOf(ec, 20_000, 2, 0).TTFT; o[1].Queueing < first/2 || o[1].Queueing > o[1].TTFT {
		t.Errorf("behind a %v prefill: queueing %v of TTFT %v", first, o[1].Queueing, o[1].TTFT)
	}
	if o[2].CachedTokens == 0 || o[2].Queueing != 0 {
		t.Errorf("a cached prompt alone: %d tokens cached, queueing %v, want 0", o[2].CachedTokens, o[2].Queueing)
	}
	// Of three requests, each band's p99 is its largest.
	var most time.Duration
	for _, b := range Summarize(res).Bands {
		most = max(most, b.Queueing.P99)
	}
	if most != o[1].Queueing {
		t.Errorf("the bands' largest queueing p99 is %v, want request 1's %v", most, o[1].Queueing)
	}
}
