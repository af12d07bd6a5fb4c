// Package scrape reads each endpoint's model-server metrics on an interval
// and hands the results to the picker, which uses them to correct its
// ledger (foreign load, prefix capacity, health; see picker/engine.go).
//
// The invariant not to break: a pick never waits for a scrape. Scrapes run
// on their own goroutines with a timeout and a bound on how many run at
// once; each round enters the picker at once, under one hold of its lock.
package scrape

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/logging"
)

// Defaults.
const (
	DefaultInterval    = 250 * time.Millisecond
	DefaultTimeout     = time.Second
	DefaultConcurrency = 16
	DefaultPath        = "/metrics"
	DefaultScheme      = "http"
	// maxBodyBytes bounds a scrape's body: an engine's exposition is tens of
	// kilobytes.
	maxBodyBytes = 8 << 20
)

// Picker is what the scraper feeds; *picker.Picker implements it.
type Picker interface {
	ScrapeTargets(dst []picker.ScrapeTarget) []picker.ScrapeTarget
	ObserveScrapes(round []picker.Scrape) (recovered, failed []netip.AddrPort)
}

// Options configure a Scraper; zero values take the defaults.
type Options struct {
	Interval, Timeout time.Duration
	Concurrency       int
	// Path and Port say where an endpoint's metrics are: Port 0 means the
	// endpoint's own port. Scheme is "http" (default) or "https".
	Path   string
	Port   uint16
	Scheme string
	Client *http.Client
	Log    logr.Logger
	// Registerer receives the scraper's metrics; nil registers none.
	Registerer prometheus.Registerer
	// VLLM, when set, names the metric families read from vLLM engines,
	// and from engines of a type the scraper does not know (the upstream
	// picker's --total-queued-requests-metric and friends); an empty name
	// is not read. Nil: vLLM's own names.
	VLLM *MetricNames
}

// MetricNames are the names of the metric families an engine is read by.
type MetricNames struct {
	Running, Waiting, KVCacheUsage, LoRAInfo, CacheInfo MetricSpec
}

// Scraper scrapes every endpoint the picker knows, every Interval.
type Scraper struct {
	p    Picker
	opts Options
	bufs sync.Pool // *bytes.Buffer
	// vllm are vLLM's names with Options.VLLM applied.
	vllm names

	// warned holds the endpoints, and engine types, already warned about:
	// a warning is one line, not one per scrape.
	mu     sync.Mutex
	warned map[string]bool

	duration prometheus.Histogram
	failures *prometheus.CounterVec
}

// New returns a scraper feeding p.
func New(p Picker, opts Options) *Scraper {
	if opts.Interval <= 0 {
		opts.Interval = DefaultInterval
	}
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.Concurrency <= 0 {
		opts.Concurrency = DefaultConcurrency
	}
	if opts.Path == "" {
		opts.Path = DefaultPath
	}
	if opts.Scheme == "" {
		opts.Scheme = DefaultScheme
	}
	if opts.Client == nil {
		opts.Client = &http.Client{Transport: NewTransport(nil)}
	}
	vllm := engines[EngineVLLM]
	if o := opts.VLLM; o != nil {
		if o.KVCacheUsage.Name != vllm.kvUsage || o.KVCacheUsage.Labels != nil {
			vllm.kvUsageOld = "" // older servers' name, read only beside vLLM's own
		}
		vllm.running, vllm.waiting, vllm.kvUsage = o.Running.Name, o.Waiting.Name, o.KVCacheUsage.Name
		vllm.loraInfo, vllm.cacheInfo = o.LoRAInfo.Name, o.CacheInfo.Name
		vllm.runningLabels, vllm.waitingLabels, vllm.kvUsageLabels = o.Running.Labels, o.Waiting.Labels, o.KVCacheUsage.Labels
		vllm.loraInfoLabels, vllm.cacheInfoLabels = o.LoRAInfo.Labels, o.CacheInfo.Labels
	}
	s := &Scraper{
		p:      p,
		opts:   opts,
		vllm:   vllm,
		warned: map[string]bool{},
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tally_engine_scrape_duration_seconds",
			Help:    "Time to scrape and parse one endpoint's model-server metrics.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 8),
		}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_engine_scrape_failures_total",
			Help: "Failed scrapes of model-server metrics, by reason (connect, status, timeout, parse).",
		}, []string{"reason"}),
	}
	s.bufs.New = func() any { return new(bytes.Buffer) }
	if opts.Registerer != nil {
		opts.Registerer.MustRegister(s.duration, s.failures)
	}
	return s
}

