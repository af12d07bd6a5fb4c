package controllers_test

import (
	"context"
	"net/http"
	"slices"
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
	"sigs.k8s.io/controller-runtime/pkg/client/apiutil"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/controllers"
	"github.com/tallyepp/tally/picker/rewrite"
)

var _ = Describe("The picker's model rewrites", func() {
	var (
		ns   string
		sink *recordingRewrites
	)
	BeforeEach(func() {
		ns = newNamespace()
		sink = &recordingRewrites{}
		mgr := newManager(ns, nil)
		Expect(controllers.SetupRewrites(mgr, types.NamespacedName{Namespace: ns, Name: poolName}, sink)).To(Succeed())
		run(mgr)
	})

	It("are told an empty set once synced, while the namespace holds no rewrite", func() {
		Eventually(sink.Calls).Should(BeNumerically(">=", 1))
		Expect(sink.Rules()).To(BeEmpty())
	})

	It("are the pool's rewrites, oldest first, and not another pool's", func() {
		// Created first: once the pool's rewrites show up, the watch has
		// delivered this one too (events arrive in resourceVersion order).
		createRewrite(ns, "other", "chat-pool", rule(nil, "elsewhere", 1))
		zeta := createRewrite(ns, "zeta", poolName, rule(models("llama"), "llama-3.1", 90, "llama-3.2", 10))
		// creationTimestamp has whole seconds; in the same second the two
		// would be ordered by name, alpha first.
		nextSecond(zeta.CreationTimestamp)
		createRewrite(ns, "alpha", poolName, rule(models("llama"), "never", 1), rule(nil, "fallback", 1))

		Eventually(sink.Rules).Should(Equal([]rewrite.Rule{
			{Name: "zeta", Models: []string{"llama"}, Targets: []rewrite.Target{{Model: "llama-3.1", Weight: 90}, {Model: "llama-3.2", Weight: 10}}},
			{Name: "alpha", Models: []string{"llama"}, Targets: []rewrite.Target{{Model: "never", Weight: 1}}},
			{Name: "alpha", Targets: []rewrite.Target{{Model: "fallback", Weight: 1}}},
		}))
	})

	It("follow an update, a poolRef that moves away, and a delete", func() {
		createRewrite(ns, "split", poolName, rule(models("llama"), "llama-3.1", 90, "llama-3.2", 10))
		createRewrite(ns, "all", poolName, rule(nil, "llama-3.1", 0))
		Eventually(sink.Rules).Should(HaveLen(2))

		updateRewrite(ns, "split", func(rw *v1alpha2.InferenceModelRewrite) {
			rw.Spec.Rules[0].Targets[0].Weight, rw.Spec.Rules[0].Targets[1].Weight = 50, 50
		})
		Eventually(sink.Rules).Should(ContainElement(rewrite.Rule{
			Name: "split", Models: []string{"llama"}, Targets: []rewrite.Target{{Model: "llama-3.1", Weight: 50}, {Model: "llama-3.2", Weight: 50}},
		}))

		updateRewrite(ns, "split", func(rw *v1alpha2.InferenceModelRewrite) { rw.Spec.PoolRef.Name = "chat-pool" })
		Eventually(sink.Rules).Should(Equal([]rewrite.Rule{{Name: "all", Targets: []rewrite.Target{{Model: "llama-3.1"}}}}))

		Expect(k8s.Delete(context.Background(), &v1alpha2.InferenceModelRewrite{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "all"}})).To(Succeed())
		Eventually(sink.Rules).Should(BeEmpty())
	})

	It("mark the pool's rewrites Accepted at their generation, naming what they ignore, and leave another pool's alone", func() {
		createRewrite(ns, "other", "chat-pool", rule(nil, "elsewhere", 1))
		createRewrite(ns, "split", poolName, rule(models("llama"), "llama-3.1", 90, "llama-3.2", 10))
		createRewrite(ns, "partial", poolName, rule(models("mistral"), "", 1, "mistral-7b", 1))

		accepted := func(name string) func() *metav1.Condition {
			return acceptedCondition(ns, name, &v1alpha2.InferenceModelRewrite{}, func(rw *v1alpha2.InferenceModelRewrite) []metav1.Condition { return rw.Status.Conditions })
		}
		Eventually(accepted("split")).Should(And(Not(BeNil()), HaveField("Status", metav1.ConditionTrue), HaveField("Reason", "Accepted"),
			HaveField("Message", "Applied by the endpoint picker of InferencePool "+poolName)))
		Eventually(accepted("partial")).Should(And(Not(BeNil()), HaveField("Status", metav1.ConditionTrue),
			HaveField("Message", ContainSubstring("ignored: spec.rules[0].targets[0].modelRewrite is empty"))))

		// A new generation is accepted again.
		updateRewrite(ns, "split", func(rw *v1alpha2.InferenceModelRewrite) { rw.Spec.Rules[0].Targets[0].Weight = 50 })
		Eventually(accepted("split")).ShouldNot(BeNil())

		var other v1alpha2.InferenceModelRewrite
		Expect(k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: "other"}, &other)).To(Succeed())
		Expect(other.Status.Conditions).To(BeEmpty(), "another pool's rewrite")
	})

	It("ignore rewrites in other namespaces", func() {
		elsewhere := newNamespace()
		createRewrite(elsewhere, "stranger", poolName, rule(nil, "x", 1))
		createRewrite(ns, "ours", poolName, rule(nil, "y", 1))
		want := []rewrite.Rule{{Name: "ours", Targets: []rewrite.Target{{Model: "y", Weight: 1}}}}
		Eventually(sink.Rules).Should(Equal(want))
		Consistently(sink.Rules, 300*time.Millisecond).Should(Equal(want))
	})
})

