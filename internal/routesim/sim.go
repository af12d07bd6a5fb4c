package routesim

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/picker"
)

// Config is one simulated pool and how the trace is replayed against it.
type Config struct {
	// Engines is the number of model servers.
	Engines int
	// KVBlocks is each engine's KV cache, in blocks of 16 tokens.
	KVBlocks int
	// LoadFactor scales the arrival rate: arrivals come LoadFactor times
	// as fast as the trace's timestamps say.
	LoadFactor float64
	// NonStreaming is the fraction of requests whose client does not
	// stream: the picker sees their first response bytes only when
	// generation ends.
	NonStreaming float64
	// Bypass is the fraction of requests sent straight to the engines in
	// rotation, not through the policy (another gateway, a batch job): a
	// policy sees them only in the engines' metrics.
	Bypass float64
	// Seed makes the run reproducible: it draws which requests stream and
	// which bypass, and seeds every policy's tie-breaking.
	Seed uint64
	// Picker configures the Tally policy's picker; zero fields take the
	// defaults, as in production.
	Picker v1alpha1.PickerConfig
	// SampleEvery, when positive, records every engine's requests
	// (running and waiting) at that interval of virtual time.
	SampleEvery time.Duration
	// Priorities gives each share's Fraction of the requests its Priority
	// (the InferenceObjective priority a request carries to the picker:
	// flow control's bands, below 0 sheddable); the rest have priority 0.
	Priorities []PriorityShare
	// FlowWeights, when set, spreads the requests over the fairness ids
	// FlowID(0), FlowID(1)... in proportion to the weights (flow control
	// serves the flows of a band in turn).
	FlowWeights []float64
	// Adapters, when positive, is how many LoRA adapters every engine
	// serves besides the base model (AdapterName(0), AdapterName(1)...):
	// each request of the trace that names none (Request.Adapter) is for
	// one of them, AdapterName(k) drawn with weight 1/(k+1)^AdapterZipf,
	// except a BaseFraction of them, which stay on the base model. The
	// engines then run at most MaxLoRAs adapters at once (1 or more) and
	// loading one costs LoRALoadTime (engine.Config's fields); the
	// policies that read metrics see them in vLLM's lora_requests_info.
	Adapters     int
	AdapterZipf  float64
	BaseFraction float64
	MaxLoRAs     int
	LoRALoadTime time.Duration
	// Roles, when set, gives each engine (one each) its part in
	// prefill/decode disaggregation, as the pod label llm-d.ai/role does:
	// picker.RolePrefill, RoleDecode, RolePrefillDecode, or "" (it
	// decodes, and prefills only its own requests). A policy that splits
	// a request (Tally with Picker.Disaggregation on, LLMDLike) runs its
	// prefill leg on a prefill-capable engine and then, when that leg
	// ends, its decode leg on its destination (sim.go, startLeg). Only
	// those policies run on a pool with an engine that does not decode.
	Roles []string
}

// role is engine e's role ("" without roles).
func (c Config) role(e int) string {
	if e < len(c.Roles) {
		return c.Roles[e]
	}
	return ""
}

// decodes reports whether engine e may be a request's destination: the
// picker's rule (picker.Endpoint.Role).
func (c Config) decodes(e int) bool {
	r := c.role(e)
	return r == "" || r == picker.RoleDecode || r == picker.RolePrefillDecode
}

// prefills reports whether engine e may prefill a request another engine
// decodes.
func (c Config) prefills(e int) bool {
	r := c.role(e)
	return r == picker.RolePrefill || r == picker.RolePrefillDecode
}

// disaggregated reports whether some engine may not take a request whole:
// only role-aware policies may run then.
func (c Config) disaggregated() bool {
	for e := range c.Engines {
		if !c.decodes(e) {
			return true
		}
	}
	return false
}

// AdapterName names the k-th LoRA adapter of Config.Adapters: the model
// name its requests carry.
func AdapterName(k int) string { return "lora-" + strconv.Itoa(k) }

// lora reports whether the engines serve LoRA adapters.
func (c Config) lora() bool { return c.Adapters > 0 }

// PriorityShare gives Fraction of the requests priority Priority.
type PriorityShare struct {
	Priority int
	Fraction float64
}

// FlowID is the fairness id of the k-th of Config.FlowWeights.
func FlowID(k int) string { return "flow-" + strconv.Itoa(k) }

// Defaults of Config and of the policies' metric intervals.
const (
	// maxTextIDs bounds the hash_id texts a workload remembers (2 KiB
	// each, 128 MiB at most) for the runs that need prompt text; the
	// sample trace has 5,576 ids, the whole Mooncake trace 43,924.
	maxTextIDs     = 65536
	DefaultEngines = 4
	// scrapeInterval is how often the metric-driven policies see the
	// engines' gauges (the upstream picker's default refresh).
	scrapeInterval = 50 * time.Millisecond
	// observeInterval is how often Tally's picker is given each engine's
	// scrape (picker.ObserveScrapes), as the scraper does by default.
	observeInterval = 250 * time.Millisecond
)

