package scrape

import (
	"context"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/modelsim/server"
	"github.com/tallyepp/tally/picker"
)

// simulators starts n model-server simulators on loopback pod IPs
// (127.0.45.x) and returns their endpoints.
func simulators(t testing.TB, n int, kvBlocks int) ([]picker.Endpoint, []*server.Server) {
	t.Helper()
	var eps []picker.Endpoint
	var sims []*server.Server
	for i := range n {
		cfg := server.DefaultConfig()
		cfg.Engine.KVBlocks = kvBlocks
		sim, err := server.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ep, stop := serve(t, netip.AddrFrom4([4]byte{127, 0, 45, byte(2 + i)}), sim)
		t.Cleanup(func() { stop(); sim.Close() })
		eps = append(eps, picker.Endpoint{Pod: fmt.Sprintf("sim-%d", i), UID: fmt.Sprintf("uid-%d", i), Address: ep})
		sims = append(sims, sim)
	}
	return eps, sims
}

func serve(t testing.TB, ip netip.Addr, h http.Handler) (netip.AddrPort, func()) {
	t.Helper()
	lis, err := net.Listen("tcp", netip.AddrPortFrom(ip, 0).String())
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go func() { _ = srv.Serve(lis) }()
	return netip.MustParseAddrPort(lis.Addr().String()), func() { _ = srv.Close() }
}

func TestScrapesSizeThePrefixIndexFromTheEngine(t *testing.T) {
	eps, _ := simulators(t, 2, 1000) // 1,000 blocks of 16 tokens
	p := picker.New(v1alpha1.Default(), picker.Options{})
	p.Replace(eps)
	s := New(p, Options{})
	s.Round(t.Context(), p.ScrapeTargets(nil))
	cfg := v1alpha1.Default()
	want := 1000 * 16 * cfg.CharsPerToken / cfg.BlockSizeChars
	for _, st := range p.Snapshot().Endpoints {
		if !st.Scraped || st.PrefixCapacityBlocks != want || st.EngineRunning != 0 {
			t.Errorf("%s after a scrape: %+v, want scraped, capacity %d blocks", st.Endpoint.Address, st, want)
		}
	}
}

// The simulator publishes vLLM's prefill timing; a scrape reads it as the
// engine counted it.
func TestScrapeReadsTheSimulatorsPrefillTiming(t *testing.T) {
	eps, sims := simulators(t, 1, 1000)
	p := picker.New(v1alpha1.Default(), picker.Options{})
	s := New(p, Options{})
	target := picker.ScrapeTarget{Address: eps[0].Address, Engine: EngineVLLM}
	st, _, err := s.fetch(t.Context(), target)
	if err != nil {
		t.Fatal(err)
	}
	if !st.HasPrefillTiming || st.PrefillSecondsTotal != 0 || st.PromptTokensTotal != 0 || st.CachedTokensTotal != 0 {
		t.Fatalf("a fresh simulator: %+v, want prefill timing at zero", st)
	}

	// The same 500-token prompt twice, one after the other on an idle
	// engine: the second finds 31 blocks of 16 tokens cached.
	body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, server.DefaultModel, strings.Repeat("0123456789", 200))
	for range 2 {
		resp, err := http.Post("http://"+eps[0].Address.String()+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("completion: status %d", resp.StatusCode)
		}
	}
	st, _, err = s.fetch(t.Context(), target)
	if err != nil {
		t.Fatal(err)
	}
	cfg := server.DefaultConfig().Engine
	step := func(tokens int) time.Duration {
		return cfg.StepBaseDuration + time.Duration(tokens)*cfg.PrefillDurationPerToken
	}
	wantSeconds := (step(500) + step(500-31*16)).Seconds()
	if !st.HasPrefillTiming || math.Abs(st.PrefillSecondsTotal-wantSeconds) > 1e-9 || st.PromptTokensTotal != 1000 || st.CachedTokensTotal != 31*16 {
		t.Fatalf("after two requests: has %v, prefill %vs, prompt %v, cached %v; want true, %vs, 1000, %d",
			st.HasPrefillTiming, st.PrefillSecondsTotal, st.PromptTokensTotal, st.CachedTokensTotal, wantSeconds, 31*16)
	}
	if eng := sims[0].Stats(); st.PromptTokensTotal != float64(eng.PromptTokens) || st.CachedTokensTotal != float64(eng.PrefixHitTokens) {
		t.Fatalf("scraped prompt %v, cached %v; the engine counted %d and %d", st.PromptTokensTotal, st.CachedTokensTotal, eng.PromptTokens, eng.PrefixHitTokens)
	}
}

