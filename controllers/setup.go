package controllers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/workqueue"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/picker"
)

// Leader election (configured by the binary) needs leases and events in the
// picker's namespace.
// +kubebuilder:rbac:groups=coordination.k8s.io,namespace=tally-system,resources=leases,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups="",namespace=tally-system,resources=events,verbs=create;patch

// The pool's problems are recorded as events/v1 Events on it (Options.Events).
// +kubebuilder:rbac:groups=events.k8s.io,namespace=tally-system,resources=events,verbs=create;patch

// Scheme returns a scheme with the client-go core types, InferencePool v1,
// and InferenceObjective and InferenceModelRewrite v1alpha2.
func Scheme() *runtime.Scheme {
	s := runtime.NewScheme()
	// Registering compiled-in types fails only on a programming error
	// (conflicting registrations), which no input can cause.
	if err := clientgoscheme.AddToScheme(s); err != nil {
		panic(fmt.Sprintf("registering client-go types: %v", err))
	}
	if err := infv1.Install(s); err != nil {
		panic(fmt.Sprintf("registering %s: %v", infv1.SchemeGroupVersion, err))
	}
	if err := v1alpha2.Install(s); err != nil {
		panic(fmt.Sprintf("registering %s: %v", v1alpha2.SchemeGroupVersion, err))
	}
	return s
}

// CacheOptions limits the manager's cache to namespace, the pool's namespace:
// the picker only needs that namespace's pods (pools select pods in their own
// namespace), and its Role grants nothing else.
func CacheOptions(namespace string) cache.Options {
	return cache.Options{
		DefaultNamespaces: map[string]cache.Config{namespace: {}},
		// Managed fields are never read and are a large share of a pod's size.
		DefaultTransform: cache.TransformStripManagedFields(),
	}
}

// Options are Setup's optional collaborators.
type Options struct {
	// Status, when set, is kept equal to what the controllers last saw of
	// the pool: whether it exists (the picker's readiness) and why it
	// offers no endpoint (the answer to a refused request).
	Status *PoolStatus
	// Events records a problem with the pool (its selector matches no pod,
	// or no Ready pod) as an Event on it; nil: logged only.
	Events EventRecorder
	// ReportInterval is how often a lasting problem is reported again;
	// zero or less means DefaultReportInterval.
	ReportInterval time.Duration
}

// Setup registers the InferencePool and pod reconcilers on mgr. They keep set
// equal to the endpoints of the pool named pool, which must be in the
// namespace that the manager's cache covers (CacheOptions).
func Setup(mgr ctrl.Manager, pool types.NamespacedName, set picker.EndpointSet, o Options) error {
	if err := checkPool(pool); err != nil {
		return err
	}
	if set == nil {
		return errors.New("endpoint set is nil: the reconcilers need a picker.EndpointSet to feed")
	}
	endpoints := newEndpointSync(set, o)
	poolR := &InferencePoolReconciler{Client: mgr.GetClient(), Pool: pool, Endpoints: endpoints}
	if err := poolR.SetupWithManager(mgr); err != nil {
		return err
	}
	podR := &PodReconciler{Client: mgr.GetClient(), Pool: pool, Endpoints: endpoints}
	return podR.SetupWithManager(mgr)
}

// SetupObjectives registers the InferenceObjective reconciler on mgr. It
// keeps sink equal to the priorities of the objectives that reference the
// pool named pool, in the namespace that the manager's cache covers.
//
// When the API server does not serve InferenceObjective v1alpha2 (its CRD is
// not installed), objectives are off: SetupObjectives logs one info line
// saying so through the manager's logger and returns nil, and the manager
// runs without the reconciler; every request then has priority 0. The kind
// is looked up once: a CRD installed later takes effect on the next start.
// Any other failure to look it up is returned.
func SetupObjectives(mgr ctrl.Manager, pool types.NamespacedName, sink ObjectiveSink) error {
	if sink == nil {
		return errors.New("objective sink is nil: the reconciler needs an ObjectiveSink to feed")
	}
	return setupIfServed(mgr, pool, v1alpha2.KindInferenceObjective, "InferenceObjectives are off: every request has priority 0",
		&InferenceObjectiveReconciler{Client: mgr.GetClient(), Status: mgr.GetClient(), Pool: pool, Sink: sink})
}

