package picker

import (
	"context"
	"errors"
	"math/rand/v2"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/utils/clock"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker/prefix"
)

const (
	// DefaultMaxRequestLifetime is Options.MaxRequestLifetime when unset.
	DefaultMaxRequestLifetime = 30 * time.Minute
	// The sweeper runs often enough that a lost release is reclaimed within
	// a tenth of the lifetime past it, and at least every maxSweepInterval.
	maxSweepInterval = 10 * time.Second
	minSweepInterval = 10 * time.Millisecond
	// maxFallbackEndpoints bounds the destination list; a Reservation
	// keeps it inline.
	maxFallbackEndpoints = v1alpha1.MaxFallbackEndpoints
)

var (
	// ErrNoEndpoint means no endpoint is eligible for the request: the pool
	// has none yet, or the gateway's subset hint names none of them.
	ErrNoEndpoint = errors.New("no eligible endpoint")
	// ErrSaturated means every candidate endpoint is over a saturation limit.
	ErrSaturated = errors.New("every eligible endpoint is saturated")
)

// Options are the picker's collaborators; zero values give production defaults.
type Options struct {
	// Clock is the picker's time: the ledger's operations are given its
	// readings, and flow control's dispatch timer runs on it. Default: the
	// real clock. It must be safe for concurrent use.
	Clock Clock
	// Rand breaks exact ties between endpoints; it is used only under the
	// picker's lock. Default: seeded randomly.
	Rand *rand.Rand
	// Registerer receives the picker's metrics; nil registers none.
	Registerer prometheus.Registerer
	// MaxRequestLifetime is how long a reservation may live before the
	// sweeper releases it; default 30 minutes.
	MaxRequestLifetime time.Duration
	// Log receives endpoint-set changes and sweeper releases.
	Log logr.Logger
	// ScrapeFailureThreshold is how many failed scrapes in a row take an
	// endpoint out of the candidates; default DefaultScrapeFailureThreshold.
	ScrapeFailureThreshold int
	// PoolName is the InferencePool's name: the "name" label of the pool
	// metrics under the upstream picker's names (inference_pool_*).
	PoolName string
}

// Request is what the picker needs from one parsed request.
type Request struct {
	Model string
	// CacheSalt is the request's cache salt ("" for none): the model server
	// never shares KV cache between requests whose salts differ, so it seeds
	// the prompt's block hashes with the model (see prefix.HashSalted).
	CacheSalt string
	// Prompt is the prefix text of the prompt; nil or empty for requests
	// routed by load alone. Pick reads it only while it runs: it keeps the
	// block hashes, never the text.
	Prompt []byte
	// PromptChars, when Prompt is empty, estimates the prompt's size in
	// characters for a request routed before its body is known (for
	// example from its content-length); it is reserved as prefill but
	// matches no prefix. Ignored when Prompt is set.
	PromptChars int
	// Stream says the client asked for a streamed response, so its first
	// response bytes mark the end of its prefill (the picker learns each
	// endpoint's prefill rate from them). A non-streamed response's first
	// bytes come when generation ends.
	Stream bool
	// MaxTokens is the request's output limit (max_tokens or its
	// equivalent), 0 when it gives none: a detached reservation's decoding
	// is modelled from it (detach.go).
	MaxTokens int
	// Subset holds the candidates named by the gateway's subset hint. An
	// entry names the endpoint at its address; one with port 0 (a bare IP),
	// or whose port no endpoint at its IP has, names every endpoint at its
	// IP, as the upstream picker matches hints by IP.
	Subset []netip.AddrPort
	// HasSubset says the gateway sent a subset hint; an empty or
	// non-matching one gives ErrNoEndpoint.
	HasSubset bool
	// Priority is the request's InferenceObjective priority (0 when it
	// names none): with flow control, higher bands are dispatched first,
	// and a request below 0 is sheddable, refused rather than queued.
	Priority int
	// FairnessID names the request's flow within its band (the
	// x-gateway-inference-fairness-id header; "" is DefaultFairnessID).
	FairnessID string
	// Bytes is the request's size against the queue's byte limits (its
	// body); at least its prompt's characters are counted.
	Bytes int64
	// Objective names the request's InferenceObjective, for the flow
	// control metrics' labels.
	Objective string
	// DestinationOnly says the gateway takes only the destination from the
	// answer (NGINX Gateway Fabric's shim): x-prefiller-host-port would
	// not reach the decode pod's sidecar, which would prefill the request
	// itself, so it is never split (disaggregation).
	DestinationOnly bool
}

