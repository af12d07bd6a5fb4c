package controllers_test

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/controllers"
	"github.com/tallyepp/tally/picker/rewrite"
)

// epoch is when the table's rewrites are created, give or take seconds.
var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// modelRewrite is an InferenceModelRewrite of pool, created at epoch plus
// createdAfter.
func modelRewrite(name, pool string, createdAfter time.Duration, rules ...v1alpha2.InferenceModelRewriteRule) v1alpha2.InferenceModelRewrite {
	return v1alpha2.InferenceModelRewrite{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", CreationTimestamp: metav1.NewTime(epoch.Add(createdAfter))},
		Spec: v1alpha2.InferenceModelRewriteSpec{
			PoolRef: &v1alpha2.PoolObjectReference{Group: "inference.networking.k8s.io", Kind: "InferencePool", Name: v1alpha2.ObjectName(pool)},
			Rules:   rules,
		},
	}
}

// rule matches the exact models (none: a catch-all) and rewrites to targets,
// given as model, weight, model, weight, ...
func rule(models []string, targets ...any) v1alpha2.InferenceModelRewriteRule {
	var r v1alpha2.InferenceModelRewriteRule
	for _, m := range models {
		r.Matches = append(r.Matches, v1alpha2.Match{Model: &v1alpha2.ModelMatch{Type: new(v1alpha2.MatchExact), Value: m}})
	}
	for i := 0; i+1 < len(targets); i += 2 {
		r.Targets = append(r.Targets, v1alpha2.TargetModel{ModelRewrite: targets[i].(string), Weight: int32(targets[i+1].(int))})
	}
	return r
}

func models(m ...string) []string { return m }

