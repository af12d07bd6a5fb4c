package controllers_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/controllers"
	"github.com/tallyepp/tally/internal/testenv"
	"github.com/tallyepp/tally/internal/testtier"
	"github.com/tallyepp/tally/picker"
)

// Suite-wide: one API server for all specs; each spec works in its own
// namespace with its own manager, so no spec sees another's objects.
var (
	env     *envtest.Environment
	restCfg *rest.Config
	k8s     client.Client
)

func TestControllers(t *testing.T) {
	testtier.SkipIfShort(t, "a kube-apiserver and etcd (envtest)")
	RegisterFailHandler(Fail)
	RunSpecs(t, "Controllers Suite")
}

var _ = BeforeSuite(func() {
	ctrl.SetLogger(GinkgoLogr)
	// A manager's first cache sync can take seconds on a loaded CI machine;
	// the default of one second makes specs flaky, not stricter.
	SetDefaultEventuallyTimeout(30 * time.Second)
	SetDefaultEventuallyPollingInterval(20 * time.Millisecond)
	var err error
	env, restCfg, err = testenv.Start()
	Expect(err).NotTo(HaveOccurred())
	k8s, err = client.New(restCfg, client.Options{Scheme: controllers.Scheme()})
	Expect(err).NotTo(HaveOccurred())
})

var _ = AfterSuite(func() {
	if env != nil {
		Expect(env.Stop()).To(Succeed())
	}
})

// recordingSet is the picker's side of Setup in these tests: it keeps the
// last set it was given.
type recordingSet struct {
	mu      sync.Mutex
	synced  bool
	current []picker.Endpoint
}

func (r *recordingSet) Replace(eps []picker.Endpoint) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.synced = true
	r.current = slices.Clone(eps)
}

func (r *recordingSet) Synced() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.synced
}

// Addresses returns the current set as "ip:port" strings, in the order the
// set was given (EndpointsFor sorts it).
func (r *recordingSet) Addresses() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.current {
		out = append(out, e.Address.String())
	}
	return out
}

// Pods returns, for each endpoint of the current set, "pod=ip:port".
func (r *recordingSet) Pods() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.current {
		out = append(out, e.Pod+"="+e.Address.String())
	}
	return out
}

const poolName = "llm"

// newNamespace creates a namespace with a unique name. envtest runs no
// namespace controller, so namespaces are never actually removed; unique names
// keep specs apart.
func newNamespace() string {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "tally-"}}
	Expect(k8s.Create(context.Background(), ns)).To(Succeed())
	return ns.Name
}

// startPicker starts a manager set up exactly as the picker binary sets it up
// (Scheme, CacheOptions, Setup) for the pool poolName in ns, and stops it when
// the spec ends.
func startPicker(ns string) *recordingSet {
	return startPickerWith(ns, controllers.Options{}, GinkgoLogr).set
}

// pickerRun is what a spec can watch of a picker started by startPickerWith.
type pickerRun struct {
	set    *recordingSet
	status *controllers.PoolStatus
}

// startPickerWith is startPicker with Setup's options and the manager's
// logger; o.Status is filled in, and o.Events is the manager's events/v1
// recorder, as in the binary, unless given.
func startPickerWith(ns string, o controllers.Options, logger logr.Logger) pickerRun {
	set := &recordingSet{}
	mgr, err := ctrl.NewManager(restCfg, ctrl.Options{
		Scheme:  controllers.Scheme(),
		Cache:   controllers.CacheOptions(ns),
		Metrics: metricsserver.Options{BindAddress: "0"},
		Logger:  logger,
		// Each spec runs its own manager with the same controller names.
		Controller: config.Controller{SkipNameValidation: new(true)},
	})
	Expect(err).NotTo(HaveOccurred())
	if o.Status == nil {
		o.Status = &controllers.PoolStatus{}
	}
	if o.Events == nil {
		o.Events = mgr.GetEventRecorder("tally-epp")
	}
	Expect(controllers.Setup(mgr, types.NamespacedName{Namespace: ns, Name: poolName}, set, o)).To(Succeed())

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		defer GinkgoRecover()
		done <- mgr.Start(ctx)
	}()
	DeferCleanup(func() {
		cancel()
		Eventually(done, 30*time.Second).Should(Receive(BeNil()))
	})
	return pickerRun{set: set, status: o.Status}
}

