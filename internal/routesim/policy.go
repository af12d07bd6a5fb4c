package routesim

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strconv"
	"time"

	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/picker"
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
	// With flow control on in Config.Picker it is TallyFlow.
	Tally = "tally"
	// TallyFlow is Tally with flow control on (Config.Picker's
	// flowControl, enabled): a request that finds every engine saturated
	// waits in the picker's queue, sent to no engine, until a dispatch
	// cycle places it, or is refused (HTTP 429).
	TallyFlow = "tally-flow"
	// ExactGreedy is no router that can exist: at each arrival it sees
	// every engine's cache and queued prefill exactly, and sends the
	// request where its uncached prompt tokens plus the prefill queued
	// ahead of it are fewest: the request's own TTFT, without error, when
	// the engines serve no adapters (it counts no adapter load nor wait
	// for a slot; ForecastGreedy does). It shows what knowing the caches
	// gains the request placed (the bound assumes one unbounded cache,
	// which no placement over several engines has); greedy for each
	// request, it does not weigh what its uncached tokens cost the
	// requests after it.
	ExactGreedy = "exact-greedy"
	// ForecastGreedy is no router that can exist either: at each arrival
	// it copies every engine, adds the request to the copy and runs it
	// until the request's first token, and sends the request where that
	// comes soonest. So it knows each request's own TTFT exactly, adapter
	// loads, waits for an adapter slot and the engine's own scheduling
	// included, but not the requests still to come, nor what its choice
	// costs them.
	ForecastGreedy = "forecast-greedy"
	// LLMDLike is a model of llm-d's prefill/decode disaggregation
	// (llmd.go): upstream-like's scorer over the decode-capable engines,
	// plus llm-d's active-request counts; its prefix-based-pd-decider
	// splits a request whose prompt the chosen engine lacks at least
	// Picker.Disaggregation.NonCachedTokens of, by the scorer's own
	// prefix index; the same scorer then picks its prefill engine.
	LLMDLike = "llm-d-like"
)

// Policies returns the policies a suite runs unless told otherwise, in
// report order.
func Policies() []string { return []string{RoundRobin, LeastRequest, UpstreamLike, Tally} }

// KnownPolicies returns every policy, in report order: Policies,
// TallyFlow, ExactGreedy, ForecastGreedy and LLMDLike.
func KnownPolicies() []string {
	return append(Policies(), TallyFlow, ExactGreedy, ForecastGreedy, LLMDLike)
}

// RoleAware reports whether a policy knows the engines' roles (and may
// split requests): the only ones that run on a pool where an engine does
// not decode (Config.Roles).
func RoleAware(policy string) bool {
	return policy == Tally || policy == TallyFlow || policy == LLMDLike
}

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

// splitter is a policy that may split a request (prefill/decode
// disaggregation): it names the engine that prefills a request it has
// just placed.
type splitter interface {
	// prefiller is the engine that runs the prefill leg of request i,
	// placed by the last pick or admission that returned it; -1 when
	// it runs whole on its destination.
	prefiller(i int) (int, error)
}

// queueing is a policy that may hold a request instead of placing it at
// once (flow control). The simulation sends a held request to no engine
// until dispatched hands it back placed, at the instant it was placed.
type queueing interface {
	// admit places request i at once, holds it, or refuses it.
	admit(i int, j *job) (admission, error)
	// dispatched appends the held requests that left the queue (placed,
	// or refused there) since the last call, in arrival order. An error
	// is a request that left it in a way no client is answered 429.
	dispatched(dst []admission) ([]admission, error)
	// nextDispatch is when the next dispatch cycle is due that no event
	// the simulation delivers will run (the drain model frees capacity,
	// a wait ends); false when nothing waits.
	nextDispatch() (time.Duration, bool)
	// dispatch runs that cycle now.
	dispatch()
}

// admission is what became of a request a queueing policy admitted: placed
// on engine, held, or refused (refused says why).
type admission struct {
	i       int
	engine  int
	held    bool
	refused string
}

// Why a queueing policy refused a request (an HTTP 429 in the ext_proc
// server); Outcome.Refused.
const (
	// RefusedShed: every engine was saturated and it was sheddable
	// (priority below 0).
	RefusedShed = "shed"
	// RefusedQueueFull: its band, or the queue, was at its limit.
	RefusedQueueFull = "queue full"
	// RefusedTTL: it waited its whole time to live.
	RefusedTTL = "ttl"
)

// rateLearner is a policy that learns the engines' prefill rates.
type rateLearner interface {
	learnedRates() RateRange
}

