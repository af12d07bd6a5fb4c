package picker

import (
	"context"
	"errors"
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
	defaultMaxRequestLifetime = 30 * time.Minute
	// The sweeper runs often enough that a lost release is reclaimed within
	// a tenth of the lifetime past it, and at least every maxSweepInterval.
	maxSweepInterval = 10 * time.Second
	minSweepInterval = 10 * time.Millisecond
	// maxFallbackEndpoints bounds the destination list (the config accepts
	// 1..16); a Reservation keeps it inline.
	maxFallbackEndpoints = 16
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
}

// Request is what the picker needs from one parsed request.
type Request struct {
	Model string
	// Prompt is the prefix text of the prompt; nil or empty for requests
	// routed by load alone.
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
	// Subset holds the candidates named by the gateway's subset hint.
	Subset []netip.AddrPort
	// HasSubset says the gateway sent a subset hint; an empty or
	// non-matching one gives ErrNoEndpoint.
	HasSubset bool
}

// EndpointStats is one endpoint's row of the ledger.
type EndpointStats struct {
	Endpoint      Endpoint
	InFlight      int // requests reserved and not released
	PrefillTokens int // outstanding prefill tokens
	Decoding      int // requests past their first byte
}

// Picker places requests on endpoints. It implements EndpointSet and
// prometheus.Collector. All methods are safe for concurrent use.
type Picker struct {
	cfg      v1alpha1.PickerConfig
	opts     Options
	metrics  *metrics
	hashBufs sync.Pool // of *[]uint64
	synced   atomic.Bool

	// afterPick, when set (tests only), runs right after Pick unlocks.
	afterPick func()

	// mu guards everything below. Inside it: no I/O, no logging, no channel
	// operations, no allocation on the pick path in steady state.
	mu     sync.Mutex
	rows   []*row // current endpoints, sorted by address
	byAddr map[netip.AddrPort]*row
	index  *prefix.Index
	rand   *rand.Rand
	mark   uint64 // epoch for de-duplicating rows without allocating

	// Reservations not yet released, oldest pick first (for the sweeper).
	oldest, newest *Reservation

	// Pick scratch, sized on Replace so picks do not grow it.
	cand    []*row
	candIDs []int
	matched []int

	// Effective operations, counted to prove exactly-once.
	firstBytes, releases, swept uint64
}

