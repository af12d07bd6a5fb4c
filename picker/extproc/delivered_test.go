package extproc_test

import (
	"strconv"
	"testing"
)

// A response whose usage reports fewer cached tokens than the picker
// predicted prunes the prefix index: the next request with that prompt no
// longer counts the blocks the engine did not keep.
func TestDeliveredCachedTokensPruneThePrefixIndex(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	prompt := letters(77, 8000) // 2,000 tokens, 15 blocks of 512 characters
	req := completion("m", prompt)
	req.hint = hintList("127.0.0.11:8000")
	noUsage := httpResponse{status: 200, chunks: []string{`{"choices":[{"text":"hi"}]}`}}
	play(t, f, req, noUsage) // records the prompt on A

	// The same prompt again: predicted cached in full; the engine reports
	// that it had none of it.
	shortfall := httpResponse{status: 200, chunks: []string{
		`{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":2000,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`}}
	play(t, f, req, shortfall)
	got := metricValue(t, f, "tally_cache_shortfall_forgotten_blocks_total")
	if got != 15 {
		t.Errorf("tally_cache_shortfall_forgotten_blocks_total = %v, want 15 (every block of the prompt)", got)
	}
	for _, s := range f.picker.Stats() {
		if s.Endpoint.Address.String() == "127.0.0.11:8000" && (s.DeliveredCachedTokens != 0 || s.PredictedCachedTokens == 0) {
			t.Errorf("A's delivered/predicted = %d/%d, want 0 and the prediction", s.DeliveredCachedTokens, s.PredictedCachedTokens)
		}
	}
}

func metricValue(t *testing.T, f *fixture, name string) float64 {
	t.Helper()
	families, err := f.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, fam := range families {
		if fam.GetName() == name {
			return fam.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("%s not gathered", name)
	return 0
}

// A client that goes away right at "data: [DONE]" cancels the stream before
// its end: the usage that arrived still corrects the index.
func TestUsageOfAStreamCutAtItsEndStillCounts(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	req := completion("m", letters(78, 8000))
	req.hint = hintList("127.0.0.11:8000")
	play(t, f, req, httpResponse{status: 200, chunks: []string{`{"choices":[{"text":"hi"}]}`}})

	x, err := f.gw.open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.sendRequest(req); err != nil {
		t.Fatal(err)
	}
	usage := `data: {"choices":[],"usage":{"prompt_tokens":2000,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}` + "\n\ndata: [DONE]\n\n"
	if err := x.sendResponseHeaders(httpResponse{status: 200, chunks: []string{usage}}); err != nil {
		t.Fatal(err)
	}
	if err := x.sendResponseChunk(usage, false); err != nil { // not the last: the client leaves first
		t.Fatal(err)
	}
	x.cancel()
	eventually(t, "the cancelled stream's usage is read", func() (bool, string) {
		got := metricValue(t, f, "tally_cache_shortfall_forgotten_blocks_total")
		return got == 15, "forgotten blocks so far: " + strconv.Itoa(int(got))
	})
}
