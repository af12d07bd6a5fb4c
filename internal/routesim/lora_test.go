package routesim

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/internal/testtier"
)

// loraConfig is the multi-adapter pool of the tests: 8 adapters drawn
// Zipf 1.1, 4 engines of max_loras 2.
func loraConfig() Config {
	return Config{Engines: 4, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 1, Seed: 1,
		Adapters: 8, AdapterZipf: 1.1, MaxLoRAs: 2, LoRALoadTime: 200 * time.Millisecond}
}

// With adapters, every policy's run ends every request once, none faster
// than its bound; each engine loads every adapter it serves at least once,
// and the swaps the summary reports are the engines'. Tally, which sees
// the adapters in its scrapes, swaps no more than round-robin and fewer
// than the same picker blind to them; upstream-like's LoRA scorer fewer
// than round-robin.
func TestAdaptersOnTheSampleTrace(t *testing.T) {
	testtier.SkipIfShort(t, "every policy over the sample trace with adapters, tens of seconds of CPU under -race")
	w, err := Prepare(loadSample(t, 150), loraConfig())
	if err != nil {
		t.Fatal(err)
	}
	bounds := w.Bounds()
	swaps := map[string]int64{}
	for _, p := range KnownPolicies() {
		res, err := w.Run(p)
		if err != nil {
			t.Fatal(err)
		}
		var finished, loads int64
		for _, e := range res.Engines {
			finished += e.FinishedRequests
			loads += e.AdapterLoads
			if e.RunningRequests+e.WaitingRequests != 0 || e.RunningAdapters != 0 {
				t.Errorf("%s: an engine still holds requests or adapters at the end: %+v", p, e)
			}
		}
		if finished != int64(w.Len()) {
			t.Errorf("%s: the engines finished %d requests, want %d", p, finished, w.Len())
		}
		for i, o := range res.Outcomes {
			if o.Engine < 0 || o.TTFT < bounds[i].TTFT || o.E2E < o.TTFT || o.Adapter != w.jobs[i].Adapter {
				t.Fatalf("%s: request %d: %+v (bound %v, adapter %q)", p, i, o, bounds[i].TTFT, w.jobs[i].Adapter)
			}
		}
		s := Summarize(res)
		if s.AdapterLoads != loads || loads == 0 {
			t.Errorf("%s: the summary counts %d swaps, the engines %d", p, s.AdapterLoads, loads)
		}
		for e, n := range s.AdaptersServed {
			if n == 0 || res.Engines[e].AdapterLoads < int64(n) {
				t.Errorf("%s: engine %d served %d adapters with %d loads", p, e, n, res.Engines[e].AdapterLoads)
			}
		}
		swaps[p] = loads
	}
	blind := runBlindTally(t, w)
	t.Logf("swaps %v, tally blind to adapters %d", swaps, blind)
	if swaps[Tally] > swaps[RoundRobin] || swaps[Tally] >= blind {
		t.Errorf("tally swapped %d adapters; round-robin %d, tally without the adapters in its scrapes %d", swaps[Tally], swaps[RoundRobin], blind)
	}
	if swaps[UpstreamLike] >= swaps[RoundRobin] {
		t.Errorf("upstream-like swapped %d adapters, round-robin %d: its LoRA scorer does nothing", swaps[UpstreamLike], swaps[RoundRobin])
	}
	again, err := w.Run(Tally)
	if err != nil {
		t.Fatal(err)
	}
	if s := Summarize(again); s.AdapterLoads != swaps[Tally] {
		t.Errorf("two runs of one workload differ: %d and %d swaps", swaps[Tally], s.AdapterLoads)
	}
}

// runBlindTally runs w under Tally with scrapes that carry no adapters,
// as from an engine that does not publish lora_requests_info, and returns
// the swaps.
func runBlindTally(t *testing.T, w *Workload) int64 {
	t.Helper()
	s, err := w.newSim()
	if err != nil {
		t.Fatal(err)
	}
	pol, err := newPolicy(Tally, w.cfg, &s.now, w.texts, nil)
	if err != nil {
		t.Fatal(err)
	}
	pol.(*tally).lora = nil
	res, err := s.runWith(pol)
	if err != nil {
		t.Fatal(err)
	}
	return Summarize(res).AdapterLoads
}

