package main

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestThePickersRegistryIsServedThroughAnother(t *testing.T) {
	inner := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tally_test_total", Help: "a counter"}, []string{"code"})
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "tally_test_seconds", Help: "a histogram", Buckets: []float64{0.1, 1}})
	inner.MustRegister(c, h)
	c.WithLabelValues("200").Add(3)
	c.WithLabelValues("503").Inc()
	h.Observe(0.5)

	outer := prometheus.NewRegistry()
	outer.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "controller_runtime_thing", Help: "the outer registry's own"}))
	bridge := &registryCollector{gatherer: inner}
	outer.MustRegister(bridge)

	want := `
# HELP tally_test_seconds a histogram
# TYPE tally_test_seconds histogram
tally_test_seconds_bucket{le="0.1"} 0
tally_test_seconds_bucket{le="1"} 1
tally_test_seconds_bucket{le="+Inf"} 1
tally_test_seconds_sum 0.5
tally_test_seconds_count 1
# HELP tally_test_total a counter
# TYPE tally_test_total counter
tally_test_total{code="200"} 3
tally_test_total{code="503"} 1
`
	if err := testutil.GatherAndCompare(outer, strings.NewReader(want), "tally_test_total", "tally_test_seconds"); err != nil {
		t.Fatal(err)
	}
	if n, err := testutil.GatherAndCount(outer); err != nil || n != 4 {
		t.Fatalf("outer has %d series (%v), want its own gauge and the 3 bridged", n, err)
	}

	bridge.detach()
	if n, err := testutil.GatherAndCount(outer); err != nil || n != 1 {
		t.Fatalf("after detach: %d series (%v), want only the outer registry's own", n, err)
	}
}