// EngineConfig is the engine model of every simulated server: the
// package's latency defaults with the configured cache size.
func (c Config) EngineConfig() engine.Config {
	ec := engine.DefaultConfig()
	ec.KVBlocks = c.KVBlocks
	ec.BlockSizeTokens = engineBlockTokens
	if c.lora() {
		ec.MaxLoRAs, ec.LoRALoadTime = c.MaxLoRAs, c.LoRALoadTime
	}
	return ec
}

// Validate names the first field that is out of range and what it accepts.
func (c Config) Validate() error {
	switch {
	case c.Engines < 1:
		return fmt.Errorf("engines: %d is invalid: must be 1 or more", c.Engines)
	case c.KVBlocks < 1:
		return fmt.Errorf("kv blocks: %d is invalid: must be 1 or more", c.KVBlocks)
	case !(c.LoadFactor > 0) || math.IsInf(c.LoadFactor, 0):
		return fmt.Errorf("load factor: %v is invalid: must be a positive number", c.LoadFactor)
	case !(c.NonStreaming >= 0 && c.NonStreaming <= 1):
		return fmt.Errorf("non-streaming fraction: %v is invalid: must be from 0 to 1", c.NonStreaming)
	case !(c.Bypass >= 0 && c.Bypass <= 1):
		return fmt.Errorf("bypass fraction: %v is invalid: must be from 0 to 1", c.Bypass)
	case c.SampleEvery < 0:
		return fmt.Errorf("sample interval: %v is invalid: must be 0 or more", c.SampleEvery)
	case c.Adapters < 0:
		return fmt.Errorf("adapters: %d is invalid: must be 0 (none) or more", c.Adapters)
	case c.lora() && c.MaxLoRAs < 1:
		return fmt.Errorf("max loras: %d is invalid: must be 1 or more to serve %d adapters", c.MaxLoRAs, c.Adapters)
	case c.lora() && !(c.AdapterZipf >= 0 && c.AdapterZipf <= 10):
		return fmt.Errorf("adapter zipf exponent: %v is invalid: must be from 0 (every adapter alike) to 10", c.AdapterZipf)
	case c.lora() && !(c.BaseFraction >= 0 && c.BaseFraction <= 1):
		return fmt.Errorf("base-model fraction: %v is invalid: must be from 0 to 1", c.BaseFraction)
	case c.lora() && c.LoRALoadTime < 0:
		return fmt.Errorf("lora load time: %v is invalid: must be 0 or more", c.LoRALoadTime)
	}
	sum := 0.0
	for i, ps := range c.Priorities {
		if !(ps.Fraction >= 0 && ps.Fraction <= 1) {
			return fmt.Errorf("priorities: share %d of priority %d: %v is invalid: must be from 0 to 1", i, ps.Priority, ps.Fraction)
		}
		if slices.ContainsFunc(c.Priorities[:i], func(o PriorityShare) bool { return o.Priority == ps.Priority }) {
			return fmt.Errorf("priorities: priority %d is given twice: give each once", ps.Priority)
		}
		sum += ps.Fraction
	}
	if sum > 1+1e-9 {
		return fmt.Errorf("priorities: the fractions sum to %v: must be at most 1 (the rest have priority 0)", sum)
	}
	for i, wt := range c.FlowWeights {
		if !(wt > 0) || math.IsInf(wt, 0) {
			return fmt.Errorf("flow weights: weight %d: %v is invalid: must be a positive number", i, wt)
		}
	}
	if err := c.validateRoles(); err != nil {
		return err
	}
	pc := v1alpha1.WithDefaults(c.Picker)
	if err := pc.Validate(); err != nil {
		return fmt.Errorf("tally's picker config: %w", err)
	}
	return nil
}

// validateRoles checks Config.Roles: one known role per engine, and some
// engine that decodes.
func (c Config) validateRoles() error {
	if len(c.Roles) == 0 {
		return nil
	}
	if len(c.Roles) != c.Engines {
		return fmt.Errorf("roles: %d given for %d engines: give one per engine, or none", len(c.Roles), c.Engines)
	}
	known := []string{"", picker.RolePrefill, picker.RoleDecode, picker.RolePrefillDecode}
	decoders := 0
	for e, r := range c.Roles {
		if !slices.Contains(known, r) {
			return fmt.Errorf("roles: engine %d: %q is invalid: accepted are %q (unlabelled), %q, %q and %q", e, r, "", picker.RolePrefill, picker.RoleDecode, picker.RolePrefillDecode)
		}
		if c.decodes(e) {
			decoders++
		}
	}
	if decoders == 0 {
		return fmt.Errorf("roles: %q: no engine decodes: give one the role %q, %q or none", c.Roles, picker.RoleDecode, picker.RolePrefillDecode)
	}
	return nil
}