// The adapters are drawn from their own stream: the same requests stream
// and bypass with adapters or without; the mix follows the Zipf weights,
// and BaseFraction keeps that share on the base model.
func TestAdapterDraws(t *testing.T) {
	testtier.SkipIfShort(t, "adapter draws over whole simulated traces (about 5 s with -race)")
	reqs := loadSample(t, 400)
	plain := Config{Engines: 4, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 1, NonStreaming: 0.3, Bypass: 0.2, Seed: 5}
	cfg := plain
	cfg.Adapters, cfg.AdapterZipf, cfg.BaseFraction, cfg.MaxLoRAs = 4, 1, 0.25, 1
	a, err := Prepare(reqs, plain)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Prepare(reqs, cfg)
	if err != nil {
		t.Fatal(err)
	}
	count := map[string]int{}
	for i := range b.jobs {
		ja, jb := &a.jobs[i], &b.jobs[i]
		if ja.stream != jb.stream || ja.bypass != jb.bypass || ja.Adapter != "" {
			t.Fatalf("request %d: adapters changed another draw", i)
		}
		count[jb.Adapter]++
	}
	// Weights 1, 1/2, 1/3, 1/4 of 0.75: 36%, 18%, 12%, 9%; base 25%.
	t.Logf("mix %v", count)
	if base := count[""]; base < 70 || base > 130 {
		t.Errorf("%d of 400 requests on the base model, want about 100", base)
	}
	for k := 1; k < 4; k++ {
		if count[AdapterName(k)] >= count[AdapterName(0)] || count[AdapterName(k)] == 0 {
			t.Errorf("mix %v: want every adapter drawn, %s the most", count, AdapterName(0))
		}
	}
	if _, err := Prepare([]Request{{InputTokens: 10, OutputTokens: 1, HashIDs: []int{1}, Adapter: "x"}}, plain); err == nil || !strings.Contains(err.Error(), "--adapters") {
		t.Errorf("a request for an adapter on engines that serve none: %v", err)
	}
	for _, k := range []int{0, 1, 2} {
		if got := drawIndex([]float64{0.5, 0.75, 1}, []float64{0, 0.5, 0.9}[k]); got != k {
			t.Errorf("drawIndex at rank %d: %d", k, got)
		}
	}
}

func TestLoRAConfigValidate(t *testing.T) {
	for _, bad := range []func(c *Config){
		func(c *Config) { c.Adapters = -1 },
		func(c *Config) { c.MaxLoRAs = 0 },
		func(c *Config) { c.AdapterZipf = -1 },
		func(c *Config) { c.BaseFraction = 1.5 },
		func(c *Config) { c.LoRALoadTime = -time.Second },
	} {
		c := loraConfig()
		bad(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%+v was accepted", c)
		}
	}
	if c := loraConfig().EngineConfig(); c.MaxLoRAs != 2 || c.LoRALoadTime != 200*time.Millisecond {
		t.Errorf("engine config %+v: want max_loras 2, a load 200ms", c)
	}
}

// The upstream picker's lora-affinity-scorer: running 1, a free slot 0.8,
// waiting 0.6, else 0.
func TestUpstreamLoRAScore(t *testing.T) {
	for _, c := range []struct {
		in    loraInfo
		model string
		want  float64
	}{
		{loraInfo{running: []string{"a", "b"}}, "a", 1},
		{loraInfo{running: []string{"b"}}, "a", 0.8},
		{loraInfo{running: []string{"b"}, waiting: []string{"a"}}, "a", 0.6},
		{loraInfo{running: []string{"b"}, waiting: []string{"c"}}, "a", 0},
		{loraInfo{running: []string{"b", "c"}}, "", 0},
		{loraInfo{}, "", 0.8},
	} {
		if got := upstreamLoRAScore(c.in, 2, c.model); got != c.want {
			t.Errorf("%+v, %q: %v, want %v", c.in, c.model, got, c.want)
		}
	}
}

