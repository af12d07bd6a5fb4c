// Package engine models one vLLM engine (v1 scheduler) in discrete scheduler
// steps. The model-server simulator runs it in real time; a routing simulation
// can run many of them in virtual time, thousands of requests in milliseconds.
//
// The engine has no goroutines and reads no clock: the caller owns time and
// moves it forward. It is not safe for concurrent use; guard it with a mutex.
//
//	e, err := engine.New(engine.DefaultConfig())
//	err = e.Add(engine.Request{ID: "r1", PromptTokens: 4096, OutputTokens: 64, BlockHashes: hashes})
//	d, events := e.Step()            // run the next scheduler step; d is how far the clock moved
//	events = e.AdvanceTo(t)          // or run every step that ends by t; then Now() == t
//	next, ok := e.NextEventAt()      // when the next step ends (ok is false when idle)
//	ok = e.Cancel("r1")              // the client went away: free its blocks
//	st := e.Stats()                  // gauges and counters, the source of /metrics
//
// Time: the clock (Now) starts at 0. A step is scheduled when it starts: the
// requests and token counts it runs are fixed then, and its events (tokens,
// completions) are stamped with the time it ends. A request added while a step
// runs waits for the next step, as in vLLM. AdvanceTo(t) completes the steps
// that end by t, starts steps only at times before t, and leaves the clock at
// t, possibly in the middle of a step; Add then stamps arrival at t. A routing
// simulation therefore advances each engine to the next arrival time, adds the
// request there and asks NextEventAt for the earliest next event.
//
// Step duration: StepBaseDuration + PrefillDurationPerToken x prefill tokens
// scheduled in the step + DecodeDurationPerSequence x sequences decoding in
// it. Each step has a budget of StepBudgetTokens: running requests first (one
// token per decoding sequence, a chunk of the rest of each prompt), then
// waiting requests in FIFO order while fewer than MaxRunningRequests run and
// the head of the queue fits in the KV cache. The step that finishes a
// prompt's prefill produces its first output token; every later step produces
// one token per decoding sequence until OutputTokens.
//
// KV cache: KVBlocks blocks of BlockSizeTokens tokens. At admission a request
// takes the blocks for its whole prompt and output, so a running request never
// runs out and is never preempted (vLLM would allocate as it goes and preempt
// when short). Prompt blocks are named by the chained hashes the caller gives
// (Request.BlockHashes); a block's hash is registered when the step that
// schedules its last token starts. The leading blocks already cached are
// reused and not prefilled again, at most up to the prompt's last token, which
// is always computed. Freed blocks that hold a hash stay cached and are
// evicted least recently used first, a request's last blocks before its first.
//
// LoRA adapters (MaxLoRAs above 0), as vLLM v1 schedules them: a request
// names its adapter (Request.Adapter; "" is the base model). At most
// MaxLoRAs distinct adapters run at once; a waiting request whose adapter
// would be one more is skipped, and the requests behind it may be admitted
// (vLLM skips it too; only a request the KV cache cannot hold stops the
// queue). The engine has MaxLoRAs adapter slots: a running adapter holds
// one; an adapter none of whose requests run stays in its slot until
// another adapter needs a slot and it is the least recently used. A step
// that admits a request whose adapter is not in a slot loads it, taking
// LoRALoadTime longer (vLLM loads adapters in the forward pass, so the
// whole batch waits), and counts it in AdapterLoads. Prefix cache entries
// are keyed by adapter as vLLM keys block hashes by the adapter's name: the
// same prompt under two adapters, or under an adapter and the base model,
// shares no block. (vLLM also keeps up to --max-cpu-loras adapters in host
// memory, which makes a reload cheaper; the engine has one tier.)
//
// Prefill/decode disaggregation, as vLLM's NixlConnector serves it. A
// prefill leg (Request.RemoteDecode) runs as any request but, when it
// finishes, keeps its blocks for the decode engine to pull: they stay held
// (in use) for KVLease, until Release frees them (the decode engine has
// read them) or the lease runs out. A decode leg (Request.RemotePrefill)
// computes no prefill of its own: admitted as any request (its blocks
// taken, its local prefix cache hits reused), it pulls the rest of its
// prompt's blocks from the prefill engine, which takes
// KVTransferDurationPerBlock per block and runs beside the steps (vLLM
// reads over NIXL asynchronously, the request waiting meanwhile, counted
// as waiting); then, at the next step, it computes its last prompt token,
// as vLLM recomputes it to get the logits, and so has its first token at
// the end of that step. The engine knows nothing of the remote side: the
// caller checks the blocks exist before adding a decode leg.
//
// Invariant: every block is in exactly one place: the free list, held by
// running, transferring or held requests (ref > 0), or cached and unreferenced on the LRU list; a
// request's blocks are taken at admission and given back exactly once, when
// it finishes or is cancelled. Likewise every running request with an
// adapter holds its adapter's slot from admission until it leaves, so the
// running adapters are at most MaxLoRAs and all in slots. Stats are read
// from that state, never counted beside it.
package engine

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/tallyepp/tally/internal/lru"
)

