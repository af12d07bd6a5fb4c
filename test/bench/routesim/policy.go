package routesim

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"time"

	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/test/modelsim/engine"
)

// The routing policies.
const (
	// RoundRobin sends each request to the next engine in turn.
	RoundRobin = "round-robin"
	// LeastRequest sends each request to the engine with the fewest running
	// and waiting requests at the last metrics scrape (every 50 ms).
	LeastRequest = "least-request"
	// UpstreamLike scores engines as the upstream picker's default
	// configuration does, on scraped metrics: queue 2 + KV usage 2 +
	// prefix 3, the prefix index written after the pick (upstream.go).
	UpstreamLike = "upstream-like"
	// Tally is the real picker package: pick, reserve, first byte,
	// delivered usage, release, and each engine's scrape every 250 ms.
	Tally = "tally"
)

// Policies returns the policies in report order.
func Policies() []string { return []string{RoundRobin, LeastRequest, UpstreamLike, Tally} }

// policy is how the simulation drives a router. Calls come in virtual-time
// order from one goroutine.
type policy interface {
	// pick returns the engine for request i.
	pick(i int, j *job) (int, error)
	// firstByte: request i's first response bytes reached the client
	// (for a non-streaming client, when generation ended).
	firstByte(i int)
	// done: request i ended; its engine reported cachedTokens of its
	// promptTokens found in the cache.
	done(i, promptTokens, cachedTokens int)
	// observeEvery is how often the policy reads the engines' stats; 0
	// for never.
	observeEvery() time.Duration
	observe(stats []engine.Stats)
}

// countObserver is a policy that needs only each engine's running and
// waiting requests, summed: the simulation then observes for it without
// reading every engine's full stats.
type countObserver interface {
	observeCounts(requests []int)
}

func newPolicy(name string, cfg Config, now *time.Duration, texts *idText) (policy, error) {
	// Every policy's tie-breaking is seeded from the run's seed.
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x706f6c696379)) // "policy"
	switch name {
	case RoundRobin:
		return &roundRobin{n: cfg.Engines}, nil
	case LeastRequest:
		return &leastRequest{load: make([]int, cfg.Engines), rng: rng}, nil
	case UpstreamLike:
		return newUpstreamLike(cfg.Engines, rng, now), nil
	case Tally:
		return newTally(cfg, now, rng, texts), nil
	}
	return nil, fmt.Errorf("policy %q is unknown: accepted are %v", name, Policies())
}

type roundRobin struct{ n, next int }

func (p *roundRobin) pick(int, *job) (int, error) {
	e := p.next % p.n
	p.next++
	return e, nil
}
func (p *roundRobin) firstByte(int)               {}
func (p *roundRobin) done(int, int, int)          {}
func (p *roundRobin) observeEvery() time.Duration { return 0 }
func (p *roundRobin) observe([]engine.Stats)      {}

// leastRequest knows only what the last scrape said: between scrapes every
// pick sees the same counts, as a picker that learns load from metrics does.
type leastRequest struct {
	load []int
	rng  *rand.Rand
}

func (p *leastRequest) pick(int, *job) (int, error) {
	best, ties := 0, 0
	for i, l := range p.load {
		switch {
		case ties == 0 || l < p.load[best]:
			best, ties = i, 1
		case l == p.load[best]:
			ties++
			if p.rng.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best, nil
}
func (p *leastRequest) firstByte(int)               {}
func (p *leastRequest) done(int, int, int)          {}
func (p *leastRequest) observeEvery() time.Duration { return scrapeInterval }
func (p *leastRequest) observe(stats []engine.Stats) {
	for i, s := range stats {
		p.load[i] = s.RunningRequests + s.WaitingRequests
	}
}
func (p *leastRequest) observeCounts(requests []int) { copy(p.load, requests) }

// tally drives the real picker on the simulation's clock.
type tally struct {
	p           *picker.Picker
	addrs       []netip.AddrPort
	byAddr      map[netip.AddrPort]int
	res         map[int]*picker.Reservation
	texts       *idText
	prompt      []byte
	cacheTokens int
}

// tallyModel is the model name of every request; it seeds the picker's
// prefix hashes and nothing else.
const tallyModel = "routesim"

func newTally(cfg Config, now *time.Duration, rng *rand.Rand, texts *idText) *tally {
	// The picker's clock is the simulation's: virtual time from a fixed
	// origin, so that its drain model and rate learning run as they would
	// in real time.
	origin := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	p := picker.New(cfg.Picker, picker.Options{
		Now:  func() time.Time { return origin.Add(*now) },
		Rand: rng,
	})
	t := &tally{
		p:           p,
		byAddr:      make(map[netip.AddrPort]int, cfg.Engines),
		res:         make(map[int]*picker.Reservation),
		texts:       texts,
		cacheTokens: cfg.KVBlocks * engineBlockTokens,
	}
	eps := make([]picker.Endpoint, cfg.Engines)
	for i := range eps {
		a := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}), 8000)
		t.addrs = append(t.addrs, a)
		t.byAddr[a] = i
		eps[i] = picker.Endpoint{Pod: fmt.Sprintf("engine-%d", i), Engine: "vllm", Address: a}
	}
	p.Replace(eps)
	return t
}

func (t *tally) pick(i int, j *job) (int, error) {
	t.prompt = t.texts.appendPrompt(t.prompt[:0], j.Request)
	r, err := t.p.Pick(picker.Request{Model: tallyModel, Prompt: t.prompt, Stream: j.stream})
	if err != nil {
		return 0, err
	}
	t.res[i] = r
	e, ok := t.byAddr[r.Endpoints()[0]]
	if !ok {
		return 0, fmt.Errorf("picker chose %v, not an engine", r.Endpoints()[0])
	}
	return e, nil
}

func (t *tally) firstByte(i int) {
	if r := t.res[i]; r != nil {
		r.FirstByte()
	}
}

// done reports the engine's usage before the release, as the ext_proc
// server does with a response's cached-token count.
func (t *tally) done(i, promptTokens, cachedTokens int) {
	if r := t.res[i]; r != nil {
		r.Delivered(promptTokens, cachedTokens)
		r.Release()
		delete(t.res, i)
	}
}

func (t *tally) observeEvery() time.Duration { return observeInterval }

// observe gives the picker what a vLLM scrape carries: running and waiting
// requests and the cache size (vllm:cache_config_info); vLLM publishes no
// queued prompt tokens.
func (t *tally) observe(stats []engine.Stats) {
	for i, s := range stats {
		t.p.ObserveEngine(t.addrs[i], picker.EngineStats{
			Running:     s.RunningRequests,
			Waiting:     s.WaitingRequests,
			CacheTokens: t.cacheTokens,
		})
	}
}