// Requests the picker never saw end (sent straight to the pod, as through
// a gateway that ends the stream at the pick): the picker learns what a
// request generates from the simulator's request_generation_tokens, read
// by the scraper.
func TestScrapesTeachThePoolsExpectedOutput(t *testing.T) {
	eps, _ := simulators(t, 1, 1000)
	p := picker.New(v1alpha1.Default(), picker.Options{})
	p.Replace(eps)
	s := New(p, Options{})
	s.Round(t.Context(), p.ScrapeTargets(nil)) // the counters' first window starts
	before := p.Snapshot().ExpectedOutputTokens

	const n, outTokens = 20, 5
	body := fmt.Sprintf(`{"model":%q,"prompt":"a short prompt","max_tokens":%d}`, server.DefaultModel, outTokens)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			resp, err := http.Post("http://"+eps[0].Address.String()+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("completion: status %d", resp.StatusCode)
			}
		})
	}
	wg.Wait()
	s.Round(t.Context(), p.ScrapeTargets(nil))
	got := p.Snapshot().ExpectedOutputTokens
	// n finished requests weigh as n responses of outTokens would.
	want := before + (outTokens-before)*(1-math.Pow(1-0.02, n))
	if math.Abs(got-want) > 0.01 {
		t.Fatalf("expected output %v after %d requests of %d tokens (from %v), want %v", got, n, outTokens, before, want)
	}
}

// flaky answers /metrics with 500 while failing is set, else as next does.
type flaky struct {
	failing atomic.Bool
	next    http.Handler
}

func (f *flaky) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if f.failing.Load() {
		http.Error(w, "down", http.StatusInternalServerError)
		return
	}
	f.next.ServeHTTP(w, r)
}

func TestAnEndpointWhoseScrapesFailLeavesTheCandidatesAndComesBack(t *testing.T) {
	eps, sims := simulators(t, 1, 1000)
	f := &flaky{next: sims[0]}
	bad, stop := serve(t, netip.MustParseAddr("127.0.45.20"), f)
	defer stop()
	eps = append(eps, picker.Endpoint{Pod: "flaky", UID: "uid-flaky", Address: bad})
	p := picker.New(v1alpha1.Default(), picker.Options{ScrapeFailureThreshold: 3})
	p.Replace(eps)
	s := New(p, Options{})
	// Its metrics answered once, then stop: it is suspect.
	s.Round(t.Context(), p.ScrapeTargets(nil))
	f.failing.Store(true)
	for range 3 {
		s.Round(t.Context(), p.ScrapeTargets(nil))
	}
	for range 10 {
		r, err := p.Admit(context.Background(), picker.Request{Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
		if r.Endpoints()[0] == bad {
			t.Fatal("picked the endpoint whose scrapes fail")
		}
		p.End(r, picker.Outcome{})
	}
	f.failing.Store(false)
	s.Round(t.Context(), p.ScrapeTargets(nil))
	if _, err := p.Admit(context.Background(), picker.Request{Model: "m", Subset: []netip.AddrPort{bad}, HasSubset: true}); err != nil {
		t.Errorf("after a successful scrape the endpoint is still excluded: %v", err)
	}
}

func TestForeignRequestsOnTheEngineSteerPicks(t *testing.T) {
	eps, _ := simulators(t, 2, 25_000)
	p := picker.New(v1alpha1.Default(), picker.Options{})
	p.Replace(eps)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	for i := range 4 {
		// Long generations: they stay running on sim-0 until cancelled.
		body := fmt.Sprintf(`{"model":%q,"prompt":"foreign %d %0500d","max_tokens":100000}`, server.DefaultModel, i, 0)
		go func() {
			req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+eps[0].Address.String()+"/v1/completions", stringsReader(body))
			req.Header.Set("content-type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	s := New(p, Options{})
	waitFor(t, func() bool {
		s.Round(ctx, p.ScrapeTargets(nil))
		return p.Snapshot().Endpoints[0].ForeignRequests == 4
	})
	for i := range 6 {
		r, err := p.Admit(context.Background(), picker.Request{Model: server.DefaultModel, Prompt: fmt.Appendf(nil, "ours %d %0400d", i, 0)})
		if err != nil {
			t.Fatal(err)
		}
		if r.Endpoints()[0] != eps[1].Address {
			t.Fatalf("pick %d went to sim-0, which runs 4 requests that did not come through the picker", i)
		}
	}
}

func stringsReader(s string) io.Reader { return strings.NewReader(s) }

// waitFor polls cond for up to 10 seconds.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Every endpoint keeps its connection between scrapes, also past the 100
// idle connections net/http's default transport keeps in all.
func TestScrapesReuseEachEndpointsConnection(t *testing.T) {
	const endpoints, rounds = 150, 3
	var opened atomic.Int64
	page := []byte("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
	var eps []picker.Endpoint
	for i := range endpoints {
		// 127.0.47.x: clear of the other tests' pod IPs.
		lis, err := net.Listen("tcp", netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 47, byte(1 + i)}), 0).String())
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{
			Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(page) }),
			ConnState: func(_ net.Conn, s http.ConnState) {
				if s == http.StateNew {
					opened.Add(1)
				}
			},
		}
		go func() { _ = srv.Serve(lis) }()
		t.Cleanup(func() { _ = srv.Close() })
		eps = append(eps, picker.Endpoint{Pod: fmt.Sprintf("p-%d", i), UID: fmt.Sprintf("u-%d", i), Address: netip.MustParseAddrPort(lis.Addr().String())})
	}
	p := picker.New(v1alpha1.Default(), picker.Options{})
	p.Replace(eps)
	s := New(p, Options{})
	for range rounds {
		s.Round(t.Context(), p.ScrapeTargets(nil))
	}
	for _, st := range p.Snapshot().Endpoints {
		if !st.Scraped || st.Unhealthy {
			t.Fatalf("%s not scraped: %+v", st.Endpoint.Address, st)
		}
	}
	if got := opened.Load(); got != endpoints {
		t.Errorf("%d rounds over %d endpoints opened %d connections, want one per endpoint", rounds, endpoints, got)
	}
}

