// Package server serves one simulated vLLM engine (package engine) over HTTP
// in real time, for tests and demos of the picker: the OpenAI completions and
// chat completions APIs (streaming and not), GET /v1/models, GET /health and
// GET /metrics with vLLM v1's metric names, plus one of its own,
// modelsim_queued_prefill_tokens: the prefill the engine has still to do,
// which a real server cannot report and a test of the picker's estimate needs.
//
//	srv, err := server.New(server.DefaultConfig())
//	defer srv.Close()
//	http.Serve(listener, srv)
//
// Prompts become tokens the way the picker estimates them (bytes of text /
// CharsPerToken), and their blocks of BlockSizeTokens x CharsPerToken bytes
// become the chained hashes the engine's prefix cache matches, so requests
// that share leading text share cached blocks. Token-id prompts count one
// token per id and hash blocks of ids.
//
// One goroutine drives the engine: it runs the engine's virtual clock at
// TimeScale times the wall clock, sleeping until the next step ends while
// there is work and waiting for a request when there is none. Times the
// engine reports (the time-to-first-token, prefill-time and decode-time
// histograms) are wall time: the engine's virtual durations divided by
// TimeScale, as an engine that fast would measure them, so that they agree
// with what a client or the picker times (at TimeScale 1 the two are the
// same). Fault injection (AddedLatency,
// ErrorRate, HangRate) happens in wall time, before the request reaches the
// engine; FailMetrics breaks GET /metrics alone, as an engine whose metrics
// exporter broke while it still serves completions. LateFirstByteFraction
// acts after the engine: it holds a streamed response's bytes back until its
// last token, as a buffering proxy would, so the first byte no longer marks
// the end of prefill.
//
// LoRA adapters (LoRAModules, off by default) are served as vLLM serves
// --lora-modules: a request whose model names an adapter runs with it (the
// engine schedules at most Engine.MaxLoRAs adapters at once, loads them
// into slots and keeps their prefix cache apart), /v1/models lists them
// with the base model as parent, and /metrics adds vllm:lora_requests_info
// and the simulator's own modelsim_lora_adapter_loads_total.
//
// Prefill/decode disaggregation (kv_transfer_params) is served as vLLM's
// NixlConnector serves it; see disagg.go.
//
// Invariant: the engine is touched only under Server.mu, and every request
// added to it leaves exactly once: it finishes, or its handler cancels it
// when the client goes away.
package server

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tallyepp/tally/internal/modelsim/engine"
)

// Defaults of the fields that are not the engine's.
const (
	DefaultModel         = "sim-model"
	DefaultCharsPerToken = 4
	// DefaultMaxTokens is the output length when a request names none.
	DefaultMaxTokens = 16
	// DefaultRequestIDHeader is the header Envoy and the dev gateway name
	// each request by.
	DefaultRequestIDHeader = "X-Request-Id"
	// HeldBackHeader is on a response held back for LateFirstByteFraction:
	// how long, in milliseconds, after its first token the simulator sent
	// it. A client subtracting it from its time to first byte has the
	// time to the first token as a streaming response would have shown it.
	HeldBackHeader = "X-Modelsim-Held-Back-Ms"
	// DefaultMaxLoRAs is vLLM's default --max-loras, for a configuration
	// that serves LoRAModules (one that serves none has Engine.MaxLoRAs 0).
	DefaultMaxLoRAs = 1
	// MaxTimeScale keeps virtual nanoseconds within int64 for over 100 days.
	MaxTimeScale = 1000
	// maxRequestBytes bounds a request body.
	maxRequestBytes = 64 << 20
)

