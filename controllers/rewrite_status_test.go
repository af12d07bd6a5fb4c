package controllers_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/go-logr/logr/funcr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/controllers"
	"github.com/tallyepp/tally/picker/rewrite"
)

// listedRewrites is a cache that holds items.
type listedRewrites struct {
	client.Reader
	items []v1alpha2.InferenceModelRewrite
}

func (l listedRewrites) List(_ context.Context, list client.ObjectList, _ ...client.ListOption) error {
	list.(*v1alpha2.InferenceModelRewriteList).Items = l.items
	return nil
}

// statusWriter answers every status patch with err, counting them.
type statusWriter struct {
	client.SubResourceWriter
	err     error
	patched []string
	last    *v1alpha2.InferenceModelRewrite // as the last patch left it
}

func (w *statusWriter) Status() client.SubResourceWriter { return w }

func (w *statusWriter) Patch(_ context.Context, obj client.Object, _ client.Patch, _ ...client.SubResourcePatchOption) error {
	w.patched = append(w.patched, obj.GetName())
	w.last = obj.(*v1alpha2.InferenceModelRewrite).DeepCopy()
	return w.err
}

type ruleSink struct{ rules []rewrite.Rule }

func (s *ruleSink) ReplaceRewrites(r []rewrite.Rule) { s.rules = r }

// Under upstream's chart the picker may not write a rewrite's status: it
// says so once and applies the rewrites all the same. Other failures are
// retried.
func TestRewriteStatusWriteFailures(t *testing.T) {
	items := []v1alpha2.InferenceModelRewrite{modelRewrite("a", "llm", 0, rule(nil, "x", 1)), modelRewrite("b", "llm", 1, rule(nil, "y", 1))}
	gr := schema.GroupResource{Group: "inference.networking.x-k8s.io", Resource: "inferencemodelrewrites"}
	for _, tc := range []struct {
		name     string
		err      error
		wantErr  bool
		warnings int
	}{
		{"forbidden", apierrors.NewForbidden(gr, "a", errors.New("RBAC")), false, 1},
		{"gone meanwhile", apierrors.NewNotFound(gr, "a"), false, 0},
		{"unavailable", apierrors.NewServiceUnavailable("etcd"), true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var lines []string
			ctx := log.IntoContext(t.Context(), funcr.New(func(prefix, args string) { lines = append(lines, args) }, funcr.Options{}))
			sink, w := &ruleSink{}, &statusWriter{err: tc.err}
			r := &controllers.InferenceModelRewriteReconciler{Client: listedRewrites{items: items}, Status: w, Pool: types.NamespacedName{Namespace: "ns", Name: "llm"}, Sink: sink}
			for range 2 {
				_, err := r.Reconcile(ctx, reconcile.Request{})
				if (err != nil) != tc.wantErr {
					t.Fatalf("Reconcile: %v, want an error: %v", err, tc.wantErr)
				}
			}
			if len(sink.rules) != 2 {
				t.Errorf("sink got %d rules, want 2 whatever the status write did", len(sink.rules))
			}
			if tc.wantErr && len(w.patched) != 2 || !tc.wantErr && len(w.patched) != 4 {
				t.Errorf("patched %q over two reconciles", w.patched)
			}
			warnings := 0
			for _, l := range lines {
				if strings.Contains(l, "may not write InferenceModelRewrite status") {
					warnings++
				}
			}
			if warnings != tc.warnings {
				t.Errorf("%d warnings, want %d: %q", warnings, tc.warnings, lines)
			}
		})
	}
}

// A rewrite already marked Accepted at its generation is not written again.
func TestRewriteStatusWrittenOnlyWhenItChanges(t *testing.T) {
	items := []v1alpha2.InferenceModelRewrite{modelRewrite("a", "llm", 0, rule(nil, "x", 1))}
	w := &statusWriter{}
	r := &controllers.InferenceModelRewriteReconciler{Client: listedRewrites{items: items}, Status: w, Pool: types.NamespacedName{Namespace: "ns", Name: "llm"}, Sink: &ruleSink{}}
	if _, err := r.Reconcile(t.Context(), reconcile.Request{}); err != nil || len(w.patched) != 1 {
		t.Fatalf("first reconcile: %v, patched %q; want one patch", err, w.patched)
	}
	// What the first patch wrote, as the cache then shows it.
	written := &statusWriter{}
	if c := w.last.Status.Conditions; len(c) != 1 || c[0].Type != "Accepted" || c[0].Status != "True" || c[0].Reason != "Accepted" {
		t.Fatalf("conditions written %+v; want Accepted True", c)
	}
	items[0].Status = w.last.Status
	r.Client, r.Status = listedRewrites{items: items}, written
	if _, err := r.Reconcile(t.Context(), reconcile.Request{}); err != nil || len(written.patched) != 0 {
		t.Fatalf("reconcile of an accepted rewrite: %v, patched %q; want none", err, written.patched)
	}
	items[0].Generation++
	if _, err := r.Reconcile(t.Context(), reconcile.Request{}); err != nil || len(written.patched) != 1 {
		t.Fatalf("reconcile of a new generation: %v, patched %q; want one", err, written.patched)
	}
}