// job is one request as every run replays it: its arrival, who sends it,
// and its prompt's block hashes, computed once and shared (read-only) by
// every run.
type job struct {
	Request
	arrival time.Duration // scaled by the load factor
	stream  bool
	bypass  bool
	// engineHashes are the prompt's 64-character (16-token) blocks, as the
	// model server hashes them; upstreamHashes the upstream-like policy's
	// blocks (upstream.go).
	engineHashes   []uint64
	upstreamHashes []uint64
	bound          Bound
	// priority and flow (an index of Config.FlowWeights, -1 for none) are
	// what it carries to a policy with flow control.
	priority, flow int
}

// Workload is a trace prepared for replay: the requests, which of them
// stream and bypass, their block hashes and their no-queueing bounds.
type Workload struct {
	cfg  Config
	jobs []job
	// texts are the prompts' hash_id texts, read-only once prepared.
	texts *idText
	// BoundPrefillTokens and BoundCachedTokens sum, over the bound (an
	// unbounded cache that saw every earlier request), the prompt tokens
	// computed and found cached.
	BoundPrefillTokens, BoundCachedTokens int64
}

// Prepare checks cfg and the trace against each other and computes what
// every run shares. It fails, naming the flag at fault, when a request
// could never fit an engine's cache.
func Prepare(reqs []Request, cfg Config) (*Workload, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, errors.New("no requests to replay")
	}
	ec := cfg.EngineConfig()
	w := &Workload{cfg: cfg, jobs: make([]job, len(reqs))}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x726f75746573696d)) // "routesim"
	// Priorities and flows draw from a stream of their own, so that
	// setting them leaves every other draw (and the numbers of runs
	// without them) as it was.
	flowRng := rand.New(rand.NewPCG(cfg.Seed, 0x666c6f7773)) // "flows"
	var flowTotal float64
	for _, wt := range cfg.FlowWeights {
		flowTotal += wt
	}
	// Adapters too, for the same reason.
	loraRng := rand.New(rand.NewPCG(cfg.Seed, 0x6c6f7261)) // "lora"
	adapterCDF := zipfCDF(cfg.Adapters, cfg.AdapterZipf)
	seen := make(map[uint64]struct{})
	w.texts = newIDText(maxTextIDs)
	var text []byte
	for i, r := range reqs {
		need := (r.InputTokens + r.OutputTokens + ec.BlockSizeTokens - 1) / ec.BlockSizeTokens
		if need > ec.KVBlocks {
			return nil, fmt.Errorf("request %d needs %d KV blocks (%d prompt + %d output tokens); --kv-blocks %d is too small for it",
				i, need, r.InputTokens, r.OutputTokens, ec.KVBlocks)
		}
		if i > 0 && r.Arrival < reqs[i-1].Arrival {
			return nil, fmt.Errorf("request %d arrives before request %d: the trace must be in arrival order", i, i-1)
		}
		if r.Adapter != "" && !cfg.lora() {
			return nil, fmt.Errorf("request %d is for LoRA adapter %q; the engines serve none (--adapters 0)", i, r.Adapter)
		}
		// Both draws always happen, so that one fraction does not change
		// which requests the other picks.
		nonStream, bypass := rng.Float64(), rng.Float64()
		prioDraw, flowDraw := flowRng.Float64(), flowRng.Float64()
		if baseDraw, adapterDraw := loraRng.Float64(), loraRng.Float64(); r.Adapter == "" && cfg.lora() && baseDraw >= cfg.BaseFraction {
			r.Adapter = AdapterName(drawIndex(adapterCDF, adapterDraw))
		}
		text = w.texts.appendPrompt(text[:0], r)
		prompt := string(text)
		j := &w.jobs[i]
		*j = job{
			Request:        r,
			arrival:        time.Duration(float64(r.Arrival) / cfg.LoadFactor),
			stream:         nonStream >= cfg.NonStreaming,
			bypass:         bypass < cfg.Bypass,
			engineHashes:   engine.TextBlockHashes(prompt, chunkChars),
			upstreamHashes: engine.TextBlockHashes(prompt[:min(len(prompt), upstreamMaxBlocks*upstreamBlockChars)], upstreamBlockChars),
			priority:       drawPriority(cfg.Priorities, prioDraw),
			flow:           drawFlow(cfg.FlowWeights, flowTotal, flowDraw),
		}
		// The bound's cache is keyed by adapter, as the engines' are (the
		// engine keys engineHashes itself): a prefix seen under another
		// adapter is no hit. The bound loads no adapter (each is in a slot
		// already), so it stays a bound. The upstream picker seeds its
		// hashes with the model name: its blocks are keyed too.
		cacheKeys := j.engineHashes
		if r.Adapter != "" {
			cacheKeys = engine.AdapterBlockHashes(j.engineHashes, r.Adapter)
			j.upstreamHashes = engine.AdapterBlockHashes(j.upstreamHashes, r.Adapter)
		}
		hits := leadingHits(seen, cacheKeys)
		j.bound = boundOf(ec, r.InputTokens, r.OutputTokens, hits)
		w.BoundPrefillTokens += int64(j.bound.PrefillTokens)
		w.BoundCachedTokens += int64(r.InputTokens - j.bound.PrefillTokens)
		for _, h := range cacheKeys[hits:] { // the leading hits are there
			seen[h] = struct{}{}
		}
	}
	w.texts.frozen = true // read by concurrent runs from now on
	return w, nil
}

