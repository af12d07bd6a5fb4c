package engine

import (
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"
)

// chain returns chained block hashes for blocks with the given contents:
// equal leading contents give equal leading hashes, as a prompt's would.
func chain(contents ...uint64) []uint64 {
	hs := make([]uint64, len(contents))
	h := uint64(14695981039346656037)
	for i, c := range contents {
		h = (h ^ c) * 1099511628211
		h ^= h >> 29
		hs[i] = h
	}
	return hs
}

// blocksOf returns n block contents numbered from first.
func blocksOf(first uint64, n int) []uint64 {
	cs := make([]uint64, n)
	for i := range cs {
		cs[i] = first + uint64(i)
	}
	return cs
}

func newEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	e, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return e
}

func mustAdd(t testing.TB, e *Engine, r Request) {
	t.Helper()
	if err := e.Add(r); err != nil {
		t.Fatalf("Add(%s): %v", r.ID, err)
	}
}

// runUntil steps e until the event (kind, id) appears and returns it.
func runUntil(t testing.TB, e *Engine, kind EventKind, id string) Event {
	t.Helper()
	for range 1_000_000 {
		d, evs := e.Step()
		for _, ev := range evs {
			if ev.Kind == kind && ev.ID == id {
				return ev
			}
		}
		if d == 0 {
			t.Fatalf("engine idle before %v of %s", kind, id)
		}
	}
	t.Fatalf("no %v of %s", kind, id)
	return Event{}
}

// prefillTime is the latency model's time to prefill uncached tokens of one
// request alone in the engine: one step per budget-sized chunk.
func prefillTime(cfg Config, uncached int) time.Duration {
	steps := (uncached + cfg.StepBudgetTokens - 1) / cfg.StepBudgetTokens
	return time.Duration(steps)*cfg.StepBaseDuration + time.Duration(uncached)*cfg.PrefillDurationPerToken
}

func TestCachedPrefixShortensTimeToFirstToken(t *testing.T) {
	cfg := DefaultConfig()
	e := newEngine(t, cfg)
	const promptTokens = 20_000 // three chunks of at most 8,192
	bs := cfg.BlockSizeTokens
	nBlocks := promptTokens / bs
	const sharedBlocks = 1000

	cold := Request{ID: "cold", PromptTokens: promptTokens, OutputTokens: 1, BlockHashes: chain(blocksOf(0, nBlocks)...)}
	mustAdd(t, e, cold)
	first := runUntil(t, e, FirstToken, "cold")
	coldTTFT := first.At - first.Arrived
	if want := prefillTime(cfg, promptTokens); coldTTFT != want {
		t.Fatalf("cold TTFT = %v, want %v", coldTTFT, want)
	}
	if first.CachedTokens != 0 {
		t.Fatalf("cold CachedTokens = %d, want 0", first.CachedTokens)
	}

	// Arrive later, on an idle engine, sharing the first 1,000 blocks.
	e.AdvanceTo(e.Now() + time.Second)
	warmContents := append(blocksOf(0, sharedBlocks), blocksOf(1_000_000, nBlocks-sharedBlocks)...)
	mustAdd(t, e, Request{ID: "warm", PromptTokens: promptTokens, OutputTokens: 1, BlockHashes: chain(warmContents...)})
	warm := runUntil(t, e, FirstToken, "warm")
	warmTTFT := warm.At - warm.Arrived
	cached := sharedBlocks * bs
	if warm.CachedTokens != cached {
		t.Fatalf("warm CachedTokens = %d, want %d", warm.CachedTokens, cached)
	}
	if want := prefillTime(cfg, promptTokens-cached); warmTTFT != want {
		t.Fatalf("warm TTFT = %v, want %v", warmTTFT, want)
	}
	saved := coldTTFT - warmTTFT
	if want := 2*cfg.StepBaseDuration + time.Duration(cached)*cfg.PrefillDurationPerToken; saved != want {
		t.Fatalf("cached prefix saved %v, want %v", saved, want)
	}

	// The whole prompt again: every block but the one holding the last
	// token is reused, since that token is always computed.
	mustAdd(t, e, Request{ID: "again", PromptTokens: promptTokens, OutputTokens: 1, BlockHashes: cold.BlockHashes})
	again := runUntil(t, e, FirstToken, "again")
	if want := (nBlocks - 1) * bs; again.CachedTokens != want {
		t.Fatalf("repeat CachedTokens = %d, want %d", again.CachedTokens, want)
	}
	if want := prefillTime(cfg, bs); again.At-again.Arrived != want {
		t.Fatalf("repeat TTFT = %v, want %v", again.At-again.Arrived, want)
	}
	st := e.Stats()
	if want := int64(3 * promptTokens); st.PrefixQueryTokens != want {
		t.Errorf("PrefixQueryTokens = %d, want %d", st.PrefixQueryTokens, want)
	}
	if want := int64(cached + (nBlocks-1)*bs); st.PrefixHitTokens != want {
		t.Errorf("PrefixHitTokens = %d, want %d", st.PrefixHitTokens, want)
	}
}

