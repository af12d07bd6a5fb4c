package picker

import (
	"math"
	"testing"
	"time"

	"github.com/tallyepp/tally/picker/prefix"
)

// podEndpoints are n endpoints with pod UIDs, as the controllers give them.
func podEndpoints(n int) []Endpoint {
	eps := endpoints(n)
	for i := range eps {
		eps[i].UID = "uid-" + eps[i].Pod
	}
	return eps
}

func TestAFlappingPodKeepsItsRow(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 0, testConfig(), Options{Now: clock.Now})
	eps := podEndpoints(3)
	p.Replace(eps)
	a := addr(0)
	prompt := text("on a", 4000)
	held := []*Reservation{mustPick(t, p, on(a, prompt)), mustPick(t, p, on(a, text("more", 400)))}
	held[1].FirstByte()

	p.Replace(eps[1:]) // a turns NotReady
	l := p.Snapshot()
	if len(l.Endpoints) != 2 || len(l.Retained) != 1 || l.InFlight != 2 {
		t.Fatalf("after a left: %d current, %d retained, %d in flight; want 2, 1, 2", len(l.Endpoints), len(l.Retained), l.InFlight)
	}
	for range 4 {
		if r := mustPick(t, p, Request{Model: model, Prompt: prompt}); endpointOf(r) == a {
			t.Fatal("a retained endpoint was picked")
		} else {
			r.Release()
		}
	}
	if _, err := p.Pick(on(a, prompt)); err == nil {
		t.Error("a subset hint naming only a retained endpoint was routed; want ErrNoEndpoint")
	}

	clock.Advance(1500 * time.Millisecond)
	p.Replace(eps) // a is Ready again: the same pod, the same row
	got := statsOf(p, a)
	// Both are decoding now: the model finished the first one's prefill
	// while a was away.
	if got.InFlight != 2 || got.Decoding != 2 {
		t.Errorf("a came back with %+v, want its 2 requests (decoding)", got)
	}
	if n := heldBlocks(p, prompt, a); n != 4000/64 {
		t.Errorf("a came back holding %d blocks of its prompt, want %d", n, 4000/64)
	}
	for _, r := range held {
		r.Release()
	}
	assertLedgerEmpty(t, p)
}

func TestANewPodAtTheSameAddressStartsFromZero(t *testing.T) {
	p := newPicker(t, 0, testConfig(), Options{})
	eps := podEndpoints(2)
	p.Replace(eps)
	a := addr(0)
	prompt := text("old pod", 4000)
	old := mustPick(t, p, on(a, prompt))

	eps[0].UID = "uid-of-the-replacement"
	p.Replace(eps)
	if got := statsOf(p, a); got.InFlight != 0 || got.PrefillTokens != 0 {
		t.Errorf("the new pod at %s starts with %+v, want zero", a, got)
	}
	if n := heldBlocks(p, prompt, a); n != 0 {
		t.Errorf("the new pod inherits %d blocks of the old one", n)
	}
	if l := p.Snapshot(); len(l.Retained) != 1 || l.Retained[0].InFlight != 1 {
		t.Errorf("the old pod's row = %+v, want retained with its request", l.Retained)
	}
	fresh := mustPick(t, p, on(a, text("new pod", 800)))
	old.FirstByte()
	old.Release() // touches the old pod's row only
	if got := statsOf(p, a); got.InFlight != 1 || got.PrefillTokens != 200 {
		t.Errorf("the new pod = %+v after the old pod's request ended, want only its own (1, 200)", got)
	}
	fresh.Release()
	assertLedgerEmpty(t, p)
}

func TestARetainedRowIsForgottenAfterItsWindowAndItsRequests(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.EndpointRetentionSeconds = 60
	p := newPicker(t, 0, cfg, Options{Now: clock.Now})
	eps := podEndpoints(2)
	p.Replace(eps)
	a := addr(0)
	prompt := text("warm", 4000)
	r := mustPick(t, p, on(a, prompt))

	p.Replace(eps[1:])
	clock.Advance(2 * time.Minute)
	p.Sweep()
	if l := p.Snapshot(); len(l.Retained) != 1 {
		t.Fatalf("a row with a request in flight was forgotten after its window: retained %v", l.Retained)
	}
	r.Release()
	p.Sweep()
	if l := p.Snapshot(); len(l.Retained) != 0 {
		t.Errorf("retained %v after its window and its last request, want none", l.Retained)
	}
	p.Replace(eps)
	if n := heldBlocks(p, prompt, a); n != 0 {
		t.Errorf("a pod back after its retention window still holds %d blocks", n)
	}
	p.mu.Lock()
	dying := p.index.Untidy()
	p.mu.Unlock()
	if dying {
		t.Error("the forgotten row's prefix entries were not reclaimed")
	}
	assertLedgerEmpty(t, p)
}

