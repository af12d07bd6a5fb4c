package extproc_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/tallyepp/tally/internal/testtier"
)

// Bursts: 128 concurrent streams of 32,000-token prompts (128,000 chars at
// the default 4 chars per token), all held open (no response) until every
// one of them is placed, as a gateway sees a burst arriving faster than any
// model server answers. The ledger sees each placement at once, so a shared
// prefix cannot pull the burst onto one endpoint.

const (
	burstStreams     = 128
	burstPromptChars = 128_000
	burstNeeds       = "128 streams of 128,000-character prompts through the gRPC server, tens of seconds of CPU under -race"
)

func TestWarmBurstSpreadsEvenly(t *testing.T) {
	testtier.SkipIfShort(t, burstNeeds)
	f := newFixture(t, fixtureOptions{quiet: true})
	prefix := letters(100, 2_048) // 512 tokens
	warmUp(t, f, prefix+letters(101, 1_000), "127.0.0.11:8000")
	split := burst(t, f, prefix)
	t.Logf("warm burst (512-token prefix held by A): A=%d B=%d C=%d", split[0], split[1], split[2])
	assertEven(t, split)
}

func TestColdBurstSpreadsEvenly(t *testing.T) {
	testtier.SkipIfShort(t, burstNeeds)
	f := newFixture(t, fixtureOptions{quiet: true})
	split := burst(t, f, letters(200, 2_048))
	t.Logf("cold burst (fresh 512-token prefix): A=%d B=%d C=%d", split[0], split[1], split[2])
	assertEven(t, split)
}

func TestLongPrefixBurstFavoursItsHolder(t *testing.T) {
	testtier.SkipIfShort(t, burstNeeds)
	f := newFixture(t, fixtureOptions{quiet: true})
	prefix := letters(300, 120_000) // 30,000 tokens
	warmUp(t, f, prefix+letters(301, 1_000), "127.0.0.11:8000")
	split := burst(t, f, prefix)
	t.Logf("long-prefix burst (30,000-token prefix held by A): A=%d B=%d C=%d", split[0], split[1], split[2])
	if split[0] <= split[1] || split[0] <= split[2] || split[1] == 0 || split[2] == 0 {
		t.Errorf("split A=%d B=%d C=%d: want A the most and every endpoint some", split[0], split[1], split[2])
	}
}

func assertEven(t *testing.T, split [3]int) {
	t.Helper()
	for i, n := range split {
		if n != 42 && n != 43 {
			t.Errorf("endpoint %c got %d of %d, want 42 or 43 each (split %v)", 'A'+i, n, burstStreams, split)
		}
	}
}

// warmUp completes one request pinned to ep, which leaves its prompt's
// blocks in ep's prefix index and nothing in the ledger.
func warmUp(t *testing.T, f *fixture, prompt, ep string) {
	t.Helper()
	req := completion("m", prompt)
	req.SubsetHint = hintList(ep)
	r, err := f.gw.roundTrip(t.Context(), req)
	if err != nil || r.Destination != ep {
		t.Fatalf("warm-up request: %+v, %v; want routed to %s", r, err, ep)
	}
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Fatalf("after the warm-up request: %s", state)
	}
}

// burst sends burstStreams requests whose prompts start with prefix, holds
// every stream open until all are placed, then completes them. It returns how
// many went to A, B and C.
func burst(t *testing.T, f *fixture, prefix string) [3]int {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var (
		placed, done sync.WaitGroup
		allPlaced    = make(chan struct{})
		mu           sync.Mutex
		firsts       []string
		errs         []error
	)
	fail := func(i int, err error) {
		mu.Lock()
		errs = append(errs, fmt.Errorf("stream %d: %w", i, err))
		mu.Unlock()
	}
	placed.Add(burstStreams)
	done.Add(burstStreams)
	for i := range burstStreams {
		prompt := prefix + letters(uint64(1_000+i), burstPromptChars-len(prefix))
		go func() {
			defer done.Done()
			x, err := f.gw.Open(ctx)
			if err != nil {
				placed.Done()
				fail(i, err)
				return
			}
			defer x.Cancel()
			r, err := x.SendRequest(completion("m", prompt))
			if err == nil && r.Destination == "" {
				err = fmt.Errorf("not routed: %+v", r.Immediate)
			}
			placed.Done()
			if err != nil {
				fail(i, err)
				return
			}
			mu.Lock()
			firsts = append(firsts, r.First())
			mu.Unlock()
			<-allPlaced
			if err := x.Respond(okResponse); err != nil {
				fail(i, err)
			}
		}()
	}
	placed.Wait()
	mu.Lock()
	failed := len(errs)
	mu.Unlock()
	if in := f.picker.Snapshot().InFlight; in != burstStreams && failed == 0 {
		t.Errorf("with the whole burst placed and held: %d in flight, want %d", in, burstStreams)
	}
	close(allPlaced)
	done.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d streams failed, first: %v", len(errs), errs[0])
	}
	eventually(t, "ledger empty after the burst", func() (bool, string) { return ledgerEmpty(f.picker) })

	var split [3]int
	for _, ep := range firsts {
		switch ep {
		case "127.0.0.11:8000":
			split[0]++
		case "127.0.0.12:8000":
			split[1]++
		case "127.0.0.13:8000":
			split[2]++
		default:
			t.Fatalf("routed to unknown endpoint %q", ep)
		}
	}
	if split[0]+split[1]+split[2] != burstStreams {
		t.Fatalf("split %v does not add up to %d", split, burstStreams)
	}
	return split
}