func TestDecodeStepsProduceOneTokenEach(t *testing.T) {
	cfg := DefaultConfig()
	e := newEngine(t, cfg)
	mustAdd(t, e, Request{ID: "r", PromptTokens: 100, OutputTokens: 5})
	var got []Event
	for e.Busy() {
		_, evs := e.Step()
		got = append(got, evs...)
	}
	kinds := []EventKind{FirstToken, Token, Token, Token, Token, Finished}
	if len(got) != len(kinds) {
		t.Fatalf("events = %v, want kinds %v", got, kinds)
	}
	at := prefillTime(cfg, 100)
	decodeStep := cfg.StepBaseDuration + cfg.DecodeDurationPerSequence
	for i, ev := range got {
		if ev.Kind != kinds[i] {
			t.Fatalf("event %d kind = %v, want %v", i, ev.Kind, kinds[i])
		}
		if i > 0 && i < 5 {
			at += decodeStep
		}
		if ev.At != at {
			t.Errorf("event %d (%v) at %v, want %v", i, ev.Kind, ev.At, at)
		}
		if want := min(i+1, 5); ev.OutputTokens != want {
			t.Errorf("event %d OutputTokens = %d, want %d", i, ev.OutputTokens, want)
		}
	}
}

func TestRequestAddedDuringAStepWaitsForTheNext(t *testing.T) {
	cfg := DefaultConfig()
	e := newEngine(t, cfg)
	mustAdd(t, e, Request{ID: "long", PromptTokens: cfg.StepBudgetTokens, OutputTokens: 10})
	firstStep := prefillTime(cfg, cfg.StepBudgetTokens)

	arrive := 50 * time.Millisecond
	if evs := e.AdvanceTo(arrive); len(evs) != 0 {
		t.Fatalf("events before the first step ended: %v", evs)
	}
	if e.Now() != arrive {
		t.Fatalf("Now = %v after AdvanceTo(%v)", e.Now(), arrive)
	}
	if next, ok := e.NextEventAt(); !ok || next != firstStep {
		t.Fatalf("NextEventAt = %v, %v; want %v, true", next, ok, firstStep)
	}
	mustAdd(t, e, Request{ID: "short", PromptTokens: 100, OutputTokens: 1})
	if st := e.Stats(); st.WaitingRequests != 1 || st.RunningRequests != 1 {
		t.Fatalf("running/waiting = %d/%d, want 1/1", st.RunningRequests, st.WaitingRequests)
	}

	// The second step decodes "long" and prefills "short" together.
	secondStep := cfg.StepBaseDuration + 100*cfg.PrefillDurationPerToken + cfg.DecodeDurationPerSequence
	evs := e.AdvanceTo(firstStep + secondStep)
	var short *Event
	for i := range evs {
		if evs[i].ID == "short" && evs[i].Kind == FirstToken {
			short = &evs[i]
		}
	}
	if short == nil {
		t.Fatalf("no first token of short by %v: %v", firstStep+secondStep, evs)
	}
	if want := firstStep - arrive + secondStep; short.At-short.Arrived != want {
		t.Fatalf("short TTFT = %v, want %v", short.At-short.Arrived, want)
	}
}

