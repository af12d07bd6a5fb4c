package picker

import (
	"fmt"
	"math"
	"testing"
	"time"
)

// A detached reservation stays in the ledger through its modelled prefill
// and decoding, then ends on its own.
func TestDetachedReservationEndsWhenTheModelSaysDone(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	p := newPicker(t, 1, cfg, Options{Clock: clock})
	// 40,000 characters: 10,000 tokens, one second of prefill.
	req := on(addr(0), text("detached", 40_000))
	req.MaxTokens = 100
	r := mustPick(t, p, req)
	p.End(r, Outcome{Detached: true})
	p.End(r, Outcome{Detached: true}) // harmless

	decode := time.Duration(100 * defaultDecodeNsPerToken)
	start := clock.ns.Load()
	for _, step := range []struct {
		at       time.Duration
		inFlight int
	}{
		{0, 1}, {900 * time.Millisecond, 1}, {time.Second + decode - 10*time.Millisecond, 1}, {time.Second + decode + 10*time.Millisecond, 0},
	} {
		clock.ns.Store(start + int64(step.at))
		l := p.Snapshot()
		if l.InFlight != step.inFlight || l.Detached != step.inFlight {
			t.Fatalf("at %v: in flight %d, detached %d, want %d", step.at, l.InFlight, l.Detached, step.inFlight)
		}
	}
	if got := p.Snapshot().DetachEnds[detachEndModel]; got != 1 {
		t.Errorf("ends by the model = %d, want 1", got)
	}
	p.End(r, Outcome{}) // after the model ended it: nothing
	assertLedgerEmpty(t, p)
}

// A bodiless request (a GET of /v1/models through a gateway that ends the
// stream at the pick) has no prefill or decoding to model: detaching it
// releases it at once, while a request with a body stays held.
func TestADetachedBodilessRequestEndsAtOnce(t *testing.T) {
	p := newPicker(t, 1, testConfig(), Options{})
	p.End(mustPick(t, p, Request{}), Outcome{Detached: true})
	if l := p.Snapshot(); l.InFlight != 0 || l.Detached != 0 {
		t.Fatalf("a detached bodiless request: in flight %d, detached %d; want none", l.InFlight, l.Detached)
	}
	r := mustPick(t, p, Request{Model: model, Bytes: 30})
	p.End(r, Outcome{Detached: true})
	if l := p.Snapshot(); l.InFlight != 1 || l.Detached != 1 {
		t.Fatalf("a detached request with a body: in flight %d, detached %d; want 1 and 1", l.InFlight, l.Detached)
	}
	p.End(r, Outcome{})
	assertLedgerEmpty(t, p)
}

// A burst of detached requests spreads as evenly as held ones: each pick
// sees the earlier ones.
func TestDetachedBurstSpreads(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 3, testConfig(), Options{Clock: clock})
	shared := text("system", 2048)
	count := map[string]int{}
	for i := range 128 {
		r := mustPick(t, p, Request{Model: model, Prompt: join(shared, text(fmt.Sprint(i), 256)), MaxTokens: 64})
		p.End(r, Outcome{Detached: true})
		clock.Advance(time.Millisecond)
	}
	for _, s := range p.Snapshot().Endpoints {
		count[s.Endpoint.Pod] = s.InFlight
		if s.Detached != s.InFlight {
			t.Errorf("%s: %d detached of %d", s.Endpoint.Pod, s.Detached, s.InFlight)
		}
	}
	for pod, n := range count {
		if n < 42 || n > 43 {
			t.Errorf("placement %v: %s has %d, want 42 or 43", count, pod, n)
		}
	}
}

