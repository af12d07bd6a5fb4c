package picker

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestRewritePrecedence(t *testing.T) {
	var r Rewrites
	if got, _, ok := r.Rewrite("m", rand.IntN); ok || got != "m" {
		t.Fatalf("no rules: %q %v, want m unchanged", got, ok)
	}
	r.ReplaceRewrites([]RewriteRule{
		{Name: "old-catch-all", Targets: []RewriteTarget{{Model: "everything"}}},
		{Name: "old", Models: []string{"a"}, Targets: []RewriteTarget{{Model: "a-old"}}},
		{Name: "old", Models: []string{"a", "b"}, Targets: []RewriteTarget{{Model: "second-rule"}}},
		{Name: "new", Models: []string{"a", "c"}, Targets: []RewriteTarget{{Model: "a-new"}}},
		{Name: "new-catch-all", Targets: []RewriteTarget{{Model: "late"}}},
		{Name: "empty", Models: []string{"d"}},
	})
	for model, want := range map[string][2]string{
		"a": {"a-old", "old"},                // the oldest resource's first rule
		"b": {"second-rule", "old"},          // an exact match beats the older catch-all
		"c": {"a-new", "new"},                //
		"z": {"everything", "old-catch-all"}, // the first catch-all
	} {
		got, name, ok := r.Rewrite(model, rand.IntN)
		if !ok || got != want[0] || name != want[1] {
			t.Errorf("%s -> %q (%q, %v), want %q (%q)", model, got, name, ok, want[0], want[1])
		}
	}
	if got, _, ok := r.Rewrite("d", rand.IntN); ok || got != "d" {
		t.Errorf("a rule without targets: %q %v, want d unchanged", got, ok)
	}
}

func TestRewriteWeightsWithinABinomialBound(t *testing.T) {
	var r Rewrites
	r.ReplaceRewrites([]RewriteRule{{Name: "split", Models: []string{"m"},
		Targets: []RewriteTarget{{Model: "v1", Weight: 90}, {Model: "v2", Weight: 9}, {Model: "v3", Weight: 1}}}})
	rng := rand.New(rand.NewPCG(3, 4))
	const n = 10_000
	counts := map[string]int{}
	for range n {
		got, _, _ := r.Rewrite("m", rng.IntN)
		counts[got]++
	}
	for model, p := range map[string]float64{"v1": 0.90, "v2": 0.09, "v3": 0.01} {
		mean, sd := n*p, math.Sqrt(n*p*(1-p))
		if c := float64(counts[model]); math.Abs(c-mean) > 4*sd {
			t.Errorf("%s drawn %v times of %d, want %v ± %.0f (4 sd)", model, c, n, mean, 4*sd)
		}
	}
	// No weights: equal shares.
	r.ReplaceRewrites([]RewriteRule{{Models: []string{"m"}, Targets: []RewriteTarget{{Model: "x"}, {Model: "y"}}}})
	counts = map[string]int{}
	for range n {
		got, _, _ := r.Rewrite("m", rng.IntN)
		counts[got]++
	}
	if d := math.Abs(float64(counts["x"]) - n/2); d > 4*math.Sqrt(n*0.25) {
		t.Errorf("unweighted split %v, want about half each", counts)
	}
}

// vLLM keys its KV cache by adapter (a LoRA adapter is a model name): a
// prefix cached for one model never serves another.
func TestPrefixesNeverMatchAcrossModels(t *testing.T) {
	p := newPicker(t, 1, testConfig(), Options{})
	prompt := text("shared", 8000)
	p.End(mustPick(t, p, Request{Model: "base", Prompt: prompt}), Outcome{})
	if r := mustPick(t, p, Request{Model: "adapter-a", Prompt: prompt}); cachedTokens(r) != 0 {
		t.Errorf("adapter-a found %d cached tokens of base's prompt, want 0", cachedTokens(r))
	}
	if r := mustPick(t, p, Request{Model: "base", Prompt: prompt}); cachedTokens(r) < 1900 {
		t.Errorf("base found %d cached tokens of its own prompt, want about 2,000", cachedTokens(r))
	}
}
