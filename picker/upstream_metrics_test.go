package picker

import (
	"math"
	"net/netip"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
)

// The pool gauges under the upstream picker's names: the engines' queue and
// running counts where scraped, else the ledger's queue (in flight and not
// yet decoding).
func TestUpstreamPoolMetricsFollowTheLedger(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	p := New(testConfig(), Options{Registerer: reg, Clock: newFakeClock(), PoolName: "pool-a"})
	// Two pods, the first with two target ports: upstream names endpoints
	// "<pod>-rank-<port index>".
	p.Replace([]Endpoint{
		{Pod: "vllm-0", Address: netip.MustParseAddrPort("127.0.0.2:8000")},
		{Pod: "vllm-0", Address: netip.MustParseAddrPort("127.0.0.2:8001")},
		{Pod: "vllm-1", Address: netip.MustParseAddrPort("127.0.0.3:8000")},
	})
	on := func(a string) Request {
		// A prompt, so there is prefill to wait for (the clock stands still).
		return Request{Model: model, Prompt: text("queued", 4000), Subset: []netip.AddrPort{netip.MustParseAddrPort(a)}, HasSubset: true}
	}
	mustPick(t, p, on("127.0.0.2:8000"))
	p.FirstByte(mustPick(t, p, on("127.0.0.2:8000"))) // decoding: no longer queued
	mustPick(t, p, on("127.0.0.3:8000"))
	mustPick(t, p, on("127.0.0.3:8000"))
	mustPick(t, p, on("127.0.0.3:8000"))

	const (
		readyHelp = "# HELP inference_pool_ready_pods Endpoints in the pool's endpoint set (a target port on a Ready pod), as tally_endpoints.\n" +
			"# TYPE inference_pool_ready_pods gauge\n"
		avgHelp = "# HELP inference_pool_average_queue_size Mean over the pool's endpoints of inference_pool_per_pod_queue_size.\n" +
			"# TYPE inference_pool_average_queue_size gauge\n"
		perPodHelp = "# HELP inference_pool_per_pod_queue_size Requests waiting in the endpoint's engine queue at its last scrape; " +
			"for an endpoint not scraped or failing its scrapes, the requests the picker placed there still waiting for or in their prefill " +
			"(in flight and not yet decoding in the ledger).\n# TYPE inference_pool_per_pod_queue_size gauge\n"
		runningHelp = "# HELP inference_pool_average_running_requests Mean over the endpoints whose last scrape succeeded of the requests " +
			"their engines reported running; not sent before a scrape.\n# TYPE inference_pool_average_running_requests gauge\n"
	)
	families := []string{"inference_pool_ready_pods", "inference_pool_average_queue_size", "inference_pool_per_pod_queue_size",
		"inference_pool_average_running_requests"}
	compare := func(what, want string) {
		t.Helper()
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want), families...); err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}

	// Before any scrape: the ledger's queue, no running average.
	compare("unscraped", readyHelp+`inference_pool_ready_pods{name="pool-a"} 3
`+avgHelp+`inference_pool_average_queue_size{name="pool-a"} 1.3333333333333333
`+perPodHelp+`inference_pool_per_pod_queue_size{model_server_pod="vllm-0-rank-0",name="pool-a"} 1
inference_pool_per_pod_queue_size{model_server_pod="vllm-0-rank-1",name="pool-a"} 0
inference_pool_per_pod_queue_size{model_server_pod="vllm-1-rank-0",name="pool-a"} 3
`)

	// A scraped endpoint reports its engine's own queue, as upstream; the
	// running average is over the scraped endpoints.
	vllm1 := netip.MustParseAddrPort("127.0.0.3:8000")
	p.ObserveEngine(vllm1, EngineStats{Running: 5, Waiting: 7})
	compare("one scraped", readyHelp+`inference_pool_ready_pods{name="pool-a"} 3
`+avgHelp+`inference_pool_average_queue_size{name="pool-a"} 2.6666666666666665
`+perPodHelp+`inference_pool_per_pod_queue_size{model_server_pod="vllm-0-rank-0",name="pool-a"} 1
inference_pool_per_pod_queue_size{model_server_pod="vllm-0-rank-1",name="pool-a"} 0
inference_pool_per_pod_queue_size{model_server_pod="vllm-1-rank-0",name="pool-a"} 7
`+runningHelp+`inference_pool_average_running_requests{name="pool-a"} 5
`)

	// Failing its scrapes, its last scrape goes stale: back to the ledger.
	for range DefaultScrapeFailureThreshold {
		p.ObserveScrapeFailure(vllm1)
	}
	compare("scrapes failing", readyHelp+`inference_pool_ready_pods{name="pool-a"} 3
`+avgHelp+`inference_pool_average_queue_size{name="pool-a"} 1.3333333333333333
`+perPodHelp+`inference_pool_per_pod_queue_size{model_server_pod="vllm-0-rank-0",name="pool-a"} 1
inference_pool_per_pod_queue_size{model_server_pod="vllm-0-rank-1",name="pool-a"} 0
inference_pool_per_pod_queue_size{model_server_pod="vllm-1-rank-0",name="pool-a"} 3
`)

	// An empty pool has no mean: only ready_pods is sent.
	p.Replace(nil)
	compare("empty", readyHelp+`inference_pool_ready_pods{name="pool-a"} 0
`)
}

