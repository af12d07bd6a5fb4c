package picker

import (
	"k8s.io/utils/clock"

	"context"
	"errors"
	"math"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tallyepp/tally/picker/prefix"
)

func TestLedgerCountsPrefillDecodingAndRelease(t *testing.T) {
	p := newPicker(t, 1, testConfig(), Options{})
	a := addr(0)
	prompt := text("p", 1000) // 250 tokens; 15 full blocks of 64 characters

	r1 := mustPick(t, p, Request{Model: model, Prompt: prompt})
	if promptTokens(r1) != 250 || cachedTokens(r1) != 0 {
		t.Errorf("fresh prompt: %d prompt / %d cached tokens, want 250 / 0", promptTokens(r1), cachedTokens(r1))
	}
	if got := statsOf(p, a); got.InFlight != 1 || got.PrefillTokens != 250 || got.Decoding != 0 {
		t.Errorf("after one pick: %+v, want 1 in flight, 250 prefill", got)
	}

	// The same prompt again: 15 blocks (960 characters) are held, 40 are not.
	r2 := mustPick(t, p, Request{Model: model, Prompt: prompt})
	if cachedTokens(r2) != 240 {
		t.Errorf("repeated prompt: %d cached tokens, want 240", cachedTokens(r2))
	}
	if got := statsOf(p, a).PrefillTokens; got != 250+10 {
		t.Errorf("prefill after a cached repeat = %d, want 260", got)
	}

	tiny := mustPick(t, p, Request{Model: model, Prompt: []byte("hi!")})
	bare := mustPick(t, p, Request{Model: model})
	if promptTokens(tiny) != 1 || promptTokens(bare) != 0 {
		t.Errorf("prompt tokens of 3 characters = %d (want 1), of none = %d (want 0)", promptTokens(tiny), promptTokens(bare))
	}
	if got := statsOf(p, a); got.InFlight != 4 || got.PrefillTokens != 261 {
		t.Errorf("with a tiny and a promptless request: %+v, want 4 in flight, 261 prefill", got)
	}

	p.FirstByte(r1)
	p.FirstByte(r1)
	if got := statsOf(p, a); got.InFlight != 4 || got.PrefillTokens != 11 || got.Decoding != 1 {
		t.Errorf("after the first byte of r1 (twice): %+v, want 4 in flight, 11 prefill, 1 decoding", got)
	}
	p.End(r1, Outcome{})
	p.End(r2, Outcome{})
	p.End(r2, Outcome{})
	p.End(tiny, Outcome{})
	p.FirstByte(bare)
	p.End(bare, Outcome{})
	assertLedgerEmpty(t, p)
}

func TestCostWeighsDecodingRequests(t *testing.T) {
	for _, tc := range []struct {
		weight int
		want   int // endpoint index that takes the next request
	}{
		{weight: 0, want: 1},   // default 128 tokens per decoding request > 100 queued tokens
		{weight: 1, want: 0},   // 1 < 100
		{weight: 500, want: 1}, // 500 > 100
	} {
		cfg := testConfig()
		cfg.DecodeWeightTokens = tc.weight
		p := newPicker(t, 2, cfg, Options{})
		dec := mustPick(t, p, on(addr(0), nil))
		p.FirstByte(dec)
		mustPick(t, p, on(addr(1), text("queued", 400))) // 100 prefill tokens
		if got := endpointOf(mustPick(t, p, Request{Model: model})); got != addr(tc.want) {
			t.Errorf("decode weight %d: picked %s, want %s", tc.weight, got, addr(tc.want))
		}
	}
}