// Defaults, fitted to vLLM 0.8.4 serving an 8B model on one H100.
const (
	// DefaultKVBlocks is about what an 8B model (128 KiB of KV per token)
	// leaves for the cache on one 80 GB GPU at 90% memory use: 400,000 tokens.
	DefaultKVBlocks                  = 25_000
	DefaultBlockSizeTokens           = 16
	DefaultMaxRunningRequests        = 256
	DefaultStepBudgetTokens          = 8192
	DefaultStepBaseDuration          = 6500 * time.Microsecond
	DefaultPrefillDurationPerToken   = 19800 * time.Nanosecond
	DefaultDecodeDurationPerSequence = 25 * time.Microsecond
	// DefaultLoRALoadTime is the cost of loading a LoRA adapter into a
	// slot; it matters only with MaxLoRAs above 0.
	DefaultLoRALoadTime = 200 * time.Millisecond
	// DefaultKVLease is how long a finished prefill leg's blocks wait to
	// be pulled (vLLM's NixlConnector lease, VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
	DefaultKVLease = 30 * time.Second
	// DefaultKVTransferDurationPerBlock is one block of an 8B model (16
	// tokens x 128 KiB = 2 MiB) read over a 400 Gb/s RDMA link: about 50 us.
	DefaultKVTransferDurationPerBlock = 50 * time.Microsecond
)

// Config sizes the engine and sets its latency model.
type Config struct {
	// KVBlocks is the number of blocks in the KV cache.
	KVBlocks int
	// BlockSizeTokens is how many tokens one block holds.
	BlockSizeTokens int
	// MaxRunningRequests bounds the requests admitted at once; the rest wait.
	MaxRunningRequests int
	// StepBudgetTokens bounds the tokens one step schedules (chunked prefill).
	StepBudgetTokens int
	// StepBaseDuration is the cost of a step regardless of its tokens.
	StepBaseDuration time.Duration
	// PrefillDurationPerToken is added per prefill token scheduled in a step.
	PrefillDurationPerToken time.Duration
	// DecodeDurationPerSequence is added per sequence decoding in a step.
	DecodeDurationPerSequence time.Duration
	// MaxLoRAs is how many distinct LoRA adapters may run at once, and
	// how many adapter slots the engine has (vLLM's --max-loras); 0 serves
	// the base model alone and refuses requests that name an adapter.
	MaxLoRAs int
	// LoRALoadTime is added to a step for each adapter it loads into a
	// slot.
	LoRALoadTime time.Duration
	// KVLease is how long a finished prefill leg (Request.RemoteDecode)
	// holds its blocks for the decode engine before they are freed.
	KVLease time.Duration
	// KVTransferDurationPerBlock is how long a decode leg
	// (Request.RemotePrefill) takes to pull one block.
	KVTransferDurationPerBlock time.Duration
}

// DefaultConfig returns the configuration of the latency model described in
// the package doc.
func DefaultConfig() Config {
	return Config{
		KVBlocks:                   DefaultKVBlocks,
		BlockSizeTokens:            DefaultBlockSizeTokens,
		MaxRunningRequests:         DefaultMaxRunningRequests,
		StepBudgetTokens:           DefaultStepBudgetTokens,
		StepBaseDuration:           DefaultStepBaseDuration,
		PrefillDurationPerToken:    DefaultPrefillDurationPerToken,
		DecodeDurationPerSequence:  DefaultDecodeDurationPerSequence,
		LoRALoadTime:               DefaultLoRALoadTime,
		KVLease:                    DefaultKVLease,
		KVTransferDurationPerBlock: DefaultKVTransferDurationPerBlock,
	}
}

// Validate reports every invalid field, naming it and what it accepts.
func (c Config) Validate() error {
	var errs []error
	bad := func(field string, got any, accepted string) {
		errs = append(errs, fmt.Errorf("engine config: %s: %v is invalid: %s", field, got, accepted))
	}
	if c.KVBlocks < 1 || c.KVBlocks > math.MaxInt32 {
		bad("KVBlocks", c.KVBlocks, fmt.Sprintf("must be from 1 to %d", math.MaxInt32))
	}
	if c.BlockSizeTokens < 1 || c.BlockSizeTokens > 1024 {
		bad("BlockSizeTokens", c.BlockSizeTokens, "must be from 1 to 1024")
	}
	if c.MaxRunningRequests < 1 {
		bad("MaxRunningRequests", c.MaxRunningRequests, "must be 1 or more")
	}
	if c.StepBudgetTokens < 1 {
		bad("StepBudgetTokens", c.StepBudgetTokens, "must be 1 or more")
	}
	// A positive base keeps the clock moving with every step.
	if c.StepBaseDuration <= 0 {
		bad("StepBaseDuration", c.StepBaseDuration, "must be positive")
	}
	if c.PrefillDurationPerToken < 0 {
		bad("PrefillDurationPerToken", c.PrefillDurationPerToken, "must be 0 or more")
	}
	if c.DecodeDurationPerSequence < 0 {
		bad("DecodeDurationPerSequence", c.DecodeDurationPerSequence, "must be 0 or more")
	}
	if c.MaxLoRAs < 0 {
		bad("MaxLoRAs", c.MaxLoRAs, "must be 0 (no adapters) or more")
	}
	if c.LoRALoadTime < 0 {
		bad("LoRALoadTime", c.LoRALoadTime, "must be 0 or more")
	}
	if c.KVLease <= 0 {
		bad("KVLease", c.KVLease, "must be positive")
	}
	if c.KVTransferDurationPerBlock < 0 {
		bad("KVTransferDurationPerBlock", c.KVTransferDurationPerBlock, "must be 0 or more")
	}
	return errors.Join(errs...)
}

