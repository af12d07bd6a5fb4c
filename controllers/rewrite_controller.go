package controllers

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/picker"
)

// +kubebuilder:rbac:groups=inference.networking.x-k8s.io,namespace=tally-system,resources=inferencemodelrewrites,verbs=get;list;watch

// RewriteSink is told the whole set of the pool's model rewrite rules, in
// precedence order (see RewritesOf).
type RewriteSink interface{ ReplaceRewrites([]picker.RewriteRule) }

// InferenceModelRewriteReconciler follows the InferenceModelRewrites of the
// pool's namespace and tells Sink the rules of those that name the pool.
//
// It writes nothing to the cluster: upstream's picker (v1.5.0) sets no
// status on an InferenceModelRewrite either. A rewrite's status stays empty
// (the CRD's default condition, Accepted Unknown Pending, is applied only to
// a status someone writes), and what Tally cannot use of a rewrite it logs.
type InferenceModelRewriteReconciler struct {
	// Client reads the manager's cache.
	Client client.Reader
	// Pool names the pool; rewrites that reference another pool are left
	// out.
	Pool types.NamespacedName
	// Sink receives the whole set on every reconcile.
	Sink RewriteSink
}

// Reconcile lists every rewrite in the pool's namespace and replaces the
// sink's whole set with the rules of those of the pool, whatever changed.
// As for objectives, every event is queued under one key, so two Reconciles
// never race to call the sink.
func (r *InferenceModelRewriteReconciler) Reconcile(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	var list v1alpha2.InferenceModelRewriteList
	if err := r.Client.List(ctx, &list, client.InNamespace(r.Pool.Namespace)); err != nil {
		return reconcile.Result{}, fmt.Errorf("listing InferenceModelRewrites in namespace %s: %w", r.Pool.Namespace, err)
	}
	rules, skipped := RewritesOf(r.Pool.Name, list.Items)
	for _, s := range skipped {
		log.FromContext(ctx).Info("Part of an InferenceModelRewrite is ignored", "reason", s)
	}
	r.Sink.ReplaceRewrites(rules)
	return reconcile.Result{}, nil
}

// RewritesOf returns the rules of the rewrites whose spec.poolRef names the
// InferencePool pool (the same group and kind rules as ObjectivesOf;
// rewrites being deleted are left out), in the order picker.Rewrites takes
// them: resources oldest first by creationTimestamp, ties (the timestamp
// has whole seconds) by name, and each resource's rules in list order.
// picker.Rewrites applies upstream's precedence on that order.
//
// A rule becomes one picker.RewriteRule named after its resource, with the
// values of its matches as Models (nil for a rule without matches: a
// catch-all) and its targets with their weights. What cannot be used is
// left out and described in skipped: a match of a type other than Exact
// (v1.5.0 has no other; the CRD defaults an unset type to Exact), a rule
// whose every match is left out (it matches nothing; it must not become a
// catch-all), and a target with an empty modelRewrite (the CRD allows one;
// upstream would send the model server an empty model). The caller passes
// one namespace's rewrites.
func RewritesOf(pool string, rewrites []v1alpha2.InferenceModelRewrite) (rules []picker.RewriteRule, skipped []string) {
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
	for _, rw := range ours {
		for ri, rule := range rw.Spec.Rules {
			var models []string
			for mi, m := range rule.Matches {
				switch {
				case m.Model == nil:
					skipped = append(skipped, fmt.Sprintf("InferenceModelRewrite %s: spec.rules[%d].matches[%d] has no model", rw.Name, ri, mi))
				case m.Model.Type != nil && *m.Model.Type != v1alpha2.MatchExact:
					skipped = append(skipped, fmt.Sprintf("InferenceModelRewrite %s: spec.rules[%d].matches[%d].model.type %q is not supported, only %q",
						rw.Name, ri, mi, *m.Model.Type, v1alpha2.MatchExact))
				default:
					models = append(models, m.Model.Value)
				}
			}
			if len(rule.Matches) > 0 && len(models) == 0 {
				skipped = append(skipped, fmt.Sprintf("InferenceModelRewrite %s: spec.rules[%d] has no match Tally can use, so it matches no request", rw.Name, ri))
				continue
			}
			var targets []picker.RewriteTarget
			for ti, t := range rule.Targets {
				if t.ModelRewrite == "" {
					skipped = append(skipped, fmt.Sprintf("InferenceModelRewrite %s: spec.rules[%d].targets[%d].modelRewrite is empty", rw.Name, ri, ti))
					continue
				}
				targets = append(targets, picker.RewriteTarget{Model: t.ModelRewrite, Weight: int(t.Weight)})
			}
			rules = append(rules, picker.RewriteRule{Name: rw.Name, Models: models, Targets: targets})
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
