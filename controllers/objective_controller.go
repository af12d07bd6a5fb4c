package controllers

import (
	"context"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/api/v1alpha2"
)

// +kubebuilder:rbac:groups=inference.networking.x-k8s.io,namespace=tally-system,resources=inferenceobjectives,verbs=get;list;watch
// +kubebuilder:rbac:groups=inference.networking.x-k8s.io,namespace=tally-system,resources=inferenceobjectives/status,verbs=get;patch

// ObjectiveSink is told the whole set of the pool's objectives: name -> priority (nil priority = 0).
type ObjectiveSink interface{ ReplaceObjectives(map[string]int) }

// InferenceObjectiveReconciler follows the InferenceObjectives of the pool's
// namespace and tells Sink the priorities of those that name the pool.
//
// With Status set it also marks each objective of the pool Accepted (see
// accepter), its message giving the priority applied. Objectives of other
// pools are left alone.
type InferenceObjectiveReconciler struct {
	// Client reads the manager's cache.
	Client client.Reader
	// Status, when set, writes the objectives' status.
	Status client.StatusClient
	// Pool names the pool; objectives that reference another pool are left
	// out.
	Pool types.NamespacedName
	// Sink receives the whole set on every reconcile.
	Sink ObjectiveSink

	status accepter
}

// Reconcile lists every objective in the pool's namespace and replaces the
// sink's whole set with those of the pool, whatever changed, then writes
// their status. Every event is queued under one key, and the workqueue
// never hands one key to two workers at once, so two Reconciles never race
// to call the sink.
func (r *InferenceObjectiveReconciler) Reconcile(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	var list v1alpha2.InferenceObjectiveList
	if err := r.Client.List(ctx, &list, client.InNamespace(r.Pool.Namespace)); err != nil {
		return reconcile.Result{}, fmt.Errorf("listing InferenceObjectives in namespace %s: %w", r.Pool.Namespace, err)
	}
	priorities := ObjectivesOf(r.Pool.Name, list.Items)
	r.Sink.ReplaceObjectives(priorities)
	if r.Status == nil {
		return reconcile.Result{}, nil
	}
	r.status.kind, r.status.w = v1alpha2.KindInferenceObjective, r.Status
	for i := range list.Items {
		o := &list.Items[i]
		p, ok := priorities[o.Name]
		if !ok {
			continue // another pool's, or being deleted
		}
		msg := fmt.Sprintf("Applied by the endpoint picker of InferencePool %s: priority %d", r.Pool.Name, p)
		if err := accept(ctx, &r.status, o, func(o *v1alpha2.InferenceObjective) *[]metav1.Condition { return &o.Status.Conditions }, msg); err != nil {
			return reconcile.Result{}, err
		}
	}
	return reconcile.Result{}, nil
}

// ObjectivesOf maps the name of each objective whose spec.poolRef names the
// InferencePool pool to its priority; an unset priority is 0, as upstream.
// A poolRef with an empty group or kind counts as inference.networking.k8s.io
// and InferencePool: the CRD defaults both, so only an object stored before
// the defaults (or written around them) has them empty. Objectives being
// deleted are left out. The caller passes one namespace's objectives.
func ObjectivesOf(pool string, objectives []v1alpha2.InferenceObjective) map[string]int {
	out := make(map[string]int, len(objectives))
	for i := range objectives {
		o := &objectives[i]
		if o.DeletionTimestamp != nil || !refersToPool(o.Spec.PoolRef, pool) {
			continue
		}
		var p int
		if o.Spec.Priority != nil {
			p = *o.Spec.Priority
		}
		out[o.Name] = p
	}
	return out
}

// refersToPool says whether ref names the InferencePool pool. An empty
// group or kind counts as inference.networking.k8s.io and InferencePool: the
// CRDs default both.
func refersToPool(ref v1alpha2.PoolObjectReference, pool string) bool {
	return string(ref.Name) == pool &&
		(ref.Group == "" || ref.Group == infv1.GroupName) &&
		(ref.Kind == "" || ref.Kind == "InferencePool")
}

// SetupWithManager watches every objective in the cached namespace, including
// those of other pools: an objective whose poolRef moves away must still
// trigger a recompute. Every event is queued under the pool's key, so a burst
// collapses into one recompute, and one reconcile is queued at start so the
// sink learns the set even when the namespace holds no objective.
func (r *InferenceObjectiveReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return setupPoolWide(mgr, r.Pool, &v1alpha2.InferenceObjective{}, v1alpha2.KindInferenceObjective, r)
}