// Request is one generation request.
type Request struct {
	// ID names the request in events and in Cancel; unique among the
	// requests the engine holds.
	ID string
	// PromptTokens is the prompt length, 1 or more.
	PromptTokens int
	// OutputTokens is how many tokens to generate, 1 or more.
	OutputTokens int
	// BlockHashes names the prompt's blocks of BlockSizeTokens tokens, in
	// order, each hash covering its block and every block before it (a
	// chain), so equal hashes mean equal prefixes. At most one per block of
	// the prompt (a last, partial block may have one); fewer is fine. The
	// engine keeps the slice: do not modify it afterwards. The caller need
	// not mix the adapter in: the engine keys the cache by Adapter itself.
	BlockHashes []uint64
	// Adapter names the LoRA adapter the request runs with; "" is the
	// base model. Only an engine with MaxLoRAs above 0 takes adapters.
	Adapter string
	// RemoteDecode marks a prefill leg: when it finishes, its blocks are
	// held for KVLease for a decode engine to pull (see Release).
	RemoteDecode bool
	// RemotePrefill marks a decode leg: its prompt's blocks not cached
	// here are pulled from a prefill engine instead of computed.
	RemotePrefill bool
}

// EventKind says what happened to a request.
type EventKind uint8

const (
	// FirstToken: the prompt is prefilled and the first output token produced.
	FirstToken EventKind = iota + 1
	// Token: one more output token after the first.
	Token
	// Finished: the last output token was produced (it has its own event
	// just before); the request has left the engine.
	Finished
)

func (k EventKind) String() string {
	switch k {
	case FirstToken:
		return "FirstToken"
	case Token:
		return "Token"
	case Finished:
		return "Finished"
	}
	return fmt.Sprintf("EventKind(%d)", uint8(k))
}

// Event is something that happened to a request at the end of a step.
type Event struct {
	Kind EventKind
	ID   string
	// At is when the step that produced the event ended.
	At time.Duration
	// Arrived is when the request was added: At-Arrived of FirstToken is
	// the time to first token.
	Arrived time.Duration
	// Scheduled is when the step that first scheduled the request (the one
	// that admitted it) started. Of FirstToken, At-Scheduled is the prefill
	// time, as vLLM's request_prefill_time_seconds measures it, and
	// Scheduled-Arrived the time queued.
	Scheduled time.Duration
	// OutputTokens is the number of output tokens produced so far.
	OutputTokens int
	// CachedTokens is the number of prompt tokens found in the prefix cache.
	CachedTokens int
}

// Stats are the engine's gauges and counters, read from its state.
type Stats struct {
	Now             time.Duration
	RunningRequests int
	WaitingRequests int
	// KVBlocks is the cache size; KVBlocksInUse are held by running
	// requests; KVBlocksCached hold a reusable prefix but no request (they
	// are evictable); the rest are free.
	KVBlocks       int
	KVBlocksInUse  int
	KVBlocksCached int
	// QueuedPrefillTokens is the prefill work left, in prompt tokens: the
	// truth a picker's prefill estimate is measured against. It counts the
	// rest of each running request's prompt, each waiting prompt less the
	// leading blocks the cache holds for it now (admission may find more or
	// fewer), and, of the chunks in the step that is running, the share of
	// the step still to run: a request arriving mid-step waits only for the
	// rest of it.
	QueuedPrefillTokens int
	// PrefixQueryTokens and PrefixHitTokens count, over admitted requests,
	// prompt tokens looked up in the prefix cache and found there.
	PrefixQueryTokens int64
	PrefixHitTokens   int64
	// FinishedRequests produced all their output; AbortedRequests were
	// cancelled, waiting or running.
	FinishedRequests int64
	AbortedRequests  int64
	Steps            int64
	// PrefillTokens were computed (not found in the cache); OutputTokens
	// were generated.
	PrefillTokens int64
	OutputTokens  int64
	Evictions     int64
	// PromptTokens counts the whole prompts, cached tokens included, of
	// the requests whose prefill finished (their first token was
	// produced), as vLLM's prompt_tokens_total does.
	PromptTokens int64
	// BusyTime is the total duration of the steps started so far.
	BusyTime time.Duration
	// RunningAdapters is how many distinct LoRA adapters the running
	// requests use (at most MaxLoRAs). AdapterLoads counts adapters loaded
	// into a slot, a free one or one whose adapter was evicted: the swaps.
	RunningAdapters int
	AdapterLoads    int64
	// HeldRequests are finished prefill legs whose blocks wait to be
	// pulled (their blocks count in KVBlocksInUse); LeasesExpired counts
	// those freed unpulled when their lease ran out, LeasesReleased
	// those pulled. KVBlocksPulled counts blocks decode legs pulled.
	HeldRequests   int
	LeasesExpired  int64
	LeasesReleased int64
	KVBlocksPulled int64
}

// KVCacheUsage is the fraction of blocks held by running requests, as vLLM's
// kv_cache_usage_perc reports it (cached unreferenced blocks count as free).
func (s Stats) KVCacheUsage() float64 {
	if s.KVBlocks == 0 {
		return 0
	}
	return float64(s.KVBlocksInUse) / float64(s.KVBlocks)
}

