package picker

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestReleasesTakeEffectExactlyOnce races every way a reservation can end
// (the stream's first byte, its end, a served-by move, the sweeper) and
// checks each reservation was released exactly once and the ledger returns
// to exactly zero without ever going negative.
func TestReleasesTakeEffectExactlyOnce(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 4, testConfig(), Options{Clock: clock, MaxRequestLifetime: time.Minute})
	const n = 300
	res := make([]*Reservation, 0, n)
	for i := range n {
		if i == n/2 {
			clock.Advance(2 * time.Minute) // the first half is old: the sweeper competes for it
		}
		var prompt []byte
		if i%3 != 0 {
			prompt = text(fmt.Sprint("shared", i%20), 1000+i) // prompts share prefixes
		}
		res = append(res, mustPick(t, p, Request{Model: model, Prompt: prompt}))
	}

	var (
		start    = make(chan struct{})
		stop     = make(chan struct{})
		wg, obs  sync.WaitGroup
		swept    atomic.Int64
		negative atomic.Int64
	)
	for i, r := range res {
		for k := range 2 {
			wg.Go(func() { <-start; p.FirstByte(r) })
			wg.Go(func() { <-start; p.ServedBy(r, addr((i+k)%4)) })
			wg.Go(func() { <-start; p.End(r, Outcome{}) })
		}
	}
	for range 3 {
		wg.Go(func() {
			<-start
			for range 20 {
				swept.Add(int64(p.sweep()))
			}
		})
	}
	obs.Go(func() { // the ledger never shows a negative count, even mid-race
		<-start
		for {
			for _, s := range p.Snapshot().Endpoints {
				if s.InFlight < 0 || s.PrefillTokens < 0 || s.Decoding < 0 {
					negative.Add(1)
				}
			}
			select {
			case <-stop:
				return
			default:
			}
		}
	})
	close(start)
	wg.Wait()
	close(stop)
	obs.Wait()

	assertLedgerEmpty(t, p)
	if negative.Load() > 0 {
		t.Errorf("observed %d negative ledger rows during the race", negative.Load())
	}
	// A release or first byte that took effect twice would leave the
	// ledger above or below zero (assertLedgerEmpty); one that never did,
	// a reservation unreleased.
	p.mu.Lock()
	unreleased, oldest := 0, p.l.picks.Front()
	for _, r := range res {
		if !r.released {
			unreleased++
		}
	}
	p.mu.Unlock()
	if unreleased > 0 {
		t.Errorf("%d of %d reservations never released", unreleased, n)
	}
	if swept.Load() > n/2 {
		t.Errorf("sweeper released %d; only the %d old ones may be swept", swept.Load(), n/2)
	}
	if got := testutil.ToFloat64(p.metrics.swept); got != float64(swept.Load()) {
		t.Errorf("tally_reservations_swept_total = %v, want %d (what Sweep returned)", got, swept.Load())
	}
	if oldest != nil {
		t.Errorf("the sweeper's list still holds reservations")
	}
}

// TestPicksRaceWithReplace runs picks and their releases concurrently with
// endpoint set changes: nothing may go negative and the ledger ends empty.
func TestPicksRaceWithReplace(t *testing.T) {
	p := newPicker(t, 4, testConfig(), Options{})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				r, err := p.pick(Request{Model: model, Prompt: text(fmt.Sprint("g", g, "i", i%7), 700)})
				if err != nil {
					continue // the set may be empty for a moment
				}
				if i%2 == 0 {
					p.FirstByte(r)
				}
				p.ServedBy(r, addr(i%4))
				p.End(r, Outcome{})
			}
		})
	}
	wg.Go(func() {
		for i := range 200 {
			p.Replace(endpoints(4)[i%4:])
		}
		p.Replace(endpoints(4))
	})
	wg.Wait()
	assertLedgerEmpty(t, p)
}

// A later FirstByte does nothing: the first one's time stays the one the
// prefill rate learns from (the race above cannot tell the two apart, as its
// clock stands still).
func TestALaterFirstByteDoesNothing(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 1, testConfig(), Options{Clock: clock})
	r := mustPick(t, p, Request{Model: model, Prompt: text("once", 4000), Stream: true})
	clock.Advance(100 * time.Millisecond)
	p.FirstByte(r)
	p.mu.Lock()
	first := r.firstByteNs
	p.mu.Unlock()
	clock.Advance(time.Second)
	p.FirstByte(r)
	p.mu.Lock()
	again := r.firstByteNs
	p.mu.Unlock()
	if again != first {
		t.Errorf("a second FirstByte moved the first byte from %v to %v", time.Duration(first), time.Duration(again))
	}
	p.End(r, Outcome{})
	assertLedgerEmpty(t, p)
}
