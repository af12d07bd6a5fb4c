package picker

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

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
	endpointUtilization, workWeight                                          *prometheus.Desc
	endpoints, retained, inFlight                                            *prometheus.Desc
	// Detached reservations (detach.go): detached so far, held now, ended.
	detached                    prometheus.Counter
	detachedActive, detachedEnd *prometheus.Desc
	expectedOutput, decodeSpeed *prometheus.Desc
	rateSamples                 *prometheus.Desc

	// The engines' view (engine.go), beside the ledger's, so drift shows.
	engineRunning, engineWaiting, foreignRequests, foreignTokens, endpointHealthy *prometheus.Desc
	prefixCapacity, deliveredCached, predictedCached, deliveryRatio               *prometheus.Desc
	legFailures, legsOff                                                          *prometheus.Desc
	healthChanges                                                                 *prometheus.CounterVec

	// The same picks and ledger under the upstream picker's names, labels
	// and buckets (gateway-api-inference-extension v1.5.0), so dashboards
	// built for it work; docs/metrics.md says what each means in Tally.
	schedulerE2E                                 *prometheus.HistogramVec
	prefixHitRatio                               *prometheus.HistogramVec
	schedulerE2EAll, prefixHitRatioAll           prometheus.Observer
	poolReadyPods, poolAvgQueue, poolPerPodQueue *prometheus.Desc
	poolAvgRunning, poolAvgKVCache               *prometheus.Desc
	poolName                                     string

	// Flow control's (flow_metrics.go); sent only with it on.
	flow *flowMetrics

	// Prefill/decode disaggregation (split.go): the counts, and their
	// descriptions with the per-endpoint legs held and the per-role sums.
	split                                     splitCounts
	splitDecisions, prefillLegs, endpointLegs *prometheus.Desc
	roleEndpoints, roleSaturated, roleQueued  *prometheus.Desc
}

// Buckets of the upstream picker's histograms, kept identical so that
// histogram_quantile over both pickers' series agrees.
var (
	upstreamSchedulerBuckets = []float64{0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1}
	upstreamRatioBuckets     = []float64{0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0}
)