// bodiless reports whether the request gives an engine nothing to do: no
// body, so no model, no prompt and no estimate of one (a GET of
// /v1/models, a health check through the gateway). It is placed at once,
// saturated or not, as the upstream picker routes a request without a
// body, past admission: holding or refusing it would free nothing, and
// would fail a gateway's probes while the pool is busy.
func (req Request) bodiless() bool {
	return req.Model == "" && len(req.Prompt) == 0 && req.PromptChars == 0 && req.Bytes == 0
}

// Clock is what the picker needs of time: k8s.io/utils/clock.RealClock
// satisfies it, and a simulation in virtual time gives its own.
type Clock interface {
	Now() time.Time
	// AfterFunc runs f once d has passed (flow control's dispatch timer).
	AfterFunc(d time.Duration, f func()) clock.Timer
}

// Picker places requests on endpoints. It holds the lock over the ledger
// (ledger.go), reads the clock for each of the ledger's operations, and does
// the work that needs no lock outside it: hashing prompts, evicting prefix
// entries in short batches, metrics. It implements EndpointSet and
// prometheus.Collector. All methods are safe for concurrent use.
type Picker struct {
	cfg      v1alpha1.PickerConfig
	opts     Options
	clock    Clock
	epoch    time.Time // origin of the ledger's time
	metrics  *metrics
	hashBufs sync.Pool // of *[]uint64
	synced   atomic.Bool
	blocks   blockLayout

	// mu guards the ledger and the dispatch timer. Inside it: no I/O, no
	// logging, no channel operation that can block (a dispatch closes a
	// waiting request's channel, which never blocks), no allocation on the
	// pick path in steady state.
	mu sync.Mutex
	l  ledger
	// The timer that runs a dispatch cycle the drain model makes due
	// while requests wait (flow control), and the ledger time it is set
	// for (0: not set).
	dispatchTimer clock.Timer
	timerDue      int64
}

