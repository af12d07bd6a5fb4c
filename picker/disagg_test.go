package picker

import (
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
)

// withRoles returns test endpoints whose roles are roles, in order.
func withRoles(roles ...string) []Endpoint {
	eps := endpoints(len(roles))
	for i, r := range roles {
		eps[i].Role = r
	}
	return eps
}

// A prefill-only pod is never a request's destination: not from the whole
// pool, however idle it is, nor when a subset hint names it among others.
func TestPrefillOnlyPodsAreNeverDestinations(t *testing.T) {
	p := newPicker(t, 0, testConfig(), Options{})
	roles := withRoles(RolePrefill, RoleDecode, RolePrefill, RolePrefillDecode, "", "encode")
	p.Replace(roles)
	got := map[netip.AddrPort]int{}
	var res []*Reservation
	for i := range 60 {
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("roles ", i), 4000)})
		got[endpointOf(r)]++
		res = append(res, r)
	}
	for _, i := range []int{0, 2, 5} {
		if got[addr(i)] != 0 {
			t.Errorf("endpoint %d (role %q) is the destination of %d requests, want none", i, roles[i].Role, got[addr(i)])
		}
	}
	for _, i := range []int{1, 3, 4} {
		if got[addr(i)] == 0 {
			t.Errorf("decode-capable endpoint %d took no request of 60: %v", i, got)
		}
	}
	r, err := p.pick(Request{Model: model, Prompt: text("hint", 400), HasSubset: true, Subset: []netip.AddrPort{addr(0), addr(1)}})
	if err != nil {
		t.Fatalf("a hint naming a prefill pod and a decode pod: %v", err)
	}
	if endpointOf(r) != addr(1) {
		t.Errorf("a hint naming a prefill pod and a decode pod gives %s, want the decode pod %s", endpointOf(r), addr(1))
	}
	if only, err := p.pick(Request{Model: model, Prompt: text("hint", 400), HasSubset: true, Subset: []netip.AddrPort{addr(0)}}); err != ErrNoEndpoint {
		t.Errorf("a hint naming only a prefill pod gives %v, want ErrNoEndpoint", err)
		if only != nil {
			res = append(res, only)
		}
	}
	for _, r := range append(res, r) {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}

// pdPicker is a picker over two prefill pods (endpoints 0 and 1) and two
// decode pods (2 and 3), splitting at 16 uncached tokens.
func pdPicker(t testing.TB, clock *fakeClock) *Picker {
	if clock == nil {
		clock = newFakeClock()
	}
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	cfg.Disaggregation.NonCachedTokens = 16
	p := newPicker(t, 0, cfg, Options{Clock: clock})
	p.Replace(withRoles(RolePrefill, RolePrefill, RoleDecode, RoleDecode))
	return p
}

// wantRow fails unless the endpoint at a holds inFlight requests, prefill
// tokens of prefill, and decoding requests decoding.
func wantRow(t *testing.T, p *Picker, when string, a netip.AddrPort, inFlight, prefill, decoding int) {
	t.Helper()
	s := statsOf(p, a)
	if s.InFlight != inFlight || s.PrefillTokens != prefill || s.Decoding != decoding {
		t.Errorf("%s: %s holds (%d in flight, %d prefill tokens, %d decoding), want (%d, %d, %d)",
			when, a, s.InFlight, s.PrefillTokens, s.Decoding, inFlight, prefill, decoding)
	}
}

// splitPick picks a 1,000-token cold prompt and checks that it is split: a
// decode pod is the destination, holding it as decoding, and a prefill pod
// holds its prefill.
func splitPick(t *testing.T, p *Picker, tag string) (r *Reservation, dest, pre netip.AddrPort) {
	t.Helper()
	r = mustPick(t, p, Request{Model: model, Prompt: text(tag, 4000), Stream: true})
	dest = endpointOf(r)
	pre, ok := r.Prefiller()
	if !ok {
		t.Fatalf("%s: a cold 1,000-token prompt is not split", tag)
	}
	if dest != addr(2) && dest != addr(3) {
		t.Fatalf("%s: destination %s, want a decode pod", tag, dest)
	}
	if pre != addr(0) && pre != addr(1) {
		t.Fatalf("%s: prefiller %s, want a prefill pod", tag, pre)
	}
	wantRow(t, p, tag+" at the pick", pre, 1, 1000, 0)
	wantRow(t, p, tag+" at the pick", dest, 1, 0, 1)
	return r, dest, pre
}

