package controllers_test

import (
	"maps"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/controllers"
)

func objective(name, pool string, priority *int, mutate ...func(*v1alpha2.InferenceObjective)) v1alpha2.InferenceObjective {
	o := v1alpha2.InferenceObjective{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns"},
		Spec: v1alpha2.InferenceObjectiveSpec{
			Priority: priority,
			PoolRef:  v1alpha2.PoolObjectReference{Group: "inference.networking.k8s.io", Kind: "InferencePool", Name: v1alpha2.ObjectName(pool)},
		},
	}
	for _, m := range mutate {
		m(&o)
	}
	return o
}

func TestObjectivesOf(t *testing.T) {
	tests := []struct {
		name string
		in   []v1alpha2.InferenceObjective
		want map[string]int
	}{
		{
			name: "the pool's objectives with their priorities, negative ones included",
			in:   []v1alpha2.InferenceObjective{objective("chat", "llm", new(10)), objective("batch", "llm", new(-5))},
			want: map[string]int{"chat": 10, "batch": -5},
		},
		{
			name: "an unset priority is 0",
			in:   []v1alpha2.InferenceObjective{objective("plain", "llm", nil)},
			want: map[string]int{"plain": 0},
		},
		{
			name: "another pool's objective is left out",
			in:   []v1alpha2.InferenceObjective{objective("chat", "llm", new(1)), objective("other", "chat-pool", new(9))},
			want: map[string]int{"chat": 1},
		},
		{
			name: "an empty group or kind counts as InferencePool's",
			in: []v1alpha2.InferenceObjective{
				objective("nogroup", "llm", new(1), func(o *v1alpha2.InferenceObjective) { o.Spec.PoolRef.Group = "" }),
				objective("nokind", "llm", new(2), func(o *v1alpha2.InferenceObjective) { o.Spec.PoolRef.Kind = "" }),
			},
			want: map[string]int{"nogroup": 1, "nokind": 2},
		},
		{
			name: "a pool of the same name in another group or of another kind is not ours",
			in: []v1alpha2.InferenceObjective{
				objective("x-group", "llm", new(1), func(o *v1alpha2.InferenceObjective) { o.Spec.PoolRef.Group = "inference.networking.x-k8s.io" }),
				objective("import", "llm", new(2), func(o *v1alpha2.InferenceObjective) { o.Spec.PoolRef.Kind = "InferencePoolImport" }),
			},
			want: map[string]int{},
		},
		{
			name: "an objective being deleted is left out",
			in: []v1alpha2.InferenceObjective{objective("going", "llm", new(3), func(o *v1alpha2.InferenceObjective) {
				now := metav1.Now()
				o.DeletionTimestamp = &now
			})},
			want: map[string]int{},
		},
		{
			name: "no objectives, an empty set",
			want: map[string]int{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := controllers.ObjectivesOf("llm", tt.in); !maps.Equal(got, tt.want) {
				t.Errorf("ObjectivesOf = %v, want %v", got, tt.want)
			}
		})
	}
}