// RateRange is the lowest and highest of the prefill rates (tokens per
// second) a policy had learned at its scrapes; zero when it learned none.
type RateRange struct{ Min, Max float64 }

func (r *RateRange) add(rate float64) {
	if r.Max == 0 {
		r.Min, r.Max = rate, rate
		return
	}
	r.Min, r.Max = min(r.Min, rate), max(r.Max, rate)
}

// countObserver is a policy that needs only each engine's running and
// waiting requests, summed: the simulation then observes for it without
// reading every engine's full stats.
type countObserver interface {
	observeCounts(requests []int)
}

// newPolicy makes the named policy for a run on engines (read only by
// ExactGreedy and ForecastGreedy).
func newPolicy(name string, cfg Config, now *time.Duration, texts *idText, engines []*engine.Engine) (policy, error) {
	// Every policy's tie-breaking is seeded from the run's seed.
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x706f6c696379)) // "policy"
	if cfg.disaggregated() && !RoleAware(name) {
		return nil, fmt.Errorf("policy %q does not know the engines' roles %q: with an engine that does not decode, run one of %s, %s, %s", name, cfg.Roles, Tally, TallyFlow, LLMDLike)
	}
	switch name {
	case RoundRobin:
		return &roundRobin{n: cfg.Engines}, nil
	case LeastRequest:
		return &leastRequest{load: make([]int, cfg.Engines), rng: rng}, nil
	case UpstreamLike:
		return newUpstreamLike(cfg.Engines, rng, now, cfg), nil
	case Tally, TallyFlow:
		if name == TallyFlow {
			cfg.Picker.FlowControl.Enabled = true
		}
		t := newTally(cfg, now, rng, texts)
		if cfg.Picker.FlowControl.Enabled {
			return &tallyFlow{tally: t}, nil
		}
		return t, nil
	case ExactGreedy:
		return &exactGreedy{engines: engines, now: now, rng: rng}, nil
	case ForecastGreedy:
		return &forecastGreedy{exactGreedy{engines: engines, now: now, rng: rng}}, nil
	case LLMDLike:
		return newLLMDLike(cfg, rng, now), nil
	}
	return nil, fmt.Errorf("policy %q is unknown: accepted are %v", name, KnownPolicies())
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

func (p *leastRequest) pick(int, *job) (int, error) { return cheapest(p.load, p.rng), nil }

