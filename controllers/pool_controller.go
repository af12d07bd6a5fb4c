package controllers

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
)

// +kubebuilder:rbac:groups=inference.networking.k8s.io,namespace=tally-system,resources=inferencepools,verbs=get;list;watch

// InferencePoolReconciler follows the one InferencePool the picker serves:
// its creation, deletion and changes to its selector or target ports.
type InferencePoolReconciler struct {
	// Client reads the manager's cache.
	Client client.Reader
	// Pool names the pool; events of other pools are ignored.
	Pool types.NamespacedName
	// Endpoints is shared with PodReconciler.
	Endpoints *EndpointSync
}

// Reconcile recomputes the whole endpoint set, whatever changed. While the
// pool has a problem (it does not exist, or offers no endpoint) it looks
// again every ReportInterval, so the problem is reported again even when
// nothing in the cluster changes.
func (r *InferencePoolReconciler) Reconcile(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	problem, err := r.Endpoints.Sync(ctx, r.Client, r.Pool)
	if err != nil || !problem {
		return reconcile.Result{}, err
	}
	return reconcile.Result{RequeueAfter: r.Endpoints.reportInterval}, nil
}

// SetupWithManager watches the pool's spec. Besides pool events it queues one
// reconcile at start, once the caches are synced: with no pool and no pods
// there would be no event at all, and the picker would never learn that its
// (empty) endpoint set is complete.
func (r *InferencePoolReconciler) SetupWithManager(mgr ctrl.Manager) error {
	isOurPool := predicate.NewPredicateFuncs(func(o client.Object) bool {
		return o.GetName() == r.Pool.Name && o.GetNamespace() == r.Pool.Namespace
	})
	initial := source.Func(func(_ context.Context, q workqueue.TypedRateLimitingInterface[reconcile.Request]) error {
		q.Add(reconcile.Request{NamespacedName: r.Pool})
		return nil
	})
	err := ctrl.NewControllerManagedBy(mgr).
		Named("inferencepool").
		// Status is written by gateways and does not change the endpoints:
		// only spec changes (a new generation), creation and deletion matter.
		For(&infv1.InferencePool{}, builder.WithPredicates(isOurPool, predicate.GenerationChangedPredicate{})).
		WatchesRawSource(initial).
		WithOptions(controller.Options{NeedLeaderElection: readOnlyController()}).
		Complete(r)
	if err != nil {
		return fmt.Errorf("building the InferencePool controller: %w", err)
	}
	return nil
}