type block struct {
	hash   uint64
	hashed bool // hash is registered in Engine.byHash for this block
	ref    int32
}

type requestState uint8

const (
	waiting      requestState = iota
	transferring              // a decode leg admitted, pulling its blocks
	running
	held // a finished prefill leg whose blocks wait to be pulled
	gone // finished or cancelled
)

type request struct {
	Request
	state     requestState
	arrived   time.Duration
	blocks    []int32 // prompt blocks first, then output blocks
	cached    int     // prompt tokens found in the prefix cache
	computed  int     // prompt tokens scheduled for prefill, cached ones included
	hashed    int     // leading prompt blocks whose hash is registered
	generated int
	// scheduledAt is when the step that admitted it started.
	scheduledAt time.Duration
	// readyAt is when a transferring decode leg has its blocks;
	// heldUntil when a held prefill leg's lease runs out.
	readyAt, heldUntil time.Duration
}

// loraSlot holds one adapter's weights. An adapter is in at most one slot.
type loraSlot struct {
	adapter  string // "" while the slot is free
	lastUsed int64  // Engine.loraTick when a request of the adapter last joined or left the batch
}

type scheduled struct {
	r       *request
	prefill int // prompt tokens in this step; 0 means a decode
}

// Engine is one simulated vLLM engine. Create it with New.
type Engine struct {
	cfg Config
	now time.Duration

	blocks []block
	free   []int32
	// evictable holds the cached blocks no request holds (hashed, ref 0),
	// the least recently released first.
	evictable *lru.List
	byHash    map[uint64]int32

	requests map[string]*request
	waiting  []*request // FIFO
	running  []*request // in admission order
	// transfers are decode legs pulling their blocks, in admission order;
	// held are finished prefill legs keeping theirs, by ID.
	transfers []*request
	held      map[string]*request

	// LoRA state, used only with MaxLoRAs above 0.
	slots       []loraSlot     // MaxLoRAs of them
	slotOf      map[string]int // resident adapter -> its slot
	loraRunning map[string]int // adapter -> running requests; absent at 0
	loraTick    int64

	inFlight  bool
	stepStart time.Duration
	stepEnd   time.Duration
	plan      []scheduled
	events    []Event

	stats Stats // counters only; gauges are computed in Stats
}

// New returns an idle engine with an empty cache at time 0.
func New(cfg Config) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	e := &Engine{
		cfg:       cfg,
		blocks:    make([]block, cfg.KVBlocks),
		free:      make([]int32, cfg.KVBlocks),
		evictable: lru.New(cfg.KVBlocks),
		byHash:    make(map[uint64]int32),
		requests:  make(map[string]*request),
		held:      make(map[string]*request),
	}
	if cfg.MaxLoRAs > 0 {
		e.slots = make([]loraSlot, cfg.MaxLoRAs)
		e.slotOf = make(map[string]int, cfg.MaxLoRAs)
		e.loraRunning = make(map[string]int, cfg.MaxLoRAs)
	}
	// Pop order from the end: block 0 first.
	for i := range e.free {
		e.free[i] = int32(cfg.KVBlocks - 1 - i)
	}
	return e, nil
}

// Config returns the configuration the engine was created with.
func (e *Engine) Config() Config { return e.cfg }

// Clone returns a copy of the engine that shares nothing it changes: what
// the copy does next (requests added, steps run) leaves the engine as it
// was. The routing simulator's forecast-greedy reference runs copies to
// ask when a request would get its first token on each engine.
func (e *Engine) Clone() *Engine {
	c := *e
	c.blocks = slices.Clone(e.blocks)
	c.free = slices.Clone(e.free)
	c.evictable = e.evictable.Clone()
	c.byHash = maps.Clone(e.byHash)
	c.requests = make(map[string]*request, len(e.requests))
	copies := make(map[*request]*request, len(e.requests))
	copyOf := func(r *request) *request {
		if n, ok := copies[r]; ok {
			return n
		}
		n := *r
		n.blocks = slices.Clone(r.blocks)
		copies[r] = &n
		return &n
	}
	for id, r := range e.requests {
		c.requests[id] = copyOf(r)
	}
	c.waiting = make([]*request, len(e.waiting))
	for i, r := range e.waiting {
		c.waiting[i] = copyOf(r)
	}
	c.running = make([]*request, len(e.running))
	for i, r := range e.running {
		c.running[i] = copyOf(r)
	}
	c.transfers = make([]*request, len(e.transfers))
	for i, r := range e.transfers {
		c.transfers[i] = copyOf(r)
	}
	c.held = make(map[string]*request, len(e.held))
	for id, r := range e.held {
		c.held[id] = copyOf(r)
	}
	c.plan = make([]scheduled, len(e.plan))
	for i, p := range e.plan {
		c.plan[i] = scheduled{r: copyOf(p.r), prefill: p.prefill}
	}
	c.events = nil
	c.slots = slices.Clone(e.slots)
	c.slotOf = maps.Clone(e.slotOf)
	c.loraRunning = maps.Clone(e.loraRunning)
	return &c
}

// Now is the engine's clock.
func (e *Engine) Now() time.Duration { return e.now }