// A shared prefix pulls harder on a pool that has been busy: its uncached
// tokens weigh 1/(1-ρ), at most maxWorkWeight, so the same pick that goes
// to an idle endpoint on a fresh pool stays with the prefix's holder after
// sustained load, and goes elsewhere again once the load has long passed.
func TestSustainedLoadWeighsUncachedTokens(t *testing.T) {
	prefix := text("shared", 4000)                                            // 62 blocks of 64 characters: 992 tokens
	req := Request{Model: model, Prompt: join(prefix, text("question", 200))} // 1,050 tokens
	for _, tc := range []struct {
		name       string
		busy, idle time.Duration // each endpoint's backlog, then idle time
		want       int
		weight     float64
	}{
		// Weight 1: 1,250 queued + 58 uncached on the holder > 1,050.
		{name: "fresh pool", want: 1, weight: 1},
		// Weight 1.5: 1,250 + 87 < 1,575.
		{name: "after 40 s of backlog", busy: 40 * time.Second, want: 0, weight: maxWorkWeight},
		{name: "long after it", busy: 40 * time.Second, idle: 5 * time.Minute, want: 1, weight: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			p := newPicker(t, 2, testConfig(), Options{Clock: clk})
			if tc.busy > 0 {
				rate := statsOf(p, addr(0)).PrefillTokensPerSecond
				backlog := text("backlog", int(rate*tc.busy.Seconds())*4)
				a, b := mustPick(t, p, on(addr(0), backlog)), mustPick(t, p, on(addr(1), backlog))
				clk.Advance(tc.busy)
				p.End(a, Outcome{})
				p.End(b, Outcome{})
				clk.Advance(tc.idle)
			}
			if got := p.Snapshot().WorkWeight; math.Abs(got-tc.weight) > 0.01 {
				t.Errorf("work weight %.3f, want %.3f", got, tc.weight)
			}
			mustPick(t, p, on(addr(0), prefix))               // the holder: 1,000 tokens queued
			mustPick(t, p, on(addr(0), text("filler", 1000))) // 250 more
			if got := endpointOf(mustPick(t, p, req)); got != addr(tc.want) {
				t.Errorf("picked %s, want %s (ledger %+v)", got, addr(tc.want), p.Snapshot().Endpoints)
			}
		})
	}
}