// An endpoint whose metrics were never read (another port or path, an
// engine type or metric names the scraper does not know) keeps serving on
// the ledger: scrapes correct the ledger, they do not decide who serves.
func TestAnEndpointWhoseMetricsWereNeverReadKeepsServing(t *testing.T) {
	eps, sims := simulators(t, 1, 1000)
	f := &flaky{next: sims[0]}
	f.failing.Store(true)
	bad, stop := serve(t, netip.MustParseAddr("127.0.45.21"), f)
	defer stop()
	odd, stopOdd := serve(t, netip.MustParseAddr("127.0.45.22"), sims[0])
	defer stopOdd()
	eps = append(eps, picker.Endpoint{Pod: "unreadable", UID: "uid-unreadable", Address: bad},
		picker.Endpoint{Pod: "odd-engine", UID: "uid-odd", Address: odd, Engine: "my-engine"})
	p := picker.New(v1alpha1.Default(), picker.Options{ScrapeFailureThreshold: 3})
	p.Replace(eps)
	s := New(p, Options{})
	for range 5 {
		s.Round(t.Context(), p.ScrapeTargets(nil))
	}
	seen := map[netip.AddrPort]int{}
	for i := range 30 {
		r, err := p.Admit(context.Background(), picker.Request{Model: "m", Prompt: fmt.Appendf(nil, "request %d %0800d", i, 0)})
		if err != nil {
			t.Fatal(err)
		}
		seen[r.Endpoints()[0]]++
	}
	if seen[bad] == 0 || seen[odd] == 0 {
		t.Errorf("placements %v: the endpoint never read (%v) and the one of an unknown engine type (%v) must both serve", seen, bad, odd)
	}
	// The unknown engine type is read by vLLM's names, as upstream.
	for _, st := range p.Snapshot().Endpoints {
		if st.Endpoint.Address == odd && !st.Scraped {
			t.Errorf("the endpoint of engine type my-engine was not read by vLLM's names")
		}
	}
}

func TestMetricNameOverridesAreRead(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "custom_running 3\ncustom_waiting 4\nvllm:num_requests_running 100\n")
	})
	a, stop := serve(t, netip.MustParseAddr("127.0.45.23"), mux)
	defer stop()
	p := picker.New(v1alpha1.Default(), picker.Options{})
	p.Replace([]picker.Endpoint{{Pod: "custom", Address: a}})
	s := New(p, Options{VLLM: &MetricNames{Running: MetricSpec{Name: "custom_running"}, Waiting: MetricSpec{Name: "custom_waiting"}}})
	s.Round(t.Context(), p.ScrapeTargets(nil))
	st := p.Snapshot().Endpoints[0]
	if st.EngineRunning != 3 || st.EngineWaiting != 4 {
		t.Errorf("running %d, waiting %d; want 3 and 4 from the overriding names", st.EngineRunning, st.EngineWaiting)
	}
}

// roundRecorder records the rounds the scraper hands the picker.
type roundRecorder struct {
	*picker.Picker
	mu     sync.Mutex
	rounds [][]picker.Scrape
}

func (r *roundRecorder) ObserveScrapes(round []picker.Scrape) (recovered, failed []netip.AddrPort) {
	r.mu.Lock()
	r.rounds = append(r.rounds, slices.Clone(round))
	r.mu.Unlock()
	return r.Picker.ObserveScrapes(round)
}