// Config configures a Server.
type Config struct {
	// Model is the served model name; requests naming another get 404.
	Model  string
	Engine engine.Config
	// CharsPerToken turns prompt bytes into tokens (and tokens into
	// generated text).
	CharsPerToken int
	// TimeScale is how many times faster than the wall clock the engine
	// runs: 10 makes a 65 ms step take 6.5 ms.
	TimeScale float64
	// AddedLatency delays every completion request (wall time) before it
	// reaches the engine, so before its first byte.
	AddedLatency time.Duration
	// ErrorRate is the fraction of completion requests answered 500.
	ErrorRate float64
	// HangRate is the fraction of completion requests never answered: they
	// wait until the client goes away (or the server closes).
	HangRate float64
	// Seed seeds the draws of ErrorRate and HangRate.
	Seed uint64
	// LateFirstByteFraction is the fraction of streamed responses whose
	// bytes, status and headers included, are all held back until the
	// last token and then written at once, as a buffering proxy or an
	// engine whose first chunk comes at the end would send them. Which
	// responses are late is drawn from a hash of the request's
	// RequestIDHeader, or of its prompt when it has none: the same request
	// is late on every run and every server, and 0.5 holds back half of
	// any set of distinct requests. Each says how long it was held back
	// (HeldBackHeader).
	LateFirstByteFraction float64
	// RequestIDHeader names the header that identifies a request for the
	// choices made per request (LateFirstByteFraction); "" tells requests
	// apart by their prompts alone.
	RequestIDHeader string
	// LoRAModules are the LoRA adapters served besides Model; empty (the
	// default) serves the base model alone. With adapters,
	// Engine.MaxLoRAs must be 1 or more (vLLM's default --max-loras is 1);
	// without, it must be 0.
	LoRAModules []LoRAModule
	// EngineID names the engine in the kv_transfer_params of prefill legs
	// (remote_engine_id); "" draws a random one, as vLLM does.
	EngineID string
	// KVLoadFailurePolicy says what a decode leg whose blocks cannot be
	// pulled does: KVLoadFailureFail (vLLM's default) answers 500,
	// KVLoadFailureRecompute computes the prefill locally.
	KVLoadFailurePolicy string
}

// DefaultConfig returns a configuration with the engine's default latency
// model, running in real time, without faults.
func DefaultConfig() Config {
	return Config{
		Model:               DefaultModel,
		Engine:              engine.DefaultConfig(),
		CharsPerToken:       DefaultCharsPerToken,
		TimeScale:           1,
		RequestIDHeader:     DefaultRequestIDHeader,
		KVLoadFailurePolicy: KVLoadFailureFail,
	}
}

// Validate reports every invalid field, naming it and what it accepts.
func (c Config) Validate() error {
	var errs []error
	bad := func(field string, got any, accepted string) {
		errs = append(errs, fmt.Errorf("server config: %s: %v is invalid: %s", field, got, accepted))
	}
	if c.Model == "" {
		bad("Model", `""`, "must not be empty")
	}
	if c.CharsPerToken < 1 || c.CharsPerToken > 64 {
		bad("CharsPerToken", c.CharsPerToken, "must be from 1 to 64")
	}
	if !(c.TimeScale > 0 && c.TimeScale <= MaxTimeScale) {
		bad("TimeScale", c.TimeScale, fmt.Sprintf("must be above 0 and at most %d", MaxTimeScale))
	}
	if c.AddedLatency < 0 {
		bad("AddedLatency", c.AddedLatency, "must be 0 or more")
	}
	if !(c.ErrorRate >= 0 && c.ErrorRate <= 1) {
		bad("ErrorRate", c.ErrorRate, "must be from 0 to 1")
	}
	if !(c.HangRate >= 0 && c.HangRate <= 1) {
		bad("HangRate", c.HangRate, "must be from 0 to 1")
	}
	if !(c.LateFirstByteFraction >= 0 && c.LateFirstByteFraction <= 1) {
		bad("LateFirstByteFraction", c.LateFirstByteFraction, "must be from 0 to 1")
	}
	if c.KVLoadFailurePolicy != KVLoadFailureFail && c.KVLoadFailurePolicy != KVLoadFailureRecompute {
		bad("KVLoadFailurePolicy", strconv.Quote(c.KVLoadFailurePolicy), `must be "fail" or "recompute"`)
	}
	c.validateLoRA(bad)
	if err := c.Engine.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Server is an http.Handler serving one simulated engine. Create it with
// New; Close stops it.
type Server struct {
	cfg   Config
	mux   *http.ServeMux
	start time.Time // wall time of virtual time 0

	mu      sync.Mutex
	eng     *engine.Engine
	pending map[string]*pending // requests in the engine, by ID
	rng     *rand.Rand
	ttft    prometheus.Histogram
	prefill prometheus.Histogram
	decode  prometheus.Histogram
	output  prometheus.Histogram // request_generation_tokens
	lora    *loraRequests        // nil without LoRAModules

	adapters map[string]LoRAModule // by name; read-only
	engineID string
	kvClient *http.Client // pulls KV blocks from prefill servers

	nextID     atomic.Uint64
	metricsOff atomic.Bool   // FailMetrics
	wake       chan struct{} // capacity 1: the driver should look again
	done       chan struct{} // closed by Close
	driverDone chan struct{}
	closeOnce  sync.Once
}

// pending is what a handler learns of its request; fields are guarded by
// Server.mu.
type pending struct {
	notify   chan struct{} // capacity 1: something changed
	adapter  string        // "" for the base model
	tokens   int           // output tokens produced so far
	cached   int           // prompt tokens found in the prefix cache
	prefill  time.Duration // first scheduled to first token, engine time
	firstAt  time.Duration // its first token, engine time
	finished bool
}

// New starts a server's engine driver; the caller serves it over HTTP and
// calls Close when done.
func New(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	eng, err := engine.New(cfg.Engine)
	if err != nil {
		return nil, fmt.Errorf("creating engine: %w", err)
	}
	s := &Server{
		cfg:        cfg,
		start:      time.Now(),
		eng:        eng,
		pending:    make(map[string]*pending),
		rng:        rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15)),
		wake:       make(chan struct{}, 1),
		done:       make(chan struct{}),
		driverDone: make(chan struct{}),
		adapters:   make(map[string]LoRAModule, len(cfg.LoRAModules)),
		engineID:   cfg.EngineID,
		kvClient:   &http.Client{Timeout: kvPullTimeout},
	}
	if s.engineID == "" {
		s.engineID = "modelsim-" + uuid.NewString()
	}
	for _, m := range cfg.LoRAModules {
		s.adapters[m.Name] = m
	}
	if len(cfg.LoRAModules) > 0 {
		s.lora = newLoRARequests()
	}
	reg := prometheus.NewRegistry()
	s.ttft = newTTFTHistogram(cfg.Model)
	s.prefill = newPhaseTimeHistogram(cfg.Model, "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.")
	s.decode = newPhaseTimeHistogram(cfg.Model, "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.")
	s.output = newGenerationTokensHistogram(cfg.Model)
	// The collector writes the histograms too, from the snapshot it reads
	// the engine in.
	if err := reg.Register(newCollector(s)); err != nil {
		return nil, fmt.Errorf("registering metrics: %w", err)
	}

	s.mux = http.NewServeMux()
	s.mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { s.handleGenerate(w, r, false) })
	s.mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.handleGenerate(w, r, true) })
	s.mux.HandleFunc("GET /v1/models", s.handleModels)
	s.mux.HandleFunc("GET /health", s.handleHealth)
	s.mux.HandleFunc("POST "+PullPath, s.handlePull)
	metrics := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	s.mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		if s.metricsOff.Load() {
			http.Error(w, "injected fault: metrics are failing", http.StatusInternalServerError)
			return
		}
		metrics.ServeHTTP(w, r)
	})

	go s.drive()
	return s, nil
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// Close stops the engine driver and ends every request in flight (streams
// are cut, requests not yet answered get 503). Later requests get 503. It
// is safe to call more than once.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		close(s.done)
		<-s.driverDone
	})
}

