package extproc

import (
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/prometheus/client_golang/prometheus"
)

// The request metrics of the upstream picker (gateway-api-inference-extension
// v1.5.0, pkg/epp/metrics): the same names, labels and buckets, so that
// dashboards and alerts built on inference_objective_* keep working after a
// switch to Tally. docs/metrics.md says what each one means here.

const (
	// DefaultMaxModelNameLabels is how many distinct model names get their
	// own model_name label value by default.
	DefaultMaxModelNameLabels = 1000
	// otherModelLabel is the model_name of every model past the cap.
	otherModelLabel = "other"
	// defaultPriority is the priority label of a request that names no
	// known InferenceObjective: 0, as the upstream picker's.
	defaultPriority = "0"
)

var (
	// generalLatencyBuckets: 5 ms to an hour, for whole requests.
	generalLatencyBuckets = []float64{
		0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6,
		8, 10, 15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200,
		1800, 2700, 3600,
	}
	// promptTokenBuckets: up to a context of a million tokens. 32778 (not
	// 32768) is the upstream value, kept so that both pickers' series share
	// buckets.
	promptTokenBuckets = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072, 262144, 524288, 1048576}
	outputTokenBuckets = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192}
	requestSizeBuckets = []float64{
		64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
		131072, 262144, 524288, 1048576, 2097152, 4194304, 8388608,
		16777216, 33554432, 67108864, 134217728, 268435456, 536870912, 1073741824,
	}
	responseSizeBuckets = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536}
	ntpotBuckets        = []float64{0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0}
)

// Error codes of inference_objective_request_error_total, as the upstream
// picker names them.
const (
	codeBadRequest         = "BadRequest"
	codeResourceExhausted  = "ResourceExhausted"
	codeServiceUnavailable = "ServiceUnavailable"
	codeInternal           = "Internal"
	codeModelServerError   = "ModelServerError"
	codeUnknown            = "Unknown"
)

// errorCode names the HTTP status the picker answered with in the upstream
// picker's error codes. 413 is a client error the upstream picker has no
// code for (it sets no body limit): BadRequest.
func errorCode(httpStatus int) string {
	switch {
	case httpStatus == 429:
		return codeResourceExhausted
	case httpStatus == 503:
		return codeServiceUnavailable
	case httpStatus >= 500:
		return codeInternal
	case httpStatus >= 400:
		return codeBadRequest
	}
	return codeUnknown
}

// objectiveMetrics are the inference_objective_* families and
// inference_extension_info.
type objectiveMetrics struct {
	requests      *prometheus.CounterVec   // model_name, target_model_name, priority
	errors        *prometheus.CounterVec   // model_name, target_model_name, error_code
	running       *prometheus.GaugeVec     // model_name
	duration      *prometheus.HistogramVec // model_name, target_model_name (and below)
	ttft          *prometheus.HistogramVec
	requestSizes  *prometheus.HistogramVec
	responseSizes *prometheus.HistogramVec
	inputTokens   *prometheus.HistogramVec
	outputTokens  *prometheus.HistogramVec
	cachedTokens  *prometheus.HistogramVec
	ntpot         *prometheus.HistogramVec
	info          *prometheus.GaugeVec   // commit, build_ref
	rewrites      *prometheus.CounterVec // model_rewrite_name, model_name, target_model

	maxModels int
	mu        sync.RWMutex
	models    map[string]*modelSeries // at most maxModels, plus other
}

// modelSeries are one model_name's series, resolved once so that a request
// costs one map lookup, not one per metric.
type modelSeries struct {
	label, target                    string
	requests                         prometheus.Counter
	running                          prometheus.Gauge
	duration, ttft                   prometheus.Observer
	requestSize, responseSize        prometheus.Observer
	inputTokens, outputTokens, ntpot prometheus.Observer
	cachedTokens                     prometheus.Observer
}