// A split request's two parts are released exactly once on every path:
// first byte then end, end without a first byte, a detached end whose
// prefill part drains by the prefiller's model, and the sweeper.
func TestASplitRequestReleasesBothPartsOnEveryPath(t *testing.T) {
	t.Run("first byte then end", func(t *testing.T) {
		p := pdPicker(t, nil)
		r, dest, pre := splitPick(t, p, "fb")
		p.FirstByte(r)
		wantRow(t, p, "after the first byte", pre, 0, 0, 0)
		wantRow(t, p, "after the first byte", dest, 1, 0, 1)
		p.FirstByte(r)
		p.End(r, Outcome{PromptTokens: 1000, CompletionTokens: 20})
		p.End(r, Outcome{})
		assertLedgerEmpty(t, p)
	})
	t.Run("end without a first byte", func(t *testing.T) {
		p := pdPicker(t, nil)
		r, _, _ := splitPick(t, p, "end")
		p.End(r, Outcome{})
		p.FirstByte(r)
		assertLedgerEmpty(t, p)
	})
	t.Run("detached", func(t *testing.T) {
		clock := newFakeClock()
		p := pdPicker(t, clock)
		req := Request{Model: model, Prompt: text("detached", 4000), MaxTokens: 10}
		r := mustPick(t, p, req)
		pre, ok := r.Prefiller()
		if !ok {
			t.Fatal("a cold 1,000-token prompt is not split")
		}
		dest := endpointOf(r)
		p.End(r, Outcome{Detached: true})
		if l := p.Snapshot(); l.Detached != 1 {
			t.Fatalf("after a detached end: %d detached, want 1", l.Detached)
		}
		wantRow(t, p, "detached, in prefill", pre, 1, 1000, 0)
		wantRow(t, p, "detached, in prefill", dest, 1, 0, 1)
		// 1,000 tokens at 10,000 tokens/s: the prefill leg is done in
		// 100 ms by the prefiller's model; then 10 tokens of decoding.
		clock.Advance(101 * time.Millisecond)
		p.sweep()
		wantRow(t, p, "detached, past its modelled prefill", pre, 0, 0, 0)
		wantRow(t, p, "detached, past its modelled prefill", dest, 1, 0, 1)
		clock.Advance(time.Duration(10*defaultDecodeNsPerToken) + time.Millisecond)
		p.sweep()
		assertLedgerEmpty(t, p)
		if got := p.Snapshot().DetachEnds[detachEndModel]; got != 1 {
			t.Errorf("ends by the model = %d, want 1", got)
		}
		p.End(r, Outcome{})
		p.FirstByte(r)
		assertLedgerEmpty(t, p)
	})
	t.Run("sweeper", func(t *testing.T) {
		clock := newFakeClock()
		p := pdPicker(t, clock)
		r, _, _ := splitPick(t, p, "swept")
		clock.Advance(DefaultMaxRequestLifetime + time.Second)
		if n := p.sweep(); n != 1 {
			t.Errorf("swept %d, want 1", n)
		}
		assertLedgerEmpty(t, p)
		p.FirstByte(r)
		p.End(r, Outcome{})
		assertLedgerEmpty(t, p)
	})
}

