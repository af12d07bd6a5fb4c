package engine

import (
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func loraConfig(maxLoRAs int) Config {
	cfg := DefaultConfig()
	cfg.MaxLoRAs = maxLoRAs
	return cfg
}

// runToEnd steps e until it is idle, checking the adapter invariant after
// every step, and returns the events by request and kind.
func runToEnd(t *testing.T, e *Engine) map[string]map[EventKind]Event {
	t.Helper()
	got := map[string]map[EventKind]Event{}
	for e.Busy() {
		_, evs := e.Step()
		for _, ev := range evs {
			if got[ev.ID] == nil {
				got[ev.ID] = map[EventKind]Event{}
			}
			if _, seen := got[ev.ID][ev.Kind]; !seen || ev.Kind != Token {
				got[ev.ID][ev.Kind] = ev
			}
		}
		checkInvariants(t, e)
		checkAdapters(t, e)
	}
	return got
}

func TestAdapterBeyondMaxLoRAsWaitsAndOthersOvertakeIt(t *testing.T) {
	e := newEngine(t, loraConfig(1))
	mustAdd(t, e, Request{ID: "a1-long", PromptTokens: 100, OutputTokens: 40, Adapter: "a1"})
	mustAdd(t, e, Request{ID: "a2", PromptTokens: 100, OutputTokens: 5, Adapter: "a2"})
	mustAdd(t, e, Request{ID: "base", PromptTokens: 100, OutputTokens: 5})
	mustAdd(t, e, Request{ID: "a1-short", PromptTokens: 100, OutputTokens: 5, Adapter: "a1"})
	e.Step()
	st := e.Stats()
	// a2 would be a second adapter: it waits, and the base model's and
	// a1's requests behind it run, as vLLM skips it.
	if st.RunningRequests != 3 || st.WaitingRequests != 1 || st.RunningAdapters != 1 || st.AdapterLoads != 1 {
		t.Fatalf("after the first step: %d running, %d waiting, %d adapters running, %d loads; want 3, 1 (a2), 1, 1",
			st.RunningRequests, st.WaitingRequests, st.RunningAdapters, st.AdapterLoads)
	}
	evs := runToEnd(t, e)
	if a2, a1 := evs["a2"][FirstToken], evs["a1-long"][Finished]; a2.Scheduled < a1.At {
		t.Fatalf("a2 was scheduled at %v, before a1's last request finished at %v", a2.Scheduled, a1.At)
	}
	if a2, base := evs["a2"][FirstToken], evs["base"][FirstToken]; base.At >= a2.At {
		t.Fatalf("the base request's first token at %v is not before a2's at %v", base.At, a2.At)
	}
	if st := e.Stats(); st.AdapterLoads != 2 || st.FinishedRequests != 4 || st.RunningAdapters != 0 {
		t.Fatalf("at the end: %d loads, %d finished, %d adapters running; want 2, 4, 0", st.AdapterLoads, st.FinishedRequests, st.RunningAdapters)
	}
}

func TestAdapterLoadsOncePerAdapterUntilEvicted(t *testing.T) {
	cfg := loraConfig(2)
	e := newEngine(t, cfg)
	// One request at a time; the two slots are taken least recently used
	// first. A load makes the step that admits the request longer.
	for i, tc := range []struct {
		adapter string
		loads   int64
	}{
		{"a1", 1}, {"a2", 2}, {"a1", 2}, {"a2", 2},
		{"a3", 3}, // evicts a1, used before a2
		{"a2", 3},
		{"a1", 4}, // evicts a3
		{"", 4},   // the base model needs no slot
		{"a2", 4},
	} {
		r := Request{ID: id(i), PromptTokens: 100, OutputTokens: 1, Adapter: tc.adapter}
		mustAdd(t, e, r)
		before := e.Stats().AdapterLoads
		ev := runUntil(t, e, FirstToken, r.ID)
		st := e.Stats()
		if st.AdapterLoads != tc.loads {
			t.Fatalf("request %d (%q): %d loads, want %d", i, tc.adapter, st.AdapterLoads, tc.loads)
		}
		want := prefillTime(cfg, 100)
		if st.AdapterLoads > before {
			want += cfg.LoRALoadTime
		}
		if got := ev.At - ev.Arrived; got != want {
			t.Fatalf("request %d (%q): time to first token %v, want %v", i, tc.adapter, got, want)
		}
		checkAdapters(t, e)
	}
}

func TestPrefixCacheIsKeyedByAdapter(t *testing.T) {
	e := newEngine(t, loraConfig(2))
	hashes := chain(blocksOf(1, 10)...) // 10 full blocks of a 161-token prompt
	for i, tc := range []struct {
		adapter string
		cached  int
	}{
		{"", 0},
		{"a1", 0},   // the base model's blocks are not a1's
		{"a1", 160}, // a1's own are
		{"a2", 0},   // nor are a1's a2's
		{"", 160},   // the base model's are still there
		{"a2", 160},
	} {
		r := Request{ID: id(i), PromptTokens: 161, OutputTokens: 1, BlockHashes: hashes, Adapter: tc.adapter}
		mustAdd(t, e, r)
		if ev := runUntil(t, e, FirstToken, r.ID); ev.CachedTokens != tc.cached {
			t.Fatalf("request %d (%q): %d cached tokens, want %d", i, tc.adapter, ev.CachedTokens, tc.cached)
		}
	}
	if hashes[0] != chain(blocksOf(1, 10)...)[0] {
		t.Fatal("Add changed the caller's BlockHashes")
	}
}

func TestAdapterErrorsNameTheField(t *testing.T) {
	e := newEngine(t, DefaultConfig())
	if err := e.Add(Request{ID: "x", PromptTokens: 1, OutputTokens: 1, Adapter: "a1"}); err == nil || !strings.Contains(err.Error(), `Adapter "a1" is invalid`) {
		t.Fatalf("an adapter on an engine without slots: err = %v", err)
	}
	cfg := DefaultConfig()
	cfg.MaxLoRAs = -1
	cfg.LoRALoadTime = -time.Second
	_, err := New(cfg)
	for _, want := range []string{"MaxLoRAs: -1 is invalid", "LoRALoadTime: -1s is invalid"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("New: err = %v, want it to contain %q", err, want)
		}
	}
}