// drawPriority is the priority of the share u (uniform in [0, 1)) falls in.
func drawPriority(shares []PriorityShare, u float64) int {
	for _, ps := range shares {
		if u < ps.Fraction {
			return ps.Priority
		}
		u -= ps.Fraction
	}
	return 0
}

// zipfCDF is the cumulative distribution of n ranks weighted 1/(k+1)^s,
// the last exactly 1.
func zipfCDF(n int, s float64) []float64 {
	cdf := make([]float64, n)
	sum := 0.0
	for k := range cdf {
		sum += math.Pow(float64(k+1), -s)
		cdf[k] = sum
	}
	for k := range cdf {
		cdf[k] /= sum
	}
	if n > 0 {
		cdf[n-1] = 1
	}
	return cdf
}

// drawIndex is the rank of cdf that u (uniform in [0, 1)) falls in.
func drawIndex(cdf []float64, u float64) int {
	k, _ := slices.BinarySearch(cdf, u)
	if k < len(cdf) && cdf[k] == u {
		k++ // [cdf[k-1], cdf[k]) is rank k
	}
	return min(k, len(cdf)-1)
}

// drawFlow is the flow whose weight u (uniform in [0, 1)) falls in; -1
// when there are none.
func drawFlow(weights []float64, total, u float64) int {
	u *= total
	for k, wt := range weights {
		if u < wt {
			return k
		}
		u -= wt
	}
	return len(weights) - 1
}

// Len is the number of requests.
func (w *Workload) Len() int { return len(w.jobs) }

// Config is the configuration the workload was prepared with.
func (w *Workload) Config() Config { return w.cfg }

// Bounds returns each request's no-queueing bound, in trace order.
func (w *Workload) Bounds() []Bound {
	out := make([]Bound, len(w.jobs))
	for i := range w.jobs {
		out[i] = w.jobs[i].bound
	}
	return out
}

// Outcome is what one request saw.
type Outcome struct {
	// Engine served it (a split request's decode leg); -1 when it was
	// refused.
	Engine int
	// Prefiller ran its prefill leg when the policy split it
	// (Config.Roles); -1 when it ran whole on Engine.
	Prefiller int
	// Bypass: it went to Engine in rotation, not through the policy.
	Bypass bool
	Stream bool
	// Priority and Flow are what it carried (Flow -1: none).
	Priority, Flow int
	// Refused, when set, is why the policy answered it 429 (flow control,
	// one of the Refused* reasons): it reached no engine and has no
	// latency.
	Refused string
	// Held: it waited in the policy's queue (flow control) until Start.
	Held bool
	// Start is when it reached its engine, and Wait how long after its
	// arrival (0 unless held).
	Start, Wait time.Duration
	// TTFT is the time from arrival to the engine's first output token
	// (the time to first token a streaming client sees; a non-streaming
	// client sees the whole response at E2E).
	TTFT time.Duration
	// E2E is the time from arrival to the last output token.
	E2E time.Duration
	// PrefillEnd, of a split request, is the time from arrival to the end
	// of its prefill leg, when its decode leg starts.
	PrefillEnd time.Duration
	// PromptTokens is its prompt; CachedTokens the prompt tokens the
	// engine found in its cache (a split request's prefiller: the tokens
	// it did not compute).
	PromptTokens, CachedTokens int
	// Queueing is its TTFT beyond its own prefill alone on an idle engine
	// with the cache it found (boundOf): the time it waited, in the
	// policy's queue or behind other requests on its engine. Unlike the
	// bound, it does not count a prefix the cache no longer held. A split
	// request's counts its KV transfer too.
	Queueing time.Duration
	// Adapter is the LoRA adapter it was for; "" for the base model.
	Adapter string `json:",omitempty"`
}

// Sample is every engine's requests (running and waiting) at one instant.
type Sample struct {
	At       time.Duration
	Requests []int
}