// logRecorder keeps the lines a logger writes at the default verbosity
// (V(0)), as funcr formats them.
type logRecorder struct {
	mu    sync.Mutex
	lines []string
}

func (r *logRecorder) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.lines = append(r.lines, prefix+" "+args)
	}, funcr.Options{Verbosity: 0})
}

// Matching returns the lines that contain every one of subs.
func (r *logRecorder) Matching(subs ...string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, l := range r.lines {
		all := true
		for _, s := range subs {
			all = all && strings.Contains(l, s)
		}
		if all {
			out = append(out, l)
		}
	}
	return out
}

func newPool(ns string, labels map[string]string, ports ...int32) *infv1.InferencePool {
	p := &infv1.InferencePool{ObjectMeta: metav1.ObjectMeta{Name: poolName, Namespace: ns}}
	p.Spec.Selector.MatchLabels = map[infv1.LabelKey]infv1.LabelValue{}
	for k, v := range labels {
		p.Spec.Selector.MatchLabels[infv1.LabelKey(k)] = infv1.LabelValue(v)
	}
	for _, n := range ports {
		p.Spec.TargetPorts = append(p.Spec.TargetPorts, infv1.Port{Number: infv1.PortNumber(n)})
	}
	return p
}

func createPool(ns string, labels map[string]string, ports ...int32) *infv1.InferencePool {
	p := newPool(ns, labels, ports...)
	Expect(k8s.Create(context.Background(), p)).To(Succeed())
	return p
}

// updatePool applies mutate to the latest version of the pool.
func updatePool(ns string, mutate func(*infv1.InferencePool)) {
	Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var p infv1.InferencePool
		if err := k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: poolName}, &p); err != nil {
			return err
		}
		mutate(&p)
		return k8s.Update(context.Background(), &p)
	})).To(Succeed())
}

func createPod(ns, name string, labels map[string]string, finalizers ...string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels, Finalizers: finalizers},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{Name: "server", Image: "vllm/vllm-openai"}},
		},
	}
	Expect(k8s.Create(context.Background(), p)).To(Succeed())
	return p
}

// setPodStatus does what the kubelet would: report the pod IP and readiness,
// through the status subresource.
func setPodStatus(ns, name, ip string, ready bool) {
	readyStatus := corev1.ConditionFalse
	if ready {
		readyStatus = corev1.ConditionTrue
	}
	Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var p corev1.Pod
		if err := k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &p); err != nil {
			return err
		}
		p.Status.PodIP = ip
		p.Status.PodIPs = []corev1.PodIP{{IP: ip}}
		p.Status.Conditions = []corev1.PodCondition{{
			Type: corev1.PodReady, Status: readyStatus, LastTransitionTime: metav1.Now(),
		}}
		return k8s.Status().Update(context.Background(), &p)
	})).To(Succeed())
}

// readyPod creates a pod and marks it Ready at ip.
func readyPod(ns, name, ip string, labels map[string]string, finalizers ...string) {
	createPod(ns, name, labels, finalizers...)
	setPodStatus(ns, name, ip, true)
}

func updatePodLabels(ns, name string, labels map[string]string) {
	Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var p corev1.Pod
		if err := k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &p); err != nil {
			return err
		}
		p.Labels = labels
		return k8s.Update(context.Background(), &p)
	})).To(Succeed())
}

func deletePod(ns, name string) {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	Expect(k8s.Delete(context.Background(), p, client.GracePeriodSeconds(0))).To(Succeed())
}

// removeFinalizers lets a pod held by a finalizer go.
func removeFinalizers(ns, name string) {
	Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var p corev1.Pod
		if err := k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &p); err != nil {
			return client.IgnoreNotFound(err)
		}
		p.Finalizers = nil
		return k8s.Update(context.Background(), &p)
	})).To(Succeed())
}
