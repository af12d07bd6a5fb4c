package picker

import (
	"fmt"
	"net/netip"
	"testing"
	"time"
)

func TestForeignLoadSteersPicksAway(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 2, testConfig(), Options{Clock: clock})
	a, b := addr(0), addr(1)
	mustPick(t, p, on(a, text("ours", 4000))) // one request of ours on a
	// a's engine runs 5 requests: 4 are not ours. b's runs none.
	p.ObserveEngine(a, EngineStats{Running: 3, Waiting: 2})
	p.ObserveEngine(b, EngineStats{})
	if s := statsOf(p, a); s.ForeignRequests != 4 || s.ForeignTokens == 0 {
		t.Fatalf("a after the scrape: %+v, want 4 foreign requests with a cost", s)
	}
	for i := range 5 {
		r := mustPick(t, p, Request{Model: model, Prompt: text("new"+string(rune('a'+i)), 400)})
		if endpointOf(r) != b {
			t.Fatalf("pick %d went to %s, want b: a's engine is busy with foreign work", i, endpointOf(r))
		}
	}
	// Scrapes stop: the foreign load fades.
	clock.Advance(30 * time.Second)
	if s := statsOf(p, a); s.ForeignTokens != 0 {
		t.Errorf("30 s after the last scrape the foreign load still costs %d tokens", s.ForeignTokens)
	}
}

func TestPrefixCapacityComesFromTheEngine(t *testing.T) {
	p := newPicker(t, 1, testConfig(), Options{})
	a := addr(0)
	prompt := text("long", 64*200) // 200 blocks
	p.End(mustPick(t, p, on(a, prompt)), Outcome{})
	// 1,600 tokens of KV cache = 6,400 characters = 100 blocks of 64.
	p.ObserveEngine(a, EngineStats{CacheTokens: 1600})
	p.tidy()
	if s := statsOf(p, a); s.PrefixCapacityBlocks != 100 {
		t.Errorf("capacity %d blocks, want 100 from the engine's 1,600 tokens", s.PrefixCapacityBlocks)
	}
	if n := heldBlocks(p, prompt, a); n != 100 {
		t.Errorf("a holds %d blocks of the prompt, want the 100 its engine can", n)
	}
}

func TestFailingScrapesExcludeAnEndpointUntilOneSucceeds(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{ScrapeFailureThreshold: 3})
	a, b := addr(0), addr(1)
	// Never read, failures do not count: the metrics may live elsewhere.
	for range 5 {
		if p.ObserveScrapeFailure(a) {
			t.Fatal("an endpoint whose metrics were never read turned unhealthy")
		}
	}
	// Read once, then failing: suspect.
	p.ObserveEngine(a, EngineStats{})
	p.ObserveEngine(b, EngineStats{})
	for i := range 3 {
		if turned := p.ObserveScrapeFailure(a); turned != (i == 2) {
			t.Fatalf("failure %d: turned unhealthy = %v", i+1, turned)
		}
	}
	for range 4 {
		if r := mustPick(t, p, Request{Model: model}); endpointOf(r) != a {
			continue
		}
		t.Fatal("an endpoint failing its scrapes was picked")
	}
	// The gateway's hint names only the failing endpoint: it can serve,
	// its scrapes only correct the ledger.
	if r, err := p.pick(on(a, nil)); err != nil || endpointOf(r) != a {
		t.Errorf("a subset naming only the failing endpoint: %v; want it routed there", err)
	}
	r, err := p.pick(Request{Model: model, Subset: []netip.AddrPort{a, b}, HasSubset: true})
	if err != nil || endpointOf(r) != b {
		t.Errorf("a subset naming the failing endpoint and a healthy one: %v; want the healthy one", err)
	}
	// Every endpoint failing: none is excluded.
	for range 3 {
		p.ObserveScrapeFailure(b)
	}
	if _, err := p.pick(on(a, nil)); err != nil {
		t.Errorf("with every endpoint failing its scrapes, a was excluded: %v", err)
	}
	if !p.ObserveEngine(a, EngineStats{}) {
		t.Error("a successful scrape did not report the recovery")
	}
	if s := statsOf(p, a); s.Unhealthy {
		t.Errorf("a after a successful scrape: %+v", s)
	}
}

// A response that reports fewer cached tokens than predicted comes after
// the engine computed the whole prompt: the blocks it lost are in its cache
// again, so the index keeps every block of the prompt there; the shortfall
// shows in the drift counters.
func TestADeliveredShortfallKeepsTheBlocksTheEngineRecomputed(t *testing.T) {
	p := newPicker(t, 1, testConfig(), Options{})
	a := addr(0)
	prompt := text("cached?", 64*100) // 100 blocks, 1,600 tokens
	p.End(mustPick(t, p, on(a, prompt)), Outcome{})
	r := mustPick(t, p, on(a, prompt))
	if cachedTokens(r) != 1600 {
		t.Fatalf("predicted %d cached tokens, want 1600", cachedTokens(r))
	}
	p.End(r, Outcome{PromptTokens: 1600, CachedTokens: 400}) // only the first quarter came from its cache
	p.End(r, Outcome{PromptTokens: 1600, CachedTokens: 0})   // a second report has no effect
	p.End(r, Outcome{})
	if n := heldBlocks(p, prompt, a); n != 100 {
		t.Errorf("a holds %d blocks after the shortfall, want all 100: it has just computed them", n)
	}
	s := statsOf(p, a)
	if s.DeliveredCachedTokens != 400 || s.PredictedCachedTokens != 1600 {
		t.Errorf("delivered/predicted = %d/%d, want 400/1600", s.DeliveredCachedTokens, s.PredictedCachedTokens)
	}
	if r2 := mustPick(t, p, on(a, prompt)); cachedTokens(r2) != 1600 {
		t.Errorf("the next pick predicts %d cached tokens, want 1600", cachedTokens(r2))
	}
}