// A burst of 64 cold long prompts over two prefill and two decode pods:
// every request is split, the prefill pods share the prefills and the
// decode pods the decodes evenly, and everything is released after.
func TestABurstSplitsEvenlyOverPrefillAndDecodePods(t *testing.T) {
	p := pdPicker(t, nil)
	const n = 64
	var (
		start = make(chan struct{})
		wg    sync.WaitGroup
		res   = make([]*Reservation, n)
		errs  = make([]error, n)
	)
	for i := range n {
		wg.Go(func() {
			<-start
			res[i], errs[i] = p.pick(Request{Model: model, Prompt: text(fmt.Sprint("pd burst ", i), 16_000), Stream: true})
		})
	}
	close(start)
	wg.Wait()
	dests, pres := map[netip.AddrPort]int{}, map[netip.AddrPort]int{}
	for i, r := range res {
		if errs[i] != nil {
			t.Fatalf("pick %d: %v", i, errs[i])
		}
		dests[endpointOf(r)]++
		if a, ok := r.Prefiller(); ok {
			pres[a]++
		}
	}
	if d0, d1 := dests[addr(2)], dests[addr(3)]; d0 != n/2 || d1 != n/2 {
		t.Errorf("decode pods got %d and %d requests (all destinations: %v), want %d each", d0, d1, dests, n/2)
	}
	p0, p1 := pres[addr(0)], pres[addr(1)]
	if p0+p1 != n || p0-p1 > 1 || p1-p0 > 1 {
		t.Errorf("prefill pods prefilled %d and %d requests, want all %d split, within 1 of each other", p0, p1, n)
	}
	wantRow(t, p, "after the burst", addr(0), p0, p0*4000, 0)
	wantRow(t, p, "after the burst", addr(1), p1, p1*4000, 0)
	for i, r := range res {
		if i%2 == 0 {
			p.FirstByte(r)
		}
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}

// A request is split only when disaggregation is on, its prompt is long
// enough, enough of it is not cached on its destination, and a prefill pod
// is no costlier than prefilling on the destination.
func TestARequestIsSplitOnlyWhenItPays(t *testing.T) {
	long := text("long", 4000) // 1,000 tokens
	t.Run("off", func(t *testing.T) {
		cfg := testConfig()
		p := newPicker(t, 0, cfg, Options{})
		p.Replace(withRoles(RolePrefill, RoleDecode))
		r := mustPick(t, p, Request{Model: model, Prompt: long})
		if a, ok := r.Prefiller(); ok {
			t.Errorf("disaggregation off: split onto %s", a)
		}
		wantRow(t, p, "off", addr(1), 1, 1000, 0)
	})
	t.Run("short prompt", func(t *testing.T) {
		p := pdPicker(t, nil)
		r := mustPick(t, p, Request{Model: model, Prompt: text("short", 40)}) // 10 tokens
		if a, ok := r.Prefiller(); ok {
			t.Errorf("10 uncached tokens (under 16): split onto %s", a)
		}
		cfg := testConfig()
		cfg.Disaggregation = v1alpha1.Disaggregation{NonCachedTokens: 16, PromptTokens: 2000}
		q := newPicker(t, 0, cfg, Options{})
		q.Replace(withRoles(RolePrefill, RoleDecode))
		if a, ok := mustPick(t, q, Request{Model: model, Prompt: long}).Prefiller(); ok {
			t.Errorf("a 1,000-token prompt under promptTokens 2000: split onto %s", a)
		}
	})
	t.Run("cached on the destination", func(t *testing.T) {
		p := pdPicker(t, nil)
		first := mustPick(t, p, on(addr(2), long))
		p.End(first, Outcome{})
		// The same prompt again, on the pod that holds it: one block
		// short of it is uncached, under 16 tokens.
		r := mustPick(t, p, on(addr(2), long))
		if a, ok := r.Prefiller(); ok {
			t.Errorf("a prompt cached on its destination: split onto %s", a)
		}
	})
	t.Run("unlabelled pool", func(t *testing.T) {
		cfg := testConfig()
		cfg.Disaggregation.NonCachedTokens = 16
		p := newPicker(t, 3, cfg, Options{})
		for i := range 6 {
			if a, ok := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("plain ", i), 4000)}).Prefiller(); ok {
				t.Errorf("an unlabelled pool split a request onto %s", a)
			}
		}
	})
	t.Run("busy prefill pods", func(t *testing.T) {
		p := pdPicker(t, nil)
		// 20,000 tokens queued on each prefill pod, through requests
		// split onto them: a cold 1,000-token prompt then prefills
		// faster where it decodes.
		for i := range 2 {
			r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("big ", i), 80_000)})
			if _, ok := r.Prefiller(); !ok {
				t.Fatal("a cold 20,000-token prompt on an idle pool is not split")
			}
		}
		r := mustPick(t, p, Request{Model: model, Prompt: long})
		if a, ok := r.Prefiller(); ok {
			t.Errorf("with 20,000 tokens queued on each prefill pod and one request decoding on each decode pod: split onto %s", a)
		}
	})
}

