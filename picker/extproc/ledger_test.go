package extproc_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/internal/testtier"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
)

// counting counts the picks that succeed.
type counting struct {
	extproc.Picker
	ok atomic.Int64
}

func (c *counting) Admit(ctx context.Context, req picker.Request) (*picker.Reservation, error) {
	res, err := c.Picker.Admit(ctx, req)
	if err == nil {
		c.ok.Add(1)
	}
	return res, err
}

// TestLedgerReturnsToZero runs 10,000 requests, 32 at a time, that end in
// every way a request ends, and checks that each reservation is released
// exactly once.
//
// Exactly once is checked with one sentinel request held on each endpoint for
// the whole run: a release applied twice would take a sentinel's count (or,
// counts never going negative, another request's) with it, and one never
// applied would stay. So the ledger must hold exactly the three sentinels
// once the 10,000 are over, and nothing once they end too; with the number
// of successful picks counted, effective releases = picks - what is held.
func TestLedgerReturnsToZero(t *testing.T) {
	testtier.SkipIfShort(t, "10,000 streams through the gRPC server, tens of seconds of CPU under -race")
	const (
		requests    = 10_000
		concurrency = 32
	)
	var picks *counting
	f := newFixture(t, fixtureOptions{quiet: true, wrap: func(p extproc.Picker) extproc.Picker {
		picks = &counting{Picker: p}
		return picks
	}})
	ctx := t.Context()

	sentinelCtx, releaseSentinels := context.WithCancel(ctx)
	defer releaseSentinels()
	sentinels := []string{"127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000"}
	for i, ep := range sentinels {
		x, err := f.gw.Open(sentinelCtx)
		if err != nil {
			t.Fatal(err)
		}
		req := completion("m", letters(uint64(9_000+i), 400)) // 100 prefill tokens
		req.SubsetHint = hintList(ep)
		if r, err := x.SendRequest(req); err != nil || r.Destination != ep {
			t.Fatalf("sentinel on %s: %+v, %v", ep, r, err)
		}
	}

	prefixes := make([]string, 8) // shared prefixes, so the prefix index is exercised too
	for i := range prefixes {
		prefixes[i] = letters(uint64(8_000+i), 512)
	}
	var (
		routedCount atomic.Int64
		errMu       sync.Mutex
		errs        []error
		work        = make(chan int)
		wg          sync.WaitGroup
	)
	start := time.Now()
	for range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				prompt := prefixes[i%len(prefixes)] + letters(uint64(i), 256+i%768)
				routed, err := playLedgerRequest(ctx, f.gw, i, prompt)
				if routed {
					routedCount.Add(1)
				}
				if err != nil {
					errMu.Lock()
					errs = append(errs, fmt.Errorf("request %d: %w", i, err))
					errMu.Unlock()
				}
			}
		}()
	}
	for i := range requests {
		work <- i
	}
	close(work)
	wg.Wait()
	elapsed := time.Since(start)
	if len(errs) > 0 {
		t.Fatalf("%d requests failed, first: %v", len(errs), errs[0])
	}
	t.Logf("%d requests (10%% cancelled mid-response, 5%% upstream 503, 2%% reset before the pick), %d at a time: %v (%.0f requests/s)",
		requests, concurrency, elapsed.Round(time.Millisecond), requests/elapsed.Seconds())

	wantRouted := int64(requests - requests*2/100 + len(sentinels))
	if got := routedCount.Load() + int64(len(sentinels)); got != wantRouted {
		t.Errorf("the gateway saw %d requests routed, want %d", got, wantRouted)
	}
	if got := picks.ok.Load(); got != wantRouted {
		t.Errorf("%d successful picks, want %d: one per routed request", got, wantRouted)
	}

	eventually(t, "only the sentinels are held", func() (bool, string) {
		l := f.picker.Snapshot()
		in, prefill := l.InFlight, l.PrefillTokens
		ok := in == len(sentinels) && prefill == 100*len(sentinels)
		for _, s := range f.picker.Snapshot().Endpoints {
			ok = ok && s.InFlight == 1 && s.PrefillTokens == 100 && s.Decoding == 0
		}
		_, state := ledgerEmpty(f.picker)
		return ok, state
	})
	releaseSentinels()
	eventually(t, "the ledger is empty", func() (bool, string) { return ledgerEmpty(f.picker) })
	in := f.picker.Snapshot().InFlight
	t.Logf("successful picks %d, effective releases %d", picks.ok.Load(), picks.ok.Load()-int64(in))
	eventually(t, "no stream left open", func() (bool, string) {
		n := f.counter(t, "tally_streams_active", nil)
		return n == 0, fmt.Sprintf("tally_streams_active = %v", n)
	})
	if got := f.counter(t, "tally_requests_total", map[string]string{"code": "200"}); got != float64(wantRouted) {
		t.Errorf("tally_requests_total{code=200} = %v, want %d", got, wantRouted)
	}
	if got := f.counter(t, "tally_picks_total", map[string]string{"result": "ok"}); got != float64(wantRouted) {
		t.Errorf("the picker's tally_picks_total{result=ok} = %v, want %d", got, wantRouted)
	}
	if got := f.counter(t, "tally_model_server_errors_total", nil); got != requests*5/100 {
		t.Errorf("tally_model_server_errors_total = %v, want %d", got, requests*5/100)
	}
}

// playLedgerRequest plays request i, ending it the way its number says. It
// reports whether the request was routed.
func playLedgerRequest(ctx context.Context, gw *gateway, i int, prompt string) (bool, error) {
	x, err := gw.Open(ctx)
	if err != nil {
		return false, err
	}
	defer x.Cancel()
	req := completion("m", prompt)
	switch kind := i % 100; {
	case kind < 10: // the client goes away mid-response
		r, err := x.SendRequest(req)
		if err != nil || r.Destination == "" {
			return false, fmt.Errorf("not routed: %+v, %v", r, err)
		}
		if err := x.SendResponseHeaders(okResponse); err != nil {
			return true, err
		}
		if kind%2 == 0 {
			if err := x.SendResponseChunk(okResponse.Chunks[0], false, true); err != nil {
				return true, err
			}
		}
		x.Cancel()
		return true, nil
	case kind < 15: // the model server fails
		r, err := x.SendRequest(req)
		if err != nil || r.Destination == "" {
			return false, fmt.Errorf("not routed: %+v, %v", r, err)
		}
		return true, x.Respond(response(503))
	case kind < 17: // the stream is reset before the body is complete
		if err := x.Send(postHeaders("/v1/completions")); err != nil {
			return false, err
		}
		if err := x.Send(envoy.BodyChunk(req.Body[:len(req.Body)/2], false)); err != nil {
			return false, err
		}
		x.Cancel()
		return false, nil
	default:
		r, err := x.SendRequest(req)
		if err != nil || r.Destination == "" {
			return false, fmt.Errorf("not routed: %+v, %v", r, err)
		}
		return true, x.Respond(okResponse)
	}
}
