package stack

import (
	"context"
	"fmt"
	"strconv"
	"testing"

	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/internal/modelsim/server"
)

func TestLateFirstByteFractionReachesTheSimulators(t *testing.T) {
	s, p := newTestPod(t)
	s.opts.LateFirstByteFraction = 1
	if err := s.ResetSimulators(0); err != nil {
		t.Fatal(err)
	}
	if cfg := s.simulatorConfig(); cfg.LateFirstByteFraction != 1 || cfg.RequestIDHeader != DrawKeyHeader {
		t.Fatalf("simulator config: late fraction %v, request id header %q; want 1 and %q", cfg.LateFirstByteFraction, cfg.RequestIDHeader, DrawKeyHeader)
	}
	// A generation long enough that the wall-clock costs of a request on
	// a loaded machine (tens of milliseconds under -race) are small beside
	// it: the split below compares wall times.
	const tokens = 400
	r := Send(context.Background(), s.HTTPClient(), p.URL(), "late-0", Completion(DefaultModel, "hello there", tokens, true))
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	// Every token takes a step of at least the base duration; the stack's
	// simulators run 10 times faster than real time.
	atLeast := tokens * engine.DefaultStepBaseDuration / 10
	if r.TTFT < atLeast || r.CompletionTokens != tokens {
		t.Fatalf("first event after %v of a %v response with %d tokens; want the whole generation, at least %v, and %d tokens", r.TTFT, r.Latency, r.CompletionTokens, atLeast, tokens)
	}
	// The simulator says it held the response back, no longer than the
	// first event waited; and once the first event came the rest came
	// with it, not token by token. (How much of the wait was the prefill
	// depends on how busy the machine is: a run beside others took 237 ms
	// of 497 for it, so that is not checked.)
	if r.HeldBack <= 0 || r.HeldBack > r.TTFT {
		t.Fatalf("held back %v of a first event after %v; want more than 0 and at most the wait", r.HeldBack, r.TTFT)
	}
	if rest := r.Latency - r.TTFT; rest > atLeast/2 {
		t.Fatalf("the events after the first took %v; a response held back whole comes at once (well under %v)", rest, atLeast/2)
	}
}

// The simulators draw a response's fate from its draw key, not its id: the
// same trace request replayed under two policies' ids is held back alike,
// and a client can tell which responses were held back (server.HoldsBack).
func TestLateResponsesFollowTheDrawKey(t *testing.T) {
	s, p := newTestPod(t)
	const fraction = 0.5
	s.opts.LateFirstByteFraction = fraction
	if err := s.ResetSimulators(0); err != nil {
		t.Fatal(err)
	}
	const tokens = 20
	atLeast := tokens * engine.DefaultStepBaseDuration / 10
	held := 0
	for i := range 8 {
		key := TraceDrawKey(i)
		want := server.HoldsBack(fraction, key)
		if want {
			held++
		}
		for _, policy := range []string{"tally", "round-robin"} {
			req := Completion(DefaultModel, fmt.Sprintf("request %d", i), tokens, true)
			req.DrawKey = key
			r := Send(context.Background(), s.HTTPClient(), p.URL(), policy+"-"+strconv.Itoa(i), req)
			if r.Err != nil {
				t.Fatal(r.Err)
			}
			// The simulator says whether it held the response back: a
			// first event's time alone would depend on the machine's load.
			if got := r.HeldBack > 0; got != want || want && r.TTFT < atLeast {
				t.Errorf("%s request %d (draw key %s): first event after %v of %v, held back %v; want held back %v (a held-back one's first event after the whole generation, at least %v)",
					policy, i, key, r.TTFT, r.Latency, got, want, atLeast)
			}
		}
	}
	if held == 0 || held == 8 {
		t.Fatalf("%d of 8 draw keys held back at fraction %v: the test needs both kinds", held, fraction)
	}
}