// An engine that reports fewer requests than the ledger holds ends the
// oldest detached ones that have reached it, never ones it has not yet
// been seen busy with, nor attached ones.
func TestEngineScrapeShortensDetachedReservations(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 1, testConfig(), Options{Clock: clock})
	var detached []*Reservation
	for i := range 4 {
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint(i), 400), MaxTokens: 10_000})
		p.End(r, Outcome{Detached: true})
		detached = append(detached, r)
	}
	attached := mustPick(t, p, Request{Model: model, Prompt: text("attached", 400), MaxTokens: 10_000})
	clock.Advance(10 * time.Millisecond)
	// Too soon after the picks to have reached the engine.
	p.ObserveEngine(addr(0), EngineStats{Running: 1})
	if l := p.Snapshot(); l.InFlight != 5 {
		t.Fatalf("in flight %d after a scrape right after the picks, want 5", l.InFlight)
	}
	// An engine that never saw them (a pod holding them in front of it)
	// ends none.
	clock.Advance(time.Second)
	p.ObserveEngine(addr(0), EngineStats{})
	if l := p.Snapshot(); l.InFlight != 5 {
		t.Fatalf("in flight %d after an idle engine's scrape, want 5", l.InFlight)
	}
	p.ObserveEngine(addr(0), EngineStats{Running: 3})
	l := p.Snapshot()
	if l.InFlight != 3 || l.Detached != 2 || l.DetachEnds[detachEndEngine] != 2 {
		t.Fatalf("after the engine reported 3 of 5: in flight %d, detached %d, ended by the engine %d; want 3, 2, 2",
			l.InFlight, l.Detached, l.DetachEnds[detachEndEngine])
	}
	p.mu.Lock()
	oldestGone := detached[0].released && detached[1].released && !detached[2].released && !attached.released
	p.mu.Unlock()
	if !oldestGone {
		t.Error("the engine's correction did not end the two oldest detached reservations")
	}
	// More requests than the ledger: foreign load, nothing ended.
	p.ObserveEngine(addr(0), EngineStats{Running: 9})
	if l := p.Snapshot(); l.InFlight != 3 || l.Endpoints[0].ForeignRequests != 6 {
		t.Errorf("in flight %d, foreign %d; want 3 and 6", l.InFlight, l.Endpoints[0].ForeignRequests)
	}
	p.End(attached, Outcome{})
	for _, r := range detached {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}

// Responses teach the pool its decode speed and output length; a response
// that arrived at once moves the speed only within bounds.
func TestCompletedResponsesTeachTheDecodeModel(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 1, testConfig(), Options{Clock: clock})
	for i := range 200 {
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint(i), 400), Stream: true})
		clock.Advance(50 * time.Millisecond)
		p.FirstByte(r)
		clock.Advance(99 * 5 * time.Millisecond) // 100 tokens at 5 ms each
		p.End(r, Outcome{CompletionTokens: 100})
		p.End(r, Outcome{})
	}
	p.mu.Lock()
	decode, output := p.l.decodeNsPerToken, p.l.meanOutputTokens
	p.mu.Unlock()
	if decode < float64(4500*time.Microsecond) || decode > float64(5500*time.Microsecond) {
		t.Errorf("decode %v per token, want about 5ms", time.Duration(decode))
	}
	if output < 95 || output > 105 {
		t.Errorf("mean output %.0f tokens, want about 100", output)
	}
	// Half the responses now arrive at once: the estimate must not collapse.
	for i := range 200 {
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("late", i), 400), Stream: true})
		clock.Advance(50 * time.Millisecond)
		p.FirstByte(r)
		if i%2 == 0 {
			clock.Advance(99 * 5 * time.Millisecond)
		}
		p.End(r, Outcome{CompletionTokens: 100})
		p.End(r, Outcome{})
	}
	p.mu.Lock()
	decode = p.l.decodeNsPerToken
	p.mu.Unlock()
	if decode < float64(4500*time.Microsecond) || decode > float64(5500*time.Microsecond) {
		t.Errorf("decode %v per token after late responses, want still about 5ms", time.Duration(decode))
	}
}