// TestCriticalSectionPublishesBeforeUnlock pauses pick #1 right after its
// critical section and shows that later picks already see both what #1
// reserved and the prefix it recorded. It fails if either write is moved
// after the unlock.
func TestCriticalSectionPublishesBeforeUnlock(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	a, b := addr(0), addr(1)
	// b carries 100 queued tokens, so a fresh pick prefers a unless it sees
	// a's load.
	mustPick(t, p, on(b, text("earlier", 400)))

	paused, resume := make(chan struct{}), make(chan struct{})
	x := text("fresh prompt", 4000) // 1,000 tokens; 62 full blocks
	first := make(chan *Reservation, 1)
	go func() {
		r, err := pickPausing(p, Request{Model: model, Prompt: x}, func() {
			close(paused)
			<-resume
		})
		if err != nil {
			t.Errorf("pick #1: %v", err)
		}
		first <- r
	}()
	select {
	case <-paused:
	case <-time.After(10 * time.Second):
		t.Fatal("pick #1 never reached the end of its critical section")
	}

	// Pick #1 is inside Pick, past its unlock. Its reservation is in the ledger:
	if got := statsOf(p, a); got.InFlight != 1 || got.PrefillTokens != 1000 {
		t.Errorf("while #1 is paused, %s shows %+v, want 1 in flight with 1000 prefill tokens", a, got)
	}
	// so an unrelated request of the same size goes to b (1000+1000 > 100+1000),
	r2 := mustPick(t, p, Request{Model: model, Prompt: text("unrelated", 4000)})
	if endpointOf(r2) != b {
		t.Errorf("pick #2 went to %s: it did not see #1's reservation on %s", endpointOf(r2), a)
	}
	// and its prompt's blocks are recorded on a: a request extending x finds them.
	r3 := mustPick(t, p, Request{Model: model, Prompt: join(x, text("follow-up", 400))})
	want := 62 * 64 / 4
	if endpointOf(r3) != a || cachedTokens(r3) != want {
		t.Errorf("pick #3 went to %s with %d cached tokens, want %s with %d: #1's prefix record was not visible",
			endpointOf(r3), cachedTokens(r3), a, want)
	}

	close(resume)
	select {
	case r1 := <-first:
		if r1 != nil && endpointOf(r1) != a {
			t.Errorf("pick #1 went to %s, want %s", endpointOf(r1), a)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("pick #1 did not return after resuming")
	}
}

func TestTiesAreBrokenAtRandomNotByListOrder(t *testing.T) {
	for _, order := range []string{"forward", "reversed"} {
		eps := endpoints(2)
		if order == "reversed" {
			slices.Reverse(eps)
		}
		p := New(testConfig(), Options{Rand: rand.New(rand.NewPCG(3, 4))})
		p.Replace(eps)
		counts := map[netip.AddrPort]int{}
		const cycles = 2000
		for i := range cycles {
			var prompt []byte
			if i%2 == 0 { // fresh prompts tie too: nobody holds them
				prompt = text(string(rune('a'+i%26))+string(rune(i)), 256)
			}
			r := mustPick(t, p, Request{Model: model, Prompt: prompt})
			counts[endpointOf(r)]++
			p.End(r, Outcome{})
		}
		// A fair coin stays within 10% of half in 2000 tosses except with
		// probability far below 1e-9.
		for _, ep := range eps {
			if n := counts[ep.Address]; n < cycles*4/10 || n > cycles*6/10 {
				t.Errorf("%s order: %s chosen %d of %d times, want about half", order, ep.Address, n, cycles)
			}
		}
	}
}

func TestFallbackListIsOrderedByCost(t *testing.T) {
	load := func(p *Picker, tokens ...int) {
		for i, n := range tokens {
			if n > 0 {
				mustPick(t, p, on(addr(i), text("load"+string(rune('a'+i)), 4*n)))
			}
		}
	}
	for _, tc := range []struct {
		name      string
		endpoints int
		fallbacks int
		load      []int
		want      []int
	}{
		{"default three of five", 5, 0, []int{300, 100, 500, 200, 400}, []int{1, 3, 0}},
		{"one", 5, 1, []int{300, 100, 500, 200, 400}, []int{1}},
		{"more than there are", 2, 5, []int{10, 0}, []int{1, 0}},
		{"all five", 5, 5, []int{5, 4, 3, 2, 1}, []int{4, 3, 2, 1, 0}},
	} {
		cfg := testConfig()
		cfg.FallbackEndpoints = tc.fallbacks
		p := newPicker(t, tc.endpoints, cfg, Options{})
		load(p, tc.load...)
		r := mustPick(t, p, Request{Model: model, Prompt: text("new", 400)})
		var want []netip.AddrPort
		for _, i := range tc.want {
			want = append(want, addr(i))
		}
		if got := r.Endpoints(); !slices.Equal(got, want) {
			t.Errorf("%s: Endpoints() = %v, want %v", tc.name, got, want)
		}
		if endpointOf(r) != r.Endpoints()[0] {
			t.Errorf("%s: Endpoint() %s is not the first of Endpoints()", tc.name, endpointOf(r))
		}
	}
}

func TestSubsetRestrictsCandidates(t *testing.T) {
	p := newPicker(t, 3, testConfig(), Options{})
	unknown := netip.MustParseAddrPort("127.0.0.99:8000")

	for name, req := range map[string]Request{
		"empty subset":        {Model: model, HasSubset: true},
		"unknown-only subset": {Model: model, HasSubset: true, Subset: []netip.AddrPort{unknown}},
	} {
		if _, err := p.pick(req); !errors.Is(err, ErrNoEndpoint) {
			t.Errorf("%s: err = %v, want ErrNoEndpoint", name, err)
		}
	}

	// b is chosen every time although it carries all the load; duplicates,
	// unknown and IPv4-mapped forms in the hint are tolerated.
	b := addr(1)
	mapped := netip.AddrPortFrom(netip.AddrFrom16(b.Addr().As16()), b.Port())
	req := Request{Model: model, Prompt: text("s", 400), HasSubset: true, Subset: []netip.AddrPort{unknown, b, mapped, b}}
	for range 10 {
		r := mustPick(t, p, req)
		if endpointOf(r) != b || len(r.Endpoints()) != 1 {
			t.Fatalf("subset {%s}: picked %v", b, r.Endpoints())
		}
	}

	// Without HasSubset the list is ignored.
	req.HasSubset = false
	if r := mustPick(t, p, req); endpointOf(r) == b {
		t.Errorf("without HasSubset, the loaded endpoint %s was picked", b)
	}
}

func TestNoEndpoints(t *testing.T) {
	p := New(testConfig(), Options{})
	if p.Synced() {
		t.Error("synced before the first Replace")
	}
	if _, err := p.pick(Request{Model: model}); !errors.Is(err, ErrNoEndpoint) {
		t.Errorf("before Replace: err = %v, want ErrNoEndpoint", err)
	}
	p.Replace(nil)
	if !p.Synced() {
		t.Error("not synced after Replace")
	}
	if _, err := p.pick(Request{Model: model}); !errors.Is(err, ErrNoEndpoint) {
		t.Errorf("with an empty pool: err = %v, want ErrNoEndpoint", err)
	}
}

func TestSaturation(t *testing.T) {
	t.Run("off by default", func(t *testing.T) {
		p := newPicker(t, 1, testConfig(), Options{})
		for i := range 200 {
			if _, err := p.pick(Request{Model: model, Prompt: text("big", 40_000)}); err != nil {
				t.Fatalf("pick %d: %v", i, err)
			}
		}
	})

	t.Run("in-flight limit", func(t *testing.T) {
		cfg := testConfig()
		cfg.Saturation.MaxInFlightRequests = 2
		p := newPicker(t, 2, cfg, Options{})
		var held []*Reservation
		for range 4 {
			held = append(held, mustPick(t, p, Request{Model: model}))
		}
		for _, s := range p.Snapshot().Endpoints {
			if s.InFlight != 2 {
				t.Errorf("%s holds %d, want 2", s.Endpoint.Address, s.InFlight)
			}
		}
		if _, err := p.pick(Request{Model: model}); !errors.Is(err, ErrSaturated) {
			t.Fatalf("fifth pick: err = %v, want ErrSaturated", err)
		}
		p.End(held[0], Outcome{})
		r := mustPick(t, p, Request{Model: model})
		if endpointOf(r) != endpointOf(held[0]) {
			t.Errorf("after a release, picked %s, want the endpoint with room %s", endpointOf(r), endpointOf(held[0]))
		}
	})

	t.Run("prefill limit skips a cheaper endpoint", func(t *testing.T) {
		cfg := testConfig()
		cfg.Saturation.MaxPrefillTokens = 1000
		cfg.DecodeWeightTokens = 1
		p := newPicker(t, 2, cfg, Options{})
		a, b := addr(0), addr(1)
		full := mustPick(t, p, on(a, text("full", 4000))) // a: 1000 prefill, saturated
		mustPick(t, p, on(b, text("some", 2000)))         // b: 500 prefill
		// A request that a already holds whole is cheaper on a, but a is saturated.
		r := mustPick(t, p, Request{Model: model, Prompt: text("full", 4000)})
		if endpointOf(r) != b || len(r.Endpoints()) != 1 {
			t.Errorf("picked %v, want only %s: a saturated endpoint is neither chosen nor a fallback", r.Endpoints(), b)
		}
		if _, err := p.pick(Request{Model: model}); !errors.Is(err, ErrSaturated) {
			t.Errorf("with both over the prefill limit: err = %v, want ErrSaturated", err)
		}
		p.FirstByte(full) // a's prefill is done: it has room again
		if r := mustPick(t, p, Request{Model: model}); endpointOf(r) != a {
			t.Errorf("after a's first byte, picked %s, want %s", endpointOf(r), a)
		}
	})
}

func TestServedByMovesTheReservation(t *testing.T) {
	p := newPicker(t, 3, testConfig(), Options{})
	a, b, c := addr(0), addr(1), addr(2)
	shared := text("shared", 640) // 10 blocks a already holds
	warm := mustPick(t, p, on(a, shared))
	p.End(warm, Outcome{})

	prompt := join(shared, text("tail", 3360)) // 4000 characters, 62 blocks
	r := mustPick(t, p, on(a, prompt))
	uncached := statsOf(p, a).PrefillTokens
	if uncached != (4000-640)/4 {
		t.Fatalf("a holds %d prefill tokens, want %d", uncached, (4000-640)/4)
	}

	p.ServedBy(r, b)
	if got := statsOf(p, a); got.InFlight != 0 || got.PrefillTokens != 0 || got.Decoding != 0 {
		t.Errorf("after ServedBy(b), a = %+v, want zero", got)
	}
	// b holds none of the prompt: it prefills all of it.
	if got := statsOf(p, b); got.InFlight != 1 || got.PrefillTokens != 1000 {
		t.Errorf("after ServedBy(b), b = %+v, want 1 in flight, 1000 prefill", got)
	}
	if endpointOf(r) != b {
		t.Errorf("Endpoint() = %s after ServedBy(b)", endpointOf(r))
	}
	if got := heldBlocks(p, prompt, b); got != 62 {
		t.Errorf("b holds %d blocks of the prompt, want 62", got)
	}
	if got := heldBlocks(p, prompt, a); got != 10 {
		t.Errorf("a holds %d blocks of the prompt, want 10: the shared head it had before, not the tail it never computed", got)
	}

	p.ServedBy(r, b)                                      // already there
	p.ServedBy(r, netip.MustParseAddrPort("10.0.0.1:80")) // unknown
	p.FirstByte(r)
	p.ServedBy(r, c)
	if got := statsOf(p, c); got.InFlight != 1 || got.PrefillTokens != 0 || got.Decoding != 1 {
		t.Errorf("after first byte and ServedBy(c), c = %+v, want 1 in flight, 1 decoding", got)
	}
	if got := statsOf(p, b); got.InFlight != 0 || got.PrefillTokens != 0 || got.Decoding != 0 {
		t.Errorf("after ServedBy(c), b = %+v, want zero", got)
	}
	p.End(r, Outcome{})
	p.ServedBy(r, a)
	assertLedgerEmpty(t, p)
}

func TestSweepReleasesOnlyOldReservations(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 2, testConfig(), Options{Clock: clock, MaxRequestLifetime: 10 * time.Minute})

	old := mustPick(t, p, Request{Model: model, Prompt: text("old", 400)})
	p.FirstByte(old)
	clock.Advance(5 * time.Minute)
	mustPick(t, p, Request{Model: model, Prompt: text("young", 800)})
	clock.Advance(6 * time.Minute) // old: 11 minutes, young: 6

	if n := p.sweep(); n != 1 {
		t.Fatalf("Sweep released %d, want 1", n)
	}
	// The young request's prefill has long drained in the model.
	if l := p.Snapshot(); l.InFlight != 1 || l.PrefillTokens != 0 {
		t.Errorf("after the sweep: %d in flight, %d prefill, want only the young request (1, 0)", l.InFlight, l.PrefillTokens)
	}
	p.End(old, Outcome{}) // already swept: no effect
	if in := p.Snapshot().InFlight; in != 1 {
		t.Errorf("releasing a swept reservation changed the ledger: %d in flight", in)
	}
	if n := p.sweep(); n != 0 {
		t.Errorf("second Sweep released %d, want 0", n)
	}
	clock.Advance(5 * time.Minute)
	if n := p.sweep(); n != 1 {
		t.Errorf("Sweep after young aged released %d, want 1", n)
	}
	assertLedgerEmpty(t, p)
	if got := testutil.ToFloat64(p.metrics.swept); got != 2 {
		t.Errorf("tally_reservations_swept_total = %v, want 2", got)
	}
}