// The prefill time (first scheduled to first token) leaves out the time
// queued; the prompt-token counter counts whole prompts, cached tokens
// included, once their prefill ends.
func TestPrefillTimeExcludesTheQueueAndPromptTokensCountAtTheFirstToken(t *testing.T) {
	cfg := DefaultConfig()
	cfg.MaxRunningRequests = 1
	e := newEngine(t, cfg)
	bs := cfg.BlockSizeTokens
	hashes := chain(blocksOf(0, 20)...)
	mustAdd(t, e, Request{ID: "a", PromptTokens: 20 * bs, OutputTokens: 5, BlockHashes: hashes})
	mustAdd(t, e, Request{ID: "b", PromptTokens: 20 * bs, OutputTokens: 1, BlockHashes: hashes}) // waits for a
	mustAdd(t, e, Request{ID: "gone", PromptTokens: 100, OutputTokens: 1})                       // cancelled while waiting

	e.AdvanceTo(time.Microsecond) // a is admitted, its prefill step runs
	if st := e.Stats(); st.RunningRequests != 1 || st.PromptTokens != 0 {
		t.Fatalf("running %d, PromptTokens %d while a's prefill runs; want 1 and 0", st.RunningRequests, st.PromptTokens)
	}
	a := runUntil(t, e, FirstToken, "a")
	if a.Scheduled != 0 || a.At-a.Scheduled != prefillTime(cfg, 20*bs) {
		t.Fatalf("a scheduled at %v, prefilled in %v; want 0 and %v", a.Scheduled, a.At-a.Scheduled, prefillTime(cfg, 20*bs))
	}
	if got := e.Stats().PromptTokens; got != 20*int64(bs) {
		t.Fatalf("PromptTokens = %d after a's first token, want %d", got, 20*bs)
	}
	aDone := runUntil(t, e, Finished, "a")
	if !e.Cancel("gone") {
		t.Fatal("Cancel(gone) of a waiting request returned false")
	}
	b := runUntil(t, e, FirstToken, "b")
	// b reuses a's blocks but the one holding its last token.
	if b.CachedTokens != 19*bs {
		t.Fatalf("b CachedTokens = %d, want %d", b.CachedTokens, 19*bs)
	}
	if b.Arrived != 0 || b.Scheduled != aDone.At {
		t.Fatalf("b arrived at %v, scheduled at %v; want 0 and when a finished, %v", b.Arrived, b.Scheduled, aDone.At)
	}
	if got, want := b.At-b.Scheduled, prefillTime(cfg, bs); got != want {
		t.Fatalf("b prefill time = %v, want %v (its TTFT %v includes the queue)", got, want, b.At-b.Arrived)
	}
	// Cached tokens count, a cancelled request whose prefill never ended
	// does not.
	if got := e.Stats().PromptTokens; got != 40*int64(bs) {
		t.Fatalf("PromptTokens = %d, want %d", got, 40*bs)
	}
}

func TestQueueFormsWhenRunningRequestsAreFull(t *testing.T) {
	cfg := DefaultConfig()
	e := newEngine(t, cfg)
	total := cfg.MaxRunningRequests + 44
	for i := range total {
		mustAdd(t, e, Request{ID: id(i), PromptTokens: 10, OutputTokens: 50})
	}
	_, evs := e.Step()
	firstStep := append([]Event(nil), evs...)
	st := e.Stats()
	if st.RunningRequests != cfg.MaxRunningRequests || st.WaitingRequests != 44 {
		t.Fatalf("running/waiting = %d/%d, want %d/44", st.RunningRequests, st.WaitingRequests, cfg.MaxRunningRequests)
	}
	// Nobody is admitted until someone finishes; then the queue drains in order.
	firstFinish, firstQueued := time.Duration(-1), time.Duration(-1)
	nextFirstToken := 0
	for evs := firstStep; len(evs) > 0 || e.Busy(); {
		for _, ev := range evs {
			if ev.Kind == Finished && firstFinish < 0 {
				firstFinish = ev.At
			}
			if ev.Kind == FirstToken {
				if ev.ID != id(nextFirstToken) {
					t.Fatalf("first token of %s, want %s (FIFO)", ev.ID, id(nextFirstToken))
				}
				nextFirstToken++
				if ev.ID == id(cfg.MaxRunningRequests) {
					firstQueued = ev.At
				}
			}
		}
		if s := e.Stats(); s.RunningRequests > cfg.MaxRunningRequests {
			t.Fatalf("running = %d > %d", s.RunningRequests, cfg.MaxRunningRequests)
		}
		_, evs = e.Step()
	}
	if firstQueued <= firstFinish {
		t.Fatalf("queued request's first token at %v, not after the first finish at %v", firstQueued, firstFinish)
	}
	if st := e.Stats(); st.FinishedRequests != int64(total) {
		t.Fatalf("finished = %d, want %d", st.FinishedRequests, total)
	}
}