// An engine without prefix caching delivers none of the cached tokens the
// index predicts there, and the index keeps recording what it served. The
// repeats of a prompt must stop going to it for a cache it does not have:
// once its responses have said so, its predicted hits count for what it
// delivers. An engine that caches keeps them.
func TestAnEngineThatNeverCachesStopsDrawingRepeats(t *testing.T) {
	for _, tc := range []struct {
		name     string
		delivers func(predicted int) int // a's cached tokens, given the prediction
		wantOnA  bool                    // where the last repeats go
	}{
		{"a caches", func(n int) int { return n }, true},
		{"a never caches", func(int) int { return 0 }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPicker(t, 2, testConfig(), Options{})
			a, b := addr(0), addr(1)
			mustPick(t, p, on(a, text("other work", 64*50))) // 800 tokens held on a throughout
			prompt := text("repeated", 64*100)               // 100 blocks, 1,600 tokens
			p.End(mustPick(t, p, on(a, prompt)), Outcome{})
			var last []netip.AddrPort
			for range 12 {
				r := mustPick(t, p, Request{Model: model, Prompt: prompt})
				at := endpointOf(r)
				if at == a {
					p.End(r, Outcome{PromptTokens: 1600, CachedTokens: tc.delivers(cachedTokens(r))})
				} else {
					p.End(r, Outcome{PromptTokens: 1600, CachedTokens: cachedTokens(r)}) // b caches
				}
				p.End(r, Outcome{})
				last = append(last, at)
			}
			for i, at := range last[8:] {
				if (at == a) != tc.wantOnA {
					t.Errorf("repeat %d went to %v (a is %v, b %v); a's cache trust %.2f", 8+i, at, a, b, statsOf(p, a).CacheTrust)
				}
			}
		})
	}
}

// A scrape read while requests were still in flight and observed after
// they ended is not foreign load: the counts are compared with the ledger at
// its fullest since the last scrape. Without that, a burst right after
// churn avoided a pod for seconds.
func TestAStaleScrapeOfEndedRequestsIsNotForeignLoad(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	var rs []*Reservation
	for i := range 6 {
		rs = append(rs, mustPick(t, p, on(addr(0), text(fmt.Sprint("stale", i), 400))))
	}
	p.ObserveEngine(addr(0), EngineStats{Running: 6})
	for _, r := range rs {
		p.End(r, Outcome{})
	}
	p.ObserveEngine(addr(0), EngineStats{Waiting: 6}) // read before the releases
	if s := statsOf(p, addr(0)); s.ForeignRequests != 0 {
		t.Errorf("%d foreign requests from a scrape of requests the ledger held since the last one, want 0", s.ForeignRequests)
	}
	// The next scrape still saying 6 is foreign load.
	p.ObserveEngine(addr(0), EngineStats{Waiting: 6})
	if s := statsOf(p, addr(0)); s.ForeignRequests != 6 {
		t.Errorf("%d foreign requests, want 6", s.ForeignRequests)
	}
}

// Two endpoints that hold the same blocks are trusted for them each by
// its own engine's delivery: one that delivers none of its predicted hits
// is not cheap for them because another endpoint with the same blocks is.
func TestEndpointsHoldingTheSameBlocksAreTrustedEachByItsOwnEngine(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	a, b := addr(0), addr(1)
	prompt := text("held on both", 64*100) // 100 blocks, 1,600 tokens
	for range 8 {
		r := mustPick(t, p, on(a, prompt))
		p.End(r, Outcome{PromptTokens: 1600, CachedTokens: 0}) // a never caches
		p.End(r, Outcome{})
		r = mustPick(t, p, on(b, prompt))
		p.End(r, Outcome{PromptTokens: 1600, CachedTokens: cachedTokens(r)})
		p.End(r, Outcome{})
	}
	for i := range 12 {
		r := mustPick(t, p, Request{Model: model, Prompt: prompt})
		if at := endpointOf(r); at != b {
			t.Errorf("repeat %d went to %v, want %v (a's cache trust %.2f, b's %.2f)", i, at, b, statsOf(p, a).CacheTrust, statsOf(p, b).CacheTrust)
			p.End(r, Outcome{PromptTokens: 1600, CachedTokens: 0})
		} else {
			p.End(r, Outcome{PromptTokens: 1600, CachedTokens: cachedTokens(r)})
		}
		p.End(r, Outcome{})
	}
}