func newObjectiveMetrics(maxModels int, commit, buildRef string) *objectiveMetrics {
	if maxModels <= 0 {
		maxModels = DefaultMaxModelNameLabels
	}
	model := []string{"model_name", "target_model_name"}
	histogram := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, model)
	}
	m := &objectiveMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inference_objective_request_total",
			Help: "Requests routed to an endpoint, by model (target_model_name: the model an InferenceModelRewrite sent it to, else the same) and priority (its InferenceObjective's).",
		}, []string{"model_name", "target_model_name", "priority"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inference_objective_request_error_total",
			Help: "Requests answered with an error by the picker (BadRequest, ResourceExhausted, ServiceUnavailable, Internal) or by the model server (ModelServerError: a status other than 200).",
		}, []string{"model_name", "target_model_name", "error_code"}),
		running: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "inference_objective_running_requests",
			Help: "Requests routed and not yet ended, by model.",
		}, []string{"model_name"}),
		duration: histogram("inference_objective_request_duration_seconds",
			"Time from the request headers reaching the picker to the end of the response, for responses seen to their end.", generalLatencyBuckets),
		ttft: histogram("inference_objective_request_ttft_seconds",
			"Time from the request headers reaching the picker to the first response body byte (for a non-streamed response, about its whole duration), for responses seen to their end.", generalLatencyBuckets),
		requestSizes: histogram("inference_objective_request_sizes",
			"Size in bytes of the request bodies routed.", requestSizeBuckets),
		responseSizes: histogram("inference_objective_response_sizes",
			"Size in bytes of the response bodies seen to their end.", responseSizeBuckets),
		inputTokens: histogram("inference_objective_input_tokens",
			"Prompt tokens per request, from the response's usage (prompt_tokens, or input_tokens).", promptTokenBuckets),
		outputTokens: histogram("inference_objective_output_tokens",
			"Generated tokens per request, from the response's usage (completion_tokens, or output_tokens).", outputTokenBuckets),
		cachedTokens: histogram("inference_objective_prompt_cached_tokens",
			"Prompt tokens the model server found in its prefix cache, per request, from the response's usage (prompt_tokens_details.cached_tokens).", promptTokenBuckets),
		ntpot: histogram("inference_objective_normalized_time_per_output_token_seconds",
			"Request duration divided by its generated tokens (from the response's usage).", ntpotBuckets),
		info: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "inference_extension_info",
			Help: "The picker's build: 1, with the commit and the module version it was built from.",
		}, []string{"commit", "build_ref"}),
		rewrites: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inference_extension_model_rewrite_decisions_total",
			Help: "Requests an InferenceModelRewrite rule matched, by the rewrite, the request's model and the target drawn.",
		}, []string{"model_rewrite_name", "model_name", "target_model"}),
		maxModels: maxModels,
		models:    make(map[string]*modelSeries),
	}
	readCommit, readBuildRef := buildInfo()
	if commit == "" {
		commit = readCommit
	}
	if buildRef == "" {
		buildRef = readBuildRef
	}
	m.info.WithLabelValues(commit, buildRef).Set(1)
	return m
}

func (m *objectiveMetrics) register(r prometheus.Registerer) {
	r.MustRegister(m.requests, m.errors, m.running, m.duration, m.ttft, m.requestSizes, m.responseSizes,
		m.inputTokens, m.outputTokens, m.cachedTokens, m.ntpot, m.info, m.rewrites)
}

// series returns the series of model sent on as target ("" or model: not
// rewritten): their own among the first maxModels pairs seen, the shared
// "other" ones after that. Past the cap, a new pair finds "other" under the
// read lock: a flood of distinct names does not serialise requests on the
// write lock.
func (m *objectiveMetrics) series(model, target string) *modelSeries {
	key := model
	if target != "" && target != model {
		key = model + "\x00" + target
	} else {
		target = model
	}
	m.mu.RLock()
	s, ok := m.models[key]
	if !ok && len(m.models) >= m.maxModels {
		s, ok = m.models[otherModelLabel]
	}
	m.mu.RUnlock()
	if ok {
		return s
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if s, ok := m.models[key]; ok {
		return s
	}
	label, tlabel := model, target
	if len(m.models) >= m.maxModels {
		if s, ok := m.models[otherModelLabel]; ok {
			return s
		}
		key, label, tlabel = otherModelLabel, otherModelLabel, otherModelLabel
	}
	s = &modelSeries{
		label:        label,
		target:       tlabel,
		requests:     m.requests.WithLabelValues(label, tlabel, defaultPriority),
		running:      m.running.WithLabelValues(label),
		duration:     m.duration.WithLabelValues(label, tlabel),
		ttft:         m.ttft.WithLabelValues(label, tlabel),
		requestSize:  m.requestSizes.WithLabelValues(label, tlabel),
		responseSize: m.responseSizes.WithLabelValues(label, tlabel),
		inputTokens:  m.inputTokens.WithLabelValues(label, tlabel),
		outputTokens: m.outputTokens.WithLabelValues(label, tlabel),
		cachedTokens: m.cachedTokens.WithLabelValues(label, tlabel),
		ntpot:        m.ntpot.WithLabelValues(label, tlabel),
	}
	// "other" is stored under its own key, past the cap: every later pair
	// finds it there.
	m.models[key] = s
	return s
}

// rewrite counts a rewrite decision, under the capped model labels.
func (m *objectiveMetrics) rewrite(rule, model, target string) {
	s := m.series(model, target)
	m.rewrites.WithLabelValues(rule, s.label, s.target).Inc()
}

// buildInfo names the binary's build: the VCS revision Go stamped into it
// (with "-dirty" for a modified tree) and the main module's version
// ("(devel)" for a build from a checkout).
func buildInfo() (commit, buildRef string) {
	commit, buildRef = "unknown", "unknown"
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return commit, buildRef
	}
	if bi.Main.Version != "" {
		buildRef = bi.Main.Version
	}
	dirty := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			commit = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if dirty && commit != "unknown" {
		commit += "-dirty"
	}
	return commit, buildRef
}