func TestQueueFormsWhenKVBlocksAreShort(t *testing.T) {
	cfg := DefaultConfig()
	cfg.KVBlocks = 10
	e := newEngine(t, cfg)
	// 80 prompt + 16 output tokens: 6 blocks each, so only one fits.
	mustAdd(t, e, Request{ID: "a", PromptTokens: 80, OutputTokens: 16})
	mustAdd(t, e, Request{ID: "b", PromptTokens: 80, OutputTokens: 16})
	e.Step()
	if st := e.Stats(); st.RunningRequests != 1 || st.WaitingRequests != 1 || st.KVBlocksInUse != 6 {
		t.Fatalf("running/waiting/in use = %d/%d/%d, want 1/1/6", st.RunningRequests, st.WaitingRequests, st.KVBlocksInUse)
	}
	aDone := runUntil(t, e, Finished, "a")
	bFirst := runUntil(t, e, FirstToken, "b")
	if bFirst.At <= aDone.At {
		t.Fatalf("b started at %v, before a finished at %v", bFirst.At, aDone.At)
	}
	if err := e.Add(Request{ID: "huge", PromptTokens: 150, OutputTokens: 20}); err == nil || !strings.Contains(err.Error(), "need 11 KV blocks") {
		t.Fatalf("Add of a request larger than the cache: err = %v, want one saying it needs 11 KV blocks", err)
	}
}

func TestEvictionIsLeastRecentlyUsedTailFirst(t *testing.T) {
	cfg := DefaultConfig()
	cfg.KVBlocks = 10
	e := newEngine(t, cfg)
	// a: 4 prompt blocks + 1 output block.
	a := Request{ID: "a", PromptTokens: 64, OutputTokens: 1, BlockHashes: chain(blocksOf(0, 4)...)}
	mustAdd(t, e, a)
	runUntil(t, e, Finished, "a")
	if st := e.Stats(); st.KVBlocksCached != 4 || st.KVBlocksInUse != 0 {
		t.Fatalf("after a: cached/in use = %d/%d, want 4/0", st.KVBlocksCached, st.KVBlocksInUse)
	}
	// b needs 8 blocks: the 6 free ones and the 2 least recently used,
	// which are a's last two prompt blocks.
	mustAdd(t, e, Request{ID: "b", PromptTokens: 120, OutputTokens: 8, BlockHashes: chain(blocksOf(100, 7)...)})
	runUntil(t, e, Finished, "b")
	if st := e.Stats(); st.Evictions != 2 {
		t.Fatalf("evictions = %d, want 2", st.Evictions)
	}
	a.ID = "a2"
	mustAdd(t, e, a)
	ev := runUntil(t, e, FirstToken, "a2")
	if want := 2 * cfg.BlockSizeTokens; ev.CachedTokens != want {
		t.Fatalf("a again: CachedTokens = %d, want %d (its first two blocks survived)", ev.CachedTokens, want)
	}
}