func newMetrics(poolName string, flowControl bool) *metrics {
	m := &metrics{
		poolName: poolName,
		flow:     newFlowMetrics(flowControl),
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
	m.endpointUtilization = prometheus.NewDesc("tally_endpoint_prefill_utilization",
		"Share of the last 20 s or so (a decayed mean) during which the picker's model had prefill queued on the endpoint.",
		[]string{"endpoint"}, nil)
	m.workWeight = prometheus.NewDesc("tally_uncached_token_weight",
		"What an uncached prompt token costs a pick, relative to a queued one: 1/(1 - the pool's mean prefill utilization), at most 1.5.",
		nil, nil)
	m.endpointPrefillRate = prometheus.NewDesc("tally_endpoint_prefill_tokens_per_second",
		"The endpoint's prefill rate in the drain model: learned from streamed first bytes, the configured starting value until then.",
		[]string{"endpoint"}, nil)
	m.endpoints = prometheus.NewDesc("tally_endpoints", "Endpoints in the pool.", nil, nil)
	m.detached = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tally_detached_reservations_total",
		Help: "Reservations whose ext_proc stream ended at the pick (the gateway shows no response): kept until the model says the request is done.",
	})
	m.rateSamples = prometheus.NewDesc("tally_prefill_rate_samples_total",
		"Streamed first bytes offered to the prefill rate, by result: learned, short (too little prefill before it), late (it came with the whole response), outlier (after twice the modelled whole request).",
		[]string{"result"}, nil)
	m.expectedOutput = prometheus.NewDesc("tally_expected_output_tokens",
		"What a request without max_tokens is expected to generate: learned from responses and engines' output counters (vllm:request_generation_tokens), the default until then. A detached reservation decodes this long.", nil, nil)
	m.decodeSpeed = prometheus.NewDesc("tally_decode_seconds_per_token",
		"How long one output token takes, learned from streamed responses; the default until then.", nil, nil)
	m.detachedActive = prometheus.NewDesc("tally_detached_inflight_requests",
		"Detached reservations held now (included in tally_inflight_requests).", nil, nil)
	m.detachedEnd = prometheus.NewDesc("tally_detached_reservation_ends_total",
		"Detached reservations ended, by reason: model (its modelled prefill and decoding are done), engine (an engine scrape reported fewer requests), swept (maximum lifetime).",
		[]string{"reason"}, nil)
	m.retained = prometheus.NewDesc("tally_retained_endpoints",
		"Endpoints that left the pool's endpoint set and keep their ledger row and prefix memory (requests in flight, or the retention window).",
		nil, nil)
	m.inFlight = prometheus.NewDesc("tally_inflight_requests",
		"Requests reserved and not yet released, on current and retained endpoints.", nil, nil)
	ep := []string{"endpoint"}
	m.engineRunning = prometheus.NewDesc("tally_engine_running_requests",
		"Requests the endpoint's engine reported running at its last scrape (compare tally_endpoint_inflight_requests).", ep, nil)
	m.engineWaiting = prometheus.NewDesc("tally_engine_waiting_requests",
		"Requests the endpoint's engine reported waiting at its last scrape.", ep, nil)
	m.foreignRequests = prometheus.NewDesc("tally_endpoint_foreign_requests",
		"Requests the engine reported beyond the picker's ledger at the last scrape: traffic that did not come through this picker.", ep, nil)
	m.foreignTokens = prometheus.NewDesc("tally_endpoint_foreign_tokens",
		"What the foreign requests add to the endpoint's cost now, in prefill tokens (fading when scrapes stop).", ep, nil)
	m.endpointHealthy = prometheus.NewDesc("tally_endpoint_healthy",
		"1 while the endpoint's metrics scrapes succeed, 0 once enough in a row have failed (it is then not a candidate).", ep, nil)
	m.prefixCapacity = prometheus.NewDesc("tally_endpoint_prefix_capacity_blocks",
		"Blocks the endpoint's prefix index remembers: from its engine's KV cache size, else lruCapacityBlocks.", ep, nil)
	m.deliveredCached = prometheus.NewDesc("tally_endpoint_delivered_cached_tokens_total",
		"Cached prompt tokens the endpoint's engine reported in usage (prompt_tokens_details.cached_tokens).", ep, nil)
	m.predictedCached = prometheus.NewDesc("tally_endpoint_predicted_cached_tokens_total",
		"Cached prompt tokens the picker predicted for the same responses.", ep, nil)
	m.legFailures = prometheus.NewDesc("tally_prefill_leg_failures_total",
		"Prefill legs the endpoint failed: split requests whose response was a server error before their first byte.", ep, nil)
	m.legsOff = prometheus.NewDesc("tally_prefill_legs_off",
		"1 while the endpoint prefills for no other pod, after prefill legs failed in a row.", ep, nil)
	m.deliveryRatio = prometheus.NewDesc("tally_endpoint_cache_delivery_ratio",
		"Delivered over predicted cached prompt tokens: below 1 the prefix index believes the engine holds more than it does.", ep, nil)
	m.healthChanges = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_endpoint_health_changes_total",
		Help: "Endpoints leaving the candidates after failed metrics scrapes (change=unhealthy), and coming back (change=recovered).",
	}, []string{"change"})
	// Upstream declares these as vectors with no labels; so do they here,
	// so that their exposition is the same.
	m.schedulerE2E = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "inference_extension_scheduler_e2e_duration_seconds",
		Help:    "Time to pick an endpoint (the same observations as tally_pick_duration_seconds, in the upstream picker's buckets).",
		Buckets: upstreamSchedulerBuckets,
	}, nil)
	m.prefixHitRatio = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "inference_extension_prefix_indexer_hit_ratio",
		Help:    "Per placed request: the share of its hashed prompt blocks that the chosen endpoint held in the prefix index at pick time.",
		Buckets: upstreamRatioBuckets,
	}, nil)
	m.schedulerE2EAll = m.schedulerE2E.WithLabelValues()
	m.prefixHitRatioAll = m.prefixHitRatio.WithLabelValues()
	m.poolReadyPods = prometheus.NewDesc("inference_pool_ready_pods",
		"Endpoints in the pool's endpoint set (a target port on a Ready pod), as tally_endpoints.", []string{"name"}, nil)
	m.poolAvgQueue = prometheus.NewDesc("inference_pool_average_queue_size",
		"Mean over the pool's endpoints of inference_pool_per_pod_queue_size.", []string{"name"}, nil)
	m.poolPerPodQueue = prometheus.NewDesc("inference_pool_per_pod_queue_size",
		"Requests waiting in the endpoint's engine queue at its last scrape; for an endpoint not scraped or failing its scrapes, "+
			"the requests the picker placed there still waiting for or in their prefill (in flight and not yet decoding in the ledger).",
		[]string{"name", "model_server_pod"}, nil)
	m.poolAvgRunning = prometheus.NewDesc("inference_pool_average_running_requests",
		"Mean over the endpoints whose last scrape succeeded of the requests their engines reported running; not sent before a scrape.",
		[]string{"name"}, nil)
	m.poolAvgKVCache = prometheus.NewDesc("inference_pool_average_kv_cache_utilization",
		"Mean over the healthy endpoints whose engines publish it of the share of their KV cache in use (0 to 1) at their last scrape; not sent before one.",
		[]string{"name"}, nil)
	m.splitDecisions = prometheus.NewDesc("tally_split_decisions_total",
		"Placed requests by whether they were split (disaggregation on): split, or why not: cached (too little of the prompt uncached on the decode pod), "+
			"short (the prompt under promptTokens), no_prefill_pod (none ready and under its saturation threshold), local_cheaper (prefilling on the decode pod costs less).",
		[]string{"decision"}, nil)
	m.prefillLegs = prometheus.NewDesc("tally_prefill_legs_total",
		"Split requests placed with the endpoint as their prefill pod (disaggregation on).", ep, nil)
	m.endpointLegs = prometheus.NewDesc("tally_endpoint_prefill_legs",
		"Prefill parts of split requests the endpoint holds now, prefilling for another endpoint (included in tally_endpoint_inflight_requests); sent for prefill-capable endpoints with disaggregation on.",
		ep, nil)
	role := []string{"role"}
	m.roleEndpoints = prometheus.NewDesc("tally_role_endpoints",
		"Endpoints in the pool's endpoint set by their llm-d.ai/role label (role=\"unlabelled\" for pods without one).", role, nil)
	m.roleSaturated = prometheus.NewDesc("tally_role_saturated_endpoints",
		"Endpoints of the role that may take no new work now: over a static saturation limit or, with flow control, over their threshold; a prefill pod so saturated prefills for no one.",
		role, nil)
	m.roleQueued = prometheus.NewDesc("tally_role_queued_prefill_tokens",
		"Prefill tokens the drain model says are still queued on the role's endpoints (a prefill pod's are its split requests' prefill parts).", role, nil)
	m.picksOK = m.picks.WithLabelValues("ok")
	m.picksNoEndpoint = m.picks.WithLabelValues("no_endpoint")
	m.picksSaturated = m.picks.WithLabelValues("saturated")
	return m
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.picks, m.swept, m.promptTokens, m.cachedTokens, m.pickDuration, m.schedulerE2E, m.prefixHitRatio,
		m.healthChanges, m.detached}
}