// The pair is chosen by the request's time to first token through it, not
// by its decode pod's cost of prefilling alone: a decode pod that holds
// most of the prompt but has a long decode queue loses to an idle one when
// a prefill pod holds the prompt too (the split moves only the KV).
func TestThePairIsChosenByItsTimeToFirstToken(t *testing.T) {
	p := pdPicker(t, nil)
	history := text("history", 60_000) // 15,000 tokens
	first := mustPick(t, p, Request{Model: model, Prompt: history, Stream: true})
	busy, ok := endpointOf(first), false
	pre, ok := first.Prefiller()
	if !ok {
		t.Fatal("a cold 15,000-token prompt on an idle pool is not split")
	}
	p.FirstByte(first)
	p.End(first, Outcome{})
	idle := addr(2)
	if busy == idle {
		idle = addr(3)
	}
	// 100 requests decoding on the pod that holds the history (12,800
	// tokens of decode weight), none on the other.
	var decoding []*Reservation
	for i := range 100 {
		r := mustPick(t, p, on(busy, text(fmt.Sprint("decode ", i), 400)))
		p.FirstByte(r)
		decoding = append(decoding, r)
	}
	// The history and 5,000 tokens more: 5,000 uncached on busy and on
	// pre, 20,000 on idle. Prefilling on busy would wait out its queue;
	// the split through pre decodes on idle at once.
	prompt := append(append([]byte{}, history...), text("question", 20_000)...)
	r := mustPick(t, p, Request{Model: model, Prompt: prompt, Stream: true})
	got, _ := r.Prefiller()
	if endpointOf(r) != idle || got != pre {
		t.Errorf("the request went to %s prefilled on %s, want the idle decode pod %s prefilled on %s (which holds its history)", endpointOf(r), got, idle, pre)
	}
	p.End(r, Outcome{})
	for _, r := range decoding {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}

// Each pick says why it split its request or did not.
func TestEachPickSaysWhyItSplitOrNot(t *testing.T) {
	long := text("why", 4000) // 1,000 tokens
	p := pdPicker(t, nil)
	split := mustPick(t, p, Request{Model: model, Prompt: long})
	if split.splitWhy != splitYes {
		t.Errorf("a cold 1,000-token prompt on an idle pool: %q, want %q", split.splitWhy, splitYes)
	}
	dest := endpointOf(split)
	p.End(split, Outcome{})
	if r := mustPick(t, p, on(dest, long)); r.splitWhy != splitCached {
		t.Errorf("a prompt cached on its destination: %q, want %q", r.splitWhy, splitCached)
	}
	if r := mustPick(t, p, Request{Model: model, Prompt: text("short", 40)}); r.splitWhy != splitShort {
		t.Errorf("a 10-token prompt: %q, want %q", r.splitWhy, splitShort)
	}
	// 20,000 tokens queued on each prefill pod: a cold 1,000-token prompt
	// prefills sooner where it decodes.
	for i := range 2 {
		mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("big ", i), 80_000)})
	}
	if r := mustPick(t, p, Request{Model: model, Prompt: text("cold", 4000)}); r.splitWhy != splitLocalCheaper {
		t.Errorf("busy prefill pods: %q, want %q", r.splitWhy, splitLocalCheaper)
	}
	q := pdPicker(t, nil)
	q.Replace(withRoles(RoleDecode, RoleDecode))
	if r := mustPick(t, q, Request{Model: model, Prompt: long}); r.splitWhy != splitNoPrefillPod {
		t.Errorf("no prefill pod: %q, want %q", r.splitWhy, splitNoPrefillPod)
	}
	if r := mustPick(t, q, Request{Model: model, Prompt: text("whole", 4000), DestinationOnly: true}); r.splitWhy != splitNoPrefillPod {
		t.Errorf("no prefill pod, a gateway that takes only the destination: %q, want %q", r.splitWhy, splitNoPrefillPod)
	}
	g := pdPicker(t, nil)
	if r := mustPick(t, g, Request{Model: model, Prompt: text("whole", 4000), DestinationOnly: true}); r.splitWhy != splitGateway {
		t.Errorf("a gateway that takes only the destination: %q, want %q", r.splitWhy, splitGateway)
	} else if a, ok := r.Prefiller(); ok {
		t.Errorf("a gateway that takes only the destination: split onto %s", a)
	}
	off := newPicker(t, 0, testConfig(), Options{})
	off.Replace(withRoles(RolePrefill, RoleDecode))
	if r := mustPick(t, off, Request{Model: model, Prompt: long}); r.splitWhy != "" {
		t.Errorf("disaggregation off: %q, want none", r.splitWhy)
	}
}

