package controllers_test

import (
	"context"
	"maps"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr/funcr"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/apiutil"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/controllers"
)

var _ = Describe("The picker's objectives", func() {
	var (
		ns   string
		sink *recordingSink
	)
	BeforeEach(func() {
		ns = newNamespace()
		sink = &recordingSink{}
		mgr := newManager(ns, nil)
		Expect(controllers.SetupObjectives(mgr, types.NamespacedName{Namespace: ns, Name: poolName}, sink)).To(Succeed())
		run(mgr)
	})

	It("are told an empty set once synced, while the namespace holds no objective", func() {
		Eventually(sink.Calls).Should(BeNumerically(">=", 1))
		Expect(sink.Objectives()).To(BeEmpty())
	})

	It("are the pool's objectives with their priorities, and not another pool's", func() {
		// Created first: once the pool's objectives show up, the watch has
		// delivered this one too (events arrive in resourceVersion order).
		createObjective(ns, "other", "chat-pool", new(9))
		createObjective(ns, "chat", poolName, new(10))
		createObjective(ns, "batch", poolName, new(-5))
		Eventually(sink.Objectives).Should(Equal(map[string]int{"chat": 10, "batch": -5}))
	})

	It("mark the pool's objectives Accepted with the priority applied, and leave another pool's alone", func() {
		createObjective(ns, "other", "chat-pool", new(9))
		createObjective(ns, "chat", poolName, new(10))
		accepted := func(name string) func() *metav1.Condition {
			return acceptedCondition(ns, name, &v1alpha2.InferenceObjective{}, func(o *v1alpha2.InferenceObjective) []metav1.Condition { return o.Status.Conditions })
		}
		Eventually(accepted("chat")).Should(And(Not(BeNil()), HaveField("Status", metav1.ConditionTrue), HaveField("Reason", "Accepted"),
			HaveField("Message", "Applied by the endpoint picker of InferencePool "+poolName+": priority 10")))
		updateObjective(ns, "chat", func(o *v1alpha2.InferenceObjective) { o.Spec.Priority = new(3) })
		Eventually(accepted("chat")).Should(And(Not(BeNil()), HaveField("Message", HaveSuffix("priority 3"))))

		var other v1alpha2.InferenceObjective
		Expect(k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: "other"}, &other)).To(Succeed())
		Expect(other.Status.Conditions).To(BeEmpty(), "another pool's objective")
	})

	It("give priority 0 to an objective without one", func() {
		createObjective(ns, "plain", poolName, nil)
		Eventually(sink.Objectives).Should(Equal(map[string]int{"plain": 0}))
	})

	It("follow a change of priority and a delete", func() {
		createObjective(ns, "chat", poolName, new(1))
		createObjective(ns, "batch", poolName, new(-1))
		Eventually(sink.Objectives).Should(Equal(map[string]int{"chat": 1, "batch": -1}))

		updateObjective(ns, "chat", func(o *v1alpha2.InferenceObjective) { o.Spec.Priority = new(20) })
		Eventually(sink.Objectives).Should(Equal(map[string]int{"chat": 20, "batch": -1}))

		updateObjective(ns, "chat", func(o *v1alpha2.InferenceObjective) { o.Spec.Priority = nil })
		Eventually(sink.Objectives).Should(Equal(map[string]int{"chat": 0, "batch": -1}))

		Expect(k8s.Delete(context.Background(), &v1alpha2.InferenceObjective{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "batch"}})).To(Succeed())
		Eventually(sink.Objectives).Should(Equal(map[string]int{"chat": 0}))
	})

	It("drop an objective whose poolRef moves to another pool, and take one that moves in", func() {
		createObjective(ns, "chat", poolName, new(1))
		createObjective(ns, "batch", "chat-pool", new(2))
		Eventually(sink.Objectives).Should(Equal(map[string]int{"chat": 1}))

		updateObjective(ns, "chat", func(o *v1alpha2.InferenceObjective) { o.Spec.PoolRef.Name = "chat-pool" })
		Eventually(sink.Objectives).Should(BeEmpty())

		updateObjective(ns, "batch", func(o *v1alpha2.InferenceObjective) { o.Spec.PoolRef.Name = poolName })
		Eventually(sink.Objectives).Should(Equal(map[string]int{"batch": 2}))
	})

	It("ignore objectives in other namespaces", func() {
		elsewhere := newNamespace()
		createObjective(elsewhere, "stranger", poolName, new(7))
		createObjective(ns, "chat", poolName, new(1))
		Eventually(sink.Objectives).Should(Equal(map[string]int{"chat": 1}))
		Consistently(sink.Objectives, 300*time.Millisecond).Should(Equal(map[string]int{"chat": 1}))
	})
})