// Busy reports whether the engine holds requests or a step is running
// (held prefill legs do not count: they wait for nothing the engine does).
func (e *Engine) Busy() bool { return e.inFlight || e.hasWork() || len(e.transfers) > 0 }

// hasWork reports whether a step starting now would schedule something.
func (e *Engine) hasWork() bool {
	return len(e.running) > 0 || len(e.waiting) > 0 || e.transferReadyBy(e.now)
}

// transferReadyBy reports whether a transfer ends by t.
func (e *Engine) transferReadyBy(t time.Duration) bool {
	next, ok := e.nextTransferEnd()
	return ok && next <= t
}

// nextTransferEnd is when the first transfer running ends.
func (e *Engine) nextTransferEnd() (time.Duration, bool) {
	if len(e.transfers) == 0 {
		return 0, false
	}
	next := e.transfers[0].readyAt
	for _, r := range e.transfers[1:] {
		next = min(next, r.readyAt)
	}
	return next, true
}

// BlocksNeeded is how many KV blocks a request of that many prompt and
// output tokens takes at admission.
func (e *Engine) BlocksNeeded(promptTokens, outputTokens int) int {
	b := e.cfg.BlockSizeTokens
	return (promptTokens + outputTokens + b - 1) / b
}

// Add queues a request, arriving at Now. It fails, naming the field at
// fault, when the request is malformed, its ID is in use, or it needs more
// blocks than the whole cache holds (it could never run).
func (e *Engine) Add(r Request) error {
	switch {
	case r.ID == "":
		return errors.New("engine: request ID is empty")
	case e.requests[r.ID] != nil || e.held[r.ID] != nil:
		return fmt.Errorf("engine: request ID %q is already in use", r.ID)
	case r.PromptTokens < 1:
		return fmt.Errorf("engine: request %q: PromptTokens %d is invalid: must be 1 or more", r.ID, r.PromptTokens)
	case r.OutputTokens < 1:
		return fmt.Errorf("engine: request %q: OutputTokens %d is invalid: must be 1 or more", r.ID, r.OutputTokens)
	case r.RemoteDecode && r.RemotePrefill:
		return fmt.Errorf("engine: request %q: RemoteDecode and RemotePrefill are both set: a request is a prefill leg or a decode leg", r.ID)
	case r.Adapter != "" && e.cfg.MaxLoRAs == 0:
		return fmt.Errorf("engine: request %q: Adapter %q is invalid: the engine serves no adapters (MaxLoRAs is 0)", r.ID, r.Adapter)
	}
	promptBlocks := (r.PromptTokens + e.cfg.BlockSizeTokens - 1) / e.cfg.BlockSizeTokens
	if len(r.BlockHashes) > promptBlocks {
		return fmt.Errorf("engine: request %q: %d BlockHashes for %d prompt tokens: at most %d (one per block of %d tokens)",
			r.ID, len(r.BlockHashes), r.PromptTokens, promptBlocks, e.cfg.BlockSizeTokens)
	}
	if need := e.BlocksNeeded(r.PromptTokens, r.OutputTokens); need > e.cfg.KVBlocks {
		return fmt.Errorf("engine: request %q: %d prompt + %d output tokens need %d KV blocks; the cache holds %d (%d tokens)",
			r.ID, r.PromptTokens, r.OutputTokens, need, e.cfg.KVBlocks, e.cfg.KVBlocks*e.cfg.BlockSizeTokens)
	}
	if r.Adapter != "" {
		r.BlockHashes = AdapterBlockHashes(r.BlockHashes, r.Adapter)
	}
	req := &request{Request: r, state: waiting, arrived: e.now}
	e.requests[r.ID] = req
	e.waiting = append(e.waiting, req)
	return nil
}

// Cancel removes a waiting or running request and frees its blocks; its
// events in a step already running are dropped. It reports whether the
// engine held the request.
func (e *Engine) Cancel(id string) bool {
	r := e.requests[id]
	if r == nil {
		return false
	}
	switch r.state {
	case waiting:
		e.waiting = slices.DeleteFunc(e.waiting, func(w *request) bool { return w == r })
	case running:
		e.release(r)
		e.running = slices.DeleteFunc(e.running, func(w *request) bool { return w == r })
	case transferring:
		e.release(r)
		e.transfers = slices.DeleteFunc(e.transfers, func(w *request) bool { return w == r })
	}
	r.state = gone
	delete(e.requests, id)
	e.stats.AbortedRequests++
	return true
}

// Step runs the engine to the end of its next step: the one running, or a
// new one starting at Now. It returns how far the clock moved (0 when there
// is nothing to do) and the step's events. The events slice is reused by the
// next call of Step or AdvanceTo.
func (e *Engine) Step() (time.Duration, []Event) {
	e.events = e.events[:0]
	start := e.now
	if !e.inFlight {
		if !e.hasWork() {
			next, ok := e.nextTransferEnd()
			if !ok {
				return 0, e.events
			}
			e.now = next // idle until a decode leg has its blocks
		}
		e.startStep()
	}
	e.now = e.stepEnd
	e.finishStep()
	return e.now - start, e.events
}