// Tally's picker gets the base model, max_lora and the adapters in its
// scrape, and a request's model is its adapter.
func TestTallySeesAdaptersInItsScrape(t *testing.T) {
	var now time.Duration
	cfg := loraConfig()
	cfg.Engines = 2
	pol, err := newPolicy(Tally, cfg, &now, &idText{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tp := pol.(*tally)
	tp.observeLoRA([]loraInfo{{running: []string{"lora-1"}}, {waiting: []string{"lora-2"}}})
	tp.observe(make([]engine.Stats, 2))
	l := tp.p.Snapshot()
	for _, e := range l.Endpoints {
		want := loraInfo{running: []string{"lora-1"}}
		if e.Endpoint.Address == tp.addrs[1] {
			want = loraInfo{waiting: []string{"lora-2"}}
		}
		if !slices.Equal(e.RunningAdapters, want.running) || !slices.Equal(e.WaitingAdapters, want.waiting) || e.MaxLoRAs != 2 {
			t.Errorf("%v: running %v, waiting %v, max_lora %d; want %+v, 2", e.Endpoint.Address, e.RunningAdapters, e.WaitingAdapters, e.MaxLoRAs, want)
		}
	}
	j := &job{Request: Request{InputTokens: 600, OutputTokens: 1, HashIDs: []int{1, 2}, Adapter: "lora-1"}, stream: true}
	e, err := pol.pick(0, j)
	if err != nil {
		t.Fatal(err)
	}
	if e != 0 {
		t.Errorf("a request for lora-1 went to engine %d, not to engine 0, which runs it", e)
	}
	if got := tp.p.Snapshot().Endpoints; got[0].Adapters["lora-1"]+got[1].Adapters["lora-1"] != 1 {
		t.Errorf("the picker does not count the request as lora-1's: %+v", got)
	}
}

// A burst for an adapter no engine has loaded: Tally loads it on fewer
// engines than round-robin, each within twice the even share of the
// burst's prefill, one swap per engine used.
func TestAdapterBurst(t *testing.T) {
	b := Burst{Requests: 64, PromptTokens: 4096, SharedTokens: 2048, OutputTokens: 8}
	w, err := PrepareBurst(b, loraConfig())
	if err != nil {
		t.Fatal(err)
	}
	if w.jobs[0].Adapter != "" || w.jobs[1].Adapter != BurstAdapter {
		t.Fatalf("warm-up for %q, burst for %q", w.jobs[0].Adapter, w.jobs[1].Adapter)
	}
	used := map[string]int{}
	for _, p := range []string{RoundRobin, Tally} {
		res, err := w.Run(p)
		if err != nil {
			t.Fatal(err)
		}
		run := SummarizeBurst(res)
		total := 0
		for _, n := range run.Prefill {
			total += n
		}
		for e, n := range run.Placed {
			if n > 0 {
				used[p]++
			}
			if run.Prefill[e]*len(run.Prefill) > 2*total {
				t.Errorf("%s: engine %d computed %d of the burst's %d prefill tokens, more than twice the even share", p, e, run.Prefill[e], total)
			}
		}
		if run.AdapterLoads != int64(used[p]) {
			t.Errorf("%s: %d swaps on %d engines used", p, run.AdapterLoads, used[p])
		}
		t.Logf("%s: placed %v, prefill %v", p, run.Placed, run.Prefill)
	}
	if used[Tally] >= used[RoundRobin] {
		t.Errorf("tally used %d engines for a new adapter's burst, round-robin %d", used[Tally], used[RoundRobin])
	}
}

// The forecast-greedy reference runs each engine forward: a request for an
// adapter goes where the adapter runs, not where its slot is held by
// another adapter for tens of seconds of decoding, though no prefill is
// queued on either engine (exact-greedy, which counts queued prefill alone,
// sends it to either).
func TestForecastGreedySeesTheWaitForAnAdapterSlot(t *testing.T) {
	testtier.SkipIfShort(t, "20 simulated runs of two routers with adapters (about 5 s with -race)")
	reqs := []Request{
		{Arrival: 0, InputTokens: 8_000, OutputTokens: 2_000, HashIDs: seq(0, blocksFor(8_000)), Adapter: "lora-0"},
		{Arrival: 0, InputTokens: 8_000, OutputTokens: 2_000, HashIDs: seq(1000, blocksFor(8_000)), Adapter: "lora-1"},
		{Arrival: time.Second, InputTokens: 1_000, OutputTokens: 2, HashIDs: seq(2000, blocksFor(1_000)), Adapter: "lora-0"},
	}
	cfg := Config{Engines: 2, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 1, Adapters: 2, BaseFraction: 1,
		MaxLoRAs: 1, LoRALoadTime: 200 * time.Millisecond}
	exactMissed := 0
	for seed := uint64(1); seed <= 20; seed++ {
		cfg.Seed = seed
		w, err := Prepare(reqs, cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, policy := range []string{ForecastGreedy, ExactGreedy} {
			res, err := w.Run(policy)
			if err != nil {
				t.Fatal(err)
			}
			o := res.Outcomes
			if o[0].Engine == o[1].Engine {
				if policy == ForecastGreedy {
					t.Fatalf("seed %d: forecast-greedy put two adapters on engine %d of max_loras 1", seed, o[0].Engine)
				}
				continue
			}
			switch {
			case policy == ExactGreedy:
				if o[2].Engine != o[0].Engine {
					exactMissed++
				}
			case o[2].Engine != o[0].Engine || o[2].TTFT > time.Second:
				t.Errorf("seed %d: the lora-0 request went to engine %d (lora-0 runs on %d), TTFT %v", seed, o[2].Engine, o[0].Engine, o[2].TTFT)
			}
		}
	}
	if exactMissed == 0 {
		t.Errorf("exact-greedy sent the lora-0 request where lora-0 runs in every seed: the scenario does not tell the policies apart")
	}
}