// FailMetrics makes GET /metrics answer 500 while failing is true; the
// completions APIs keep serving. False restores the metrics.
func (s *Server) FailMetrics(failing bool) { s.metricsOff.Store(failing) }

// Stats returns the engine's gauges and counters at the current time.
func (s *Server) Stats() engine.Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.advanceLocked()
	return s.eng.Stats()
}

// loraInfoSeries is one series of vllm:lora_requests_info.
type loraInfoSeries struct {
	labels loraInfoLabels
	at     float64 // unix seconds of its last write
}

// histograms are the request histograms, observed under mu.
func (s *Server) histograms() []prometheus.Histogram {
	return []prometheus.Histogram{s.ttft, s.prefill, s.decode, s.output}
}

// metricsSnapshot reads the engine, the LoRA gauge's series and the
// histograms at once. Read apart, a scrape whose reading of the engine
// ended requests the driver had not yet come to could report them ended
// in its gauges and counters and not in its histograms (or the reverse),
// so a picker would miss their output tokens.
func (s *Server) metricsSnapshot() (engine.Stats, []loraInfoSeries, []prometheus.Metric) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.advanceLocked()
	var series []loraInfoSeries
	if s.lora != nil {
		series = make([]loraInfoSeries, 0, len(s.lora.series))
		for l, at := range s.lora.series {
			series = append(series, loraInfoSeries{l, at})
		}
	}
	hists := make([]prometheus.Metric, 0, 4)
	for _, h := range s.histograms() {
		hists = append(hists, frozen(h))
	}
	return s.eng.Stats(), series, hists
}

func (s *Server) closed() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// wallSeconds is an engine duration in seconds of the wall clock.
func (s *Server) wallSeconds(d time.Duration) float64 { return d.Seconds() / s.cfg.TimeScale }

// virtualNow maps the wall clock onto the engine's clock.
func (s *Server) virtualNow() time.Duration {
	return time.Duration(float64(time.Since(s.start)) * s.cfg.TimeScale)
}