// The shared API server serves InferenceObjective; these managers are given
// a RESTMapper that looks the kind up somewhere it is not served, through
// the real discovery client, as a cluster without the CRD would answer.
var _ = DescribeTable("Without InferenceObjective served, objectives are off and the manager still runs",
	func(instead schema.GroupVersion) {
		ns := newNamespace()
		log := &logLines{}
		mgr := newManager(ns, func(o *ctrl.Options) {
			o.Logger = funcr.New(log.add, funcr.Options{})
			o.MapperProvider = func(c *rest.Config, h *http.Client) (meta.RESTMapper, error) {
				m, err := apiutil.NewDynamicRESTMapper(c, h)
				return notServing{RESTMapper: m, instead: instead}, err
			}
		})
		sink := &recordingSink{}
		Expect(controllers.SetupObjectives(mgr, types.NamespacedName{Namespace: ns, Name: poolName}, sink)).To(Succeed())
		Expect(log.matching("InferenceObjectives are off")).To(ConsistOf(
			And(ContainSubstring("every request has priority 0"), ContainSubstring("is its CRD installed?")),
		))

		done := run(mgr)
		createObjective(ns, "chat", poolName, new(1))
		Consistently(done, 500*time.Millisecond).ShouldNot(Receive())
		Expect(sink.Calls()).To(BeZero())
	},
	Entry("when the API group is not served", schema.GroupVersion{Group: "absent.tallyepp.io", Version: "v1alpha2"}),
	Entry("when the group and version are served without the kind", schema.GroupVersion{Group: "inference.networking.k8s.io", Version: "v1"}),
)

// notServing looks the v1alpha2 kinds (InferenceObjective,
// InferenceModelRewrite) up in another group and version.
type notServing struct {
	meta.RESTMapper
	instead schema.GroupVersion
}

func (m notServing) RESTMapping(gk schema.GroupKind, versions ...string) (*meta.RESTMapping, error) {
	if gk.Group == v1alpha2.GroupName {
		gk.Group, versions = m.instead.Group, []string{m.instead.Version}
	}
	return m.RESTMapper.RESTMapping(gk, versions...)
}

// recordingSink is the picker's side of SetupObjectives in these tests.
type recordingSink struct {
	mu    sync.Mutex
	calls int
	last  map[string]int
}

func (s *recordingSink) ReplaceObjectives(m map[string]int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	s.last = maps.Clone(m)
}

func (s *recordingSink) Objectives() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.last)
}

func (s *recordingSink) Calls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) add(prefix, args string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, prefix+" "+args)
}

func (l *logLines) matching(substr string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range l.lines {
		if strings.Contains(line, substr) {
			out = append(out, line)
		}
	}
	return out
}

// newManager builds a manager as the picker binary does (Scheme,
// CacheOptions) for namespace ns; configure, when set, changes its options.
func newManager(ns string, configure func(*ctrl.Options)) ctrl.Manager {
	opts := ctrl.Options{
		Scheme:     controllers.Scheme(),
		Cache:      controllers.CacheOptions(ns),
		Metrics:    metricsserver.Options{BindAddress: "0"},
		Controller: config.Controller{SkipNameValidation: new(true)},
	}
	if configure != nil {
		configure(&opts)
	}
	mgr, err := ctrl.NewManager(restCfg, opts)
	Expect(err).NotTo(HaveOccurred())
	return mgr
}

// run starts mgr until the spec ends; the channel receives what Start
// returned.
func run(mgr ctrl.Manager) <-chan error {
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
	return done
}

func createObjective(ns, name, pool string, priority *int) {
	o := &v1alpha2.InferenceObjective{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha2.InferenceObjectiveSpec{
			Priority: priority,
			PoolRef:  v1alpha2.PoolObjectReference{Name: v1alpha2.ObjectName(pool)},
		},
	}
	Expect(k8s.Create(context.Background(), o)).To(Succeed())
}

func updateObjective(ns, name string, mutate func(*v1alpha2.InferenceObjective)) {
	Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var o v1alpha2.InferenceObjective
		if err := k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &o); err != nil {
			return err
		}
		mutate(&o)
		return k8s.Update(context.Background(), &o)
	})).To(Succeed())
}

// acceptedCondition reads the object name of ns (of empty's type) and
// returns its Accepted condition, nil while it has none for its current
// generation.
func acceptedCondition[T client.Object](ns, name string, empty T, conds func(T) []metav1.Condition) func() *metav1.Condition {
	return func() *metav1.Condition {
		obj := empty.DeepCopyObject().(T)
		Expect(k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, obj)).To(Succeed())
		c := meta.FindStatusCondition(conds(obj), "Accepted")
		if c != nil && c.ObservedGeneration != obj.GetGeneration() {
			return nil // an older generation's
		}
		return c
	}
}