func TestCancelFreesTheRequest(t *testing.T) {
	cfg := DefaultConfig()
	cfg.KVBlocks = 10
	e := newEngine(t, cfg)
	mustAdd(t, e, Request{ID: "run", PromptTokens: 64, OutputTokens: 64, BlockHashes: chain(blocksOf(0, 4)...)})
	mustAdd(t, e, Request{ID: "wait", PromptTokens: 64, OutputTokens: 64})
	e.AdvanceTo(time.Millisecond) // "run" is admitted; its first step is running
	if st := e.Stats(); st.KVBlocksInUse != 8 || st.WaitingRequests != 1 {
		t.Fatalf("in use/waiting = %d/%d, want 8/1", st.KVBlocksInUse, st.WaitingRequests)
	}
	if !e.Cancel("wait") || !e.Cancel("run") {
		t.Fatal("Cancel of a held request returned false")
	}
	if e.Cancel("run") {
		t.Fatal("second Cancel returned true")
	}
	_, evs := e.Step() // the step that was running completes without them
	if len(evs) != 0 {
		t.Fatalf("events of cancelled requests: %v", evs)
	}
	st := e.Stats()
	if st.KVBlocksInUse != 0 || st.RunningRequests != 0 || st.WaitingRequests != 0 || st.AbortedRequests != 2 {
		t.Fatalf("after cancel: %+v", st)
	}
	// Its prompt blocks were scheduled, so they stay cached for reuse.
	if st.KVBlocksCached != 4 {
		t.Fatalf("cached blocks = %d, want 4", st.KVBlocksCached)
	}
	if e.Busy() {
		t.Fatal("engine busy with nothing to do")
	}
	if err := e.Add(Request{ID: "run", PromptTokens: 1, OutputTokens: 1}); err != nil {
		t.Fatalf("ID of a cancelled request not reusable: %v", err)
	}
}

// TestQueuedPrefillTokensCountWhatIsLeftToCompute follows one long prompt
// through chunked prefill, with a second one that shares part of it waiting
// behind: the gauge counts the share of a step's chunk that the step has
// still to run, and a waiting prompt without the blocks the cache already
// holds.
func TestQueuedPrefillTokensCountWhatIsLeftToCompute(t *testing.T) {
	cfg := DefaultConfig()
	cfg.MaxRunningRequests = 1 // keep the second request waiting
	e := newEngine(t, cfg)
	bs := cfg.BlockSizeTokens
	queued := func(want int, when string) {
		t.Helper()
		if got := e.Stats().QueuedPrefillTokens; got != want {
			t.Fatalf("%s: QueuedPrefillTokens = %d, want %d", when, got, want)
		}
	}
	queued(0, "idle")

	const longTokens = 20_000 // chunks of 8,192, 8,192 and 3,616
	long := Request{ID: "long", PromptTokens: longTokens, OutputTokens: 2, BlockHashes: chain(blocksOf(0, longTokens/bs)...)}
	mustAdd(t, e, long)
	queued(longTokens, "waiting, nothing cached")

	e.AdvanceTo(time.Nanosecond) // the first step starts and is still running
	queued(longTokens, "as the first chunk starts")
	stepEnd, _ := e.NextEventAt()
	e.AdvanceTo(stepEnd / 2)
	queued(longTokens-cfg.StepBudgetTokens/2, "half way through the first chunk")
	e.Step()
	queued(longTokens-cfg.StepBudgetTokens, "after the first chunk")

	// Shares the first 100 blocks of the long prompt, which the first chunk
	// has cached; waits, since the long request takes the only running slot.
	const sharedBlocks, shortTokens = 100, 4000
	contents := append(blocksOf(0, sharedBlocks), blocksOf(1_000_000, shortTokens/bs-sharedBlocks)...)
	mustAdd(t, e, Request{ID: "short", PromptTokens: shortTokens, OutputTokens: 1, BlockHashes: chain(contents...)})
	queued(longTokens-cfg.StepBudgetTokens+shortTokens-sharedBlocks*bs, "with a waiting prompt partly cached")

	runUntil(t, e, FirstToken, "long")
	queued(shortTokens-sharedBlocks*bs, "the long prompt computed, the short one waiting")
	runUntil(t, e, FirstToken, "short")
	queued(0, "both prompts computed")
	if st := e.Stats(); st.PrefillTokens != int64(longTokens+shortTokens-sharedBlocks*bs) {
		t.Fatalf("PrefillTokens = %d, want %d: the gauge and the counter disagree on what was computed", st.PrefillTokens, longTokens+shortTokens-sharedBlocks*bs)
	}

	// A cancelled request leaves nothing queued.
	mustAdd(t, e, Request{ID: "gone", PromptTokens: 5000, OutputTokens: 1})
	e.AdvanceTo(e.Now() + time.Nanosecond)
	e.Cancel("gone")
	for e.Busy() {
		e.Step()
	}
	queued(0, "after a cancellation")
}