// Detached requests are ended by what two scrapes in a row say: when the
// pods end a burst's requests between two scrapes of one round, the pod
// scraped after does not look lighter than the others until the next
// round tells them all.
func TestOneScrapeAloneEndsNoDetachedRequest(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 2, testConfig(), Options{Clock: clock})
	for i := range 8 {
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint(i), 400), MaxTokens: 10_000})
		p.End(r, Outcome{Detached: true})
	}
	busy := func(n int) EngineStats { return EngineStats{Running: n} }
	clock.Advance(time.Second)
	p.ObserveScrapes([]Scrape{{Address: addr(0), Stats: busy(4)}, {Address: addr(1), Stats: busy(4)}})
	clock.Advance(250 * time.Millisecond)
	// The pods end every request between the round's two scrapes.
	p.ObserveScrapes([]Scrape{{Address: addr(0), Stats: busy(4)}, {Address: addr(1), Stats: busy(0)}})
	if s := p.Snapshot().Endpoints; s[0].Detached != 4 || s[1].Detached != 4 {
		t.Fatalf("detached %d and %d after one scrape said endpoint 1 had ended its 4, want 4 and 4", s[0].Detached, s[1].Detached)
	}
	clock.Advance(250 * time.Millisecond)
	p.ObserveScrapes([]Scrape{{Address: addr(0), Stats: busy(0)}, {Address: addr(1), Stats: busy(0)}})
	if s := p.Snapshot().Endpoints; s[0].Detached != 4 || s[1].Detached != 0 {
		t.Fatalf("detached %d and %d after the second scrape, want 4 and 0", s[0].Detached, s[1].Detached)
	}
	clock.Advance(250 * time.Millisecond)
	p.ObserveScrapes([]Scrape{{Address: addr(0), Stats: busy(0)}, {Address: addr(1), Stats: busy(0)}})
	if s := p.Snapshot().Endpoints; s[0].Detached != 0 || s[1].Detached != 0 {
		t.Fatalf("detached %d and %d after two scrapes of each said all ended, want none", s[0].Detached, s[1].Detached)
	}
	assertLedgerEmpty(t, p)
}

// A round of scrapes reaches the picker when its slowest scrape answers: an
// engine's count read long before then does not hold the requests placed
// on it since, and they are not taken for ended ones.
func TestAScrapeIsJudgedByWhenItWasSent(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 1, testConfig(), Options{Clock: clock})
	place := func(n int, what string) {
		for i := range n {
			r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint(what, i), 400), MaxTokens: 10_000})
			p.End(r, Outcome{Detached: true})
		}
	}
	busy := func(n int) EngineStats { return EngineStats{Running: n} }
	place(10, "old")
	clock.Advance(time.Second)
	p.ObserveScrapes([]Scrape{{Address: addr(0), Stats: busy(10)}})
	// Two rounds held up 500 ms by a slow engine elsewhere: this engine was
	// read 100 ms before 5 more requests were placed, and 50 ms after.
	clock.Advance(100 * time.Millisecond)
	place(5, "new")
	clock.Advance(400 * time.Millisecond)
	p.ObserveScrapes([]Scrape{{Address: addr(0), Stats: busy(10), Age: 500 * time.Millisecond}})
	clock.Advance(50 * time.Millisecond)
	p.ObserveScrapes([]Scrape{{Address: addr(0), Stats: busy(10), Age: 500 * time.Millisecond}})
	if s := p.Snapshot().Endpoints; s[0].Detached != 15 {
		t.Fatalf("detached %d after two rounds whose scrapes were sent before the 5 new requests could arrive, want 15", s[0].Detached)
	}
	// Sent 600 ms after the new requests, two scrapes find 12: 3 ended.
	clock.Advance(600 * time.Millisecond)
	p.ObserveScrapes([]Scrape{{Address: addr(0), Stats: busy(12), Age: 100 * time.Millisecond}})
	clock.Advance(250 * time.Millisecond)
	p.ObserveScrapes([]Scrape{{Address: addr(0), Stats: busy(12), Age: 100 * time.Millisecond}})
	if s := p.Snapshot().Endpoints; s[0].Detached != 12 {
		t.Fatalf("detached %d after two scrapes found 12, want 12", s[0].Detached)
	}
}