// Describe implements prometheus.Collector.
func (p *Picker) Describe(ch chan<- *prometheus.Desc) {
	m := p.metrics
	for _, d := range []*prometheus.Desc{m.endpointInFlight, m.endpointPrefill, m.endpointDecoding, m.endpointPrefillRate, m.endpointUtilization, m.workWeight, m.endpoints, m.retained, m.inFlight,
		m.detachedActive, m.detachedEnd, m.rateSamples, m.expectedOutput, m.decodeSpeed,
		m.poolReadyPods, m.poolAvgQueue, m.poolPerPodQueue, m.poolAvgRunning, m.poolAvgKVCache,
		m.engineRunning, m.engineWaiting, m.foreignRequests, m.foreignTokens, m.endpointHealthy,
		m.prefixCapacity, m.deliveredCached, m.predictedCached, m.deliveryRatio, m.legFailures, m.legsOff,
		m.splitDecisions, m.prefillLegs, m.endpointLegs, m.roleEndpoints, m.roleSaturated, m.roleQueued} {
		ch <- d
	}
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
	m.describeFlow(ch)
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
		ch <- prometheus.MustNewConstMetric(m.endpointUtilization, prometheus.GaugeValue, s.Utilization, ep)
		m.collectEngine(ch, s, ep)
	}
	ch <- prometheus.MustNewConstMetric(m.endpoints, prometheus.GaugeValue, float64(len(l.Endpoints)))
	ch <- prometheus.MustNewConstMetric(m.retained, prometheus.GaugeValue, float64(len(l.Retained)))
	ch <- prometheus.MustNewConstMetric(m.inFlight, prometheus.GaugeValue, float64(l.InFlight))
	ch <- prometheus.MustNewConstMetric(m.workWeight, prometheus.GaugeValue, l.WorkWeight)
	ch <- prometheus.MustNewConstMetric(m.detachedActive, prometheus.GaugeValue, float64(l.Detached))
	ch <- prometheus.MustNewConstMetric(m.expectedOutput, prometheus.GaugeValue, l.ExpectedOutputTokens)
	ch <- prometheus.MustNewConstMetric(m.decodeSpeed, prometheus.GaugeValue, l.DecodeSecondsPerToken)
	for i, n := range l.DetachEnds {
		ch <- prometheus.MustNewConstMetric(m.detachedEnd, prometheus.CounterValue, float64(n), detachEndNames[i])
	}
	for i, n := range l.RateSamples {
		ch <- prometheus.MustNewConstMetric(m.rateSamples, prometheus.CounterValue, float64(n), rateSampleNames[i])
	}
	m.collectPool(ch, l.Endpoints)
	m.collectRoles(ch, &l, p.cfg.Disaggregation.Enabled())
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
	p.collectFlow(ch)
}

