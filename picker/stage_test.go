package picker

import (
	"fmt"
	"math"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker/internal/ratemodel"
)

// pdFlowPicker is pdPicker with flow control on: at 10,000 tokens/s and
// the default 250 ms threshold, a pod is saturated from 2,500 queued
// tokens. edit adjusts the configuration first.
func pdFlowPicker(t *testing.T, edit func(*v1alpha1.PickerConfig)) *Picker {
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	cfg.Disaggregation.NonCachedTokens = 16
	cfg.FlowControl.Enabled = true
	if edit != nil {
		edit(&cfg)
	}
	p := newPicker(t, 0, v1alpha1.WithDefaults(cfg), Options{Clock: newFakeClock()})
	p.Replace(withRoles(RolePrefill, RolePrefill, RoleDecode, RoleDecode))
	return p
}

// enqueueNow places req at once, or fails.
func enqueueNow(t *testing.T, p *Picker, req Request) *Reservation {
	t.Helper()
	r, tk, err := p.Enqueue(req)
	if err != nil || tk != nil {
		t.Fatalf("Enqueue: want placed at once, got ticket %v, err %v", tk != nil, err)
	}
	return r
}

// A request that would be split is placed only while a prefill pod is
// free to prefill it: once both prefill pods are saturated, the next
// request prefills on a decode pod with room for it (not split, though a
// saturated prefill pod costs less than the decode pod's load), the one
// after that waits once the decode pods are saturated too, and it is
// dispatched, split, when a prefill part ends at its request's first byte.
func TestSaturatedPrefillPodsHoldSplitRequests(t *testing.T) {
	// A decoding request weighs as much as 10,000 queued tokens: a
	// prefill pod with 3,000 queued is cheaper than a decode pod with one
	// request decoding.
	p := pdFlowPicker(t, func(c *v1alpha1.PickerConfig) { c.DecodeWeightTokens = 10_000 })
	long := func(tag string) Request { return Request{Model: model, Prompt: text(tag, 12_000), Stream: true} } // 3,000 tokens
	var split []*Reservation
	pres := map[netip.AddrPort]bool{}
	for i := range 2 {
		r := enqueueNow(t, p, long(fmt.Sprint("fill ", i)))
		pre, ok := r.Prefiller()
		if !ok {
			t.Fatalf("fill %d on an idle pool: not split", i)
		}
		pres[pre] = true
		split = append(split, r)
	}
	if !pres[addr(0)] || !pres[addr(1)] {
		t.Fatalf("two cold prompts prefilled on %v, want one on each prefill pod", pres)
	}
	// Both prefill pods hold 3,000 tokens: saturated.
	var whole []*Reservation
	for i := range 2 {
		r := enqueueNow(t, p, long(fmt.Sprint("whole ", i)))
		if pre, ok := r.Prefiller(); ok {
			t.Fatalf("request %d split onto the saturated prefill pod %s, want it prefilled on a free decode pod", i, pre)
		}
		whole = append(whole, r)
	}
	if a, b := endpointOf(whole[0]), endpointOf(whole[1]); a == b {
		t.Fatalf("both unsplit requests went to %s, want one on each decode pod", a)
	}
	wantRow(t, p, "decode pods prefilling", addr(2), 2, 3000, 1)
	wantRow(t, p, "decode pods prefilling", addr(3), 2, 3000, 1)

	// Every pod is saturated for prefill; the decode pods have decode
	// slots, but no prefill pod is free: it waits.
	tk := mustWait(t, p, long("waiter"))
	if l := p.Snapshot(); l.Waiting != 1 {
		t.Fatalf("%d waiting, want 1", l.Waiting)
	}

	// The first split request's first byte frees its prefill pod.
	freed, _ := split[0].Prefiller()
	p.FirstByte(split[0])
	r := placed(t, tk)
	pre, ok := r.Prefiller()
	if !ok || pre != freed {
		t.Fatalf("dispatched with prefiller %s (split %v), want split onto the freed prefill pod %s", pre, ok, freed)
	}
	if d := endpointOf(r); d != addr(2) && d != addr(3) {
		t.Fatalf("dispatched to %s, want a decode pod", d)
	}
	wantRow(t, p, "after the dispatch", freed, 1, 3000, 0)

	for _, r := range append(append(split, whole...), r) {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}

// Decode pods with every decoding slot taken hold a request that would be
// split, however idle the prefill pods are; a prefill part's end does not
// dispatch it, a decode slot's does.
func TestFullDecodePodsHoldEvenWithFreePrefillPods(t *testing.T) {
	p := pdFlowPicker(t, func(c *v1alpha1.PickerConfig) { c.FlowControl.MaxDecodingRequests = 1 })
	req := func(tag string) Request { return Request{Model: model, Prompt: text(tag, 4000), Stream: true} } // 1,000 tokens
	var fill []*Reservation
	for i := range 2 {
		r := enqueueNow(t, p, req(fmt.Sprint("fill ", i)))
		if _, ok := r.Prefiller(); !ok {
			t.Fatalf("fill %d on an idle pool: not split", i)
		}
		fill = append(fill, r)
	}
	tk := mustWait(t, p, req("waiter"))
	p.FirstByte(fill[0])
	p.FirstByte(fill[1])
	wantRow(t, p, "prefill parts done", addr(0), 0, 0, 0)
	wantRow(t, p, "prefill parts done", addr(1), 0, 0, 0)
	if !waiting(tk) {
		t.Fatal("dispatched onto a decode pod with no decoding slot free")
	}
	dest := endpointOf(fill[1])
	p.End(fill[1], Outcome{})
	r := placed(t, tk)
	if got := endpointOf(r); got != dest {
		t.Errorf("dispatched to %s, want the decode pod that freed a slot, %s", got, dest)
	}
	if _, ok := r.Prefiller(); !ok {
		t.Error("dispatched unsplit, with both prefill pods idle")
	}
	p.End(r, Outcome{})
	p.End(fill[0], Outcome{})
	assertLedgerEmpty(t, p)
}

// Split requests teach their prefill pod's rate: a prefill pod whose first
// bytes come twice as late is learned about half as fast, the decode pods
// learn nothing, and in a later burst, drained by the model alone, the
// slower prefill pod takes about half as many prefills.
func TestSplitFirstBytesTeachThePrefillPodsRate(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.Disaggregation.NonCachedTokens = 16
	p := newPicker(t, 0, cfg, Options{Clock: clock})
	p.Replace(withRoles(RolePrefill, RolePrefill, RoleDecode, RoleDecode))
	engine := map[netip.AddrPort]float64{addr(0): 50_000, addr(1): 25_000} // tokens/s
	rng := rand.New(rand.NewPCG(7, 1))
	for i := range 400 {
		tokens := 500 + rng.IntN(8000)
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("learn ", i), tokens*4), Stream: true})
		pre, ok := r.Prefiller()
		if !ok {
			t.Fatalf("request %d on an idle pool: not split", i)
		}
		noise := math.Exp(rng.NormFloat64() * 0.3)
		// The prefill leg, then the KV transfer and the first decode step.
		clock.Advance(time.Duration(float64(tokens)/engine[pre]*noise*float64(time.Second)) + 20*time.Millisecond)
		p.FirstByte(r)
		clock.Advance(63 * 8 * time.Millisecond)
		p.End(r, Outcome{CompletionTokens: 64})
	}
	rs := rates(p)
	if ratio := rs[0] / rs[1]; ratio < 1.6 || ratio > 2.4 {
		t.Errorf("rates %.0f: the half-speed prefill pod is learned %.2fx slower, want about 2x", rs, ratio)
	}
	p.mu.Lock()
	for _, i := range []int{2, 3} {
		if w := p.l.byAddr[addr(i)]; w.rates != (ratemodel.Endpoint{}) {
			t.Errorf("decode pod %d learned from split requests: %+v", i, w.rates)
		}
	}
	p.mu.Unlock()

	// A burst at 100,000 tokens/s, more than both prefill pods' 75,000:
	// no first bytes, so only the drain model at the learned rates empties
	// their queues.
	pres := map[netip.AddrPort]int{}
	var res []*Reservation
	for i := range 90 {
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("burst ", i), 8000), Stream: true})
		pre, ok := r.Prefiller()
		if !ok {
			t.Fatalf("burst request %d: not split", i)
		}
		pres[pre]++
		res = append(res, r)
		clock.Advance(20 * time.Millisecond)
	}
	t.Logf("learned rates %.0f; the burst's prefills %d and %d", rs, pres[addr(0)], pres[addr(1)])
	if ratio := float64(pres[addr(0)]) / float64(pres[addr(1)]); ratio < 1.4 || ratio > 2.6 {
		t.Errorf("the burst's prefills: %d on the fast pod, %d on the half-speed one (%.2fx), want about 2x", pres[addr(0)], pres[addr(1)], ratio)
	}
	for _, r := range res {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}
