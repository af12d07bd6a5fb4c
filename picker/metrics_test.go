package picker

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestMetricsMatchStats(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	clock := newFakeClock()
	cfg := testConfig()
	cfg.Saturation.MaxInFlightRequests = 3
	p := newPicker(t, 3, cfg, Options{Registerer: reg, Clock: clock, MaxRequestLifetime: time.Minute})

	var picked []*Reservation
	pick := func(req Request) error {
		r, err := p.pick(req)
		if err == nil {
			picked = append(picked, r)
		}
		return err
	}
	prompt := text("metrics", 4000)
	for _, req := range []Request{
		on(addr(0), prompt),
		on(addr(0), prompt), // cached
		on(addr(2), nil),
		on(addr(2), text("other", 1000)),
	} {
		if err := pick(req); err != nil {
			t.Fatal(err)
		}
	}
	p.FirstByte(picked[2])
	clock.Advance(2 * time.Minute)
	for range 3 {
		if err := pick(on(addr(1), nil)); err != nil {
			t.Fatal(err)
		}
	}
	if err := pick(on(addr(1), nil)); err != ErrSaturated {
		t.Fatalf("fourth request on one endpoint: %v, want ErrSaturated", err)
	}
	if err := pick(Request{Model: model, HasSubset: true}); err != ErrNoEndpoint {
		t.Fatalf("empty subset: %v, want ErrNoEndpoint", err)
	}
	p.End(picked[len(picked)-1], Outcome{})
	if n := p.sweep(); n != 4 {
		t.Fatalf("Sweep released %d, want the 4 picks made before the clock moved", n)
	}

	var want strings.Builder
	gauge := func(name, help string, value func(EndpointStats) int) {
		fmt.Fprintf(&want, "# HELP %s %s\n# TYPE %s gauge\n", name, help, name)
		for _, s := range p.Snapshot().Endpoints {
			fmt.Fprintf(&want, "%s{endpoint=%q} %d\n", name, s.Endpoint.Address.String(), value(s))
		}
	}
	gauge("tally_endpoint_inflight_requests", "Requests reserved on the endpoint and not yet released.",
		func(s EndpointStats) int { return s.InFlight })
	gauge("tally_endpoint_prefill_tokens", "Estimated prefill tokens outstanding on the endpoint.",
		func(s EndpointStats) int { return s.PrefillTokens })
	gauge("tally_endpoint_decoding_requests", "Requests on the endpoint past their first response byte.",
		func(s EndpointStats) int { return s.Decoding })
	inFlight := p.Snapshot().InFlight
	promptSum, cachedSum := 0, 0
	for _, r := range picked {
		promptSum += promptTokens(r)
		cachedSum += cachedTokens(r)
	}
	fmt.Fprintf(&want, `# HELP tally_endpoints Endpoints in the pool.
# TYPE tally_endpoints gauge
tally_endpoints %d
# HELP tally_inflight_requests Requests reserved and not yet released, on current and retained endpoints.
# TYPE tally_inflight_requests gauge
tally_inflight_requests %d
# HELP tally_picks_total Picks by result: ok, no_endpoint (answered 503) or saturated (answered 429).
# TYPE tally_picks_total counter
tally_picks_total{result="no_endpoint"} 1
tally_picks_total{result="ok"} %d
tally_picks_total{result="saturated"} 1
# HELP tally_reservations_swept_total Reservations released by the sweeper because their stream's end was never seen.
# TYPE tally_reservations_swept_total counter
tally_reservations_swept_total 4
# HELP tally_prompt_tokens_total Estimated prompt tokens of placed requests.
# TYPE tally_prompt_tokens_total counter
tally_prompt_tokens_total %d
# HELP tally_prefix_cached_tokens_total Estimated prompt tokens found in the chosen endpoint's prefix index; divided by tally_prompt_tokens_total it is the prefix hit rate.
# TYPE tally_prefix_cached_tokens_total counter
tally_prefix_cached_tokens_total %d
`, len(p.Snapshot().Endpoints), inFlight, len(picked), promptSum, cachedSum)

	if inFlight != 2 || cachedSum == 0 {
		t.Fatalf("scenario went wrong: %d in flight (want 2), %d cached tokens (want > 0)", inFlight, cachedSum)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want.String()),
		"tally_endpoint_inflight_requests", "tally_endpoint_prefill_tokens", "tally_endpoint_decoding_requests",
		"tally_endpoints", "tally_inflight_requests", "tally_picks_total", "tally_reservations_swept_total",
		"tally_prompt_tokens_total", "tally_prefix_cached_tokens_total"); err != nil {
		t.Error(err)
	}

	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "tally_pick_duration_seconds" {
			if got := f.GetMetric()[0].GetHistogram().GetSampleCount(); got != uint64(len(picked)+2) {
				t.Errorf("pick duration histogram counted %d picks, want %d", got, len(picked)+2)
			}
			return
		}
	}
	t.Error("tally_pick_duration_seconds was not gathered")
}

func TestPickerWithoutRegistererStillCollects(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	mustPick(t, p, Request{Model: model})
	// 5 gauges per endpoint, 4 pool gauges, 3 pick results, 3 counters, 1
	// histogram; under upstream names, 2 histograms, 2 pool gauges and 1
	// gauge per endpoint; of the engines' view, before any scrape, 2 gauges
	// and 2 counters per endpoint; detached
	// reservations, a gauge, a counter and 3 ends; the decode model's 2
	// gauges. The prefill rate's samples, 6 results. The unlabelled
	// role's 3 gauges (no split metric: disaggregation is off).
	if got, want := testutil.CollectAndCount(p), 5*2+4+3+3+1+2+2+2+4*2+5+6+2+3; got != want {
		t.Errorf("collected %d metrics, want %d", got, want)
	}
}
