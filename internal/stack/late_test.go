package stack

import (
	"context"
	"testing"

	"github.com/tallyepp/tally/internal/modelsim/engine"
)

func TestLateFirstByteFractionReachesTheSimulators(t *testing.T) {
	s, p := newTestPod(t)
	s.opts.LateFirstByteFraction = 1
	if err := s.ResetSimulators(0); err != nil {
		t.Fatal(err)
	}
	if cfg := s.simulatorConfig(); cfg.LateFirstByteFraction != 1 || cfg.RequestIDHeader != RequestIDHeader {
		t.Fatalf("simulator config: late fraction %v, request id header %q; want 1 and %q", cfg.LateFirstByteFraction, cfg.RequestIDHeader, RequestIDHeader)
	}
	const tokens = 50
	r := Send(context.Background(), s.HTTPClient(), p.URL(), "late-0", Completion(DefaultModel, "hello there", tokens, true))
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	// Every token takes a step of at least the base duration; the stack's
	// simulators run 10 times faster than real time.
	if atLeast := tokens * engine.DefaultStepBaseDuration / 10; r.TTFT < atLeast || r.CompletionTokens != tokens {
		t.Fatalf("first event after %v of a %v response with %d tokens; want the whole generation, at least %v, and %d tokens", r.TTFT, r.Latency, r.CompletionTokens, atLeast, tokens)
	}
}