func TestNonStreamedPrefillDrainsAtTheModelRate(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	p := newPicker(t, 1, cfg, Options{Now: clock.Now})
	a := addr(0)
	first := mustPick(t, p, Request{Model: model, Prompt: text("one", 4000)}) // 1000 tokens: 100 ms
	second := mustPick(t, p, Request{Model: model, Prompt: text("two", 4000)})

	clock.Advance(50 * time.Millisecond)
	if got := statsOf(p, a); got.PrefillTokens != 1500 || got.Decoding != 0 {
		t.Errorf("after 50 ms: %+v, want 1500 prefill, none decoding", got)
	}
	clock.Advance(100 * time.Millisecond)
	if got := statsOf(p, a); got.PrefillTokens != 500 || got.Decoding != 1 {
		t.Errorf("after 150 ms: %+v, want the first done (decoding) and 500 prefill left", got)
	}
	// The second's first byte comes early: what the model still counted goes.
	second.FirstByte()
	if got := statsOf(p, a); got.PrefillTokens != 0 || got.Decoding != 2 {
		t.Errorf("after the second's first byte: %+v, want 0 prefill, 2 decoding", got)
	}
	first.FirstByte() // non-streamed: its body at the end of generation
	if got := statsOf(p, a); got.Decoding != 2 || got.InFlight != 2 {
		t.Errorf("a late first byte changed the ledger: %+v", got)
	}
	if rate := statsOf(p, a).PrefillTokensPerSecond; rate != 10_000 {
		t.Errorf("non-streamed first bytes taught the rate: %v, want the starting 10000", rate)
	}
	first.Release()
	second.Release()
	assertLedgerEmpty(t, p)
}

func TestStreamedFirstBytesTeachThePrefillRate(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	p := newPicker(t, 1, cfg, Options{Now: clock.Now})
	a := addr(0)
	// The engine really prefills 50,000 tokens/s: 5,000 tokens take 100 ms.
	for i := range 30 {
		r := mustPick(t, p, Request{Model: model, Prompt: text("p"+string(rune('a'+i)), 20_000), Stream: true})
		clock.Advance(100 * time.Millisecond)
		r.FirstByte()
		r.Release()
	}
	rate := statsOf(p, a).PrefillTokensPerSecond
	if math.Abs(rate-50_000) > 5_000 {
		t.Errorf("learned rate %.0f tokens/s, want about 50000", rate)
	}
	// Now a queue of non-streamed requests drains at the learned rate.
	for i := range 4 {
		mustPick(t, p, Request{Model: model, Prompt: text("q"+string(rune('a'+i)), 20_000)})
	}
	clock.Advance(250 * time.Millisecond)
	want := 20_000 - 0.25*rate
	if got := statsOf(p, a); got.Decoding != 2 || math.Abs(float64(got.PrefillTokens)-want) > 100 {
		t.Errorf("after 250 ms of 4 x 5,000 tokens at %.0f/s: %+v, want 2 decoding and %.0f prefill", rate, got, want)
	}
}

func TestOnlyTheFirstPromptBlocksAreRecorded(t *testing.T) {
	cfg := testConfig()
	cfg.MaxPromptBlocks = 10 // 7 blocks of 64 characters, then 3 of 1,024
	p := newPicker(t, 1, cfg, Options{})
	prompt := text("huge", 100*64)
	r := mustPick(t, p, Request{Model: model, Prompt: prompt})
	if promptTokens(r) != 100*64/4 {
		t.Errorf("prompt tokens = %d, want every token counted (%d)", promptTokens(r), 100*64/4)
	}
	p.mu.Lock()
	n := p.index.Len(p.rows[0].id)
	p.mu.Unlock()
	if n != 10 {
		t.Errorf("recorded %d blocks, want the cap of 10", n)
	}
	again := mustPick(t, p, Request{Model: model, Prompt: prompt})
	if want := (7*64 + 3*1024) / 4; cachedTokens(again) != want {
		t.Errorf("a repeat matched %d cached tokens, want the %d the 10 blocks cover", cachedTokens(again), want)
	}
	// A prompt that parts in the coarse tail matches up to the block
	// where it parts.
	other := append(prompt[:7*64+1024+10:7*64+1024+10], text("elsewhere", 5000)...)
	if got, want := cachedTokens(mustPick(t, p, Request{Model: model, Prompt: other})), (7*64+1024)/4; got != want {
		t.Errorf("a prompt parting in the second coarse block matched %d tokens, want %d", got, want)
	}
}

func TestServedByKeepsBlocksAnotherRequestRecorded(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	a, b := addr(0), addr(1)
	prompt := text("shared by two", 4000)
	first := mustPick(t, p, on(a, prompt))
	second := mustPick(t, p, on(a, prompt)) // is served by a, from the blocks first put there
	first.ServedBy(b)
	if n := heldBlocks(p, prompt, a); n != 4000/64 {
		t.Errorf("a holds %d blocks after the first request moved to b, want %d: the second still computes them there", n, 4000/64)
	}
	second.Release()
	first.Release()
	assertLedgerEmpty(t, p)
}