func TestRunSweepsUntilCancelled(t *testing.T) {
	p := newPicker(t, 1, testConfig(), Options{Clock: clock.RealClock{}, MaxRequestLifetime: 50 * time.Millisecond})
	mustPick(t, p, Request{Model: model, Prompt: text("forgotten", 400)})

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan struct{})
	go func() {
		p.Run(ctx)
		close(done)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if in := p.Snapshot().InFlight; in == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Run did not sweep the forgotten reservation within 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
}

func TestCriticalSectionDoesNotAllocateOnKnownBlocks(t *testing.T) {
	p := newPicker(t, 16, testConfig(), Options{})
	req := Request{Model: model, Prompt: text("known", 8000)}
	hashes := prefix.HashSalted(nil, model, "", req.Prompt, p.cfg.BlockSizeChars)
	r := &Reservation{}
	place := func() {
		*r = Reservation{hashes: hashes, promptChars: len(req.Prompt)}
		p.mu.Lock()
		defer p.mu.Unlock()
		if err := p.l.place(r, req); err != nil {
			t.Fatal(err)
		}
		p.l.release(r, 0)
	}
	place()
	if allocs := testing.AllocsPerRun(100, place); allocs != 0 {
		t.Errorf("the critical section allocated %.1f times per pick of a known prompt, want 0", allocs)
	}
}