// TestAdaptersUnderRandomLoad mixes the base model and five adapters over
// three slots, with cancellations, checking the block and adapter
// invariants after every call.
func TestAdaptersUnderRandomLoad(t *testing.T) {
	cfg := loraConfig(3)
	cfg.KVBlocks = 1000
	cfg.MaxRunningRequests = 32
	cfg.LoRALoadTime = 20 * time.Millisecond
	e := newEngine(t, cfg)
	rng := rand.New(rand.NewPCG(3, 4))
	adapters := []string{"", "a1", "a2", "a3", "a4", "a5"}
	var live []string
	maxRunning := 0
	now := time.Duration(0)
	for i := range 600 {
		// About half the engine's capacity: a busier engine keeps three
		// adapters running and starves the others, as vLLM would.
		now += time.Duration(rng.IntN(160)) * time.Millisecond
		for _, ev := range e.AdvanceTo(now) {
			if ev.Kind == Finished {
				live = removeID(live, ev.ID)
			}
		}
		checkInvariants(t, e)
		checkAdapters(t, e)
		maxRunning = max(maxRunning, e.Stats().RunningAdapters)
		prompt := 1 + rng.IntN(1500)
		r := Request{
			ID: id(i), PromptTokens: prompt, OutputTokens: 1 + rng.IntN(200),
			BlockHashes: chain(blocksOf(uint64(rng.IntN(4))*1_000_000, prompt/cfg.BlockSizeTokens)...),
			Adapter:     adapters[rng.IntN(len(adapters))],
		}
		mustAdd(t, e, r)
		live = append(live, r.ID)
		if rng.IntN(10) == 0 {
			victim := live[rng.IntN(len(live))]
			if !e.Cancel(victim) {
				t.Fatalf("Cancel(%s) of a held request returned false", victim)
			}
			live = removeID(live, victim)
		}
		checkInvariants(t, e)
		checkAdapters(t, e)
	}
	runToEnd(t, e)
	st := e.Stats()
	if maxRunning != cfg.MaxLoRAs || st.AdapterLoads <= int64(len(adapters)-1) || st.PrefixHitTokens == 0 {
		t.Fatalf("the load did not exercise the slots: at most %d adapters ran, %d loads, %d hit tokens", maxRunning, st.AdapterLoads, st.PrefixHitTokens)
	}
}

func removeID(ids []string, id string) []string {
	for i, x := range ids {
		if x == id {
			return append(ids[:i], ids[i+1:]...)
		}
	}
	return ids
}