// A pool whose gateway ends every stream at the pick sees no response: it
// learns what a request generates from the engines' output counters, and
// a detached request without max_tokens then decodes that long.
func TestEngineOutputCountersTeachTheExpectedOutput(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	p := newPicker(t, 2, cfg, Options{Clock: clock})
	expected := func() float64 { return p.Snapshot().ExpectedOutputTokens }
	if got := expected(); got != defaultOutputTokens {
		t.Fatalf("expected output before any counter: %v, want the default %d", got, defaultOutputTokens)
	}
	// Each engine finishes 5 requests of 1,000 tokens between scrapes.
	var finished, generated [2]float64
	scrape := func(i int) {
		p.ObserveEngine(addr(i), EngineStats{FinishedRequestsTotal: finished[i], GenerationTokensTotal: generated[i], HasOutputCounts: true})
	}
	scrape(0)
	scrape(1)
	if got := expected(); got != defaultOutputTokens {
		t.Fatalf("expected output after the first counters alone: %v, want the default (they start a window)", got)
	}
	for range 40 {
		for i := range 2 {
			finished[i] += 5
			generated[i] += 5_000
			scrape(i)
		}
	}
	if got := expected(); got < 990 || got > 1000 {
		t.Fatalf("expected output after 400 finished requests of 1,000 tokens: %v", got)
	}
	// A scrape with nothing finished, an engine restart (counters back to
	// 0) and an engine that stops publishing the counters teach nothing.
	scrape(0)
	finished[1], generated[1] = 0, 0
	scrape(1)
	p.ObserveEngine(addr(0), EngineStats{})
	before := expected()
	finished[1], generated[1] = 2, 20
	scrape(1) // a new window after the restart: 2 requests of 10 tokens
	after := expected()
	if want := before + (10-before)*(1-(1-outputLearnWeight)*(1-outputLearnWeight)); after < want-0.01 || after > want+0.01 {
		t.Errorf("after the restart's first window: %v, want %v (2 requests of 10 tokens, from %v)", after, want, before)
	}

	// A detached request without max_tokens decodes the learned output.
	expectDetachedDecodes(t, p, clock, 0, time.Duration(after*defaultDecodeNsPerToken))
}

// expectDetachedDecodes places a detached request of one second's prefill
// (and maxTokens, when not 0) on p's first endpoint, and checks that it
// stays in the ledger until its prefill and decode have passed, within
// 100 ms.
func expectDetachedDecodes(t *testing.T, p *Picker, clock *fakeClock, maxTokens int, decode time.Duration) {
	t.Helper()
	req := on(addr(0), text("detached", 40_000)) // one second of prefill
	req.MaxTokens = maxTokens
	r := mustPick(t, p, req)
	p.End(r, Outcome{Detached: true})
	start := clock.ns.Load()
	clock.ns.Store(start + int64(time.Second+decode-100*time.Millisecond))
	if l := p.Snapshot(); l.Detached != 1 {
		t.Fatalf("detached %d before its modelled decoding ended (%v), want 1", l.Detached, decode)
	}
	clock.ns.Store(start + int64(time.Second+decode+100*time.Millisecond))
	if l := p.Snapshot(); l.Detached != 0 {
		t.Fatalf("detached %d after its modelled decoding ended (%v), want 0", l.Detached, decode)
	}
	assertLedgerEmpty(t, p)
}