// After a fallback, the prediction booked against the engine's usage is
// the serving endpoint's, not the first choice's.
func TestServedByBooksTheServingEndpointsPrediction(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	a, b := addr(0), addr(1)
	prompt := text("held by b", 64*100) // 100 blocks, 1,600 tokens
	mustPick(t, p, on(b, prompt)).Release()
	r := mustPick(t, p, on(a, prompt)) // a holds none of it
	if cachedTokens(r) != 0 {
		t.Fatalf("predicted %d cached tokens on a, want 0", cachedTokens(r))
	}
	r.ServedBy(b)
	if cachedTokens(r) != 1600 {
		t.Errorf("after ServedBy(b), CachedTokens() = %d, want b's 1600", cachedTokens(r))
	}
	r.Delivered(1600, 1600)
	r.Release()
	if s := statsOf(p, b); s.DeliveredCachedTokens != 1600 || s.PredictedCachedTokens != 1600 {
		t.Errorf("b's delivered/predicted = %d/%d, want 1600/1600", s.DeliveredCachedTokens, s.PredictedCachedTokens)
	}
	if s := statsOf(p, a); s.DeliveredCachedTokens != 0 || s.PredictedCachedTokens != 0 {
		t.Errorf("a's delivered/predicted = %d/%d, want 0/0: it did not serve", s.DeliveredCachedTokens, s.PredictedCachedTokens)
	}
}

func TestShortPromptsDoNotTeachTheRate(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 1, testConfig(), Options{Now: clock.Now})
	for i := range 20 {
		// 100 tokens whose first byte takes 20 ms: overhead, not prefill.
		r := mustPick(t, p, Request{Model: model, Prompt: text("short"+string(rune('a'+i)), 400), Stream: true})
		clock.Advance(20 * time.Millisecond)
		r.FirstByte()
		r.Release()
	}
	if rate := statsOf(p, addr(0)).PrefillTokensPerSecond; rate != float64(testConfig().PrefillTokensPerSecond) {
		t.Errorf("short prompts taught a rate of %.0f tokens/s, want the starting %d kept", rate, testConfig().PrefillTokensPerSecond)
	}
}

func TestTheRateFitSeparatesFixedOverhead(t *testing.T) {
	// The engine prefills 50,000 tokens/s; every first byte also pays a
	// fixed cost, whatever the prompt. Up to maxPrefillOverhead the fit
	// takes it as overhead; beyond it, the rest is taken as slower prefill
	// (a rate learned low, never high).
	for _, c := range []struct {
		fixed  time.Duration
		lo, hi float64
	}{
		{25 * time.Millisecond, 45_000, 55_000},
		{80 * time.Millisecond, 30_000, 50_000},
	} {
		clock := newFakeClock()
		p := newPicker(t, 1, testConfig(), Options{Now: clock.Now})
		for i := range 40 {
			tokens := 1000 + (i%5)*2000
			r := mustPick(t, p, Request{Model: model, Prompt: text("o"+string(rune('a'+i)), tokens*4), Stream: true})
			clock.Advance(c.fixed + time.Duration(tokens)*time.Second/50_000)
			r.FirstByte()
			r.Release()
		}
		if rate := statsOf(p, addr(0)).PrefillTokensPerSecond; rate < c.lo || rate > c.hi {
			t.Errorf("%v fixed: learned %.0f tokens/s, want %.0f to %.0f", c.fixed, rate, c.lo, c.hi)
		}
	}
}

func TestAHugePromptsTailIsRecordedOutsideTheCriticalSection(t *testing.T) {
	cfg := testConfig() // 64-character blocks: 32,000 tokens are 2,000 of them
	p := newPicker(t, 1, cfg, Options{})
	prompt := text("long context", 200_000) // 50,000 tokens: 2,000 fine blocks in the lock, more after
	all := len(prefix.HashTiered(nil, model, "", prompt, cfg.BlockSizeChars, p.blocks.fine, p.blocks.coarseChars, cfg.MaxPromptBlocks))
	var inSection int
	_, err := pickPausing(p, Request{Model: model, Prompt: prompt}, func() { // right after the critical section, before the tail
		p.mu.Lock()
		inSection = p.index.Len(p.rows[0].id)
		p.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	after := p.index.Len(p.rows[0].id)
	p.mu.Unlock()
	if inSection != p.blocks.inLock || after != all || all <= p.blocks.inLock {
		t.Errorf("blocks recorded: %d in the critical section (want %d), %d after the pick (want all %d)", inSection, p.blocks.inLock, after, all)
	}
}