// The hit ratio is observed once per placed request: matched blocks over
// hashed blocks on the chosen endpoint, in the upstream buckets; the
// scheduler duration once per pick, whatever its result.
func TestUpstreamPickHistograms(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	p := newPicker(t, 2, testConfig(), Options{Registerer: reg})
	prompt := text("ratio", 64*10)                                        // ten blocks of the test config
	mustPick(t, p, on(addr(0), prompt))                                   // cold: 0
	mustPick(t, p, on(addr(0), prompt))                                   // warm: 1
	mustPick(t, p, on(addr(0), join(prompt[:64*5], text("other", 64*5)))) // half: 0.5
	mustPick(t, p, on(addr(1), nil))                                      // no prompt: not observed
	if _, err := p.pick(Request{Model: model, HasSubset: true}); err != ErrNoEndpoint {
		t.Fatalf("empty subset: %v, want ErrNoEndpoint", err)
	}

	ratio := histogram(t, reg, "inference_extension_prefix_indexer_hit_ratio")
	if ratio.GetSampleCount() != 3 || math.Abs(ratio.GetSampleSum()-1.5) > 1e-9 {
		t.Errorf("hit ratio: %d samples summing to %g, want 3 summing to 1.5", ratio.GetSampleCount(), ratio.GetSampleSum())
	}
	assertBuckets(t, ratio, upstreamRatioBuckets)
	e2e := histogram(t, reg, "inference_extension_scheduler_e2e_duration_seconds")
	if e2e.GetSampleCount() != 5 {
		t.Errorf("scheduler e2e duration: %d samples, want one per pick (5)", e2e.GetSampleCount())
	}
	assertBuckets(t, e2e, []float64{0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1})
}

func histogram(t *testing.T, g prometheus.Gatherer, name string) *dto.Histogram {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name {
			if len(f.GetMetric()) != 1 || len(f.GetMetric()[0].GetLabel()) != 0 {
				t.Fatalf("%s: want one series without labels, got %v", name, f.GetMetric())
			}
			return f.GetMetric()[0].GetHistogram()
		}
	}
	t.Fatalf("%s was not gathered", name)
	return nil
}

func assertBuckets(t *testing.T, h *dto.Histogram, want []float64) {
	t.Helper()
	var got []float64
	for _, b := range h.GetBucket() {
		got = append(got, b.GetUpperBound())
	}
	if len(got) != len(want) {
		t.Fatalf("buckets %v, want %v", got, want)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("buckets %v, want %v", got, want)
		}
	}
}

// The KV cache average is over the healthy endpoints whose engines publish
// their use; an endpoint never scraped, not publishing it, or failing its
// scrapes does not count.
func TestUpstreamKVCacheUtilizationAveragesTheScrapes(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	p := New(testConfig(), Options{Registerer: reg, Clock: newFakeClock(), PoolName: "pool-a"})
	a, b, c, d := netip.MustParseAddrPort("127.0.0.2:8000"), netip.MustParseAddrPort("127.0.0.3:8000"),
		netip.MustParseAddrPort("127.0.0.4:8000"), netip.MustParseAddrPort("127.0.0.5:8000")
	p.Replace([]Endpoint{{Pod: "a", Address: a}, {Pod: "b", Address: b}, {Pod: "c", Address: c}, {Pod: "d", Address: d}})
	const help = "# HELP inference_pool_average_kv_cache_utilization Mean over the healthy endpoints whose engines publish it of the share " +
		"of their KV cache in use (0 to 1) at their last scrape; not sent before one.\n# TYPE inference_pool_average_kv_cache_utilization gauge\n"
	compare := func(what, want string) {
		t.Helper()
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "inference_pool_average_kv_cache_utilization"); err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}
	compare("before any scrape", "")
	p.ObserveEngine(c, EngineStats{Running: 1}) // publishes no KV use
	compare("no engine publishes it", "")
	p.ObserveEngine(a, EngineStats{KVCacheUsage: 0.625, HasKVCacheUsage: true})
	p.ObserveEngine(b, EngineStats{KVCacheUsage: 0.125, HasKVCacheUsage: true})
	compare("two publish it", help+`inference_pool_average_kv_cache_utilization{name="pool-a"} 0.375
`)
	for range DefaultScrapeFailureThreshold {
		p.ObserveScrapeFailure(a)
	}
	compare("one fails its scrapes", help+`inference_pool_average_kv_cache_utilization{name="pool-a"} 0.125
`)
	p.ObserveEngine(b, EngineStats{Running: 2}) // stopped publishing it
	compare("none publishes it any more", "")
}
