package picker

import "github.com/prometheus/client_golang/prometheus"

// metrics are the picker's counters and histogram. They are updated outside
// the picker's lock; the per-endpoint gauges are not stored at all but read
// from the ledger at scrape time (Collect), so they can never drift from it.
type metrics struct {
	picks           *prometheus.CounterVec
	picksOK         prometheus.Counter
	picksNoEndpoint prometheus.Counter
	picksSaturated  prometheus.Counter
	swept           prometheus.Counter
	promptTokens    prometheus.Counter
	cachedTokens    prometheus.Counter
	pickDuration    prometheus.Histogram

	// Gauges read from the ledger at scrape time.
	endpointInFlight, endpointPrefill, endpointDecoding, endpointPrefillRate *prometheus.Desc
	endpoints, retained, inFlight                                            *prometheus.Desc
}

func newMetrics() *metrics {
	m := &metrics{
		picks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_picks_total",
			Help: "Picks by result: ok, no_endpoint (answered 503) or saturated (answered 429).",
		}, []string{"result"}),
		swept: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_reservations_swept_total",
			Help: "Reservations released by the sweeper because their stream's end was never seen.",
		}),
		promptTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_prompt_tokens_total",
			Help: "Estimated prompt tokens of placed requests.",
		}),
		cachedTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_prefix_cached_tokens_total",
			Help: "Estimated prompt tokens found in the chosen endpoint's prefix index; divided by tally_prompt_tokens_total it is the prefix hit rate.",
		}),
		pickDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tally_pick_duration_seconds",
			Help: "Time to pick an endpoint, hashing and waiting for the lock included.",
			// 1µs to about 1s: a pick is microseconds unless the lock is contended.
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 11),
		}),
	}
	m.endpointInFlight = prometheus.NewDesc("tally_endpoint_inflight_requests",
		"Requests reserved on the endpoint and not yet released.", []string{"endpoint"}, nil)
	m.endpointPrefill = prometheus.NewDesc("tally_endpoint_prefill_tokens",
		"Estimated prefill tokens outstanding on the endpoint.", []string{"endpoint"}, nil)
	m.endpointDecoding = prometheus.NewDesc("tally_endpoint_decoding_requests",
		"Requests on the endpoint past their first response byte.", []string{"endpoint"}, nil)
	m.endpointPrefillRate = prometheus.NewDesc("tally_endpoint_prefill_tokens_per_second",
		"The endpoint's prefill rate in the drain model: learned from streamed first bytes, the configured starting value until then.",
		[]string{"endpoint"}, nil)
	m.endpoints = prometheus.NewDesc("tally_endpoints", "Endpoints in the pool.", nil, nil)
	m.retained = prometheus.NewDesc("tally_retained_endpoints",
		"Endpoints that left the pool's endpoint set and keep their ledger row and prefix memory (requests in flight, or the retention window).",
		nil, nil)
	m.inFlight = prometheus.NewDesc("tally_inflight_requests",
		"Requests reserved and not yet released, on current and retained endpoints.", nil, nil)
	m.picksOK = m.picks.WithLabelValues("ok")
	m.picksNoEndpoint = m.picks.WithLabelValues("no_endpoint")
	m.picksSaturated = m.picks.WithLabelValues("saturated")
	return m
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.picks, m.swept, m.promptTokens, m.cachedTokens, m.pickDuration}
}

// Describe implements prometheus.Collector.
func (p *Picker) Describe(ch chan<- *prometheus.Desc) {
	m := p.metrics
	for _, d := range []*prometheus.Desc{m.endpointInFlight, m.endpointPrefill, m.endpointDecoding, m.endpointPrefillRate, m.endpoints, m.retained, m.inFlight} {
		ch <- d
	}
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector. It copies the ledger under the
// lock and sends the metrics after releasing it.
func (p *Picker) Collect(ch chan<- prometheus.Metric) {
	m := p.metrics
	l := p.Snapshot()
	for _, s := range l.Endpoints {
		ep := s.Endpoint.Address.String()
		ch <- prometheus.MustNewConstMetric(m.endpointInFlight, prometheus.GaugeValue, float64(s.InFlight), ep)
		ch <- prometheus.MustNewConstMetric(m.endpointPrefill, prometheus.GaugeValue, float64(s.PrefillTokens), ep)
		ch <- prometheus.MustNewConstMetric(m.endpointDecoding, prometheus.GaugeValue, float64(s.Decoding), ep)
		ch <- prometheus.MustNewConstMetric(m.endpointPrefillRate, prometheus.GaugeValue, s.PrefillTokensPerSecond, ep)
	}
	ch <- prometheus.MustNewConstMetric(m.endpoints, prometheus.GaugeValue, float64(len(l.Endpoints)))
	ch <- prometheus.MustNewConstMetric(m.retained, prometheus.GaugeValue, float64(len(l.Retained)))
	ch <- prometheus.MustNewConstMetric(m.inFlight, prometheus.GaugeValue, float64(l.InFlight))
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
}