// New returns a picker with no endpoints. Zero fields of cfg take the
// defaults of v1alpha1.Default. It panics if opts.Registerer rejects the
// picker's metrics (registering two pickers on one registry is a bug).
func New(cfg v1alpha1.PickerConfig, opts Options) *Picker {
	def := v1alpha1.Default()
	orDefault := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	orDefault(&cfg.BlockSizeChars, def.BlockSizeChars)
	orDefault(&cfg.LRUCapacityBlocks, def.LRUCapacityBlocks)
	orDefault(&cfg.CharsPerToken, def.CharsPerToken)
	orDefault(&cfg.FallbackEndpoints, def.FallbackEndpoints)
	if cfg.DecodeWeightTokens == 0 {
		cfg.DecodeWeightTokens = def.DecodeWeightTokens
	}
	cfg.FallbackEndpoints = min(cfg.FallbackEndpoints, maxFallbackEndpoints)

	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Rand == nil {
		opts.Rand = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
	if opts.MaxRequestLifetime <= 0 {
		opts.MaxRequestLifetime = defaultMaxRequestLifetime
	}

	p := &Picker{
		cfg:     cfg,
		opts:    opts,
		metrics: newMetrics(),
		byAddr:  make(map[netip.AddrPort]*row),
		index:   prefix.NewIndex(cfg.LRUCapacityBlocks),
		rand:    opts.Rand,
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

// Replace makes eps the whole endpoint set. Removed endpoints lose their
// ledger row and prefix entries at once; their in-flight reservations keep
// running and release as no-ops. An endpoint whose address comes back, or
// whose address now belongs to another pod, starts from zero. The first call
// marks the picker as synced.
func (p *Picker) Replace(eps []Endpoint) {
	var added, removed int
	p.mu.Lock()
	p.mark++
	for _, ep := range eps {
		if !ep.Address.IsValid() {
			continue
		}
		r, ok := p.byAddr[key(ep.Address)]
		if ok && r.mark == p.mark {
			continue // listed twice: the first wins
		}
		if ok && r.ep.Pod != ep.Pod {
			// Another pod reuses the address: its cache is not the old one's.
			p.dropRowLocked(r)
			removed++
			ok = false
		}
		if !ok {
			r = &row{ep: ep, id: p.index.Add(), live: true}
			p.byAddr[key(ep.Address)] = r
			added++
		}
		r.mark = p.mark
	}
	for _, r := range p.rows {
		if r.live && r.mark != p.mark {
			p.dropRowLocked(r)
			removed++
		}
	}
	p.rows = p.rows[:0]
	for _, r := range p.byAddr { // only live rows are in byAddr
		p.rows = append(p.rows, r)
	}
	clear(p.rows[len(p.rows):cap(p.rows)]) // let dropped rows be collected
	slices.SortFunc(p.rows, func(a, b *row) int { return a.ep.Address.Compare(b.ep.Address) })
	if n := len(p.rows); cap(p.cand) < n {
		p.cand = make([]*row, 0, n)
		p.candIDs = make([]int, 0, n)
		p.matched = make([]int, n)
	}
	total := len(p.rows)
	p.mu.Unlock()

	p.synced.Store(true)
	if added > 0 || removed > 0 {
		p.opts.Log.V(1).Info("endpoint set changed", "added", added, "removed", removed, "endpoints", total)
	}
}

// dropRowLocked forgets an endpoint. Reservations that point at r see it is
// no longer live and release nothing from it.
func (p *Picker) dropRowLocked(r *row) {
	r.live = false
	p.index.Remove(r.id)
	r.id = -1
	delete(p.byAddr, key(r.ep.Address))
}

// Synced reports whether the endpoint set has been replaced at least once.
func (p *Picker) Synced() bool { return p.synced.Load() }

// Pick hashes req.Prompt outside any lock, then in one critical section
// scores the candidates, chooses, reserves the cost in the ledger and records
// the prompt's blocks on the chosen endpoint. The caller must Release the
// reservation when the request ends.
func (p *Picker) Pick(req Request) (*Reservation, error) {
	start := time.Now()
	buf := p.hashBufs.Get().(*[]uint64)
	hashes := prefix.Hash((*buf)[:0], req.Model, req.Prompt, p.cfg.BlockSizeChars)
	*buf = hashes
	r := &Reservation{
		p:            p,
		pickedAt:     p.opts.Now(),
		promptTokens: p.tokens(len(req.Prompt)),
	}
	if len(hashes) > 0 {
		// Set before the lock: once linked, the sweeper may release r.
		r.hashes, r.hashBuf = hashes, buf
	} else {
		p.hashBufs.Put(buf)
	}

	p.mu.Lock()
	err := p.placeLocked(r, req)
	p.mu.Unlock()
	if p.afterPick != nil {
		p.afterPick()
	}

	m := p.metrics
	m.pickDuration.Observe(time.Since(start).Seconds())
	switch {
	case err == nil:
		m.picksOK.Inc()
		m.promptTokens.Add(float64(r.promptTokens))
		m.cachedTokens.Add(float64(r.cachedTokens))
		return r, nil
	case errors.Is(err, ErrSaturated):
		m.picksSaturated.Inc()
	default:
		m.picksNoEndpoint.Inc()
	}
	if r.hashBuf != nil {
		p.hashBufs.Put(r.hashBuf)
	}
	return nil, err
}

// Stats returns the ledger row of every current endpoint, sorted by address.
func (p *Picker) Stats() []EndpointStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]EndpointStats, len(p.rows))
	for i, r := range p.rows {
		out[i] = EndpointStats{Endpoint: r.ep, InFlight: r.inFlight, PrefillTokens: r.prefill, Decoding: r.decoding}
	}
	return out
}

// Totals sums the ledger over the current endpoints.
func (p *Picker) Totals() (inFlight, prefillTokens int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range p.rows {
		inFlight += r.inFlight
		prefillTokens += r.prefill
	}
	return inFlight, prefillTokens
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
			if n := p.Sweep(); n > 0 {
				p.opts.Log.Info("released reservations that outlived the maximum request lifetime; their streams never ended",
					"released", n, "maxRequestLifetime", p.opts.MaxRequestLifetime)
			}
		}
	}
}

// Sweep releases every reservation picked more than MaxRequestLifetime ago
// and returns how many it released. It is the backstop for a stream whose end
// was never seen; a later Release of a swept reservation does nothing.
func (p *Picker) Sweep() int {
	cutoff := p.opts.Now().Add(-p.opts.MaxRequestLifetime)
	n := 0
	p.mu.Lock()
	// The list is in lock order, and pick times are read just before the
	// lock, so a reservation may sit behind one a few microseconds younger:
	// it is then swept on the next run.
	for r := p.oldest; r != nil && r.pickedAt.Before(cutoff); r = p.oldest {
		p.releaseLocked(r)
		p.swept++
		n++
	}
	p.mu.Unlock()
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