// Result is one policy's run over a workload.
type Result struct {
	Policy   string
	Outcomes []Outcome
	// Engines is each engine's stats when the last request finished.
	Engines []engine.Stats
	// Placed counts, per engine, the requests the policy placed there
	// (bypassing requests not included): a split request's destination.
	Placed []int
	// PrefillLegs counts, per engine, the prefill legs of split requests
	// it ran; nil when none was split.
	PrefillLegs []int `json:",omitempty"`
	// Samples, when Config.SampleEvery is set.
	Samples []Sample
	// LearnedRates is the range of the prefill rates the policy had
	// learned at its scrapes (Tally's picker); zero for the others.
	LearnedRates RateRange
	// Contended counts, per flow of Config.FlowWeights, the requests
	// dispatched from the policy's queue while every flow had requests
	// waiting: how a policy shares capacity between backlogged flows.
	Contended []int
	// End is the virtual time when the last request finished; Wall is how
	// long the run took.
	End  time.Duration
	Wall time.Duration
}

// Run replays the workload against fresh engines with the named policy
// (one of Policies). It is deterministic: the same workload and policy give
// the same result. It fails if a request cannot be placed or never ends.
func (w *Workload) Run(policyName string) (*Result, error) {
	start := time.Now()
	s, err := w.newSim()
	if err != nil {
		return nil, err
	}
	pol, err := newPolicy(policyName, w.cfg, &s.now, w.texts, s.engines)
	if err != nil {
		return nil, err
	}
	res, err := s.runWith(pol)
	if err != nil {
		return nil, fmt.Errorf("policy %s: %w", policyName, err)
	}
	res.Policy = policyName
	res.Wall = time.Since(start)
	return res, nil
}

// newSim is a run of w on fresh engines.
func (w *Workload) newSim() (*sim, error) {
	s := &sim{w: w, engines: make([]*engine.Engine, w.cfg.Engines)}
	for i := range s.engines {
		e, err := engine.New(w.cfg.EngineConfig())
		if err != nil {
			return nil, fmt.Errorf("engine %d: %w", i, err)
		}
		s.engines[i] = e
	}
	return s, nil
}

// runWith runs the simulation with pol, made on s.now.
func (s *sim) runWith(pol policy) (*Result, error) {
	w := s.w
	s.pol = pol
	s.queue, _ = pol.(queueing)
	res := &Result{
		Outcomes:  make([]Outcome, len(w.jobs)),
		Placed:    make([]int, w.cfg.Engines),
		Contended: make([]int, len(w.cfg.FlowWeights)),
	}
	s.res = res
	s.waitingByFlow = make([]int, len(w.cfg.FlowWeights))
	if err := s.run(); err != nil {
		return nil, err
	}
	res.Engines = make([]engine.Stats, len(s.engines))
	for i, e := range s.engines {
		res.Engines[i] = e.Stats()
	}
	res.End = s.now
	if l, ok := pol.(rateLearner); ok {
		res.LearnedRates = l.learnedRates()
	}
	return res, nil
}

// sim is one run: virtual time, the engines, the policy. Everything
// happens in one goroutine, in an order fixed by the virtual times and, at
// equal times, by: engine steps that end (engine order), then the policy's
// metric observation, then its dispatch cycle (flow control), then arrivals
// (trace order), then the start of the engines' next steps. Requests a
// queueing policy dispatches reach their engines at the instant it
// dispatched them, once the engines' events of that instant are handled,
// in arrival order.
type sim struct {
	w       *Workload
	engines []*engine.Engine
	pol     policy
	queue   queueing // pol, when it holds requests; nil otherwise
	res     *Result
	now     time.Duration

	next     int // the next request to arrive
	done     int // finished or refused
	bypassRR int
	stats    []engine.Stats // scratch for observations
	// inEngine counts each engine's requests added and not finished: its
	// running and waiting requests, without the cost of engine.Stats
	// (which walks the waiting requests' cached prefixes).
	inEngine []int
	// waiting counts the requests in the policy's queue, waitingByFlow
	// those of each flow; lastDispatch is the time of the last dispatch
	// cycle the simulation ran (-1: none yet); admitted is scratch for
	// dispatched.
	waiting       int
	waitingByFlow []int
	lastDispatch  time.Duration
	admitted      []admission
	// lora follows each engine's adapters as vLLM's lora_requests_info
	// reports them, for the policies that read it (nil without adapters).
	lora []engine.AdapterRequests
	// decoders are the engines that may be a destination, the bypassing
	// requests' rotation; handoffs the split requests whose prefill leg
	// ended at this instant, whose decode legs start once every engine's
	// events of the instant are handled.
	decoders []int
	handoffs []int
}

// never is a time after any event.
const never = time.Duration(math.MaxInt64)

