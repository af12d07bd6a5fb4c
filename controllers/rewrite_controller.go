package controllers

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/picker/rewrite"
)

// +kubebuilder:rbac:groups=inference.networking.x-k8s.io,namespace=tally-system,resources=inferencemodelrewrites,verbs=get;list;watch
// +kubebuilder:rbac:groups=inference.networking.x-k8s.io,namespace=tally-system,resources=inferencemodelrewrites/status,verbs=get;patch

// RewriteSink is told the whole set of the pool's model rewrite rules, in
// precedence order (see RewritesOf).
type RewriteSink interface{ ReplaceRewrites([]rewrite.Rule) }

// InferenceModelRewriteReconciler follows the InferenceModelRewrites of the
// pool's namespace and tells Sink the rules of those that name the pool.
//
// With Status set it also marks each rewrite of the pool Accepted (see
// accepter), its message naming any part it ignores. Rewrites of other
// pools are left alone.
type InferenceModelRewriteReconciler struct {
	// Client reads the manager's cache.
	Client client.Reader
	// Status, when set, writes the rewrites' status.
	Status client.StatusClient
	// Pool names the pool; rewrites that reference another pool are left
	// out.
	Pool types.NamespacedName
	// Sink receives the whole set on every reconcile.
	Sink RewriteSink

	status accepter
}

// Reconcile lists every rewrite in the pool's namespace and replaces the
// sink's whole set with the rules of those of the pool, whatever changed,
// then writes their status. As for objectives, every event is queued under
// one key, so two Reconciles never race to call the sink.
func (r *InferenceModelRewriteReconciler) Reconcile(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	var list v1alpha2.InferenceModelRewriteList
	if err := r.Client.List(ctx, &list, client.InNamespace(r.Pool.Namespace)); err != nil {
		return reconcile.Result{}, fmt.Errorf("listing InferenceModelRewrites in namespace %s: %w", r.Pool.Namespace, err)
	}
	rules, skipped := RewritesOf(r.Pool.Name, list.Items)
	for _, s := range skipped {
		log.FromContext(ctx).Info("Part of an InferenceModelRewrite is ignored", "reason", s.String())
	}
	r.Sink.ReplaceRewrites(rules)
	if r.Status == nil {
		return reconcile.Result{}, nil
	}
	r.status.kind, r.status.w = v1alpha2.KindInferenceModelRewrite, r.Status
	for _, rw := range poolRewrites(r.Pool.Name, list.Items) {
		if err := r.accept(ctx, rw, skipped); err != nil {
			return reconcile.Result{}, err
		}
	}
	return reconcile.Result{}, nil
}

// accept marks rw Accepted, naming the parts of it skipped.
func (r *InferenceModelRewriteReconciler) accept(ctx context.Context, rw *v1alpha2.InferenceModelRewrite, skipped []SkippedPart) error {
	msg := "Applied by the endpoint picker of InferencePool " + r.Pool.Name
	var ignored []string
	for _, s := range skipped {
		if s.Rewrite == rw.Name {
			ignored = append(ignored, s.Part)
		}
	}
	if len(ignored) > 0 {
		msg += "; ignored: " + strings.Join(ignored, "; ")
	}
	return accept(ctx, &r.status, rw, func(rw *v1alpha2.InferenceModelRewrite) *[]metav1.Condition { return &rw.Status.Conditions }, msg)
}

// SkippedPart is a part of an InferenceModelRewrite that Tally cannot use.
type SkippedPart struct {
	Rewrite, Part string
}

func (s SkippedPart) String() string { return "InferenceModelRewrite " + s.Rewrite + ": " + s.Part }

// poolRewrites returns the rewrites whose spec.poolRef names the
// InferencePool pool (the same group and kind rules as ObjectivesOf;
// rewrites being deleted are left out), in the order rewrite.Table takes
// them: resources oldest first by creationTimestamp, ties (the timestamp
// has whole seconds) by name.
func poolRewrites(pool string, rewrites []v1alpha2.InferenceModelRewrite) []*v1alpha2.InferenceModelRewrite {
	ours := make([]*v1alpha2.InferenceModelRewrite, 0, len(rewrites))
	for i := range rewrites {
		rw := &rewrites[i]
		if rw.Spec.PoolRef == nil || rw.DeletionTimestamp != nil || !refersToPool(*rw.Spec.PoolRef, pool) {
			continue
		}
		ours = append(ours, rw)
	}
	slices.SortFunc(ours, func(a, b *v1alpha2.InferenceModelRewrite) int {
		return cmp.Or(a.CreationTimestamp.Compare(b.CreationTimestamp.Time), cmp.Compare(a.Name, b.Name))
	})
	return ours
}

// RewritesOf returns the rules of the pool's rewrites (poolRewrites), in
// the order rewrite.Table takes them: the resources in poolRewrites'
// order, and each resource's rules in list order. rewrite.Table applies
// upstream's precedence on that order.
//
// A rule becomes one rewrite.Rule named after its resource, with the
// values of its matches as Models (nil for a rule without matches: a
// catch-all) and its targets with their weights. What cannot be used is
// left out and described in skipped: a match of a type other than Exact
// (v1.5.0 has no other; the CRD defaults an unset type to Exact), a rule
// whose every match is left out (it matches nothing; it must not become a
// catch-all), and a target with an empty modelRewrite (the CRD allows one;
// upstream would send the model server an empty model). The caller passes
// one namespace's rewrites.
func RewritesOf(pool string, rewrites []v1alpha2.InferenceModelRewrite) (rules []rewrite.Rule, skipped []SkippedPart) {
	for _, rw := range poolRewrites(pool, rewrites) {
		skip := func(format string, a ...any) {
			skipped = append(skipped, SkippedPart{Rewrite: rw.Name, Part: fmt.Sprintf(format, a...)})
		}
		for ri, rule := range rw.Spec.Rules {
			var models []string
			for mi, m := range rule.Matches {
				switch {
				case m.Model == nil:
					skip("spec.rules[%d].matches[%d] has no model", ri, mi)
				case m.Model.Type != nil && *m.Model.Type != v1alpha2.MatchExact:
					skip("spec.rules[%d].matches[%d].model.type %q is not supported, only %q", ri, mi, *m.Model.Type, v1alpha2.MatchExact)
				default:
					models = append(models, m.Model.Value)
				}
			}
			if len(rule.Matches) > 0 && len(models) == 0 {
				skip("spec.rules[%d] has no match Tally can use, so it matches no request", ri)
				continue
			}
			var targets []rewrite.Target
			for ti, t := range rule.Targets {
				if t.ModelRewrite == "" {
					skip("spec.rules[%d].targets[%d].modelRewrite is empty", ri, ti)
					continue
				}
				targets = append(targets, rewrite.Target{Model: t.ModelRewrite, Weight: int(t.Weight)})
			}
			rules = append(rules, rewrite.Rule{Name: rw.Name, Models: models, Targets: targets})
		}
	}
	return rules, skipped
}

// SetupWithManager watches every rewrite in the cached namespace, including
// those of other pools: a rewrite whose poolRef moves away must still
// trigger a recompute. Every event is queued under the pool's key, and one
// reconcile is queued at start so the sink learns the set even when the
// namespace holds no rewrite.
func (r *InferenceModelRewriteReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return setupPoolWide(mgr, r.Pool, &v1alpha2.InferenceModelRewrite{}, v1alpha2.KindInferenceModelRewrite, r)
}