// checkAdapters checks the adapter invariant: the running requests use at
// most MaxLoRAs adapters, each counted right and resident in one slot.
func checkAdapters(t *testing.T, e *Engine) {
	t.Helper()
	running := map[string]int{}
	for _, r := range e.running {
		if r.Adapter != "" {
			running[r.Adapter]++
		}
	}
	if len(running) > e.cfg.MaxLoRAs {
		t.Fatalf("%d adapters run (%v), MaxLoRAs is %d", len(running), running, e.cfg.MaxLoRAs)
	}
	if len(running) != len(e.loraRunning) {
		t.Fatalf("running adapters %v, counted %v", running, e.loraRunning)
	}
	for a, n := range running {
		if e.loraRunning[a] != n {
			t.Fatalf("adapter %s: %d running, counted %d", a, n, e.loraRunning[a])
		}
		if i, ok := e.slotOf[a]; !ok || e.slots[i].adapter != a {
			t.Fatalf("running adapter %s is not in a slot", a)
		}
	}
	if e.Stats().RunningAdapters != len(running) {
		t.Fatalf("RunningAdapters = %d, want %d", e.Stats().RunningAdapters, len(running))
	}
	for a, i := range e.slotOf {
		if e.slots[i].adapter != a {
			t.Fatalf("slot index says %s is in slot %d, which holds %q", a, i, e.slots[i].adapter)
		}
	}
}

// A clone runs as the engine would have, and what it does leaves the
// engine as it was: the clone, taken mid-step with both slots held, one
// adapter's request waiting for a slot, a base-model request waiting for
// blocks and a prefix cached, runs the same steps as the engine given the
// same request (evicting blocks as it goes), while another clone, given
// other work, changes nothing the engine then does.
func TestACloneRunsAsTheEngineWouldAndChangesNothing(t *testing.T) {
	cfg := loraConfig(2)
	cfg.KVBlocks = 64 // small enough that requests wait for blocks and evict
	build := func() *Engine {
		e := newEngine(t, cfg)
		for _, r := range []Request{
			{ID: "short", PromptTokens: 160, OutputTokens: 2, BlockHashes: []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, Adapter: "a1"},
			{ID: "a1-long", PromptTokens: 64, OutputTokens: 300, BlockHashes: []uint64{1, 2, 3, 4}, Adapter: "a1"},
			{ID: "a2-long", PromptTokens: 64, OutputTokens: 300, BlockHashes: []uint64{11, 12, 13, 14}, Adapter: "a2"},
			{ID: "a3", PromptTokens: 64, OutputTokens: 20, BlockHashes: []uint64{1, 2, 3, 4}, Adapter: "a3"},
			{ID: "base", PromptTokens: 300, OutputTokens: 20, BlockHashes: []uint64{21, 22, 23}},
		} {
			mustAdd(t, e, r)
			e.AdvanceTo(e.Now() + 250*time.Millisecond)
		}
		return e
	}
	original, twin := build(), build()
	var waiting []string
	for _, r := range original.waiting {
		waiting = append(waiting, r.ID)
	}
	if s := original.Stats(); !original.inFlight || len(original.slotOf) != cfg.MaxLoRAs || !slices.Equal(waiting, []string{"a3", "base"}) || s.KVBlocksCached == 0 {
		t.Fatalf("the engine to clone is not mid-step, with both slots held, a3 and base waiting and a prefix cached: in flight %v, slots %v, waiting %v, %d blocks cached",
			original.inFlight, original.slotOf, waiting, s.KVBlocksCached)
	}
	clone := original.Clone()
	other := original.Clone()
	mustAdd(t, other, Request{ID: "other", PromptTokens: 400, OutputTokens: 30, BlockHashes: []uint64{9, 8, 7}, Adapter: "a4"})
	runToEnd(t, other)
	other.Cancel("a1-long")

	next := Request{ID: "next", PromptTokens: 200, OutputTokens: 10, BlockHashes: []uint64{1, 2, 5}, Adapter: "a3"}
	mustAdd(t, original, next)
	mustAdd(t, twin, next)
	mustAdd(t, clone, next)
	want := runToEnd(t, twin)
	if twin.Stats().Evictions == 0 {
		t.Fatalf("the run evicted no block: %+v", twin.Stats())
	}
	for name, e := range map[string]*Engine{"the engine": original, "its clone": clone} {
		got := runToEnd(t, e)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s ran otherwise than an engine built the same way:\n got %v\nwant %v", name, got, want)
		}
		if g, w := e.Stats(), twin.Stats(); g != w {
			t.Errorf("%s ended with stats %+v, want %+v", name, g, w)
		}
	}
}
