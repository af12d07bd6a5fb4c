package extproc_test

import (
	"net/netip"
	"strconv"
	"testing"
)

// A response whose usage reports fewer cached tokens than the picker
// predicted is booked in the endpoint's drift counters; the prompt stays in
// the prefix index, as the engine has just computed it.
func TestDeliveredCachedTokensAreBookedAgainstThePrediction(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	prompt := letters(77, 8000) // 2,000 tokens, 15 blocks of 512 characters
	req := completion("m", prompt)
	req.SubsetHint = hintList("127.0.0.11:8000")
	a := netip.MustParseAddrPort("127.0.0.11:8000")
	noUsage := response(200, `{"choices":[{"text":"hi"}]}`)
	play(t, f, req, noUsage) // records the prompt on A

	// The same prompt again: predicted cached in full; the engine reports
	// that it had none of it.
	shortfall := response(200,
		`{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":2000,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`)
	play(t, f, req, shortfall)
	s := statsOf(f.picker, a)
	if s.DeliveredCachedTokens != 0 || s.PredictedCachedTokens == 0 {
		t.Fatalf("A's delivered/predicted = %d/%d, want 0 and the prediction", s.DeliveredCachedTokens, s.PredictedCachedTokens)
	}
	predicted := s.PredictedCachedTokens
	play(t, f, req, shortfall)
	if again := statsOf(f.picker, a).PredictedCachedTokens - predicted; again != predicted {
		t.Errorf("the third request was predicted %d cached tokens, want %d as before: the prompt left the index", again, predicted)
	}
}

// A client that goes away right at "data: [DONE]" cancels the stream before
// its end: the usage that arrived still corrects the index.
func TestUsageOfAStreamCutAtItsEndStillCounts(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	req := completion("m", letters(78, 8000))
	req.SubsetHint = hintList("127.0.0.11:8000")
	play(t, f, req, response(200, `{"choices":[{"text":"hi"}]}`))

	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.SendRequest(req); err != nil {
		t.Fatal(err)
	}
	usage := `data: {"choices":[],"usage":{"prompt_tokens":2000,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}` + "\n\ndata: [DONE]\n\n"
	if err := x.SendResponseHeaders(response(200, usage)); err != nil {
		t.Fatal(err)
	}
	if err := x.SendResponseChunk([]byte(usage), false, true); err != nil { // not the last: the client leaves first
		t.Fatal(err)
	}
	x.Cancel()
	eventually(t, "the cancelled stream's usage is read", func() (bool, string) {
		s := statsOf(f.picker, netip.MustParseAddrPort("127.0.0.11:8000"))
		return s.PredictedCachedTokens > 0, "A's predicted cached tokens so far: " + strconv.FormatInt(s.PredictedCachedTokens, 10)
	})
}