func TestRewritesOf(t *testing.T) {
	tests := []struct {
		name        string
		in          []v1alpha2.InferenceModelRewrite
		want        []rewrite.Rule
		wantSkipped int
	}{
		{
			name: "a weighted split of one model",
			in:   []v1alpha2.InferenceModelRewrite{modelRewrite("split", "llm", 0, rule(models("llama"), "llama-3.1", 90, "llama-3.2", 10))},
			want: []rewrite.Rule{{Name: "split", Models: []string{"llama"}, Targets: []rewrite.Target{{Model: "llama-3.1", Weight: 90}, {Model: "llama-3.2", Weight: 10}}}},
		},
		{
			name: "a rule without matches is a catch-all, Models nil; unset weights stay 0",
			in:   []v1alpha2.InferenceModelRewrite{modelRewrite("all", "llm", 0, rule(nil, "llama-3.1", 0, "llama-3.2", 0))},
			want: []rewrite.Rule{{Name: "all", Targets: []rewrite.Target{{Model: "llama-3.1"}, {Model: "llama-3.2"}}}},
		},
		{
			name: "several matches are one rule for each of their models",
			in:   []v1alpha2.InferenceModelRewrite{modelRewrite("many", "llm", 0, rule(models("llama", "llama-latest"), "llama-3.1", 1))},
			want: []rewrite.Rule{{Name: "many", Models: []string{"llama", "llama-latest"}, Targets: []rewrite.Target{{Model: "llama-3.1", Weight: 1}}}},
		},
		{
			name: "resources oldest first, whatever their names and list order; each one's rules in list order",
			in: []v1alpha2.InferenceModelRewrite{
				modelRewrite("alpha", "llm", 2*time.Second, rule(models("llama"), "new", 1)),
				modelRewrite("zeta", "llm", time.Second, rule(models("llama"), "old", 1), rule(nil, "fallback", 1)),
			},
			want: []rewrite.Rule{
				{Name: "zeta", Models: []string{"llama"}, Targets: []rewrite.Target{{Model: "old", Weight: 1}}},
				{Name: "zeta", Targets: []rewrite.Target{{Model: "fallback", Weight: 1}}},
				{Name: "alpha", Models: []string{"llama"}, Targets: []rewrite.Target{{Model: "new", Weight: 1}}},
			},
		},
		{
			name: "created in the same second, by name",
			in: []v1alpha2.InferenceModelRewrite{
				modelRewrite("b", "llm", 0, rule(models("llama"), "from-b", 1)),
				modelRewrite("a", "llm", 0, rule(models("llama"), "from-a", 1)),
			},
			want: []rewrite.Rule{
				{Name: "a", Models: []string{"llama"}, Targets: []rewrite.Target{{Model: "from-a", Weight: 1}}},
				{Name: "b", Models: []string{"llama"}, Targets: []rewrite.Target{{Model: "from-b", Weight: 1}}},
			},
		},
		{
			name: "another pool's, another group's, another kind's, and those being deleted or without a poolRef are left out; an empty group or kind is InferencePool's",
			in: []v1alpha2.InferenceModelRewrite{
				modelRewrite("other", "chat-pool", 0, rule(nil, "x", 1)),
				withRef(modelRewrite("x-group", "llm", 0, rule(nil, "x", 1)), func(r *v1alpha2.PoolObjectReference) { r.Group = "inference.networking.x-k8s.io" }),
				withRef(modelRewrite("import", "llm", 0, rule(nil, "x", 1)), func(r *v1alpha2.PoolObjectReference) { r.Kind = "InferencePoolImport" }),
				func() v1alpha2.InferenceModelRewrite {
					rw := modelRewrite("going", "llm", 0, rule(nil, "x", 1))
					rw.DeletionTimestamp = new(metav1.NewTime(epoch))
					return rw
				}(),
				func() v1alpha2.InferenceModelRewrite {
					rw := modelRewrite("noref", "llm", 0, rule(nil, "x", 1))
					rw.Spec.PoolRef = nil
					return rw
				}(),
				withRef(modelRewrite("defaults", "llm", 0, rule(nil, "ours", 1)), func(r *v1alpha2.PoolObjectReference) { r.Group, r.Kind = "", "" }),
			},
			want: []rewrite.Rule{{Name: "defaults", Targets: []rewrite.Target{{Model: "ours", Weight: 1}}}},
		},
		{
			name: "an unset match type is Exact; another type is skipped, and a rule left without matches matches nothing rather than everything",
			in: []v1alpha2.InferenceModelRewrite{modelRewrite("types", "llm", 0,
				v1alpha2.InferenceModelRewriteRule{
					Matches: []v1alpha2.Match{
						{Model: &v1alpha2.ModelMatch{Value: "llama"}},
						{Model: &v1alpha2.ModelMatch{Type: new(v1alpha2.MatchValidationType("Prefix")), Value: "ll"}},
					},
					Targets: []v1alpha2.TargetModel{{ModelRewrite: "llama-3.1"}},
				},
				v1alpha2.InferenceModelRewriteRule{
					Matches: []v1alpha2.Match{{Model: &v1alpha2.ModelMatch{Type: new(v1alpha2.MatchValidationType("Prefix")), Value: "ll"}}, {}},
					Targets: []v1alpha2.TargetModel{{ModelRewrite: "never"}},
				},
			)},
			want:        []rewrite.Rule{{Name: "types", Models: []string{"llama"}, Targets: []rewrite.Target{{Model: "llama-3.1"}}}},
			wantSkipped: 4, // the Prefix match of each rule, the nil model, the second rule
		},
		{
			name:        "a rule without targets is kept (it wins its models and rewrites nothing); an empty modelRewrite is skipped",
			in:          []v1alpha2.InferenceModelRewrite{modelRewrite("keep", "llm", 0, rule(models("llama")), rule(models("mistral"), "", 1, "mistral-7b", 1))},
			want:        []rewrite.Rule{{Name: "keep", Models: []string{"llama"}}, {Name: "keep", Models: []string{"mistral"}, Targets: []rewrite.Target{{Model: "mistral-7b", Weight: 1}}}},
			wantSkipped: 1,
		},
		{
			name: "no rewrites, no rules",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, skipped := controllers.RewritesOf("llm", tt.in)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("RewritesOf rules (-want +got):\n%s", diff)
			}
			if len(skipped) != tt.wantSkipped {
				t.Errorf("RewritesOf skipped %d parts, want %d: %q", len(skipped), tt.wantSkipped, skipped)
			}
		})
	}
}

// The order RewritesOf gives is the one rewrite.Table resolves precedence
// on: exact before catch-all wherever either comes, then oldest first.
func TestRewritesOfFeedsPickerPrecedence(t *testing.T) {
	rules, _ := controllers.RewritesOf("llm", []v1alpha2.InferenceModelRewrite{
		modelRewrite("newest-exact", "llm", 3*time.Second, rule(models("llama"), "newest", 1)),
		modelRewrite("oldest-catch-all", "llm", time.Second, rule(nil, "fallback", 1)),
		modelRewrite("older-exact", "llm", 2*time.Second, rule(models("llama"), "older", 1)),
	})
	var rw rewrite.Table
	rw.ReplaceRewrites(rules)
	first := func(int) int { return 0 }
	for model, want := range map[string]string{"llama": "older", "mistral": "fallback"} {
		if got, _, ok := rw.Rewrite(model, first); !ok || got != want {
			t.Errorf("Rewrite(%q) = %q, %v; want %q", model, got, ok, want)
		}
	}
}

func withRef(rw v1alpha2.InferenceModelRewrite, mutate func(*v1alpha2.PoolObjectReference)) v1alpha2.InferenceModelRewrite {
	mutate(rw.Spec.PoolRef)
	return rw
}