// A round reaches the picker at once, when its slowest scrape has
// answered: no pick sees one engine's news before another's of the same
// round.
func TestARoundReachesThePickerAtOnce(t *testing.T) {
	eps, _ := simulators(t, 2, 25_000)
	p := picker.New(v1alpha1.Default(), picker.Options{})
	slowSim, err := server.New(server.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(slowSim.Close)
	var seenEarly atomic.Int32
	slow, stop := serve(t, netip.AddrFrom4([4]byte{127, 0, 45, 8}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(300 * time.Millisecond) // the fast ones have answered
		for _, st := range p.Snapshot().Endpoints {
			if st.Scraped {
				seenEarly.Add(1)
			}
		}
		slowSim.ServeHTTP(w, r)
	}))
	t.Cleanup(stop)
	refused := netip.MustParseAddrPort("127.0.45.9:1")
	eps = append(eps, picker.Endpoint{Pod: "slow", UID: "uid-slow", Address: slow}, picker.Endpoint{Pod: "refused", UID: "uid-refused", Address: refused})
	p.Replace(eps)
	rec := &roundRecorder{Picker: p}
	New(rec, Options{}).Round(t.Context(), p.ScrapeTargets(nil))

	if n := seenEarly.Load(); n != 0 {
		t.Errorf("%d endpoints' scrapes reached the picker while another of the round was still answering", n)
	}
	if len(rec.rounds) != 1 || len(rec.rounds[0]) != 4 {
		t.Fatalf("rounds handed to the picker: %+v, want one of 4 scrapes", rec.rounds)
	}
	for _, s := range rec.rounds[0] {
		if s.Failed != (s.Address == refused) {
			t.Errorf("scrape of %v: failed %v", s.Address, s.Failed)
		}
		// Every scrape was sent before the slow one answered: each says
		// its counts are at least that old.
		if s.Age < 300*time.Millisecond {
			t.Errorf("scrape of %v: age %v, want at least the slow scrape's 300ms", s.Address, s.Age)
		}
	}
	for _, st := range p.Snapshot().Endpoints {
		if st.Scraped != (st.Endpoint.Address != refused) {
			t.Errorf("%s after the round: scraped %v", st.Endpoint.Pod, st.Scraped)
		}
	}
}

// tritonMetrics is what Triton's TensorRT-LLM backend publishes (trimmed):
// its request counts are one family whose request_type label says which
// count a series is, and so are its KV cache block figures.
const tritonMetrics = `# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="ensemble",version="1"} 120
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 2
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 3
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 512
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 5
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 2496
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 3744
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 6240
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.4
`

// TestTritonLabelFiltersAreHonoured reads a Triton server with the metric
// flags the upstream chart passes for it: each count is the one series its
// label filter names, not the family's sum.
func TestTritonLabelFiltersAreHonoured(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, tritonMetrics) })
	a, stop := serve(t, netip.MustParseAddr("127.0.45.24"), mux)
	defer stop()
	spec := func(s string) MetricSpec {
		t.Helper()
		m, err := ParseMetricSpec(s)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	names := MetricNames{
		Waiting:      spec("nv_trt_llm_request_metrics{request_type=waiting}"),
		Running:      spec("nv_trt_llm_request_metrics{request_type=scheduled}"),
		KVCacheUsage: spec("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"),
	}
	p := picker.New(v1alpha1.Default(), picker.Options{})
	p.Replace([]picker.Endpoint{{Pod: "triton", Address: a}})
	New(p, Options{VLLM: &names}).Round(t.Context(), p.ScrapeTargets(nil))
	st := p.Snapshot().Endpoints[0]
	if st.EngineRunning != 3 || st.EngineWaiting != 2 {
		t.Errorf("running %d, waiting %d; want 3 (scheduled) and 2 (waiting)", st.EngineRunning, st.EngineWaiting)
	}
	if st.KVCacheUsage != 0.4 {
		t.Errorf("KV cache usage %v, want 0.4 (the fraction series)", st.KVCacheUsage)
	}
}

func TestParseMetricSpec(t *testing.T) {
	for _, tc := range []struct{ in, want, err string }{
		{in: "", want: ""},
		{in: "vllm:num_requests_waiting", want: "vllm:num_requests_waiting"},
		{in: "nv_trt_llm_request_metrics{request_type=waiting}", want: "nv_trt_llm_request_metrics{request_type=waiting}"},
		{in: ` m { a = "x", b=y } `, want: "m{a=x,b=y}"},
		{in: "m{", err: "at the end"},
		{in: "m{a=x}y", err: "at the end"},
		{in: "m{a}", err: `label filter "a" must be label=value`},
		{in: "m{a=}", err: "must be label=value"},
		{in: "{a=x}", err: "the metric name is empty"},
		{in: "a=b", err: "must be a metric name"},
	} {
		got, err := ParseMetricSpec(tc.in)
		switch {
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("ParseMetricSpec(%q) = %v, %v; want an error saying %q", tc.in, got, err, tc.err)
		case tc.err == "" && (err != nil || got.String() != tc.want):
			t.Errorf("ParseMetricSpec(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}