// requestMetrics follows one stream for the upstream request metrics. Only
// the stream's goroutine touches it.
type requestMetrics struct {
	m          *objectiveMetrics
	model      string       // the request's model, once its body is parsed
	target     string       // the model a rewrite sent it to ("": none)
	priority   int          // its InferenceObjective's
	series     *modelSeries // set once routed
	receivedAt time.Time
	firstByte  time.Time
	status     int  // the model server's HTTP status; 0 before its headers
	bytes      int  // response body bytes
	ended      bool // the response was seen to its end
}

// requestHeaders starts the clock of the request's duration.
func (r *requestMetrics) requestHeaders() { r.receivedAt = time.Now() }

// routed counts a request the picker sent to an endpoint; bodyBytes < 0
// means its body was not buffered (no size to record).
func (r *requestMetrics) routed(bodyBytes int) {
	r.series = r.m.series(r.model, r.target)
	if r.priority == 0 {
		r.series.requests.Inc()
	} else {
		r.m.requests.WithLabelValues(r.series.label, r.series.target, strconv.Itoa(r.priority)).Inc()
	}
	r.series.running.Inc()
	if bodyBytes >= 0 {
		r.series.requestSize.Observe(float64(bodyBytes))
	}
}

// rejected counts a request the picker answered itself with httpStatus.
func (r *requestMetrics) rejected(httpStatus int) {
	s := r.m.series(r.model, r.target)
	r.m.errors.WithLabelValues(s.label, s.target, errorCode(httpStatus)).Inc()
}

func (r *requestMetrics) responseHeaders(h *corev3.HeaderMap) {
	if code, err := strconv.Atoi(headerValue(h, ":status")); err == nil {
		r.status = code
	}
}

func (r *requestMetrics) responseBody(n int) {
	if r.series == nil || r.ended || n == 0 {
		return
	}
	if r.firstByte.IsZero() {
		r.firstByte = time.Now()
	}
	r.bytes += n
}

// responseEnd records a response seen to its end: its duration, time to
// first byte, size and the token usage resp read.
func (r *requestMetrics) responseEnd(resp *response) {
	if r.series == nil || r.ended {
		return
	}
	r.ended = true
	s := r.series
	elapsed := time.Since(r.receivedAt).Seconds()
	s.duration.Observe(elapsed)
	if !r.firstByte.IsZero() {
		s.ttft.Observe(r.firstByte.Sub(r.receivedAt).Seconds())
	}
	s.responseSize.Observe(float64(r.bytes))
	u, ok := resp.usage()
	if !ok {
		return
	}
	// As upstream: token counts of zero are not observed, a reported cached
	// count is, even zero.
	if u.promptTokens > 0 {
		s.inputTokens.Observe(float64(u.promptTokens))
	}
	if u.completionTokens > 0 {
		s.outputTokens.Observe(float64(u.completionTokens))
		s.ntpot.Observe(elapsed / float64(u.completionTokens))
	}
	if u.hasCached {
		s.cachedTokens.Observe(float64(u.cachedTokens))
	}
}

// closed runs when the stream ends, however it ends.
func (r *requestMetrics) closed() {
	if r.series != nil {
		r.series.running.Dec()
		if r.status != 0 && r.status != 200 {
			r.m.errors.WithLabelValues(r.series.label, r.series.label, codeModelServerError).Inc()
		}
	}
}

// bodyLen is the size of the buffered request body, or -1 when none was
// buffered (a bodiless request, or one routed on its headers alone).
func (st *stream) bodyLen() int {
	if st.body == nil {
		return -1
	}
	return len(*st.body)
}