func (s *sim) run() error {
	n := len(s.w.jobs)
	observeEvery := s.pol.observeEvery()
	nextObserve, nextSample := never, never
	if observeEvery > 0 {
		nextObserve = 0
	}
	if s.w.cfg.SampleEvery > 0 {
		nextSample = 0
	}
	s.stats = make([]engine.Stats, len(s.engines))
	s.inEngine = make([]int, len(s.engines))
	if s.w.cfg.lora() {
		s.lora = make([]engine.AdapterRequests, len(s.engines))
	}
	s.lastDispatch = -1
	for e := range s.engines {
		if s.w.cfg.decodes(e) {
			s.decoders = append(s.decoders, e)
		}
	}
	for s.done < n {
		t := never
		if s.next < n {
			t = s.w.jobs[s.next].arrival
		}
		for _, e := range s.engines {
			if at, ok := e.NextEventAt(); ok && at < t {
				t = at
			}
		}
		nextDispatch := s.nextDispatch()
		t = min(t, nextDispatch)
		if t == never {
			return fmt.Errorf("%d of %d requests never finished", n-s.done, n)
		}
		t = min(t, nextObserve, nextSample)
		s.now = t

		for i, e := range s.engines {
			if at, ok := e.NextEventAt(); ok && at <= t {
				if err := s.handle(i, e.AdvanceTo(t)); err != nil {
					return err
				}
			}
		}
		if err := s.handOff(); err != nil {
			return err
		}
		// First bytes and releases free capacity: the policy dispatched
		// from its queue while it heard of them.
		if err := s.collect(); err != nil {
			return err
		}
		if t == nextObserve {
			if c, ok := s.pol.(countObserver); ok {
				c.observeCounts(s.inEngine)
			} else {
				stats, err := s.readStats()
				if err != nil {
					return err
				}
				if l, ok := s.pol.(loraObserver); ok && s.lora != nil {
					l.observeLoRA(s.loraScrape())
				}
				s.pol.observe(stats)
			}
			nextObserve += observeEvery
			if err := s.collect(); err != nil {
				return err
			}
		}
		if t == nextDispatch {
			s.queue.dispatch()
			s.lastDispatch = t
			if err := s.collect(); err != nil {
				return err
			}
		}
		if t == nextSample {
			s.sample()
			nextSample += s.w.cfg.SampleEvery
		}
		for s.next < n && s.w.jobs[s.next].arrival <= t {
			if err := s.arrive(s.next); err != nil {
				return err
			}
			s.next++
		}
		// Start the next step of every engine that has work and no step
		// running: it starts now, with everything that arrived by now, and
		// the engine's clock moves 1 ns into it (an arrival in that
		// nanosecond waits for the next step, as one mid-step would).
		for _, e := range s.engines {
			if at, ok := e.NextEventAt(); ok && at == e.Now() {
				_ = e.AdvanceTo(e.Now() + 1)
			}
		}
	}
	return nil
}

// nextDispatch is when the policy's queue wants its next dispatch cycle:
// never without a queue or with nothing waiting, and never twice at one
// instant (a cycle at an instant places all it can then).
func (s *sim) nextDispatch() time.Duration {
	if s.queue == nil {
		return never
	}
	at, ok := s.queue.nextDispatch()
	if !ok {
		return never
	}
	return max(at, s.now, s.lastDispatch+1)
}

func (s *sim) readStats() ([]engine.Stats, error) {
	for i, e := range s.engines {
		e.AdvanceTo(s.now) // every step ending by now is handled already
		st := e.Stats()
		if n := st.RunningRequests + st.WaitingRequests; n != s.inEngine[i] {
			return nil, fmt.Errorf("engine %d holds %d requests at %v; the simulation counts %d", i, n, s.now, s.inEngine[i])
		}
		s.stats[i] = st
	}
	return s.stats, nil
}

func (s *sim) sample() {
	s.res.Samples = append(s.res.Samples, Sample{At: s.now, Requests: slices.Clone(s.inEngine)})
}

func (s *sim) arrive(i int) error {
	j := &s.w.jobs[i]
	s.res.Outcomes[i] = Outcome{Engine: -1, Prefiller: -1, Bypass: j.bypass, Stream: j.stream, Priority: j.priority, Flow: j.flow,
		PromptTokens: j.InputTokens, Adapter: j.Adapter}
	if j.bypass {
		target := s.decoders[s.bypassRR%len(s.decoders)]
		s.bypassRR++
		return s.start(i, target, -1)
	}
	if s.queue == nil {
		target, err := s.pol.pick(i, j)
		if err != nil {
			return fmt.Errorf("picking an engine for request %d: %w", i, err)
		}
		return s.startPlaced(i, target)
	}
	// While requests wait, a newcomer joins them and the cycle its
	// admission runs serves whoever's turn it is: placed or refused at
	// once, it still went through the queue beside them.
	queued := s.waiting > 0
	a, err := s.queue.admit(i, j)
	if err != nil {
		return fmt.Errorf("admitting request %d: %w", i, err)
	}
	passed := queued && !a.held
	if a.held || passed {
		s.enterQueue(j.flow)
	}
	// The cycle may have placed requests that waited before it.
	if err := s.collect(); err != nil {
		return err
	}
	if passed {
		s.leaveQueue(j.flow, a.refused == "")
	}
	switch {
	case a.refused != "":
		s.refuse(i, a.refused)
		return nil
	case a.held:
		s.res.Outcomes[i].Held = true
		return nil
	}
	return s.startPlaced(i, a.engine)
}