// cheapest returns the index of the least of costs, choosing uniformly at
// random among ties.
func cheapest(costs []int, rng *rand.Rand) int {
	best, ties := 0, 0
	for i, c := range costs {
		switch {
		case ties == 0 || c < costs[best]:
			best, ties = i, 1
		case c == costs[best]:
			ties++
			if rng.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
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

// exactGreedy reads the engines themselves at each arrival (ExactGreedy).
type exactGreedy struct {
	engines []*engine.Engine
	now     *time.Duration
	rng     *rand.Rand
	costs   []int // scratch
}

func (p *exactGreedy) pick(i int, j *job) (int, error) {
	return p.cheapestBy(func(e *engine.Engine) (int, error) {
		return j.InputTokens - e.CachedPrefixTokens(j.engineHashes, j.InputTokens) + e.Stats().QueuedPrefillTokens, nil
	})
}

// cheapestBy brings every engine to now and returns the one of least cost
// (ties broken by the run's seed).
func (p *exactGreedy) cheapestBy(cost func(e *engine.Engine) (int, error)) (int, error) {
	p.costs = p.costs[:0]
	for k, e := range p.engines {
		if evs := e.AdvanceTo(*p.now); len(evs) > 0 {
			return 0, fmt.Errorf("engine %d had %d events unhandled at %v", k, len(evs), *p.now)
		}
		c, err := cost(e)
		if err != nil {
			return 0, fmt.Errorf("engine %d: %w", k, err)
		}
		p.costs = append(p.costs, c)
	}
	return cheapest(p.costs, p.rng), nil
}
func (p *exactGreedy) firstByte(int)               {}
func (p *exactGreedy) done(int, int, int)          {}
func (p *exactGreedy) observeEvery() time.Duration { return 0 }
func (p *exactGreedy) observe([]engine.Stats)      {}

// forecastGreedy runs a copy of each engine at each arrival (ForecastGreedy).
type forecastGreedy struct{ exactGreedy }

func (p *forecastGreedy) pick(i int, j *job) (int, error) {
	return p.cheapestBy(func(e *engine.Engine) (int, error) {
		ttft, err := firstTokenOn(e.Clone(), i, j)
		if err != nil {
			return 0, fmt.Errorf("forecasting request %d: %w", i, err)
		}
		return int(ttft), nil
	})
}

// firstTokenOn adds request i to e and runs e until its first token, which
// it returns as a time from e's clock at the start.
func firstTokenOn(e *engine.Engine, i int, j *job) (time.Duration, error) {
	start, id := e.Now(), strconv.Itoa(i)
	if err := e.Add(engine.Request{ID: id, PromptTokens: j.InputTokens, OutputTokens: j.OutputTokens, BlockHashes: j.engineHashes, Adapter: j.Adapter}); err != nil {
		return 0, err
	}
	for e.Busy() {
		_, evs := e.Step()
		for _, ev := range evs {
			if ev.Kind == engine.FirstToken && ev.ID == id {
				return ev.At - start, nil
			}
		}
	}
	return 0, errors.New("the engine went idle before the request's first token")
}

// tally drives the real picker on the simulation's clock.
type tally struct {
	p     *picker.Picker
	clock *virtualClock // the picker's
	// rates is the range of the prefill rates the picker held at its
	// scrapes, its starting value (prefillTokensPerSecond) included.
	rates       RateRange
	addrs       []netip.AddrPort
	byAddr      map[netip.AddrPort]int
	res         map[int]*picker.Reservation
	texts       *idText
	prompt      []byte
	cacheTokens int
	// lora is every engine's lora_requests_info for the next observe, and
	// maxLoRAs their max_lora; nil without adapters.
	lora     []loraInfo
	maxLoRAs int
}

// tallyModel is the base model's name: the model of every request that is
// for no adapter, and the one the engines' scrapes name. A request for an
// adapter carries the adapter's name instead, as vLLM serves adapters; the
// model seeds the picker's prefix hashes.
const tallyModel = "routesim"

// model is the model name request j carries.
func (j *job) model() string {
	if j.Adapter != "" {
		return j.Adapter
	}
	return tallyModel
}

func newTally(cfg Config, now *time.Duration, rng *rand.Rand, texts *idText) *tally {
	// The picker's clock is the simulation's: virtual time from a fixed
	// origin, so that its drain model and rate learning run as they would
	// in real time.
	clock := &virtualClock{origin: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), now: now}
	p := picker.New(cfg.Picker, picker.Options{Clock: clock, Rand: rng})
	t := &tally{
		p:           p,
		clock:       clock,
		byAddr:      make(map[netip.AddrPort]int, cfg.Engines),
		res:         make(map[int]*picker.Reservation),
		texts:       texts,
		cacheTokens: cfg.KVBlocks * engineBlockTokens,
	}
	if cfg.lora() {
		t.lora, t.maxLoRAs = make([]loraInfo, cfg.Engines), cfg.MaxLoRAs
	}
	eps := make([]picker.Endpoint, cfg.Engines)
	for i := range eps {
		a := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}), 8000)
		t.addrs = append(t.addrs, a)
		t.byAddr[a] = i
		eps[i] = picker.Endpoint{Pod: fmt.Sprintf("engine-%d", i), Engine: "vllm", Role: cfg.role(i), Address: a}
	}
	p.Replace(eps)
	return t
}