// TestStatsMatchStateUnderRandomLoad drives the engine with random arrivals,
// shared prefixes and cancellations, checking after every call that the
// blocks partition as the invariant says and that Stats agree with the
// requests and events.
func TestStatsMatchStateUnderRandomLoad(t *testing.T) {
	cfg := DefaultConfig()
	cfg.KVBlocks = 1000
	cfg.MaxRunningRequests = 32
	e := newEngine(t, cfg)
	rng := rand.New(rand.NewPCG(1, 2))

	added, cancelled, finished := 0, 0, 0
	var outputTokens, hitTokens, queryTokens, promptTokens int64
	cancelledBeforeFirstToken := map[string]bool{}
	live := map[string]int{} // ID -> prompt tokens, while held
	seen := map[string]bool{}
	check := func(evs []Event) {
		t.Helper()
		for _, ev := range evs {
			switch ev.Kind {
			case FirstToken:
				outputTokens++
				hitTokens += int64(ev.CachedTokens)
				queryTokens += int64(live[ev.ID])
				promptTokens += int64(live[ev.ID])
				seen[ev.ID] = true
				if ev.Scheduled < ev.Arrived || ev.At <= ev.Scheduled {
					t.Fatalf("first token of %s: arrived %v, scheduled %v, at %v; want arrived <= scheduled < at", ev.ID, ev.Arrived, ev.Scheduled, ev.At)
				}
			case Token:
				outputTokens++
			case Finished:
				finished++
				delete(live, ev.ID)
			}
		}
		checkInvariants(t, e)
		st := e.Stats()
		if got := int(st.FinishedRequests); got != finished {
			t.Fatalf("FinishedRequests = %d, events say %d", got, finished)
		}
		if got := int(st.AbortedRequests); got != cancelled {
			t.Fatalf("AbortedRequests = %d, want %d", got, cancelled)
		}
		if st.RunningRequests+st.WaitingRequests != added-cancelled-finished {
			t.Fatalf("running+waiting = %d, want %d", st.RunningRequests+st.WaitingRequests, added-cancelled-finished)
		}
		if st.OutputTokens != outputTokens {
			t.Fatalf("OutputTokens = %d, events say %d", st.OutputTokens, outputTokens)
		}
		if st.PromptTokens != promptTokens {
			t.Fatalf("PromptTokens = %d, first tokens say %d", st.PromptTokens, promptTokens)
		}
		if st.PrefixHitTokens > st.PrefixQueryTokens {
			t.Fatalf("hits %d > queries %d", st.PrefixHitTokens, st.PrefixQueryTokens)
		}
		livePrompts := 0
		for _, n := range live {
			livePrompts += n
		}
		if st.QueuedPrefillTokens < 0 || st.QueuedPrefillTokens > livePrompts {
			t.Fatalf("QueuedPrefillTokens = %d, want from 0 to %d (the live prompts)", st.QueuedPrefillTokens, livePrompts)
		}
		if st.KVCacheUsage() != float64(st.KVBlocksInUse)/float64(cfg.KVBlocks) {
			t.Fatalf("KVCacheUsage %v disagrees with %d/%d", st.KVCacheUsage(), st.KVBlocksInUse, cfg.KVBlocks)
		}
	}

	now := time.Duration(0)
	for i := range 600 {
		now += time.Duration(rng.IntN(40)) * time.Millisecond
		check(e.AdvanceTo(now))
		// Prompts from 8 conversations; each shares a random number of
		// leading blocks with its conversation.
		conv := uint64(rng.IntN(8)) * 1_000_000
		prompt := 1 + rng.IntN(1500)
		nb := prompt / cfg.BlockSizeTokens
		shared := rng.IntN(nb + 1)
		contents := append(blocksOf(conv, shared), blocksOf(uint64(i+1)*10_000_000, nb-shared)...)
		r := Request{ID: id(i), PromptTokens: prompt, OutputTokens: 1 + rng.IntN(200), BlockHashes: chain(contents...)}
		mustAdd(t, e, r)
		added++
		live[r.ID] = prompt
		if rng.IntN(10) == 0 && len(live) > 0 {
			for victim := range live {
				if !e.Cancel(victim) {
					t.Fatalf("Cancel(%s) of a held request returned false", victim)
				}
				if !seen[victim] {
					cancelledBeforeFirstToken[victim] = true
				}
				delete(live, victim)
				cancelled++
				break
			}
		}
		check(nil)
	}
	for e.Busy() {
		_, evs := e.Step()
		check(evs)
	}
	st := e.Stats()
	if st.KVBlocksInUse != 0 || st.QueuedPrefillTokens != 0 {
		t.Fatalf("idle with %d blocks in use and %d prefill tokens queued", st.KVBlocksInUse, st.QueuedPrefillTokens)
	}
	// Requests cancelled before their first token may have been admitted
	// (counted) or not; all others were counted exactly once.
	if st.PrefixHitTokens < hitTokens || st.PrefixQueryTokens < queryTokens {
		t.Fatalf("prefix hits/queries %d/%d below what first tokens show, %d/%d", st.PrefixHitTokens, st.PrefixQueryTokens, hitTokens, queryTokens)
	}
	if len(cancelledBeforeFirstToken) == 0 && (st.PrefixHitTokens != hitTokens || st.PrefixQueryTokens != queryTokens) {
		t.Fatalf("prefix hits/queries %d/%d, first tokens show %d/%d", st.PrefixHitTokens, st.PrefixQueryTokens, hitTokens, queryTokens)
	}
	if st.PrefixHitTokens == 0 || st.Evictions == 0 {
		t.Fatalf("the load did not exercise reuse and eviction: hits %d, evictions %d", st.PrefixHitTokens, st.Evictions)
	}
}

