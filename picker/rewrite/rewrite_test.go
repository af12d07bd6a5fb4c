package rewrite

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestRewritePrecedence(t *testing.T) {
	var r Table
	if got, _, ok := r.Rewrite("m", rand.IntN); ok || got != "m" {
		t.Fatalf("no rules: %q %v, want m unchanged", got, ok)
	}
	r.ReplaceRewrites([]Rule{
		{Name: "old-catch-all", Targets: []Target{{Model: "everything"}}},
		{Name: "old", Models: []string{"a"}, Targets: []Target{{Model: "a-old"}}},
		{Name: "old", Models: []string{"a", "b"}, Targets: []Target{{Model: "second-rule"}}},
		{Name: "new", Models: []string{"a", "c"}, Targets: []Target{{Model: "a-new"}}},
		{Name: "new-catch-all", Targets: []Target{{Model: "late"}}},
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
	var r Table
	r.ReplaceRewrites([]Rule{{Name: "split", Models: []string{"m"},
		Targets: []Target{{Model: "v1", Weight: 90}, {Model: "v2", Weight: 9}, {Model: "v3", Weight: 1}}}})
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
	r.ReplaceRewrites([]Rule{{Models: []string{"m"}, Targets: []Target{{Model: "x"}, {Model: "y"}}}})
	counts = map[string]int{}
	for range n {
		got, _, _ := r.Rewrite("m", rng.IntN)
		counts[got]++
	}
	if d := math.Abs(float64(counts["x"]) - n/2); d > 4*math.Sqrt(n*0.25) {
		t.Errorf("unweighted split %v, want about half each", counts)
	}
}