// collectPool sends the upstream picker's pool gauges. The queue is the
// engine's own waiting count, as upstream, for an endpoint whose last scrape
// succeeded; otherwise (never scraped, or failing its scrapes) what the
// ledger holds: in flight and not yet decoding. Running requests come from
// scrapes only, and the KV-cache use is averaged over the endpoints whose
// last successful scrape published it (not sent when none did).
func (m *metrics) collectPool(ch chan<- prometheus.Metric, eps []EndpointStats) {
	ch <- prometheus.MustNewConstMetric(m.poolReadyPods, prometheus.GaugeValue, float64(len(eps)), m.poolName)
	if len(eps) == 0 {
		return // no mean of nothing; upstream leaves the averages unset too
	}
	queued, rank := 0, 0
	running, scraped := 0, 0
	kvUsage, kvScraped := 0.0, 0
	for i, s := range eps {
		q := max(s.InFlight-s.Decoding, 0)
		if s.Scraped && !s.Unhealthy {
			q = s.EngineWaiting
			running += s.EngineRunning
			scraped++
			if s.KVCacheUsage >= 0 {
				kvUsage += s.KVCacheUsage
				kvScraped++
			}
		}
		queued += q
		// The upstream picker names an endpoint "<pod>-rank-<i>", i the
		// target port's position. The set is sorted by address, so a pod's
		// endpoints (one IP) are adjacent, in port order.
		if i > 0 && eps[i-1].Endpoint.Pod == s.Endpoint.Pod {
			rank++
		} else {
			rank = 0
		}
		ch <- prometheus.MustNewConstMetric(m.poolPerPodQueue, prometheus.GaugeValue, float64(q),
			m.poolName, s.Endpoint.Pod+"-rank-"+strconv.Itoa(rank))
	}
	ch <- prometheus.MustNewConstMetric(m.poolAvgQueue, prometheus.GaugeValue, float64(queued)/float64(len(eps)), m.poolName)
	if scraped > 0 {
		ch <- prometheus.MustNewConstMetric(m.poolAvgRunning, prometheus.GaugeValue, float64(running)/float64(scraped), m.poolName)
	}
	if kvScraped > 0 {
		ch <- prometheus.MustNewConstMetric(m.poolAvgKVCache, prometheus.GaugeValue, kvUsage/float64(kvScraped), m.poolName)
	}
}