// AdvanceTo runs every step that ends by t, starting new ones only before t,
// and sets the clock to t (a t before Now changes nothing). It returns the
// events of the steps it completed, in order; the slice is reused by the next
// call of Step or AdvanceTo.
func (e *Engine) AdvanceTo(t time.Duration) []Event {
	e.events = e.events[:0]
	for {
		if e.inFlight {
			if e.stepEnd > t {
				break
			}
			e.now = e.stepEnd
			e.finishStep()
			continue
		}
		if e.now >= t {
			break
		}
		if !e.hasWork() {
			next, ok := e.nextTransferEnd()
			if !ok || next >= t {
				break
			}
			e.now = next // idle until a decode leg has its blocks
		}
		e.startStep()
	}
	if t > e.now {
		e.now = t
	}
	e.expireLeases()
	return e.events
}

// NextEventAt returns when the running step ends, or Now when requests wait
// for a step to start; ok is false when the engine is idle.
func (e *Engine) NextEventAt() (at time.Duration, ok bool) {
	if e.inFlight {
		return e.stepEnd, true
	}
	if e.hasWork() {
		return e.now, true
	}
	return e.nextTransferEnd()
}

// Stats returns the engine's gauges and counters.
func (e *Engine) Stats() Stats {
	s := e.stats
	s.Now = e.now
	s.RunningRequests = len(e.running)
	s.WaitingRequests = len(e.waiting) + len(e.transfers) // as vLLM counts WAITING_FOR_REMOTE_KVS
	s.HeldRequests = len(e.held)
	s.KVBlocks = e.cfg.KVBlocks
	s.KVBlocksCached = e.evictable.Len()
	s.KVBlocksInUse = e.cfg.KVBlocks - len(e.free) - e.evictable.Len()
	s.QueuedPrefillTokens = e.queuedPrefillTokens()
	s.RunningAdapters = len(e.loraRunning)
	return s
}

// queuedPrefillTokens reads the prefill work left from the requests and the
// running step, as Stats documents it.
func (e *Engine) queuedPrefillTokens() int {
	n := 0
	for _, r := range e.running {
		n += r.PromptTokens - r.computed // computed counts the running step's chunks already
	}
	if e.inFlight {
		inStep := 0
		for _, p := range e.plan {
			if p.r.state == running {
				inStep += p.prefill
			}
		}
		left := float64(e.stepEnd-e.now) / float64(e.stepEnd-e.stepStart)
		n += int(math.Round(float64(inStep) * left))
	}
	n += len(e.transfers) // each computes its last prompt token
	for _, r := range e.waiting {
		if r.RemotePrefill {
			n++
			continue
		}
		hits, _ := e.cachedPrefix(r)
		n += r.PromptTokens - hits*e.cfg.BlockSizeTokens
	}
	return n
}

// startStep schedules a step at Now: running requests first, then admits
// waiting ones in FIFO order, skipping those whose adapter cannot run yet.
func (e *Engine) startStep() {
	e.expireLeases() // before admission, so that expired blocks can be reused
	e.promoteTransfers()
	budget := e.cfg.StepBudgetTokens
	prefillTokens, decodes := 0, 0
	e.plan = e.plan[:0]
	for _, r := range e.running {
		if budget == 0 {
			break
		}
		if r.computed < r.PromptTokens {
			n := min(r.PromptTokens-r.computed, budget)
			e.schedulePrefill(r, n)
			budget -= n
			prefillTokens += n
			continue
		}
		e.plan = append(e.plan, scheduled{r: r})
		budget--
		decodes++
	}
	loads := 0
	for i := 0; i < len(e.waiting) && len(e.running)+len(e.transfers) < e.cfg.MaxRunningRequests && budget > 0; {
		r := e.waiting[i]
		if !e.adapterFits(r.Adapter) {
			i++ // as vLLM: skipped for this step, keeping its place
			continue
		}
		if !e.admit(r) {
			break // first come, first served: nobody overtakes for memory
		}
		if i == 0 {
			e.waiting[0] = nil
			e.waiting = e.waiting[1:]
		} else {
			e.waiting = slices.Delete(e.waiting, i, i+1)
		}
		if e.holdAdapter(r.Adapter) {
			loads++
		}
		if r.RemotePrefill {
			e.startTransfer(r)
			continue
		}
		e.running = append(e.running, r)
		n := min(r.PromptTokens-r.computed, budget)
		e.schedulePrefill(r, n)
		budget -= n
		prefillTokens += n
	}
	d := e.cfg.StepBaseDuration +
		time.Duration(prefillTokens)*e.cfg.PrefillDurationPerToken +
		time.Duration(decodes)*e.cfg.DecodeDurationPerSequence +
		time.Duration(loads)*e.cfg.LoRALoadTime
	e.inFlight = true
	e.stepStart = e.now
	e.stepEnd = e.now + d
	e.stats.Steps++
	e.stats.BusyTime += d
	e.stats.PrefillTokens += int64(prefillTokens)
}

// admit gives r its blocks, reusing its cached prefix, if the cache can
// hold it now.
func (e *Engine) admit(r *request) bool {
	bs := e.cfg.BlockSizeTokens
	hits, hitsEvictable := e.cachedPrefix(r)
	need := e.BlocksNeeded(r.PromptTokens, r.OutputTokens)
	if need-hits > len(e.free)+e.evictable.Len()-hitsEvictable {
		return false
	}
	r.blocks = make([]int32, 0, need)
	for i := range hits {
		idx := e.byHash[r.BlockHashes[i]]
		b := &e.blocks[idx]
		if b.ref == 0 {
			e.evictable.Remove(idx)
		}
		b.ref++
		r.blocks = append(r.blocks, idx)
	}
	for len(r.blocks) < need {
		r.blocks = append(r.blocks, e.allocate())
	}
	r.state = running
	r.scheduledAt = e.now // admit runs as a step starts; a request is never preempted
	r.cached = hits * bs
	r.computed = r.cached
	r.hashed = hits
	e.stats.PrefixQueryTokens += int64(r.PromptTokens)
	e.stats.PrefixHitTokens += int64(r.cached)
	return true
}