// /debug/ledger lists the oldest maxListedReservations reservations and
// counts the rest, as the ledger holds them: ended ones leave the count.
func TestTheListedReservationsCountThoseLeftOut(t *testing.T) {
	p := newPicker(t, 3, testConfig(), Options{})
	rs := make([]*Reservation, maxListedReservations+3)
	for i := range rs {
		rs[i] = mustPick(t, p, Request{Model: model, Prompt: text("listed "+strconv.Itoa(i), 8)})
	}
	l := p.SnapshotWithReservations()
	if len(l.Reservations) != maxListedReservations || l.ReservationsOmitted != 3 {
		t.Fatalf("%d reservations listed, %d omitted; want %d and 3", len(l.Reservations), l.ReservationsOmitted, maxListedReservations)
	}
	p.End(rs[0], Outcome{})
	p.End(rs[len(rs)-1], Outcome{})
	l = p.SnapshotWithReservations()
	if len(l.Reservations) != maxListedReservations || l.ReservationsOmitted != 1 {
		t.Fatalf("after two ended: %d listed, %d omitted; want %d and 1", len(l.Reservations), l.ReservationsOmitted, maxListedReservations)
	}
	for _, r := range rs[1 : len(rs)-1] {
		p.End(r, Outcome{})
	}
	if l = p.SnapshotWithReservations(); len(l.Reservations) != 0 || l.ReservationsOmitted != 0 {
		t.Fatalf("with none in flight: %d listed, %d omitted", len(l.Reservations), l.ReservationsOmitted)
	}
}