// TestThousandsOfRequestsInVirtualTime runs the way a routing simulation
// would: advance to each arrival, add, and finally drain.
func TestThousandsOfRequestsInVirtualTime(t *testing.T) {
	cfg := DefaultConfig()
	e := newEngine(t, cfg)
	const n = 5000
	const promptTokens, outputTokens = 1000, 50
	arrivals := make(map[string]time.Duration, n)
	var ttftSum time.Duration
	collect := func(evs []Event) {
		for _, ev := range evs {
			if ev.Kind == FirstToken {
				if ev.Arrived != arrivals[ev.ID] {
					t.Fatalf("%s arrived at %v, added at %v", ev.ID, ev.Arrived, arrivals[ev.ID])
				}
				ttftSum += ev.At - ev.Arrived
			}
		}
	}
	for i := range n {
		at := time.Duration(i) * 50 * time.Millisecond // 20 requests/s
		collect(e.AdvanceTo(at))
		arrivals[id(i)] = at
		mustAdd(t, e, Request{ID: id(i), PromptTokens: promptTokens, OutputTokens: outputTokens})
	}
	for e.Busy() {
		next, _ := e.NextEventAt()
		collect(e.AdvanceTo(next + time.Nanosecond))
	}
	st := e.Stats()
	if st.FinishedRequests != n || st.OutputTokens != n*outputTokens || st.PrefillTokens != n*promptTokens {
		t.Fatalf("finished %d, output %d, prefill %d", st.FinishedRequests, st.OutputTokens, st.PrefillTokens)
	}
	// 20 requests/s of 1,000 tokens is 40% of the prefill capacity: no
	// request should take longer to start than a handful of steps.
	if mean := ttftSum / n; mean < prefillTime(cfg, promptTokens) || mean > 10*prefillTime(cfg, promptTokens) {
		t.Fatalf("mean TTFT %v outside [%v, %v]", mean, prefillTime(cfg, promptTokens), 10*prefillTime(cfg, promptTokens))
	}
}