// enterQueue counts a request of flow (-1: none) waiting in the policy's
// queue.
func (s *sim) enterQueue(flow int) {
	s.waiting++
	if flow >= 0 {
		s.waitingByFlow[flow]++
	}
}

// leaveQueue counts a request of flow leaving the policy's queue,
// dispatched or refused, and the dispatches made while every flow waited.
func (s *sim) leaveQueue(flow int, dispatched bool) {
	s.waiting--
	if flow < 0 {
		return
	}
	if dispatched && !slices.Contains(s.waitingByFlow, 0) {
		s.res.Contended[flow]++
	}
	s.waitingByFlow[flow]--
}

// collect starts the requests the policy dispatched from its queue since
// the last call, and counts those it refused there.
func (s *sim) collect() error {
	if s.queue == nil {
		return nil
	}
	var err error
	if s.admitted, err = s.queue.dispatched(s.admitted[:0]); err != nil {
		return err
	}
	for _, a := range s.admitted {
		o := &s.res.Outcomes[a.i]
		if !o.Held || o.Engine >= 0 || o.Refused != "" {
			return fmt.Errorf("request %d left the policy's queue but was not waiting there", a.i)
		}
		s.leaveQueue(o.Flow, a.refused == "")
		if a.refused != "" {
			s.refuse(a.i, a.refused)
			continue
		}
		if err := s.startPlaced(a.i, a.engine); err != nil {
			return err
		}
	}
	return nil
}

func (s *sim) refuse(i int, why string) {
	s.res.Outcomes[i].Refused = why
	s.done++
}

// startPlaced starts request i on the engine the policy placed it on, or,
// when the policy split it, its prefill leg on the prefiller it named. A
// destination must decode and a prefiller prefill (Config.Roles): the
// picker's rules, which no policy may break.
func (s *sim) startPlaced(i, target int) error {
	if target < 0 || target >= len(s.engines) {
		return fmt.Errorf("request %d placed on engine %d of %d", i, target, len(s.engines))
	}
	if !s.w.cfg.decodes(target) {
		return fmt.Errorf("request %d placed on engine %d, whose role %q does not decode", i, target, s.w.cfg.role(target))
	}
	pre := -1
	if sp, ok := s.pol.(splitter); ok {
		var err error
		if pre, err = sp.prefiller(i); err != nil {
			return fmt.Errorf("request %d: %w", i, err)
		}
	}
	switch {
	case pre < 0:
	case pre >= len(s.engines) || pre == target:
		return fmt.Errorf("request %d placed on engine %d is prefilled on engine %d of %d", i, target, pre, len(s.engines))
	case !s.w.cfg.prefills(pre):
		return fmt.Errorf("request %d prefilled on engine %d, whose role %q does not prefill for others", i, pre, s.w.cfg.role(pre))
	}
	s.res.Placed[target]++
	return s.start(i, target, pre)
}

// A request's legs on the engines. A request that is not split runs
// whole on its destination; a split one runs a prefill leg on its
// prefiller, then its decode leg on its destination. The engines name a
// whole request or a decode leg by its index, a prefill leg by its index
// and prefillLegSuffix.
type leg uint8

const (
	wholeLeg leg = iota
	prefillLeg
	decodeLeg
)

const prefillLegSuffix = "/prefill"

// start adds request i now to engine target or, when pre is an engine,
// its prefill leg to pre (its decode leg follows at the hand-off).
func (s *sim) start(i, target, pre int) error {
	j := &s.w.jobs[i]
	o := &s.res.Outcomes[i]
	o.Engine, o.Start, o.Wait = target, s.now, s.now-j.arrival
	if pre < 0 {
		return s.startLeg(i, target, wholeLeg)
	}
	o.Prefiller = pre
	if s.res.PrefillLegs == nil {
		s.res.PrefillLegs = make([]int, len(s.engines))
	}
	s.res.PrefillLegs[pre]++
	return s.startLeg(i, pre, prefillLeg)
}

