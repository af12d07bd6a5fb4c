package picker

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/utils/clock"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker/prefix"
)

const model = "test-model"

// testConfig is the default configuration with blocks of 64 characters, so
// that the tests' prompts are many blocks long.
func testConfig() v1alpha1.PickerConfig {
	cfg := v1alpha1.Default()
	cfg.BlockSizeChars = 64
	cfg.LRUCapacityBlocks = 100_000
	cfg.MaxPromptBlocks = 2048
	return cfg
}

// addr is the address of test endpoint i.
func addr(i int) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, byte(2 + i)}), 8000)
}

// endpoints returns n test endpoints on loopback addresses.
func endpoints(n int) []Endpoint {
	out := make([]Endpoint, n)
	for i := range out {
		out[i] = Endpoint{Pod: fmt.Sprintf("pod-%d", i), Address: addr(i)}
	}
	return out
}

// text returns n characters of text unique to tag (letters, deterministic).
func text(tag string, n int) []byte {
	h := fnv.New64a()
	h.Write([]byte(tag))
	var seed [32]byte
	for i := range 4 {
		v := h.Sum64() + uint64(i)*0x9e3779b97f4a7c15
		for j := range 8 {
			seed[i*8+j] = byte(v >> (8 * j))
		}
	}
	b := make([]byte, n)
	_, _ = rand.NewChaCha8(seed).Read(b)
	for i := range b {
		b[i] = 'a' + b[i]%26
	}
	return b
}

func join(parts ...[]byte) []byte {
	var out []byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// newPicker returns a picker over n endpoints with a fixed tie-breaking seed.
func newPicker(t testing.TB, n int, cfg v1alpha1.PickerConfig, opts Options) *Picker {
	t.Helper()
	if opts.Rand == nil {
		opts.Rand = rand.New(rand.NewPCG(1, 2))
	}
	if opts.Clock == nil {
		// A clock that stands still unless a test moves it: the drain model
		// then releases no prefill behind a test's back.
		opts.Clock = newFakeClock()
	}
	p := New(cfg, opts)
	p.Replace(endpoints(n))
	return p
}

func mustPick(t testing.TB, p *Picker, req Request) *Reservation {
	t.Helper()
	r, err := p.pick(req)
	if err != nil {
		t.Fatalf("Pick: %v", err)
	}
	return r
}

// on restricts a request to one endpoint through the subset hint.
func on(a netip.AddrPort, prompt []byte) Request {
	return Request{Model: model, Prompt: prompt, Subset: []netip.AddrPort{a}, HasSubset: true}
}

// heldBlocks reports how many leading blocks of prompt the prefix index
// places on a (-1 if a is not an endpoint).
func heldBlocks(p *Picker, prompt []byte, a netip.AddrPort) int {
	h := prefix.HashSalted(nil, model, "", prompt, p.cfg.BlockSizeChars)
	p.mu.Lock()
	defer p.mu.Unlock()
	r, ok := p.l.byAddr[key(a)]
	if !ok {
		return -1
	}
	out := []int{0}
	p.l.index.Match(h, []int{r.id}, out)
	return out[0]
}

// pickPausing is Pick with pause run right after its critical section
// unlocks, before the rest of the pick (a long prompt's tail, the evictions
// owed, the metrics).
func pickPausing(p *Picker, req Request, pause func()) (*Reservation, error) {
	r := p.prepare(req)
	p.mu.Lock()
	err := p.l.place(r, req)
	untidy := p.l.index.Untidy()
	p.mu.Unlock()
	pause()
	return p.placed(r, err, untidy, time.Now())
}

// statsOf returns the ledger row of a (zero if a is not an endpoint).
func statsOf(p *Picker, a netip.AddrPort) EndpointStats {
	for _, s := range p.Snapshot().Endpoints {
		if s.Endpoint.Address == a {
			return s
		}
	}
	return EndpointStats{}
}

// assertLedgerEmpty checks every row and the totals are exactly zero.
func assertLedgerEmpty(t *testing.T, p *Picker) {
	t.Helper()
	if l := p.Snapshot(); l.InFlight != 0 || l.PrefillTokens != 0 {
		t.Errorf("totals = (%d in flight, %d prefill tokens), want (0, 0)", l.InFlight, l.PrefillTokens)
	}
	for _, s := range p.Snapshot().Endpoints {
		if s.InFlight != 0 || s.PrefillTokens != 0 || s.Decoding != 0 {
			t.Errorf("%s: %+v, want all zero", s.Endpoint.Address, s)
		}
	}
}

// fakeClock is a clock tests move by hand; safe for concurrent use.
type fakeClock struct {
	ns     atomic.Int64
	mu     sync.Mutex
	timers []*fakeTimer
}

func newFakeClock() *fakeClock {
	c := &fakeClock{}
	c.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}

func (c *fakeClock) Now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *fakeClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// AfterFunc makes a timer that never fires: tests run the dispatch cycle
// it would run by hand (dispatchNow), and read when it is due (nextTimer).
func (c *fakeClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	t := &fakeTimer{c: c}
	t.Reset(d)
	c.mu.Lock()
	c.timers = append(c.timers, t)
	c.mu.Unlock()
	return t
}

// nextTimer is when the earliest armed timer is due.
func (c *fakeClock) nextTimer() (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var at time.Time
	ok := false
	for _, t := range c.timers {
		if due, armed := t.due(); armed && (!ok || due.Before(at)) {
			at, ok = due, true
		}
	}
	return at, ok
}

type fakeTimer struct {
	c     *fakeClock
	mu    sync.Mutex
	at    time.Time
	armed bool
}

func (t *fakeTimer) C() <-chan time.Time { return nil }

func (t *fakeTimer) Stop() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	was := t.armed
	t.armed = false
	return was
}

func (t *fakeTimer) Reset(d time.Duration) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	was := t.armed
	t.at, t.armed = t.c.Now().Add(d), true
	return was
}

func (t *fakeTimer) due() (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.at, t.armed
}

// dispatchNow runs a dispatch cycle now, as the dispatch timer does, and
// returns how many requests it placed.
func (p *Picker) dispatchNow() int {
	now := p.now()
	p.mu.Lock()
	defer p.mu.Unlock()
	n := p.l.dispatch(now)
	p.rearm(now)
	return n
}

// endpointOf is the endpoint now holding r: the chosen one, or the one
// named by ServedBy.
func endpointOf(r *Reservation) netip.AddrPort {
	return r.row.ep.Address
}

// promptTokens is r's estimated prompt tokens.
func promptTokens(r *Reservation) int { return r.promptTokens }

// cachedTokens is the prompt tokens the endpoint holding r held in its
// prefix index when it took r.
func cachedTokens(r *Reservation) int {
	return r.cachedTokens
}

// ObserveEngine records a successful scrape of the endpoint at addr, a
// round of its own; it reports whether the endpoint became healthy again.
func (p *Picker) ObserveEngine(addr netip.AddrPort, s EngineStats) (recovered bool) {
	r, _ := p.ObserveScrapes([]Scrape{{Address: addr, Stats: s}})
	return len(r) > 0
}

// ObserveScrapeFailure records a failed scrape of the endpoint at addr, a
// round of its own; it reports whether the endpoint just turned unhealthy.
func (p *Picker) ObserveScrapeFailure(addr netip.AddrPort) (failed bool) {
	_, f := p.ObserveScrapes([]Scrape{{Address: addr, Failed: true}})
	return len(f) > 0
}