func TestConfigAndRequestErrorsNameTheField(t *testing.T) {
	cfg := DefaultConfig()
	cfg.KVBlocks = 0
	cfg.StepBaseDuration = 0
	_, err := New(cfg)
	if err == nil || !strings.Contains(err.Error(), "KVBlocks: 0 is invalid") || !strings.Contains(err.Error(), "StepBaseDuration") {
		t.Fatalf("New with a bad config: err = %v", err)
	}
	e := newEngine(t, DefaultConfig())
	for _, tc := range []struct {
		r    Request
		want string
	}{
		{Request{PromptTokens: 1, OutputTokens: 1}, "ID is empty"},
		{Request{ID: "x", PromptTokens: 0, OutputTokens: 1}, "PromptTokens 0"},
		{Request{ID: "x", PromptTokens: 1, OutputTokens: 0}, "OutputTokens 0"},
		{Request{ID: "x", PromptTokens: 16, OutputTokens: 1, BlockHashes: []uint64{1, 2}}, "2 BlockHashes"},
	} {
		if err := e.Add(tc.r); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Add(%+v): err = %v, want it to contain %q", tc.r, err, tc.want)
		}
	}
	mustAdd(t, e, Request{ID: "x", PromptTokens: 1, OutputTokens: 1})
	if err := e.Add(Request{ID: "x", PromptTokens: 1, OutputTokens: 1}); err == nil || !strings.Contains(err.Error(), "already in use") {
		t.Errorf("duplicate ID: err = %v", err)
	}
}

func BenchmarkVirtualTime(b *testing.B) {
	cfg := DefaultConfig()
	for b.Loop() {
		e, _ := New(cfg)
		for i := range 1000 {
			e.AdvanceTo(time.Duration(i) * 5 * time.Millisecond)
			_ = e.Add(Request{ID: id(i), PromptTokens: 1000, OutputTokens: 50, BlockHashes: chain(blocksOf(uint64(i%10)*100, 62)...)})
		}
		for e.Busy() {
			e.Step()
		}
	}
}

func id(i int) string { return "r" + strconv.Itoa(i) }

// checkInvariants checks the package invariant: every block is free, held
// (its ref equals the number of running requests holding it), or cached on
// the LRU list, and the hash index points at hashed blocks.
func checkInvariants(t *testing.T, e *Engine) {
	t.Helper()
	refs := make([]int32, len(e.blocks))
	for _, r := range e.running {
		if r.state != running {
			t.Fatalf("request %s on the running list in state %d", r.ID, r.state)
		}
		if want := e.BlocksNeeded(r.PromptTokens, r.OutputTokens); len(r.blocks) != want {
			t.Fatalf("request %s holds %d blocks, needs %d", r.ID, len(r.blocks), want)
		}
		for _, idx := range r.blocks {
			refs[idx]++
		}
	}
	for _, r := range e.waiting {
		if r.state != waiting || r.blocks != nil {
			t.Fatalf("waiting request %s in state %d with %d blocks", r.ID, r.state, len(r.blocks))
		}
	}
	if got := len(e.running) + len(e.waiting); got != len(e.requests) {
		t.Fatalf("running+waiting = %d, requests map has %d", got, len(e.requests))
	}
	place := make([]int, len(e.blocks)) // 1 free, 2 LRU
	for _, idx := range e.free {
		place[idx]++
		if e.blocks[idx].hashed {
			t.Fatalf("free block %d is hashed", idx)
		}
	}
	n := 0
	for idx := range e.evictable.All() {
		place[idx] += 2
		n++
		if !e.blocks[idx].hashed {
			t.Fatalf("LRU block %d is not hashed", idx)
		}
	}
	if n != e.evictable.Len() {
		t.Fatalf("LRU list has %d blocks, recorded %d", n, e.evictable.Len())
	}
	for idx := range e.blocks {
		b := e.blocks[idx]
		if b.ref != refs[idx] {
			t.Fatalf("block %d ref %d, held by %d requests", idx, b.ref, refs[idx])
		}
		switch {
		case b.ref > 0 && place[idx] != 0:
			t.Fatalf("held block %d also on list %d", idx, place[idx])
		case b.ref == 0 && place[idx] != 1 && place[idx] != 2:
			t.Fatalf("unheld block %d on list %d (want exactly one)", idx, place[idx])
		}
	}
	hashed := 0
	for _, b := range e.blocks {
		if b.hashed {
			hashed++
		}
	}
	if hashed != len(e.byHash) {
		t.Fatalf("%d hashed blocks, %d in the hash index", hashed, len(e.byHash))
	}
	for h, idx := range e.byHash {
		if !e.blocks[idx].hashed || e.blocks[idx].hash != h {
			t.Fatalf("hash index entry %x points at block %d holding %x (hashed %v)", h, idx, e.blocks[idx].hash, e.blocks[idx].hashed)
		}
	}
}