// startLeg adds one leg of request i to engine e now. As llm-d's
// sidecar asks them, a prefill leg generates one token
// (max_tokens 1) and holds its KV blocks for the decode leg
// (do_remote_decode); a decode leg pulls the blocks its engine does not
// cache (do_remote_prefill) and generates the whole output.
func (s *sim) startLeg(i, e int, l leg) error {
	j := &s.w.jobs[i]
	eng := s.engines[e]
	if evs := eng.AdvanceTo(s.now); len(evs) > 0 {
		// Every step ending by now is handled before anything starts.
		return fmt.Errorf("engine %d had %d events unhandled at %v", e, len(evs), s.now)
	}
	req := engine.Request{
		ID:            strconv.Itoa(i),
		PromptTokens:  j.InputTokens,
		OutputTokens:  j.OutputTokens,
		BlockHashes:   j.engineHashes,
		Adapter:       j.Adapter,
		RemotePrefill: l == decodeLeg,
	}
	if l == prefillLeg {
		req.ID += prefillLegSuffix
		req.OutputTokens, req.RemoteDecode = 1, true
	}
	if err := eng.Add(req); err != nil {
		return fmt.Errorf("adding request %d to engine %d: %w", i, e, err)
	}
	s.inEngine[e]++
	if s.lora != nil {
		s.lora[e].Add(j.Adapter)
	}
	return nil
}

// handOff starts the decode legs of the split requests whose prefill leg
// ended at this instant, in the order the legs ended: the sidecar sends
// the decode leg as soon as the prefill leg answers, and the decode
// engine pulls the blocks as it arrives (internal/modelsim/server).
func (s *sim) handOff() error {
	for _, i := range s.handoffs {
		if err := s.startLeg(i, s.res.Outcomes[i].Engine, decodeLeg); err != nil {
			return err
		}
	}
	s.handoffs = s.handoffs[:0]
	return nil
}

func (s *sim) handle(engineIdx int, events []engine.Event) error {
	for _, ev := range events {
		if ev.Kind == engine.Token {
			continue
		}
		id, isPrefill := strings.CutSuffix(ev.ID, prefillLegSuffix)
		i, err := strconv.Atoi(id)
		if err != nil || i < 0 || i >= len(s.w.jobs) {
			return fmt.Errorf("engine %d reported unknown request %q", engineIdx, ev.ID)
		}
		j := &s.w.jobs[i]
		o := &s.res.Outcomes[i]
		if isPrefill {
			if err := s.prefillEvent(engineIdx, i, ev); err != nil {
				return err
			}
			continue
		}
		switch ev.Kind {
		case engine.FirstToken:
			o.TTFT = ev.At - j.arrival
			if o.Prefiller < 0 {
				o.CachedTokens = ev.CachedTokens
			}
			ec := s.engines[engineIdx].Config()
			alone := boundOf(ec, j.InputTokens, j.OutputTokens, o.CachedTokens/ec.BlockSizeTokens)
			o.Queueing = o.TTFT - alone.TTFT
			if s.lora != nil {
				s.lora[engineIdx].Started(j.Adapter)
			}
			if j.stream && !j.bypass {
				s.pol.firstByte(i)
			}
		case engine.Finished:
			o.E2E = ev.At - j.arrival
			s.done++
			s.inEngine[engineIdx]--
			if s.lora != nil {
				s.lora[engineIdx].Left(j.Adapter, true)
			}
			if !j.bypass {
				if !j.stream {
					s.pol.firstByte(i)
				}
				s.pol.done(i, j.InputTokens, ev.CachedTokens)
			}
		}
	}
	return nil
}

// prefillEvent handles an event of request i's prefill leg on engine e.
// The policy hears nothing of it: through llm-d's sidecar the client's
// first bytes are the decode leg's. When it ends, its blocks go to the
// decode leg, which starts at this instant (handOff).
func (s *sim) prefillEvent(e, i int, ev engine.Event) error {
	j := &s.w.jobs[i]
	o := &s.res.Outcomes[i]
	if o.Prefiller != e {
		return fmt.Errorf("engine %d reported the prefill leg of request %d, prefilled on engine %d", e, i, o.Prefiller)
	}
	switch ev.Kind {
	case engine.FirstToken:
		o.CachedTokens = ev.CachedTokens
		if s.lora != nil {
			s.lora[e].Started(j.Adapter)
		}
	case engine.Finished:
		o.PrefillEnd = ev.At - j.arrival
		s.inEngine[e]--
		if s.lora != nil {
			s.lora[e].Left(j.Adapter, true)
		}
		// The decode engine pulls the blocks as its leg arrives, which
		// frees them here (the NIXL read's notification).
		if !s.engines[e].Release(ev.ID) {
			return fmt.Errorf("engine %d no longer holds the KV blocks of request %d's prefill leg", e, i)
		}
		s.handoffs = append(s.handoffs, i)
	}
	return nil
}