// A prefill pod off after failed legs is tried again after its backoff,
// and one leg that works ends the count.
func TestAPrefillPodBackOffEnds(t *testing.T) {
	clock := newFakeClock()
	p := pdPicker(t, clock)
	p.Replace(withRoles(RolePrefill, RoleDecode))
	fail := func(tag string) {
		t.Helper()
		r := mustPick(t, p, Request{Model: model, Prompt: text(tag, 4000), Stream: true})
		if _, ok := r.Prefiller(); !ok {
			t.Fatalf("%s: not split", tag)
		}
		p.End(r, Outcome{ServerError: true})
	}
	for i := range legFailureThreshold {
		fail(fmt.Sprint("fail ", i))
	}
	if r := mustPick(t, p, Request{Model: model, Prompt: text("off", 4000)}); r.splitWhy != splitNoPrefillPod {
		t.Errorf("after %d failed legs: %q, want %q", legFailureThreshold, r.splitWhy, splitNoPrefillPod)
	} else {
		p.End(r, Outcome{})
	}
	clock.Advance(legBackoff)
	fail("again") // tried again after the backoff, and failing: off for twice as long
	clock.Advance(legBackoff)
	if r := mustPick(t, p, Request{Model: model, Prompt: text("still off", 4000)}); r.splitWhy != splitNoPrefillPod {
		t.Errorf("one backoff into a doubled one: %q, want %q", r.splitWhy, splitNoPrefillPod)
	} else {
		p.End(r, Outcome{})
	}
	clock.Advance(legBackoff)
	r := mustPick(t, p, Request{Model: model, Prompt: text("works", 4000), Stream: true})
	if _, ok := r.Prefiller(); !ok {
		t.Fatal("after the doubled backoff: not split")
	}
	p.FirstByte(r)
	p.End(r, Outcome{})
	fail("once more") // one failure after a leg that worked does not turn it off
	if r := mustPick(t, p, Request{Model: model, Prompt: text("on", 4000)}); r.splitWhy != splitYes {
		t.Errorf("one failure after a leg that worked: %q, want %q", r.splitWhy, splitYes)
	} else {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}

// A split request for an adapter holds the adapter on its prefill pod too
// (the prefill leg runs with it) until its prefill part ends, and its first
// byte waits for a load there.
func TestASplitRequestHoldsItsAdapterOnItsPrefillPod(t *testing.T) {
	p := pdPicker(t, nil)
	p.Replace(withRoles(RolePrefill, RoleDecode))
	observeLoRA(p, 2, map[int][]string{1: {"sql"}}) // loaded on the decode pod only
	r := mustPick(t, p, Request{Model: "sql", Prompt: text("adapter", 4000), Stream: true})
	if pre, ok := r.Prefiller(); !ok || pre != addr(0) {
		t.Fatalf("prefiller %v %v, want the prefill pod %s", pre, ok, addr(0))
	}
	if got := statsOf(p, addr(0)).Adapters["sql"]; got != 1 {
		t.Errorf("the prefill pod holds %d requests for the adapter, want 1", got)
	}
	if !r.adapterLoad {
		t.Error("the adapter is not loaded on the prefill pod, yet the first byte is not taken to wait for its load")
	}
	p.FirstByte(r)
	if got := statsOf(p, addr(0)).Adapters["sql"]; got != 0 {
		t.Errorf("after the first byte the prefill pod holds %d requests for the adapter, want 0", got)
	}
	p.End(r, Outcome{})
	assertLedgerEmpty(t, p)
}

// Bursts whose prompts share a head, or of which one decode pod holds a
// long prefix, stay even over both stages: a decode pod that prefilled a
// request itself (nothing decoding there yet) splits again once its own
// queue is as long as a prefill pod's, rather than prefilling the rest of
// the burst itself.
func TestBurstsWithSharedHeadsSplitEvenly(t *testing.T) {
	head := text("system prompt", 2048) // 512 tokens
	for _, tc := range []struct {
		name string
		warm bool // one decode pod holds head and 30,000 tokens more
		// legs: the prefill legs are even in count (with a long prefix
		// they are even in tokens: the pod that holds it runs short legs)
		legs bool
	}{{"shared head", false, true}, {"long prefix on one decode pod", true, false}} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdPicker(t, nil)
			prefix := head
			if tc.warm {
				prefix = append(append([]byte{}, head...), text("long prefix", 120_000)...)
				w := mustPick(t, p, on(addr(2), append(append([]byte{}, prefix...), text("warm", 8000)...)))
				p.FirstByte(w)
				p.End(w, Outcome{})
			}
			const n = 128
			dests, pres := map[netip.AddrPort]int{}, map[netip.AddrPort]int{}
			var res []*Reservation
			for i := range n {
				prompt := append(append([]byte{}, prefix...), text(fmt.Sprint("own ", i), 128_000-len(prefix))...)
				r := mustPick(t, p, Request{Model: model, Prompt: prompt, Stream: true})
				dests[endpointOf(r)]++
				if a, ok := r.Prefiller(); ok {
					pres[a]++
				}
				res = append(res, r)
			}
			if d2, d3 := dests[addr(2)], dests[addr(3)]; d2-d3 > 1 || d3-d2 > 1 {
				t.Errorf("decode pods got %d and %d of %d, want within 1", d2, d3, n)
			}
			p0, p1 := pres[addr(0)], pres[addr(1)]
			if p0+p1 < n*3/4 || tc.legs && (p0-p1 > 1 || p1-p0 > 1) {
				t.Errorf("prefill pods prefilled %d and %d of %d, want three quarters split at least (even: %v)", p0, p1, n, tc.legs)
			}
			for _, r := range res {
				p.End(r, Outcome{})
			}
			assertLedgerEmpty(t, p)
		})
	}
}