// As for objectives: the API server serves the kind, and the manager's
// RESTMapper looks it up where it is not served.
var _ = Describe("Without InferenceModelRewrite served", func() {
	It("rewrites are off and the manager still runs", func() {
		ns := newNamespace()
		log := &logLines{}
		mgr := newManager(ns, func(o *ctrl.Options) {
			o.Logger = funcr.New(log.add, funcr.Options{})
			o.MapperProvider = func(c *rest.Config, h *http.Client) (meta.RESTMapper, error) {
				m, err := apiutil.NewDynamicRESTMapper(c, h)
				return notServing{RESTMapper: m, instead: schema.GroupVersion{Group: "absent.tallyepp.io", Version: "v1alpha2"}}, err
			}
		})
		sink := &recordingRewrites{}
		Expect(controllers.SetupRewrites(mgr, types.NamespacedName{Namespace: ns, Name: poolName}, sink)).To(Succeed())
		Expect(log.matching("InferenceModelRewrites are off")).To(ConsistOf(
			And(ContainSubstring("no request's model is rewritten"), ContainSubstring("is its CRD installed?")),
		))

		done := run(mgr)
		createRewrite(ns, "all", poolName, rule(nil, "x", 1))
		Consistently(done, 500*time.Millisecond).ShouldNot(Receive())
		Expect(sink.Calls()).To(BeZero())
	})
})

// recordingRewrites is the picker's side of SetupRewrites in these tests.
type recordingRewrites struct {
	mu    sync.Mutex
	calls int
	last  []rewrite.Rule
}

func (s *recordingRewrites) ReplaceRewrites(rules []rewrite.Rule) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	s.last = slices.Clone(rules)
}

func (s *recordingRewrites) Rules() []rewrite.Rule {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.last)
}

func (s *recordingRewrites) Calls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

// createRewrite creates a rewrite of pool with rules, its poolRef's group
// and kind left to the CRD's defaults.
func createRewrite(ns, name, pool string, rules ...v1alpha2.InferenceModelRewriteRule) *v1alpha2.InferenceModelRewrite {
	rw := &v1alpha2.InferenceModelRewrite{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha2.InferenceModelRewriteSpec{
			PoolRef: &v1alpha2.PoolObjectReference{Name: v1alpha2.ObjectName(pool)},
			Rules:   rules,
		},
	}
	Expect(k8s.Create(context.Background(), rw)).To(Succeed())
	return rw
}

func updateRewrite(ns, name string, mutate func(*v1alpha2.InferenceModelRewrite)) {
	Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var rw v1alpha2.InferenceModelRewrite
		if err := k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &rw); err != nil {
			return err
		}
		mutate(&rw)
		return k8s.Update(context.Background(), &rw)
	})).To(Succeed())
}

// nextSecond waits until the clock, which the API server shares, is past
// the second of created, so that what is created next is younger.
func nextSecond(created metav1.Time) {
	Eventually(time.Now).Should(BeTemporally(">=", created.Add(time.Second)))
}