// An engine that times its decoding teaches the pool's decode speed: its
// decode seconds over the tokens after each finished request's first. No
// response is needed (a gateway that ends the stream at the pick shows
// none), and a detached request then ends when that speed says.
func TestEngineDecodeTimeTeachesTheDecodeSpeed(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	p := newPicker(t, 2, cfg, Options{Clock: clock})
	speed := func() float64 { return p.Snapshot().DecodeSecondsPerToken }
	var finished, generated, seconds [2]float64
	scrape := func(i int, timed bool) {
		p.ObserveEngine(addr(i), EngineStats{FinishedRequestsTotal: finished[i], GenerationTokensTotal: generated[i], HasOutputCounts: true,
			DecodeSecondsTotal: seconds[i], HasDecodeTiming: timed})
	}
	scrape(0, true)
	scrape(1, true)
	// Each engine finishes 5 requests of 101 tokens between scrapes, at
	// 2 ms a token after the first: 0.2 s of decoding each.
	const want = 0.002
	for range 40 {
		for i := range 2 {
			finished[i] += 5
			generated[i] += 5 * 101
			seconds[i] += 5 * 100 * want
			scrape(i, true)
		}
	}
	if got := speed(); math.Abs(got-want) > want/100 {
		t.Fatalf("decode speed after 400 timed requests: %v s a token, want %v", got, want)
	}
	// Counts without decode time, a restart's first window (counters back
	// to 0) and requests of one token each teach no speed.
	before := speed()
	finished[0] += 50
	generated[0] += 50 * 101
	seconds[0] += 50 * 100 * 0.05 // would be 50 ms a token
	scrape(0, false)
	scrape(0, true) // the window after one without decode time starts anew
	finished[1], generated[1], seconds[1] = 0, 0, 0
	scrape(1, true)
	finished[1], generated[1] = 10, 10
	scrape(1, true)
	if got := speed(); got != before {
		t.Fatalf("decode speed moved to %v s a token from %v without a timed window", got, before)
	}
	// The expected output did learn from the untimed window and the
	// one-token requests.
	if got := p.Snapshot().ExpectedOutputTokens; got >= 101 {
		t.Errorf("expected output %v: the one-token requests taught nothing", got)
	}

	// A detached request of 500 output tokens ends after its prefill and
	// 500 tokens at the learned speed.
	expectDetachedDecodes(t, p, clock, 500, time.Duration(500*before*float64(time.Second)))
}

// The two scrapes in a row that end detached requests must both have been
// sent late enough to count them: a shortfall left from requests that have
// since left the ledger (a gateway's cancelled ones, just before a burst)
// ends none of a burst still arriving.
func TestAnEarlierShortfallEndsNoneOfANewBurst(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 1, testConfig(), Options{Clock: clock})
	pick := func(name string) *Reservation {
		r := mustPick(t, p, Request{Model: model, Prompt: text(name, 400), MaxTokens: 100_000})
		p.End(r, Outcome{Detached: true})
		return r
	}
	var old []*Reservation
	for i := range 10 {
		old = append(old, pick(fmt.Sprint("old-", i)))
	}
	clock.Advance(200 * time.Millisecond)
	p.ObserveEngine(addr(0), EngineStats{Running: 10})
	clock.Advance(250 * time.Millisecond)
	p.ObserveEngine(addr(0), EngineStats{Running: 5}) // a shortfall of 5, said once
	for _, r := range old {
		p.End(r, Outcome{})
	}
	// A burst right after, before any scrape: by the next one, sent
	// 150 ms after its first pick, 3 of its 40 have reached the engine.
	for i := range 40 {
		pick(fmt.Sprint("burst-", i))
		clock.Advance(time.Millisecond)
	}
	clock.Advance(110 * time.Millisecond)
	p.ObserveEngine(addr(0), EngineStats{Running: 3})
	if l := p.Snapshot(); l.Detached != 40 || l.DetachEnds[detachEndEngine] != 0 {
		t.Fatalf("detached %d of the burst's 40, %d ended by the engine; want all 40 kept", l.Detached, l.DetachEnds[detachEndEngine])
	}
}
