package picker

import (
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// maxFairnessLabels bounds the distinct fairness_id label values of the flow
// control metrics: the header is the client's to set, so later flows share
// "other".
const maxFairnessLabels = 64

// flowMetrics are flow control's metrics under the upstream picker's names
// (gateway-api-inference-extension v1.5.0, inference_extension_flow_control_*)
// and Tally's own. The queue's gauges are read from the queue at scrape time.
type flowMetrics struct {
	queueDuration  *prometheus.HistogramVec
	queueSize      *prometheus.Desc
	queueBytes     *prometheus.Desc
	poolSaturation *prometheus.Desc
	outcomes       *prometheus.Desc
	enabled        bool
	mu             sync.Mutex
	fairnessLabels map[string]bool
}

func newFlowMetrics(enabled bool) *flowMetrics {
	queueLabels := []string{"fairness_id", "priority", "inference_pool", "model_name", "target_model_name"}
	return &flowMetrics{
		enabled: enabled,
		queueDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "inference_extension_flow_control_request_queue_duration_seconds",
			Help:    "Time requests spent in flow control, from arrival to their outcome (Dispatched, RejectedCapacity, RejectedOther, EvictedTTL, EvictedContextCancelled, EvictedOther).",
			Buckets: []float64{0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0},
		}, []string{"fairness_id", "priority", "outcome", "inference_pool", "model_name", "target_model_name"}),
		queueSize: prometheus.NewDesc("inference_extension_flow_control_queue_size",
			"Requests waiting in the flow control queue now.", queueLabels, nil),
		queueBytes: prometheus.NewDesc("inference_extension_flow_control_queue_bytes",
			"Bytes of the requests waiting in the flow control queue now.", queueLabels, nil),
		poolSaturation: prometheus.NewDesc("inference_extension_flow_control_pool_saturation",
			"Share of the pool's candidate endpoints (decode-capable, not failing scrapes) over their saturation threshold. At 1 a new request waits, unless it can be split onto a free prefill pod and a decode pod with a decoding slot free; prefill pods are counted in tally_role_saturated_endpoints.",
			[]string{"inference_pool"}, nil),
		outcomes: prometheus.NewDesc("tally_flow_control_requests_total",
			"Requests that found every candidate saturated (flow control), by outcome: the upstream outcome names.",
			[]string{"outcome"}, nil),
		fairnessLabels: map[string]bool{},
	}
}

func (f *flowMetrics) fairnessLabel(id string) string {
	if id == "" {
		id = DefaultFairnessID
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fairnessLabels[id] {
		return id
	}
	if len(f.fairnessLabels) >= maxFairnessLabels {
		return "other"
	}
	f.fairnessLabels[id] = true
	return id
}

// observe records one request's time in flow control and its outcome.
func (f *flowMetrics) observe(req Request, pool string, outcome int, waited time.Duration) {
	f.queueDuration.WithLabelValues(f.fairnessLabel(req.FairnessID), strconv.Itoa(req.Priority), outcomeNames[outcome],
		pool, req.Model, req.Model).Observe(waited.Seconds())
}

func (m *metrics) observeQueue(t *Ticket, waited time.Duration) {
	m.flow.observe(t.req, m.poolName, t.outcome, waited)
}

func (m *metrics) observeRefused(req Request, err error) {
	m.flow.observe(req, m.poolName, outcomeOf(err), 0)
}

// queueGauge is one series of the queue gauges.
type queueGauge struct {
	fairness, model string
	priority        int
	n               int
	bytes           int64
}

// flowSnapshot reads the queue's gauges, the pool's saturation and the
// outcome counts under one hold of the lock.
func (p *Picker) flowSnapshot() (gauges []queueGauge, saturation float64, outcomes [numOutcomes]uint64) {
	now := p.now()
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.l.flowGauges(now)
}

// flowGauges reads the queue's gauges and the pool's saturation as of now,
// changing nothing.
func (l *ledger) flowGauges(now int64) (gauges []queueGauge, saturation float64, outcomes [numOutcomes]uint64) {
	q := &l.queue
	type key struct {
		fairness, model string
		priority        int
	}
	idx := map[key]int{}
	for t := q.arrivals.Front(); t != nil; t = q.arrivals.Next(t) {
		k := key{t.flow.ID(), t.req.Model, t.flow.Band().Priority()}
		i, ok := idx[k]
		if !ok {
			i = len(gauges)
			idx[k] = i
			gauges = append(gauges, queueGauge{fairness: k.fairness, model: k.model, priority: k.priority})
		}
		gauges[i].n++
		gauges[i].bytes += t.bytes
	}
	if n := len(l.candidateRows); n > 0 {
		full := 0
		for _, c := range l.candidateRows {
			v := l.projected(c, now, nil)
			if l.saturated(c, v.queued, v.decoding, now) {
				full++
			}
		}
		saturation = float64(full) / float64(n)
	}
	return gauges, saturation, q.outcomes
}

func (m *metrics) describeFlow(ch chan<- *prometheus.Desc) {
	if !m.flow.enabled {
		return
	}
	for _, d := range []*prometheus.Desc{m.flow.queueSize, m.flow.queueBytes, m.flow.poolSaturation, m.flow.outcomes} {
		ch <- d
	}
	m.flow.queueDuration.Describe(ch)
}

func (p *Picker) collectFlow(ch chan<- prometheus.Metric) {
	m := p.metrics
	f := m.flow
	if !f.enabled {
		return
	}
	gauges, saturation, outcomes := p.flowSnapshot()
	for _, g := range gauges {
		fid := f.fairnessLabel(g.fairness)
		prio := strconv.Itoa(g.priority)
		ch <- prometheus.MustNewConstMetric(f.queueSize, prometheus.GaugeValue, float64(g.n), fid, prio, m.poolName, g.model, g.model)
		ch <- prometheus.MustNewConstMetric(f.queueBytes, prometheus.GaugeValue, float64(g.bytes), fid, prio, m.poolName, g.model, g.model)
	}
	ch <- prometheus.MustNewConstMetric(f.poolSaturation, prometheus.GaugeValue, saturation, m.poolName)
	for i, n := range outcomes {
		ch <- prometheus.MustNewConstMetric(f.outcomes, prometheus.CounterValue, float64(n), outcomeNames[i])
	}
	f.queueDuration.Collect(ch)
}