// collectEngine sends an endpoint's engine-side gauges; those that come from
// scrapes only once it has been scraped.
func (m *metrics) collectEngine(ch chan<- prometheus.Metric, s EndpointStats, ep string) {
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, ep)
	}
	gauge(m.prefixCapacity, float64(s.PrefixCapacityBlocks))
	healthy := 1.0
	if s.Unhealthy {
		healthy = 0
	}
	gauge(m.endpointHealthy, healthy)
	if s.Scraped {
		gauge(m.engineRunning, float64(s.EngineRunning))
		gauge(m.engineWaiting, float64(s.EngineWaiting))
		gauge(m.foreignRequests, float64(s.ForeignRequests))
		gauge(m.foreignTokens, float64(s.ForeignTokens))
	}
	ch <- prometheus.MustNewConstMetric(m.deliveredCached, prometheus.CounterValue, float64(s.DeliveredCachedTokens), ep)
	ch <- prometheus.MustNewConstMetric(m.predictedCached, prometheus.CounterValue, float64(s.PredictedCachedTokens), ep)
	if s.Endpoint.prefills() {
		ch <- prometheus.MustNewConstMetric(m.legFailures, prometheus.CounterValue, float64(s.PrefillLegFailures), ep)
		off := 0.0
		if s.PrefillLegsOff {
			off = 1
		}
		gauge(m.legsOff, off)
	}
	if s.PredictedCachedTokens > 0 {
		gauge(m.deliveryRatio, float64(s.DeliveredCachedTokens)/float64(s.PredictedCachedTokens))
	}
}

// collectRoles sends the per-role sums and, with disaggregation on, the
// split decisions, the prefill legs placed on each prefill pod so far and
// those each holds now. The decisions are sent from the start, zeros
// included, so that a dashboard's rate() has a series before the first.
func (m *metrics) collectRoles(ch chan<- prometheus.Metric, l *Ledger, disaggregation bool) {
	for _, r := range l.Roles {
		ch <- prometheus.MustNewConstMetric(m.roleEndpoints, prometheus.GaugeValue, float64(r.Endpoints), r.Role)
		ch <- prometheus.MustNewConstMetric(m.roleSaturated, prometheus.GaugeValue, float64(r.Saturated), r.Role)
		ch <- prometheus.MustNewConstMetric(m.roleQueued, prometheus.GaugeValue, float64(r.PrefillTokens), r.Role)
	}
	if !disaggregation {
		return
	}
	for i, d := range splitDecisions {
		ch <- prometheus.MustNewConstMetric(m.splitDecisions, prometheus.CounterValue, float64(m.split.decisions[i].Load()), string(d))
	}
	for _, c := range m.split.legsOf(l) {
		ch <- prometheus.MustNewConstMetric(m.prefillLegs, prometheus.CounterValue, float64(c.n), c.addr.String())
	}
	for _, s := range l.Endpoints {
		if s.Endpoint.prefills() {
			ch <- prometheus.MustNewConstMetric(m.endpointLegs, prometheus.GaugeValue, float64(s.PrefillLegs), s.Endpoint.Address.String())
		}
	}
}