// New returns a picker with no endpoints. Zero fields of cfg take the
// defaults of v1alpha1.Default. It panics if opts.Registerer rejects the
// picker's metrics (registering two pickers on one registry is a bug).
func New(cfg v1alpha1.PickerConfig, opts Options) *Picker {
	cfg = v1alpha1.WithDefaults(cfg)
	cfg.FallbackEndpoints = min(cfg.FallbackEndpoints, maxFallbackEndpoints)

	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Rand == nil {
		opts.Rand = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
	if opts.MaxRequestLifetime <= 0 {
		opts.MaxRequestLifetime = DefaultMaxRequestLifetime
	}
	if opts.ScrapeFailureThreshold <= 0 {
		opts.ScrapeFailureThreshold = DefaultScrapeFailureThreshold
	}

	p := &Picker{
		cfg:     cfg,
		opts:    opts,
		clock:   opts.Clock,
		epoch:   opts.Clock.Now(),
		metrics: newMetrics(opts.PoolName, cfg.FlowControl.Enabled),
		blocks:  newBlockLayout(cfg),
		l:       newLedger(cfg, opts.Rand, opts.ScrapeFailureThreshold),
	}
	p.hashBufs.New = func() any {
		b := make([]uint64, 0, 1024)
		return &b
	}
	if opts.Registerer != nil {
		opts.Registerer.MustRegister(p)
	}
	return p
}

// now reads the clock as the ledger's time: nanoseconds since New
// (monotonic with the real clock). Read it before taking the lock.
func (p *Picker) now() int64 { return int64(p.clock.Now().Sub(p.epoch)) }

// Admit is the picker's entry point: it places req and returns its
// reservation, which the caller ends with End (and reports with FirstByte
// and ServedBy as the response comes).
//
// The prompt is hashed outside any lock (prepare); then, in one critical
// section, the ledger scores the candidates, chooses, reserves the
// request's cost and records its prompt's blocks on the chosen endpoint
// (ledger.place); after the lock, a long prompt's tail is recorded and the
// evictions its records owe run in short holds of their own (placed).
//
// Without flow control, or with some candidate below its saturation
// threshold, Admit never waits. With flow control on and every candidate
// saturated, it waits in the queue until a dispatch cycle places it, its
// TTL passes (ErrQueueTimeout), ctx ends (ctx's error: nothing is left
// behind), or the picker shuts down (ErrShuttingDown).
func (p *Picker) Admit(ctx context.Context, req Request) (*Reservation, error) {
	start := time.Now()
	if !p.cfg.FlowControl.Enabled {
		return p.placeNow(p.prepare(req), req, start)
	}
	r, t, err := p.Enqueue(req)
	if t == nil {
		return r, err
	}
	return t.Wait(ctx)
}

// pick is Admit without flow control: it never waits, and with every
// candidate saturated returns ErrSaturated.
func (p *Picker) pick(req Request) (*Reservation, error) {
	start := time.Now()
	return p.placeNow(p.prepare(req), req, start)
}

// placeNow is pick of r, prepared from req.
func (p *Picker) placeNow(r *Reservation, req Request, start time.Time) (*Reservation, error) {
	p.mu.Lock()
	err := p.l.place(r, req)
	untidy := p.l.untidy()
	p.mu.Unlock()
	return p.placed(r, err, untidy, start)
}

// prepare hashes req's prompt (outside any lock) into a new reservation.
// At most MaxPromptBlocks blocks are hashed and recorded, so that a huge
// prompt holds the lock no longer than a long one: fine blocks for the
// head, coarse ones for the tail (blocks.go).
func (p *Picker) prepare(req Request) *Reservation {
	buf := p.hashBufs.Get().(*[]uint64)
	hashes := p.hash((*buf)[:0], req)
	*buf = hashes
	r := p.l.newReservation(req, hashes, p.now())
	if len(hashes) > 0 {
		// Set before the lock: once linked, the sweeper may release r.
		r.hashBuf = buf
	} else {
		p.hashBufs.Put(buf)
	}
	return r
}

// hash appends req's prompt's block hashes to dst: fine blocks for the
// head, coarse ones for the tail, at most MaxPromptBlocks (blocks.go).
func (p *Picker) hash(dst []uint64, req Request) []uint64 {
	return prefix.HashTiered(dst, req.Model, req.CacheSalt, req.Prompt,
		p.cfg.BlockSizeChars, p.blocks.fine, p.blocks.coarseChars, p.cfg.MaxPromptBlocks)
}

// placed finishes a placement outside the lock: the long prompt's tail, the
// evictions its records owe, and the metrics. It returns r, or nil and err.
func (p *Picker) placed(r *Reservation, err error, untidy bool, start time.Time) (*Reservation, error) {
	if err == nil && r.nHashes > p.blocks.inLock {
		p.mu.Lock()
		untidy = p.l.recordTail(r) || untidy
		p.mu.Unlock()
	}
	if untidy {
		p.tidy() // the evictions this pick's records owe, outside its critical section
	}

	m := p.metrics
	elapsed := time.Since(start).Seconds()
	m.pickDuration.Observe(elapsed)
	m.schedulerE2EAll.Observe(elapsed)
	switch {
	case err == nil:
		m.picksOK.Inc()
		p.countSplit(r)
		m.promptTokens.Add(float64(r.promptTokens))
		// Read without the lock: r is not returned yet, so no ServedBy
		// can have moved it.
		m.cachedTokens.Add(float64(r.cachedTokens))
		if r.nHashes > 0 {
			m.prefixHitRatioAll.Observe(float64(r.cachedBlocks) / float64(r.nHashes))
		}
		return r, nil
	case errors.Is(err, ErrSaturated):
		m.picksSaturated.Inc()
	case errors.Is(err, ErrNoEndpoint):
		m.picksNoEndpoint.Inc()
	}
	// Never placed, so never linked: nothing else can see r.
	p.putHashes(r.hashBuf)
	r.hashes, r.hashBuf = nil, nil
	return nil, err
}

// putHashes gives a reservation's hash buffer back for reuse.
func (p *Picker) putHashes(buf *[]uint64) {
	if buf != nil {
		*buf = (*buf)[:0]
		p.hashBufs.Put(buf)
	}
}

// tidyBatchBlocks bounds the prefix entries evicted or freed under one
// hold of the lock (tens of microseconds), so a pick never waits long behind
// an eviction or a removal.
const tidyBatchBlocks = 256

// tidy evicts the prefix entries over an endpoint's capacity and frees
// those of dropped rows, a batch per hold of the lock.
func (p *Picker) tidy() {
	for more := true; more; {
		p.mu.Lock()
		more = p.l.tidy(tidyBatchBlocks)
		p.mu.Unlock()
	}
}

// FirstByte marks the first response bytes of r: the endpoint has computed
// the prompt, so what is left of its prefill is released and it is
// decoding. Later calls, and calls after End, do nothing.
func (p *Picker) FirstByte(r *Reservation) {
	now := p.now()
	p.mu.Lock()
	p.l.firstByte(r, now)
	p.rearm(now)
	p.mu.Unlock()
}

// ServedBy moves what r still holds to addr, the endpoint that actually
// served the request (the gateway may have used a fallback), and records
// the prompt's blocks there. The blocks the request added to the previous
// holder are forgotten there, unless another request recorded them since:
// it never computed them. Nothing happens if addr is not a current
// endpoint, already the holder, or r has ended or is detached.
func (p *Picker) ServedBy(r *Reservation, addr netip.AddrPort) {
	now := p.now()
	p.mu.Lock()
	untidy := p.l.servedBy(r, addr, now)
	p.mu.Unlock()
	if untidy {
		p.tidy()
	}
}

// End ends r's stream with its outcome, in one hold of the lock: the
// engine's usage corrects the endpoint's cache trust, the output teaches
// the decode model, and the reservation is released, or, when the stream
// ended at the pick (o.Detached), held until the model says the request is
// done (detach.go). Calls after the first, and after the sweeper released
// r, do nothing.
func (p *Picker) End(r *Reservation, o Outcome) {
	now := p.now()
	p.mu.Lock()
	buf, detached := p.l.end(r, o, now)
	p.rearm(now)
	p.mu.Unlock()
	p.putHashes(buf)
	if detached {
		p.metrics.detached.Inc()
	}
}

// Replace makes eps the whole endpoint set. An endpoint is identified by its
// pod's UID (or, without one, its pod name) and address: one that leaves the
// set keeps its row (ledger and prefix memory), no longer a candidate, while
// requests are in flight on it or for the retention window, and gets it back
// if it returns. Another pod at the same address starts from zero. Dropping a
// row costs O(1) under the lock; its prefix entries are freed afterwards in
// short batches of their own. The first call marks the picker as synced.
func (p *Picker) Replace(eps []Endpoint) {
	now := p.now()
	p.mu.Lock()
	c := p.l.setEndpoints(eps, now)
	p.rearm(now)
	p.mu.Unlock()
	p.tidy()

	p.synced.Store(true)
	if c.added > 0 || c.returned > 0 || c.left > 0 || c.dropped > 0 {
		p.opts.Log.V(1).Info("endpoint set changed", "added", c.added, "returned", c.returned,
			"left", c.left, "forgotten", c.dropped, "endpoints", c.total)
	}
}

// Synced reports whether the endpoint set has been replaced at least once.
func (p *Picker) Synced() bool { return p.synced.Load() }

// Snapshot returns the whole ledger as of now, read under one hold of the
// lock. It changes nothing: what the drain model has finished by now is
// worked out, not applied.
func (p *Picker) Snapshot() Ledger {
	now := p.now()
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.l.snapshot(now)
}

// Run sweeps stale reservations until ctx ends: every tenth of
// MaxRequestLifetime, at most 10 seconds apart.
func (p *Picker) Run(ctx context.Context) {
	interval := min(max(p.opts.MaxRequestLifetime/10, minSweepInterval), maxSweepInterval)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if n := p.sweep(); n > 0 {
				p.opts.Log.Info("released reservations that outlived the maximum request lifetime; their streams never ended",
					"released", n, "maxRequestLifetime", p.opts.MaxRequestLifetime)
			}
		}
	}
}

// sweep releases every reservation picked more than MaxRequestLifetime ago
// and returns how many it released. It is the backstop for a stream whose end
// was never seen; a later End of a swept reservation does nothing. It also
// forgets retained endpoints whose retention is over.
func (p *Picker) sweep() int {
	now := p.now()
	p.mu.Lock()
	n, dropped := p.l.sweep(now, int64(p.opts.MaxRequestLifetime))
	p.rearm(now)
	p.mu.Unlock()
	if dropped > 0 {
		p.tidy()
	}
	if n > 0 {
		p.metrics.swept.Add(float64(n))
	}
	return n
}