// SetupRewrites registers the InferenceModelRewrite reconciler on mgr. It
// keeps sink equal to the rules of the rewrites that reference the pool
// named pool, in the namespace that the manager's cache covers.
//
// When the API server does not serve InferenceModelRewrite v1alpha2, rewrites
// are off, as objectives are in SetupObjectives: one info line, nil, and
// every request keeps its model.
func SetupRewrites(mgr ctrl.Manager, pool types.NamespacedName, sink RewriteSink) error {
	if sink == nil {
		return errors.New("rewrite sink is nil: the reconciler needs a RewriteSink to feed")
	}
	return setupIfServed(mgr, pool, v1alpha2.KindInferenceModelRewrite, "InferenceModelRewrites are off: no request's model is rewritten",
		&InferenceModelRewriteReconciler{Client: mgr.GetClient(), Status: mgr.GetClient(), Pool: pool, Sink: sink})
}

// checkPool says what is missing from the pool's name.
func checkPool(pool types.NamespacedName) error {
	if pool.Name == "" || pool.Namespace == "" {
		return fmt.Errorf("InferencePool %q: both a name and a namespace are required", pool)
	}
	return nil
}

// setupIfServed registers r on mgr for the pool's resources of kind, if
// the API server serves kind (v1alpha2Served says what happens if not).
func setupIfServed(mgr ctrl.Manager, pool types.NamespacedName, kind, off string, r interface{ SetupWithManager(ctrl.Manager) error }) error {
	if err := checkPool(pool); err != nil {
		return err
	}
	served, err := v1alpha2Served(mgr, kind, off)
	if err != nil || !served {
		return err
	}
	return r.SetupWithManager(mgr)
}

// setupPoolWide builds a read-only controller for r that reconciles the
// pool as a whole, once at start and on any change to an object of obj's
// kind: the reconciler reads every such object and feeds the lot.
func setupPoolWide(mgr ctrl.Manager, pool types.NamespacedName, obj client.Object, kind string, r reconcile.Reconciler) error {
	toPool := handler.EnqueueRequestsFromMapFunc(func(context.Context, client.Object) []reconcile.Request {
		return []reconcile.Request{{NamespacedName: pool}}
	})
	initial := source.Func(func(_ context.Context, q workqueue.TypedRateLimitingInterface[reconcile.Request]) error {
		q.Add(reconcile.Request{NamespacedName: pool})
		return nil
	})
	err := ctrl.NewControllerManagedBy(mgr).
		Named(strings.ToLower(kind)).
		Watches(obj, toPool).
		WatchesRawSource(initial).
		WithOptions(controller.Options{NeedLeaderElection: readOnlyController()}).
		Complete(r)
	if err != nil {
		return fmt.Errorf("building the %s controller: %w", kind, err)
	}
	return nil
}

// v1alpha2Served looks up once whether the API server serves kind in
// v1alpha2. When it does not (its CRD is not installed), it logs off, the
// consequence, as one info line through the manager's logger and returns
// false; any other failure to look it up is returned.
func v1alpha2Served(mgr ctrl.Manager, kind, off string) (bool, error) {
	gk := schema.GroupKind{Group: v1alpha2.GroupName, Kind: kind}
	if _, err := mgr.GetRESTMapper().RESTMapping(gk, v1alpha2.SchemeGroupVersion.Version); err != nil {
		if meta.IsNoMatchError(err) {
			mgr.GetLogger().Info(off,
				"reason", "the API server does not serve "+gk.Kind+" "+v1alpha2.SchemeGroupVersion.String()+" (is its CRD installed?)",
				"error", err.Error())
			return false, nil
		}
		return false, fmt.Errorf("looking up whether the API server serves %s %s: %w", gk.Kind, v1alpha2.SchemeGroupVersion, err)
	}
	return true, nil
}

// readOnlyController is the NeedLeaderElection option of every controller:
// they write nothing to the cluster, so every replica runs them and a standby
// holds a current endpoint set (and objectives and rewrites) the moment it
// takes over.
func readOnlyController() *bool {
	return new(false)
}

// RESTConfig returns the API server connection the binaries use: the
// kubeconfig file at path (their --kubeconfig flag, which defaults to
// $KUBECONFIG), else the in-cluster service account.
func RESTConfig(path string) (*rest.Config, error) {
	if path != "" {
		c, err := clientcmd.BuildConfigFromFlags("", path)
		if err != nil {
			return nil, fmt.Errorf("flag --kubeconfig %q: %w", path, err)
		}
		return c, nil
	}
	c, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("no --kubeconfig or KUBECONFIG given and not running in a cluster: %w", err)
	}
	return c, nil
}