// advanceLocked brings the engine to the current time and tells handlers
// what happened to their requests.
func (s *Server) advanceLocked() {
	if s.closed() {
		return
	}
	events := s.eng.AdvanceTo(s.virtualNow())
	for _, ev := range events {
		p := s.pending[ev.ID]
		if p == nil {
			continue
		}
		switch ev.Kind {
		case engine.FirstToken:
			s.ttft.Observe(s.wallSeconds(ev.At - ev.Arrived))
			p.prefill = ev.At - ev.Scheduled
			p.firstAt = ev.At
			p.cached = ev.CachedTokens
			p.tokens = ev.OutputTokens
			if s.lora != nil {
				s.lora.Started(p.adapter)
			}
		case engine.Token:
			p.tokens = ev.OutputTokens
		case engine.Finished:
			// vLLM observes the prefill and decode times of finished
			// requests only: those their client cancelled are not counted.
			s.prefill.Observe(s.wallSeconds(p.prefill))
			s.decode.Observe(s.wallSeconds(ev.At - p.firstAt))
			s.output.Observe(float64(ev.OutputTokens))
			p.finished = true
			delete(s.pending, ev.ID)
			if s.lora != nil {
				s.lora.Left(p.adapter, true)
			}
		}
		select {
		case p.notify <- struct{}{}:
		default: // a notification is already waiting; the handler reads the latest state
		}
	}
	// vLLM writes the LoRA gauge as it processes a step's outputs; a step
	// with none (a prefill chunk) changes nothing it reports.
	if s.lora != nil && len(events) > 0 {
		s.lora.record(time.Now())
	}
}

// drive runs the engine in real time until Close.
func (s *Server) drive() {
	defer close(s.driverDone)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		s.mu.Lock()
		s.advanceLocked()
		next, busy := s.eng.NextEventAt()
		wait := time.Duration(float64(next-s.eng.Now()) / s.cfg.TimeScale)
		s.mu.Unlock()

		var tick <-chan time.Time
		if busy {
			// A due step (wait 0) starts on the next pass, once the
			// virtual clock has moved past its start.
			timer.Reset(wait)
			tick = timer.C
		}
		select {
		case <-s.done:
			return
		case <-s.wake:
		case <-tick:
		}
	}
}

func (s *Server) wakeDriver() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// submit adds r to the engine at the current time.
func (s *Server) submit(r engine.Request) (*pending, error) {
	p := &pending{notify: make(chan struct{}, 1), adapter: r.Adapter}
	s.mu.Lock()
	s.advanceLocked()
	err := s.eng.Add(r)
	if err == nil {
		s.pending[r.ID] = p
		if s.lora != nil {
			s.lora.Add(r.Adapter)
		}
	}
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	s.wakeDriver()
	return p, nil
}

// cancel takes the request out of the engine if it is still there.
func (s *Server) cancel(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed() {
		return
	}
	s.advanceLocked()
	if p, ok := s.pending[id]; ok {
		delete(s.pending, id)
		s.eng.Cancel(id)
		if s.lora != nil {
			// As vLLM aborts: the gauge shows it at the next step's record.
			s.lora.Left(p.adapter, p.tokens > 0)
		}
	}
}

// snapshot reads p under the lock.
func (s *Server) snapshot(p *pending) (tokens, cached int, finished bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return p.tokens, p.cached, p.finished
}

// lateFirstBytes reports whether a streamed response is held back until
// its last token: a hash of the request's id (its RequestIDHeader), or of
// its prompt (promptKey) when it has none, drawn against
// LateFirstByteFraction.
func (s *Server) lateFirstBytes(requestID string, promptKey uint64) bool {
	if requestID != "" {
		return HoldsBack(s.cfg.LateFirstByteFraction, requestID)
	}
	return drawnBelow(promptKey, s.cfg.LateFirstByteFraction)
}

// HoldsBack reports whether a server whose LateFirstByteFraction is
// fraction holds back the streamed response of the request whose
// RequestIDHeader is id, so that a client can tell its late responses
// from the others.
func HoldsBack(fraction float64, id string) bool {
	return drawnBelow(xxhash.Sum64String(id), fraction)
}

func drawnBelow(h uint64, fraction float64) bool {
	return fraction > 0 && float64(h>>11)/(1<<53) < fraction // the top 53 bits, uniform in [0, 1)
}

// fault draws which injected fault, if any, hits a request.
func (s *Server) fault() (fail, hang bool) {
	if s.cfg.ErrorRate == 0 && s.cfg.HangRate == 0 {
		return false, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rng.Float64() < s.cfg.ErrorRate {
		return true, false
	}
	return false, s.rng.Float64() < s.cfg.HangRate
}

// EngineID is the engine's id, as prefill legs name it in remote_engine_id.
func (s *Server) EngineID() string { return s.engineID }
