package picker

import (
	"context"
	"errors"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

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
	// Now is the clock for reservation ages (the sweeper); default time.Now.
	// It must be safe for concurrent use.
	Now func() time.Time
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

// EndpointStats is one endpoint's row of the ledger.
type EndpointStats struct {
	Endpoint Endpoint
	InFlight int // requests reserved and not released
	// PrefillTokens is the prefill the drain model says is still queued.
	PrefillTokens int
	Decoding      int // requests past their first byte or modelled prefill
	// Detached counts the in-flight requests whose stream ended at the
	// pick, held until the model says they are done (detach.go).
	Detached int
	// PrefillTokensPerSecond is the endpoint's prefill rate: learned from
	// streamed first bytes, the configured starting value until then.
	PrefillTokensPerSecond float64
	// Utilization is the share of the last 20 s or so (a decayed mean)
	// during which the drain model had prefill queued on it.
	Utilization float64
	// What its engine's metrics said at the last scrape (Scraped false:
	// never scraped): running and waiting requests, the requests beyond the
	// ledger (foreign) and their cost now, and whether it is failing scrapes.
	Scraped                        bool
	EngineRunning, EngineWaiting   int
	ForeignRequests, ForeignTokens int
	Unhealthy                      bool
	// KVCacheUsage is the share of its KV cache in use (0 to 1) at the last
	// scrape; -1 when the engine does not publish it or was never scraped.
	KVCacheUsage float64
	// PrefixCapacityBlocks is the size of its prefix index, from its engine
	// or the configuration.
	PrefixCapacityBlocks int
	// Cached prompt tokens its engine delivered, and the picker predicted,
	// over the responses that reported usage.
	DeliveredCachedTokens, PredictedCachedTokens int64
	// CacheTrust is the share of the prefix index's predicted cached tokens
	// its cost counts as cached: recent responses' delivered share (1 until
	// one says otherwise).
	CacheTrust float64
	// Adapters counts its requests in flight by LoRA adapter (nil: none);
	// RunningAdapters, WaitingAdapters and MaxLoRAs are what its engine
	// last said of its adapters (adapters.go).
	Adapters                         map[string]int
	RunningAdapters, WaitingAdapters []string
	MaxLoRAs                         int
}

// Ledger is one consistent view of the whole ledger.
type Ledger struct {
	// InFlight, Detached and PrefillTokens sum every row, retained ones
	// included.
	InFlight, Detached, PrefillTokens int
	// Waiting counts the requests in the flow control queue.
	Waiting int
	// DetachEnds counts the detached reservations ended, by why: the model
	// said done, an engine scrape said so, the sweeper.
	DetachEnds [numDetachEnds]uint64
	// RateSamples counts the streamed first bytes offered to the prefill
	// rate, by what became of them (ratefit.go, rateSampleNames).
	RateSamples [numRateSamples]uint64
	// LoRALoadSeconds is what placement charges for loading an adapter:
	// loraLoadMilliseconds until first bytes have taught it.
	LoRALoadSeconds float64
	// WorkWeight is what an uncached prompt token costs a pick over the
	// current endpoints, relative to a queued one (place.go, workWeight).
	WorkWeight float64
	// ExpectedOutputTokens and DecodeSecondsPerToken are what a detached
	// request without max_tokens is expected to generate, and how long each
	// output token takes (detach.go): defaults until responses teach them
	// (the output also the engines' output counters).
	ExpectedOutputTokens, DecodeSecondsPerToken float64
	// Endpoints are the current endpoints, sorted by address.
	Endpoints []EndpointStats
	// Retained are endpoints that left the set and keep their row (in flight
	// requests, or the retention window), sorted by address.
	Retained []EndpointStats
}

// Picker places requests on endpoints. It implements EndpointSet and
// prometheus.Collector. All methods are safe for concurrent use.
type Picker struct {
	cfg       v1alpha1.PickerConfig
	opts      Options
	metrics   *metrics
	hashBufs  sync.Pool // of *[]uint64
	synced    atomic.Bool
	epoch     time.Time // origin of the drain model's clock
	retention time.Duration
	blocks    blockLayout
	// flowOn: cfg.FlowControl.Enabled (flow.go).
	flowOn bool
	// loraSeen: some engine has published its LoRA adapters; the base
	// models and adapters engines have named (adapters.go). Guarded by mu.
	loraSeen                  bool
	baseModels, knownAdapters map[string]bool

	// mu guards everything below. Inside it: no I/O, no logging, no channel
	// operation that can block (a dispatch closes a waiting request's
	// channel, which never blocks), no allocation on the pick path in
	// steady state.
	mu     sync.Mutex
	rows   []*row                  // current endpoints, sorted by address
	byAddr map[netip.AddrPort]*row // current endpoints
	// candidates are the current endpoints a pick may choose without a
	// subset hint: rows minus those excluded for failing scrapes.
	candidates []*row
	byKey      map[rowKey]*row // current and retained endpoints
	index      *prefix.Index
	rand       *rand.Rand
	mark       uint64 // epoch for de-duplicating rows without allocating
	owners     uint32 // the last owner tag given to a pick's prefix records
	// meanPromptTokens is a moving mean of the prompts placed: the size of
	// a foreign request when its engine does not say (engine.go).
	meanPromptTokens float64

	// Reservations not yet released, oldest pick first (for the sweeper).
	picks list[Reservation, pickLinks]

	// The pool's prefill rate, learned from every endpoint's streamed first
	// bytes (ratefit.go), and the fate of those samples.
	pool        poolRate
	rateSamples [numRateSamples]uint64
	// What loading an adapter takes, learned from the first bytes of
	// requests that waited for one (adapters.go).
	loraLoad decayedMean

	// Detached reservations past their prefill, by modelled end, and the
	// pool's decode model they end by (detach.go); why they ended.
	detachedDue      dueHeap
	decodeNsPerToken float64
	meanOutputTokens float64
	detachEnds       [numDetachEnds]uint64

	// Requests waiting for capacity (flow control, flow.go), and the timer
	// that runs a dispatch cycle the drain model makes due (set by Run).
	queue         flowQueue
	dispatchTimer *time.Timer

	// Pick scratch, sized on Replace so picks do not grow it.
	cand    []*row
	candIDs []int
	matched []int
	// best and bestKeys are bestLocked's scratch: the chosen candidates
	// and their tie keys, room for one more than the longest list.
	best     []int
	bestKeys []uint64
}

// New returns a picker with no endpoints. Zero fields of cfg take the
// defaults of v1alpha1.Default. It panics if opts.Registerer rejects the
// picker's metrics (registering two pickers on one registry is a bug).
func New(cfg v1alpha1.PickerConfig, opts Options) *Picker {
	cfg = v1alpha1.WithDefaults(cfg)
	cfg.FallbackEndpoints = min(cfg.FallbackEndpoints, maxFallbackEndpoints)

	if opts.Now == nil {
		opts.Now = time.Now
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
		cfg:       cfg,
		opts:      opts,
		metrics:   newMetrics(opts.PoolName, cfg.FlowControl.Enabled),
		epoch:     opts.Now(),
		retention: time.Duration(cfg.EndpointRetentionSeconds) * time.Second,
		blocks:    newBlockLayout(cfg),
		byAddr:    make(map[netip.AddrPort]*row),
		byKey:     make(map[rowKey]*row),
		index:     prefix.NewIndex(cfg.LRUCapacityBlocks),
		rand:      opts.Rand,
		best:      make([]int, 0, maxFallbackEndpoints+1),
		bestKeys:  make([]uint64, 0, maxFallbackEndpoints+1),
		// Until picks teach it: a guess at one request's prompt.
		meanPromptTokens: defaultForeignRequestTokens,
		pool:             newPoolRate(float64(cfg.PrefillTokensPerSecond)),
		loraLoad:         startedAt(float64(cfg.LoRALoadMilliseconds)/1000, loraLoadPrior),
		decodeNsPerToken: defaultDecodeNsPerToken,
		meanOutputTokens: defaultOutputTokens,
		flowOn:           cfg.FlowControl.Enabled,
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

// clock reads the picker's clock as nanoseconds since New (monotonic when
// Options.Now is time.Now). Read it before taking the lock.
func (p *Picker) clock() int64 { return int64(p.opts.Now().Sub(p.epoch)) }

// Replace makes eps the whole endpoint set. An endpoint is identified by its
// pod's UID (or, without one, its pod name) and address: one that leaves the
// set keeps its row (ledger and prefix memory), no longer a candidate, while
// requests are in flight on it or for the retention window, and gets it back
// if it returns. Another pod at the same address starts from zero. Dropping a
// row costs O(1) under the lock; its prefix entries are freed afterwards in
// short batches of their own. The first call marks the picker as synced.
func (p *Picker) Replace(eps []Endpoint) {
	now := p.clock()
	var added, returned, left int
	p.mu.Lock()
	p.mark++
	for _, ep := range eps {
		if !ep.Address.IsValid() {
			continue
		}
		if w, ok := p.byAddr[key(ep.Address)]; ok && w.mark == p.mark {
			continue // the address is listed twice: the first wins
		}
		k := identity(ep)
		w, ok := p.byKey[k]
		switch {
		case !ok:
			w = &row{key: k, id: p.index.Add(), at: now}
			w.rate = p.rateOf(w)
			p.byKey[k] = w
			added++
		case !w.current:
			returned++
		}
		w.ep, w.current, w.mark = ep, true, p.mark
		p.byAddr[key(ep.Address)] = w
	}
	for _, w := range p.rows {
		if w.mark != p.mark {
			w.current, w.leftAt = false, now
			left++
		}
	}
	clear(p.byAddr)
	p.rows = p.rows[:0]
	for _, w := range p.byKey {
		if w.current {
			p.rows = append(p.rows, w)
			p.byAddr[key(w.ep.Address)] = w
		}
	}
	clear(p.rows[len(p.rows):cap(p.rows)]) // let dropped rows be collected
	slices.SortFunc(p.rows, func(a, b *row) int { return a.ep.Address.Compare(b.ep.Address) })
	p.refreshCandidatesLocked()
	if n := len(p.rows); cap(p.cand) < n {
		p.cand = make([]*row, 0, n)
		p.candIDs = make([]int, 0, n)
		p.matched = make([]int, n)
	}
	dropped := p.expireLocked(now)
	total := len(p.rows)
	p.freedLocked(now) // new endpoints take waiting requests
	p.mu.Unlock()
	p.tidy()

	p.synced.Store(true)
	if added > 0 || returned > 0 || left > 0 || dropped > 0 {
		p.opts.Log.V(1).Info("endpoint set changed", "added", added, "returned", returned,
			"left", left, "forgotten", dropped, "endpoints", total)
	}
}

// expireLocked drops the retained rows whose requests have all ended and
// whose retention window is over. It does not walk their prefix entries.
func (p *Picker) expireLocked(now int64) (dropped int) {
	for k, w := range p.byKey {
		if !w.current && w.inFlight == 0 && time.Duration(now-w.leftAt) >= p.retention {
			p.index.Remove(w.id)
			w.id, w.dropped = -1, true
			delete(p.byKey, k)
			dropped++
		}
	}
	return dropped
}

// recordTail records the blocks of a long prompt past what its critical
// section recorded, unless the request has ended or moved since (ServedBy
// records all of them itself). It reports whether evictions are owed.
func (p *Picker) recordTail(r *Reservation) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !r.released && r.row.id >= 0 && r.tailOn == r.row {
		// Recording the whole prompt walks the head it recorded a moment
		// ago (still at the front of the list) and puts the tail behind
		// it, where eviction takes a prompt's tail before its head.
		p.index.Record(r.row.id, r.hashes, r.owner)
	}
	return p.index.Untidy()
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
		more = p.index.Tidy(tidyBatchBlocks)
		p.mu.Unlock()
	}
}

// Synced reports whether the endpoint set has been replaced at least once.
func (p *Picker) Synced() bool { return p.synced.Load() }

// Pick hashes req.Prompt outside any lock, then in one critical section
// scores the candidates, chooses, reserves the cost in the ledger and records
// the prompt's blocks on the chosen endpoint. The caller must Release the
// reservation when the request ends. Pick never waits: with every candidate
// saturated it returns ErrSaturated, flow control or not (see Admit).
func (p *Picker) Pick(req Request) (*Reservation, error) {
	start := time.Now()
	r, untidy, err := p.place(req)
	return p.placed(r, err, untidy, start)
}

// place is Pick's critical section, with its reservation prepared before
// it; untidy reports whether the index owes evictions.
func (p *Picker) place(req Request) (r *Reservation, untidy bool, err error) {
	r = p.prepare(req)
	p.mu.Lock()
	err = p.placeLocked(r, req)
	untidy = p.index.Untidy()
	p.mu.Unlock()
	return r, untidy, err
}

// prepare hashes req's prompt (outside any lock) into a new reservation.
// At most MaxPromptBlocks blocks are hashed and recorded, so that a huge
// prompt holds the lock no longer than a long one: fine blocks for the
// head, coarse ones for the tail (blocks.go).
func (p *Picker) prepare(req Request) *Reservation {
	chars := len(req.Prompt)
	if chars == 0 {
		chars = max(req.PromptChars, 0)
	}
	buf := p.hashBufs.Get().(*[]uint64)
	hashes := prefix.HashTiered((*buf)[:0], req.Model, req.CacheSalt, req.Prompt,
		p.cfg.BlockSizeChars, p.blocks.fine, p.blocks.coarseChars, p.cfg.MaxPromptBlocks)
	*buf = hashes
	now := p.opts.Now()
	r := &Reservation{
		p:            p,
		pickedAt:     now,
		pickedNs:     int64(now.Sub(p.epoch)),
		promptChars:  chars,
		promptTokens: p.tokens(chars),
		stream:       req.Stream,
		bodiless:     req.bodiless(),
		maxTokens:    max(req.MaxTokens, 0),
		heapIdx:      -1,
		nHashes:      len(hashes),
	}
	if len(hashes) > 0 {
		// Set before the lock: once linked, the sweeper may release r.
		r.hashes, r.hashBuf = hashes, buf
	} else {
		p.hashBufs.Put(buf)
	}
	return r
}

// placed finishes a placement outside the lock: the long prompt's tail, the
// evictions its records owe, and the metrics. It returns r, or nil and err.
func (p *Picker) placed(r *Reservation, err error, untidy bool, start time.Time) (*Reservation, error) {
	if err == nil && r.nHashes > p.blocks.inLock {
		untidy = p.recordTail(r) || untidy
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
	if r.hashBuf != nil {
		p.hashBufs.Put(r.hashBuf)
		r.hashes, r.hashBuf = nil, nil
	}
	return nil, err
}

// Snapshot returns the whole ledger, read under one hold of the lock.
func (p *Picker) Snapshot() Ledger {
	now := p.clock()
	p.mu.Lock()
	defer p.mu.Unlock()
	l := Ledger{Endpoints: make([]EndpointStats, 0, len(p.rows))}
	for _, w := range p.byKey {
		w.drain(now)
	}
	p.expireDetachedLocked(now)
	l.DetachEnds = p.detachEnds
	l.Waiting = p.queue.n
	l.RateSamples = p.rateSamples
	l.LoRALoadSeconds = p.loraLoad.mean()
	l.WorkWeight = workWeight(p.rows)
	l.ExpectedOutputTokens, l.DecodeSecondsPerToken = p.meanOutputTokens, p.decodeNsPerToken/1e9
	for _, w := range p.byKey {
		e := &w.engine
		s := EndpointStats{Endpoint: w.ep, InFlight: w.inFlight, PrefillTokens: w.queued(),
			Decoding: w.decoding, Detached: w.detached, PrefillTokensPerSecond: w.rate, Utilization: w.utilization,
			Scraped: e.scraped, EngineRunning: e.running, EngineWaiting: e.waiting,
			ForeignRequests: e.foreign, ForeignTokens: e.foreignCost(now), Unhealthy: e.unhealthy,
			KVCacheUsage:          -1,
			PrefixCapacityBlocks:  p.index.Capacity(w.id),
			DeliveredCachedTokens: e.delivered, PredictedCachedTokens: e.predic, CacheTrust: e.cacheTrust(),
			Adapters: maps.Clone(w.adapterRefs), RunningAdapters: e.runningAdapters,
			WaitingAdapters: e.waitingAdapters, MaxLoRAs: e.maxLoRAs}
		if e.scraped {
			s.KVCacheUsage = e.kvUsage
		}
		l.InFlight += s.InFlight
		l.Detached += s.Detached
		l.PrefillTokens += s.PrefillTokens
		if w.current {
			l.Endpoints = append(l.Endpoints, s)
		} else {
			l.Retained = append(l.Retained, s)
		}
	}
	byAddress := func(a, b EndpointStats) int { return a.Endpoint.Address.Compare(b.Endpoint.Address) }
	slices.SortFunc(l.Endpoints, byAddress)
	slices.SortFunc(l.Retained, byAddress)
	return l
}

// Stats returns the ledger row of every current endpoint, sorted by address.
func (p *Picker) Stats() []EndpointStats { return p.Snapshot().Endpoints }

// Run sweeps stale reservations until ctx ends: every tenth of
// MaxRequestLifetime, at most 10 seconds apart.
func (p *Picker) Run(ctx context.Context) {
	interval := min(max(p.opts.MaxRequestLifetime/10, minSweepInterval), maxSweepInterval)
	t := time.NewTicker(interval)
	defer t.Stop()
	if p.flowOn {
		p.mu.Lock()
		p.dispatchTimer = time.AfterFunc(time.Hour, p.dispatchOnTimer)
		p.armLocked(p.clock())
		p.mu.Unlock()
		defer func() {
			p.mu.Lock()
			p.dispatchTimer.Stop()
			p.dispatchTimer = nil
			p.mu.Unlock()
		}()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if n := p.Sweep(); n > 0 {
				p.opts.Log.Info("released reservations that outlived the maximum request lifetime; their streams never ended",
					"released", n, "maxRequestLifetime", p.opts.MaxRequestLifetime)
			}
		}
	}
}

// Sweep releases every reservation picked more than MaxRequestLifetime ago
// and returns how many it released. It is the backstop for a stream whose end
// was never seen; a later Release of a swept reservation does nothing. It
// also forgets retained endpoints whose retention is over.
func (p *Picker) Sweep() int {
	wall := p.opts.Now()
	now := int64(wall.Sub(p.epoch))
	cutoff := wall.Add(-p.opts.MaxRequestLifetime)
	n := 0
	p.mu.Lock()
	// The list is in lock order, and pick times are read just before the
	// lock, so a reservation may sit behind one a few microseconds younger:
	// it is then swept on the next run.
	for r := p.picks.head; r != nil && r.pickedAt.Before(cutoff); r = p.picks.head {
		if r.detached {
			p.detachEnds[detachEndSwept]++
		}
		p.releaseLocked(r, now)
		n++
	}
	for _, w := range p.byKey {
		w.drain(now)
	}
	p.expireDetachedLocked(now)
	dropped := p.expireLocked(now)
	p.freedLocked(now)
	p.mu.Unlock()
	if dropped > 0 {
		p.tidy()
	}
	if n > 0 {
		p.metrics.swept.Add(float64(n))
	}
	return n
}

// tokens estimates the tokens of chars characters of prompt: rounded up, so
// any text costs at least one token.
func (p *Picker) tokens(chars int) int {
	return (chars + p.cfg.CharsPerToken - 1) / p.cfg.CharsPerToken
}
