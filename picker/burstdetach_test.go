package picker

import (
	"cmp"
	"fmt"
	"slices"
	"testing"
	"time"
)

// burstAfterBurst plays two held bursts of 128 requests of 8,000 tokens
// through a gateway that ends each stream at the pick (every reservation
// detached), 1.5 ms apart, over 3 endpoints whose engines are scraped every
// interval (first at offset); each request reaches its engine lag after its
// pick, and the engines end the first burst's requests all at once when it
// is placed. It returns the second burst's placement.
func burstAfterBurst(t *testing.T, interval, offset, lag time.Duration) [3]int {
	clock := newFakeClock()
	p := newPicker(t, 3, testConfig(), Options{Now: clock.Now})
	index := map[string]int{}
	for i := range 3 {
		index[addr(i).String()] = i
	}
	var held [3]int
	type arrival struct {
		at int64
		ep int
	}
	var pending []arrival
	nextScrape := clock.ns.Load() + int64(offset)
	step := func(d time.Duration) {
		end := clock.ns.Load() + int64(d)
		for {
			next := min(end, nextScrape)
			for len(pending) > 0 && pending[0].at <= next {
				held[pending[0].ep]++
				pending = pending[1:]
			}
			clock.ns.Store(next)
			if next < nextScrape {
				return
			}
			round := make([]Scrape, 3)
			for i := range round {
				round[i] = Scrape{Address: addr(i), Stats: EngineStats{Running: held[i]}}
			}
			p.ObserveScrapes(round)
			nextScrape += int64(interval)
		}
	}
	var placed [3]int
	for burst := range 2 {
		placed = [3]int{}
		for i := range 128 {
			r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("burst", burst, "-", i), 8_000*4), MaxTokens: 16})
			r.Detach()
			ep := index[r.Endpoints()[0].String()]
			placed[ep]++
			pending = append(pending, arrival{at: clock.ns.Load() + int64(lag), ep: ep})
			step(1500 * time.Microsecond)
		}
		step(lag)
		held = [3]int{} // the engines end the burst's requests
	}
	return placed
}

func TestABurstAfterABurstOfDetachedRequestsSpreads(t *testing.T) {
	for _, interval := range []time.Duration{10 * time.Millisecond, 50 * time.Millisecond, 250 * time.Millisecond} {
		for _, offset := range []time.Duration{0, 3 * time.Millisecond} {
			for _, lag := range []time.Duration{2 * time.Millisecond, 20 * time.Millisecond} {
				placed := burstAfterBurst(t, interval, offset, lag)
				for _, n := range placed {
					if n < 42 || n > 43 {
						t.Errorf("scrapes every %v from %v, arrival lag %v: second burst %v, want within one of even", interval, offset, lag, placed)
						break
					}
				}
			}
		}
	}
}

// A burst's detached requests that reach their engines late, up to the
// scrape interval plus detachArrival after their picks (a loaded gateway),
// and run on are not taken for ended: the ledger keeps them all.
func TestLateArrivalsAreNotTakenForEndedRequests(t *testing.T) {
	for _, c := range []struct{ interval, lag time.Duration }{
		{10 * time.Millisecond, 100 * time.Millisecond},
		{50 * time.Millisecond, 100 * time.Millisecond},
		{250 * time.Millisecond, 150 * time.Millisecond},
		{250 * time.Millisecond, 300 * time.Millisecond},
	} {
		interval, lag := c.interval, c.lag
		clock := newFakeClock()
		p := newPicker(t, 3, testConfig(), Options{Now: clock.Now})
		index := map[string]int{}
		for i := range 3 {
			index[addr(i).String()] = i
		}
		type arrival struct {
			at int64
			ep int
		}
		var pending []arrival
		var held [3]int
		nextScrape := clock.ns.Load() + int64(interval)
		step := func(d time.Duration) {
			end := clock.ns.Load() + int64(d)
			for {
				next := min(end, nextScrape)
				for len(pending) > 0 && pending[0].at <= next {
					held[pending[0].ep]++
					pending = pending[1:]
				}
				clock.ns.Store(next)
				if next < nextScrape {
					return
				}
				round := make([]Scrape, 3)
				for i := range round {
					round[i] = Scrape{Address: addr(i), Stats: EngineStats{Waiting: held[i]}}
				}
				p.ObserveScrapes(round)
				nextScrape += int64(interval)
			}
		}
		for i := range 128 {
			// Long outputs: the model ends none of them in the test.
			r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("late-", i), 8_000*4), MaxTokens: 100_000})
			r.Detach()
			// Arrivals spread over the lag, the first ones slowest: a
			// gateway catching up.
			at := clock.ns.Load() + int64(lag) - int64(i)*int64(lag)/256
			pending = append(pending, arrival{at: at, ep: index[r.Endpoints()[0].String()]})
			slices.SortFunc(pending, func(a, b arrival) int { return cmp.Compare(a.at, b.at) })
			step(1500 * time.Microsecond)
		}
		step(lag + 3*interval)
		if l := p.Snapshot(); l.Detached != 128 {
			t.Errorf("scrapes every %v, arrival lag up to %v: %d of 128 detached requests left in the ledger, all running; engines hold %v", interval, lag, l.Detached, held)
		}
	}
}
