package controllers

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// +kubebuilder:rbac:groups="",namespace=tally-system,resources=pods,verbs=get;list;watch

// PodReconciler follows the pods in the pool's namespace: readiness, pod IP,
// labels and deletion.
type PodReconciler struct {
	// Client reads the manager's cache.
	Client client.Reader
	// Pool names the pool whose endpoints the pods make up.
	Pool types.NamespacedName
	// Endpoints is shared with InferencePoolReconciler.
	Endpoints *EndpointSync
}

// Reconcile recomputes the whole endpoint set, whatever changed.
func (r *PodReconciler) Reconcile(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	// The pool's reconciler looks again while there is a problem.
	_, err := r.Endpoints.Sync(ctx, r.Client, r.Pool)
	return reconcile.Result{}, err
}

// SetupWithManager watches every pod in the cached namespace, including pods
// the pool does not select: a pod whose labels stop matching must still
// trigger a recompute. Every pod event is queued under the pool's key, so a
// burst of pod changes collapses into one recompute of the whole set.
func (r *PodReconciler) SetupWithManager(mgr ctrl.Manager) error {
	toPool := handler.EnqueueRequestsFromMapFunc(func(context.Context, client.Object) []reconcile.Request {
		return []reconcile.Request{{NamespacedName: r.Pool}}
	})
	err := ctrl.NewControllerManagedBy(mgr).
		Named("pod").
		Watches(&corev1.Pod{}, toPool).
		WithOptions(controller.Options{NeedLeaderElection: readOnlyController()}).
		Complete(r)
	if err != nil {
		return fmt.Errorf("building the pod controller: %w", err)
	}
	return nil
}