func (t *tally) pick(i int, j *job) (int, error) {
	t.prompt = t.texts.appendPrompt(t.prompt[:0], j.Request)
	// Without flow control, Admit never waits.
	r, err := t.p.Admit(context.Background(), picker.Request{Model: j.model(), Prompt: t.prompt, Stream: j.stream})
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

// prefiller reads the prefill pod of request i's reservation, as the
// ext_proc server writes it into x-prefiller-host-port.
func (t *tally) prefiller(i int) (int, error) {
	r := t.res[i]
	if r == nil {
		return -1, nil
	}
	a, ok := r.Prefiller()
	if !ok {
		return -1, nil
	}
	e, ok := t.byAddr[a]
	if !ok {
		return 0, fmt.Errorf("picker chose prefiller %v, not an engine", a)
	}
	return e, nil
}

func (t *tally) firstByte(i int) {
	if r := t.res[i]; r != nil {
		t.p.FirstByte(r)
	}
}

// done reports the engine's usage before the release, as the ext_proc
// server does with a response's cached-token count.
func (t *tally) done(i, promptTokens, cachedTokens int) {
	if r := t.res[i]; r != nil {
		t.p.End(r, picker.Outcome{PromptTokens: promptTokens, CachedTokens: cachedTokens})
		delete(t.res, i)
	}
}

func (t *tally) observeEvery() time.Duration { return observeInterval }

func (t *tally) observeLoRA(engines []loraInfo) { copy(t.lora, engines) }

// observe gives the picker what a vLLM scrape carries: running and waiting
// requests and the cache size (vllm:cache_config_info); with adapters, the
// base model (the model_name label) and lora_requests_info. vLLM publishes
// no queued prompt tokens. The round reaches the picker at once, as the
// scraper hands it over.
func (t *tally) observe(stats []engine.Stats) {
	round := make([]picker.Scrape, 0, len(stats))
	for i, s := range stats {
		es := picker.EngineStats{
			Running:     s.RunningRequests,
			Waiting:     s.WaitingRequests,
			CacheTokens: t.cacheTokens,
		}
		if t.lora != nil {
			es.Model, es.HasLoRA, es.MaxLoRAs = tallyModel, true, t.maxLoRAs
			es.RunningAdapters, es.WaitingAdapters = t.lora[i].running, t.lora[i].waiting
		}
		round = append(round, picker.Scrape{Address: t.addrs[i], Stats: es})
	}
	t.p.ObserveScrapes(round)
	for _, st := range t.p.Snapshot().Endpoints {
		t.rates.add(st.PrefillTokensPerSecond)
	}
}

// learnedRates is the range of the prefill rates the picker learned.
func (t *tally) learnedRates() RateRange { return t.rates }

// tallyFlow is tally with flow control: the picker's non-blocking Enqueue,
// and its dispatch cycles in virtual time. A cycle runs inside every call
// that may free capacity (first byte, release, scrape), when a request
// arrives, and when the picker's dispatch timer fires; a held request reaches its
// engine (the reservation's first endpoint) only once its ticket says it
// was placed.
type tallyFlow struct {
	*tally
	// waiting are the held requests, in arrival order.
	waiting []waiter
}

type waiter struct {
	i int
	t *picker.Ticket
}

func (t *tallyFlow) admit(i int, j *job) (admission, error) {
	t.prompt = t.texts.appendPrompt(t.prompt[:0], j.Request)
	req := picker.Request{Model: j.model(), Prompt: t.prompt, Stream: j.stream, Priority: j.priority}
	if j.flow >= 0 {
		req.FairnessID = FlowID(j.flow)
	}
	r, ticket, err := t.p.Enqueue(req)
	switch {
	case err != nil:
		why, ok := refusal(err)
		if !ok {
			return admission{}, err
		}
		return admission{i: i, refused: why}, nil
	case ticket != nil:
		t.waiting = append(t.waiting, waiter{i: i, t: ticket})
		return admission{i: i, held: true}, nil
	}
	return t.placed(i, r)
}

// placed records request i's reservation and names its engine.
func (t *tallyFlow) placed(i int, r *picker.Reservation) (admission, error) {
	t.res[i] = r
	e, ok := t.byAddr[r.Endpoints()[0]]
	if !ok {
		return admission{}, fmt.Errorf("picker chose %v, not an engine", r.Endpoints()[0])
	}
	return admission{i: i, engine: e}, nil
}

// refusal names the reason of an error the ext_proc server answers 429;
// false for any other.
func refusal(err error) (string, bool) {
	switch {
	case errors.Is(err, picker.ErrShed):
		return RefusedShed, true
	case errors.Is(err, picker.ErrQueueFull):
		return RefusedQueueFull, true
	case errors.Is(err, picker.ErrQueueTimeout):
		return RefusedTTL, true
	}
	return "", false
}

func (t *tallyFlow) dispatched(dst []admission) ([]admission, error) {
	n := 0
	var errs []error
	for _, w := range t.waiting {
		r, done, err := w.t.Result()
		switch {
		case !done:
			t.waiting[n] = w
			n++
		case err != nil:
			why, ok := refusal(err)
			if !ok {
				errs = append(errs, fmt.Errorf("request %d left the picker's queue: %w", w.i, err))
				continue
			}
			dst = append(dst, admission{i: w.i, refused: why})
		default:
			a, err := t.placed(w.i, r)
			if err != nil {
				errs = append(errs, fmt.Errorf("request %d: %w", w.i, err))
				continue
			}
			dst = append(dst, a)
		}
	}
	clear(t.waiting[n:])
	t.waiting = t.waiting[:n]
	return dst, errors.Join(errs...)
}

// nextDispatch is when the picker's dispatch timer fires.
func (t *tallyFlow) nextDispatch() (time.Duration, bool) { return t.clock.next() }

func (t *tallyFlow) dispatch() { t.clock.fire() }