// CachedPrefixTokens returns how many leading tokens of a prompt of
// promptTokens, with these block hashes, the cache holds now: what
// admission would find if it came now (never the last token). No real
// router sees this; the routing simulator's exact-greedy policy does.
func (e *Engine) CachedPrefixTokens(hashes []uint64, promptTokens int) int {
	hits, _ := e.cachedPrefix(&request{Request: Request{PromptTokens: promptTokens, BlockHashes: hashes}})
	return hits * e.cfg.BlockSizeTokens
}

// cachedPrefix counts the leading prompt blocks of r the cache holds now,
// and how many of those no running request holds (they sit on the LRU list).
func (e *Engine) cachedPrefix(r *request) (hits, evictable int) {
	// The last prompt token is always computed: its logits give the first
	// output token.
	maxHit := min(len(r.BlockHashes), (r.PromptTokens-1)/e.cfg.BlockSizeTokens)
	for hits < maxHit {
		idx, ok := e.byHash[r.BlockHashes[hits]]
		if !ok {
			break
		}
		if e.blocks[idx].ref == 0 {
			evictable++
		}
		hits++
	}
	return hits, evictable
}

// schedulePrefill schedules the next n prompt tokens of r and registers the
// hashes of the blocks they complete, so that requests admitted from now on
// reuse them (vLLM caches a block when it is scheduled full).
func (e *Engine) schedulePrefill(r *request, n int) {
	e.plan = append(e.plan, scheduled{r: r, prefill: n})
	r.computed += n
	e.registerHashes(r)
}

// finishStep produces the tokens of the step that ends at Now.
func (e *Engine) finishStep() {
	e.inFlight = false
	finished := false
	for _, p := range e.plan {
		r := p.r
		if r.state != running {
			continue // cancelled during the step
		}
		switch {
		case p.prefill == 0:
			r.generated++
			e.emit(Token, r)
		case r.computed == r.PromptTokens:
			r.generated = 1
			e.stats.PromptTokens += int64(r.PromptTokens)
			e.emit(FirstToken, r)
		default:
			continue // a chunk of a longer prompt
		}
		e.stats.OutputTokens++
		if r.generated == r.OutputTokens {
			e.emit(Finished, r)
			delete(e.requests, r.ID)
			e.stats.FinishedRequests++
			finished = true
			if r.RemoteDecode {
				// vLLM holds the blocks of a prefill leg that ended
				// length-capped, which every simulated request does.
				e.dropAdapter(r.Adapter)
				r.state = held
				r.heldUntil = e.now + e.cfg.KVLease
				e.held[r.ID] = r
				continue
			}
			e.release(r)
			r.state = gone
		}
	}
	clear(e.plan) // drop references to finished requests
	e.plan = e.plan[:0]
	if finished {
		e.running = slices.DeleteFunc(e.running, func(r *request) bool { return r.state != running })
	}
}

func (e *Engine) emit(kind EventKind, r *request) {
	e.events = append(e.events, Event{
		Kind:         kind,
		ID:           r.ID,
		At:           e.now,
		Arrived:      r.arrived,
		Scheduled:    r.scheduledAt,
		OutputTokens: r.generated,
		CachedTokens: r.cached,
	})
}

// adapterFits reports whether a request of adapter may join the batch: the
// base model always may; an adapter if it runs already or fewer than
// MaxLoRAs adapters run.
func (e *Engine) adapterFits(adapter string) bool {
	return adapter == "" || e.loraRunning[adapter] > 0 || len(e.loraRunning) < e.cfg.MaxLoRAs
}

// holdAdapter counts a request of adapter joining the batch, loading the
// adapter into a slot if it is in none. It reports whether it loaded.
func (e *Engine) holdAdapter(adapter string) (loaded bool) {
	if adapter == "" {
		return false
	}
	e.loraRunning[adapter]++
	e.loraTick++
	if i, ok := e.slotOf[adapter]; ok {
		e.slots[i].lastUsed = e.loraTick
		return false
	}
	// adapterFits let fewer than MaxLoRAs adapters run, and every running
	// adapter is in a slot: a slot is free or holds an adapter none of
	// whose requests run. Take a free one, or the least recently used.
	victim := -1
	for i, s := range e.slots {
		if s.adapter == "" {
			victim = i
			break
		}
		if e.loraRunning[s.adapter] == 0 && (victim < 0 || s.lastUsed < e.slots[victim].lastUsed) {
			victim = i
		}
	}
	if victim < 0 {
		panic("engine: no adapter slot to load into; adapterFits checked there was one")
	}
	if old := e.slots[victim].adapter; old != "" {
		delete(e.slotOf, old)
	}
	e.slots[victim] = loraSlot{adapter: adapter, lastUsed: e.loraTick}
	e.slotOf[adapter] = victim
	e.stats.AdapterLoads++
	return true
}