// Run scrapes until ctx ends. Each round scrapes every endpoint, at most
// Concurrency at once, and waits for them (each bounded by Timeout) before
// the next round, so a slow engine never piles scrapes up.
func (s *Scraper) Run(ctx context.Context) {
	t := time.NewTicker(s.opts.Interval)
	defer t.Stop()
	var targets []picker.ScrapeTarget
	for {
		targets = s.p.ScrapeTargets(targets[:0])
		s.Round(ctx, targets)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Round scrapes targets once, and hands the picker what they all said at
// once when the last has answered (or timed out), each with how long ago
// it was sent.
func (s *Scraper) Round(ctx context.Context, targets []picker.ScrapeTarget) {
	round := make([]picker.Scrape, len(targets))
	sent := make([]time.Time, len(targets))
	errs := make([]error, len(targets))
	work := make(chan int)
	var wg sync.WaitGroup
	for range min(s.opts.Concurrency, len(targets)) {
		wg.Go(func() {
			for i := range work {
				sent[i] = time.Now()
				round[i], errs[i] = s.scrapeOne(ctx, targets[i])
			}
		})
	}
	for i := range targets {
		work <- i
	}
	close(work)
	wg.Wait()
	if ctx.Err() != nil {
		return // shutting down: what failed is not the engines' fault
	}
	now := time.Now()
	for i := range round {
		round[i].Age = now.Sub(sent[i])
	}
	recovered, failed := s.p.ObserveScrapes(round)
	for _, addr := range recovered {
		s.opts.Log.Info("endpoint is a candidate again: its metrics scrape succeeded", "endpoint", addr.String())
	}
	for i, r := range round {
		a := r.Address.String()
		switch {
		case !r.Failed:
			s.forget("read:" + a)
		case slices.Contains(failed, r.Address):
			s.opts.Log.Info("endpoint left the candidates: its metrics scrapes keep failing", "endpoint", a, "error", errs[i].Error())
		case s.once("read:" + a):
			logging.Warn(s.opts.Log, "cannot read an endpoint's metrics; it serves on the picker's ledger alone, and leaves the candidates only if its metrics stop answering after they have answered",
				"endpoint", a, "error", errs[i].Error())
		}
	}
}

// scrapeOne scrapes t; a failed scrape is counted by its reason.
func (s *Scraper) scrapeOne(ctx context.Context, t picker.ScrapeTarget) (picker.Scrape, error) {
	start := time.Now()
	stats, reason, err := s.fetch(ctx, t)
	s.duration.Observe(time.Since(start).Seconds())
	if err != nil {
		if ctx.Err() == nil {
			s.failures.WithLabelValues(reason).Inc()
		}
		return picker.Scrape{Address: t.Address, Failed: true}, err
	}
	return picker.Scrape{Address: t.Address, Stats: stats}, nil
}

func (s *Scraper) fetch(ctx context.Context, t picker.ScrapeTarget) (picker.EngineStats, string, error) {
	engine := t.Engine
	n, ok := engines[engine]
	switch {
	case engine == "" || engine == EngineVLLM:
		engine, n = EngineVLLM, s.vllm
	case !ok:
		// Read as vLLM, as the upstream picker reads an engine it does not
		// know.
		if s.once("engine:" + engine) {
			logging.Warn(s.opts.Log, "an engine type the picker does not know; its metrics are read by vLLM's names",
				"engineType", engine, "known", []string{EngineVLLM, EngineSGLang, EngineTRTLLM})
		}
		n = s.vllm
	}
	addr := t.Address
	if s.opts.Port != 0 {
		addr = netip.AddrPortFrom(addr.Addr(), s.opts.Port)
	}
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.opts.Scheme+"://"+addr.String()+s.opts.Path, nil)
	if err != nil {
		return picker.EngineStats{}, "connect", err
	}
	resp, err := s.opts.Client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return picker.EngineStats{}, "timeout", err
		}
		return picker.EngineStats{}, "connect", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxBodyBytes))
		return picker.EngineStats{}, "status", fmt.Errorf("GET %s: HTTP %d", req.URL, resp.StatusCode)
	}
	buf := s.bufs.Get().(*bytes.Buffer)
	defer s.bufs.Put(buf)
	buf.Reset()
	if _, err := buf.ReadFrom(io.LimitReader(resp.Body, maxBodyBytes)); err != nil {
		if ctx.Err() != nil {
			return picker.EngineStats{}, "timeout", err
		}
		return picker.EngineStats{}, "connect", err
	}
	stats, seen := parse(buf.Bytes(), n)
	if !seen {
		return picker.EngineStats{}, "parse", fmt.Errorf("GET %s: no %s or %s in the %s metrics", req.URL, n.running, n.waiting, engine)
	}
	return stats, "", nil
}

// once reports whether key is warned about for the first time.
func (s *Scraper) once(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.warned[key] {
		return false
	}
	s.warned[key] = true
	return true
}

// forget lets key be warned about again.
func (s *Scraper) forget(key string) {
	s.mu.Lock()
	delete(s.warned, key)
	s.mu.Unlock()
}

// NewTransport returns the HTTP transport scrapes need (tlsConfig for
// https, else nil): every endpoint keeps its connection between scrapes,
// however many endpoints there are (net/http's default transport keeps 100
// idle connections in all, so a larger pool would reconnect on most
// scrapes: at 1,000 endpoints, twice the picker's CPU per request), and no
// proxy from the environment stands between the picker and a pod.
func NewTransport(tlsConfig *tls.Config) *http.Transport {
	return &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        0, // no cap over all endpoints
		MaxIdleConnsPerHost: 2, // one scrape of an endpoint at a time
		IdleConnTimeout:     time.Minute,
		TLSClientConfig:     tlsConfig,
		TLSHandshakeTimeout: 5 * time.Second,
	}
}