// dropAdapter counts a request of adapter leaving the batch; the adapter
// stays in its slot.
func (e *Engine) dropAdapter(adapter string) {
	if adapter == "" {
		return
	}
	if n := e.loraRunning[adapter] - 1; n > 0 {
		e.loraRunning[adapter] = n
	} else {
		delete(e.loraRunning, adapter)
	}
	e.loraTick++
	e.slots[e.slotOf[adapter]].lastUsed = e.loraTick
}

// release gives back r's blocks and its hold on its adapter.
func (e *Engine) release(r *request) {
	e.dropAdapter(r.Adapter)
	e.freeBlocks(r)
}

// freeBlocks gives back r's blocks, last first, so that a prompt's tail is
// evicted before its head (the head is the part other prompts share).
func (e *Engine) freeBlocks(r *request) {
	for i := len(r.blocks) - 1; i >= 0; i-- {
		idx := r.blocks[i]
		b := &e.blocks[idx]
		b.ref--
		if b.ref > 0 {
			continue
		}
		if b.hashed {
			e.evictable.PushBack(idx)
		} else {
			e.free = append(e.free, idx)
		}
	}
	r.blocks = nil
}

// allocate takes a free block, or evicts the least recently used cached one.
func (e *Engine) allocate() int32 {
	var idx int32
	if n := len(e.free); n > 0 {
		idx = e.free[n-1]
		e.free = e.free[:n-1]
	} else {
		var ok bool
		if idx, ok = e.evictable.Oldest(); !ok {
			panic("engine: no block to allocate; admit checked there was one")
		}
		e.evictable.Remove(idx)
		b := &e.blocks[idx]
		delete(e.byHash, b.hash)
		b.hashed = false
		e.stats.Evictions++
	}
	e.blocks[idx].ref = 1
	return idx
}

// startTransfer starts the pull of a decode leg's prompt blocks that
// admission did not find cached here; it begins as the step starts, as
// vLLM's workers start the read with the step's forward pass.
func (e *Engine) startTransfer(r *request) {
	bs := e.cfg.BlockSizeTokens
	pull := (r.PromptTokens+bs-1)/bs - r.cached/bs
	r.state = transferring
	r.readyAt = e.now + time.Duration(pull)*e.cfg.KVTransferDurationPerBlock
	e.transfers = append(e.transfers, r)
	e.stats.KVBlocksPulled += int64(pull)
}

// promoteTransfers moves the decode legs whose blocks have arrived to the
// running requests: their whole prompt but its last token is computed, and
// the blocks it fills are registered in the prefix cache, as vLLM caches
// blocks it received.
func (e *Engine) promoteTransfers() {
	if !e.transferReadyBy(e.now) {
		return
	}
	e.transfers = slices.DeleteFunc(e.transfers, func(r *request) bool {
		if r.readyAt > e.now {
			return false
		}
		r.state = running
		e.running = append(e.running, r)
		// schedulePrefill registers hashes as it goes; the pulled tokens
		// are computed already, so register them the same way.
		r.computed = max(r.computed, r.PromptTokens-1)
		e.registerHashes(r)
		return true
	})
}

// registerHashes names the blocks r's computed tokens fill, so that
// requests admitted from now on reuse them.
func (e *Engine) registerHashes(r *request) {
	bs := e.cfg.BlockSizeTokens
	for r.hashed < len(r.BlockHashes) && min((r.hashed+1)*bs, r.PromptTokens) <= r.computed {
		h := r.BlockHashes[r.hashed]
		if _, taken := e.byHash[h]; !taken {
			idx := r.blocks[r.hashed]
			e.byHash[h] = idx
			e.blocks[idx].hash = h
			e.blocks[idx].hashed = true
		}
		r.hashed++
	}
}

// expireLeases frees the blocks of held prefill legs whose lease has run
// out by Now.
func (e *Engine) expireLeases() {
	for id, r := range e.held {
		if r.heldUntil <= e.now {
			e.freeBlocks(r)
			r.state = gone
			delete(e.held, id)
			e.stats.LeasesExpired++
		}
	}
}

// HeldBlockIDs returns the KV blocks of a finished prefill leg's prompt,
// as vLLM names them in remote_block_ids; ok is false when the engine
// holds no such leg (unknown, pulled, or its lease ran out by Now).
func (e *Engine) HeldBlockIDs(id string) (ids []int, ok bool) {
	r := e.held[id]
	if r == nil || r.heldUntil <= e.now {
		return nil, false
	}
	bs := e.cfg.BlockSizeTokens
	n := (r.PromptTokens + bs - 1) / bs
	ids = make([]int, n)
	for i := range n {
		ids[i] = int(r.blocks[i])
	}
	return ids, true
}

// Release frees a held prefill leg's blocks, as the prefill engine does
// when the decode engine tells it it has read them. It reports whether
// the engine held the leg (false when unknown, released already, or its
// lease ran out by Now).
func (e *Engine) Release(id string) bool {
	r := e.held[id]
	if r == nil {
		return false
	}
	if r.heldUntil <= e.now {
		e.expireLeases()
		return false
	}
	e.freeBlocks(r)
	r.state = gone
	delete(e.held, id)
	e.stats.LeasesReleased++
	return true
}
