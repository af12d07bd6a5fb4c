package controllers_test

import (
	"context"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
)

// Pods are never scheduled here (no scheduler, no kubelet); the specs set
// their IP and readiness through the status subresource, as a kubelet would.
var _ = Describe("The picker's endpoint set", func() {
	var (
		ns  string
		set *recordingSet
	)
	llm := map[string]string{"app": "llm"}

	// Every expectation names the exact set: a controller that missed one
	// transition leaves a set that differs from it.
	expectSet := func(want ...string) {
		GinkgoHelper()
		if len(want) == 0 {
			Eventually(set.Addresses).Should(BeEmpty())
			return
		}
		Eventually(set.Addresses).Should(Equal(want))
	}

	BeforeEach(func() {
		ns = newNamespace()
		set = startPicker(ns)
	})

	It("is synced and empty while the pool does not exist, and fills when the pool is created later", func() {
		// Nothing exists in the namespace yet, so no watch event can trigger
		// this first, empty set: the controllers must produce it on start.
		Eventually(set.Synced).Should(BeTrue())
		Expect(set.Addresses()).To(BeEmpty())

		readyPod(ns, "a", "10.0.0.1", llm)
		Consistently(set.Addresses, 500*time.Millisecond).Should(BeEmpty())

		createPool(ns, llm, 8000)
		expectSet("10.0.0.1:8000")
		Expect(set.Pods()).To(Equal([]string{"a=10.0.0.1:8000"}))
	})

	It("adds a pod when it becomes Ready and removes it when it becomes NotReady", func() {
		createPool(ns, llm, 8000)
		readyPod(ns, "a", "10.0.0.1", llm)
		createPod(ns, "b", llm)
		setPodStatus(ns, "b", "10.0.0.2", false)
		expectSet("10.0.0.1:8000")

		setPodStatus(ns, "b", "10.0.0.2", true)
		expectSet("10.0.0.1:8000", "10.0.0.2:8000")

		setPodStatus(ns, "a", "10.0.0.1", false)
		expectSet("10.0.0.2:8000")
	})

	It("removes a pod when it is deleted", func() {
		createPool(ns, llm, 8000)
		readyPod(ns, "a", "10.0.0.1", llm)
		readyPod(ns, "b", "10.0.0.2", llm)
		expectSet("10.0.0.1:8000", "10.0.0.2:8000")

		deletePod(ns, "a")
		expectSet("10.0.0.2:8000")
	})

	It("removes a pod as soon as it is being deleted, while it still reports Ready", func() {
		const hold = "test.tallyepp.io/hold"
		createPool(ns, llm, 8000)
		readyPod(ns, "a", "10.0.0.1", llm, hold)
		readyPod(ns, "b", "10.0.0.2", llm)
		DeferCleanup(removeFinalizers, ns, "a")
		expectSet("10.0.0.1:8000", "10.0.0.2:8000")

		deletePod(ns, "a")
		expectSet("10.0.0.2:8000")

		// The finalizer kept the pod: it was dropped for its deletionTimestamp,
		// not because it was gone.
		var p corev1.Pod
		Expect(k8s.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: "a"}, &p)).To(Succeed())
		Expect(p.DeletionTimestamp).NotTo(BeNil())
		Expect(p.Status.Conditions).To(ContainElement(HaveField("Status", corev1.ConditionTrue)))
	})

	It("follows pod labels: a pod that leaves the selector is removed, one that joins is added", func() {
		createPool(ns, llm, 8000)
		readyPod(ns, "a", "10.0.0.1", llm)
		readyPod(ns, "b", "10.0.0.2", llm)
		readyPod(ns, "c", "10.0.0.3", map[string]string{"app": "other"})
		expectSet("10.0.0.1:8000", "10.0.0.2:8000")

		updatePodLabels(ns, "a", map[string]string{"app": "other"})
		expectSet("10.0.0.2:8000")

		updatePodLabels(ns, "c", map[string]string{"app": "llm", "extra": "label"})
		expectSet("10.0.0.2:8000", "10.0.0.3:8000")
	})

	It("follows a change of pod IP", func() {
		createPool(ns, llm, 8000)
		readyPod(ns, "a", "10.0.0.1", llm)
		readyPod(ns, "b", "10.0.0.2", llm)
		expectSet("10.0.0.1:8000", "10.0.0.2:8000")

		setPodStatus(ns, "a", "10.0.0.9", true)
		expectSet("10.0.0.2:8000", "10.0.0.9:8000")
	})

	It("follows a change of the pool's selector", func() {
		createPool(ns, llm, 8000)
		readyPod(ns, "a", "10.0.0.1", llm)
		readyPod(ns, "b", "10.0.0.2", map[string]string{"app": "llm", "variant": "fast"})
		readyPod(ns, "c", "10.0.0.3", map[string]string{"app": "chat"})
		expectSet("10.0.0.1:8000", "10.0.0.2:8000")

		updatePool(ns, func(p *infv1.InferencePool) {
			p.Spec.Selector.MatchLabels = map[infv1.LabelKey]infv1.LabelValue{"app": "llm", "variant": "fast"}
		})
		expectSet("10.0.0.2:8000")

		updatePool(ns, func(p *infv1.InferencePool) {
			p.Spec.Selector.MatchLabels = map[infv1.LabelKey]infv1.LabelValue{"app": "chat"}
		})
		expectSet("10.0.0.3:8000")
	})

	It("gives one endpoint per target port and follows changes of the ports", func() {
		createPool(ns, llm, 8000)
		readyPod(ns, "a", "10.0.0.1", llm)
		readyPod(ns, "b", "10.0.0.2", llm)
		expectSet("10.0.0.1:8000", "10.0.0.2:8000")

		updatePool(ns, func(p *infv1.InferencePool) {
			p.Spec.TargetPorts = []infv1.Port{{Number: 8001}, {Number: 8000}}
		})
		expectSet("10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001")
		Expect(set.Pods()).To(Equal([]string{
			"a=10.0.0.1:8000", "a=10.0.0.1:8001", "b=10.0.0.2:8000", "b=10.0.0.2:8001",
		}))

		updatePool(ns, func(p *infv1.InferencePool) {
			p.Spec.TargetPorts = []infv1.Port{{Number: 9000}}
		})
		expectSet("10.0.0.1:9000", "10.0.0.2:9000")
	})

	It("empties when the pool is deleted, and fills again when it comes back", func() {
		pool := createPool(ns, llm, 8000)
		readyPod(ns, "a", "10.0.0.1", llm)
		expectSet("10.0.0.1:8000")

		Expect(k8s.Delete(context.Background(), pool)).To(Succeed())
		expectSet()
		Expect(set.Synced()).To(BeTrue())

		createPool(ns, llm, 8001)
		expectSet("10.0.0.1:8001")
	})

	It("ignores other pools in the same namespace", func() {
		createPool(ns, llm, 8000)
		other := newPool(ns, map[string]string{"app": "chat"}, 7000)
		other.Name = "chat"
		Expect(k8s.Create(context.Background(), other)).To(Succeed())
		readyPod(ns, "a", "10.0.0.1", llm)
		readyPod(ns, "c", "10.0.0.3", map[string]string{"app": "chat"})
		expectSet("10.0.0.1:8000")

		Expect(k8s.Delete(context.Background(), other)).To(Succeed())
		readyPod(ns, "b", "10.0.0.2", llm)
		expectSet("10.0.0.1:8000", "10.0.0.2:8000")
	})

	It("ignores pods in other namespaces, even when their labels match", func() {
		createPool(ns, llm, 8000)
		elsewhere := newNamespace()
		readyPod(elsewhere, "x", "10.0.0.8", llm)
		// Created after x: once this pod shows up, the watch has delivered
		// everything before it (watch events arrive in resourceVersion order).
		readyPod(ns, "a", "10.0.0.1", llm)
		expectSet("10.0.0.1:8000")

		setPodStatus(elsewhere, "x", "10.0.0.9", true)
		readyPod(ns, "b", "10.0.0.2", llm)
		expectSet("10.0.0.1:8000", "10.0.0.2:8000")
	})

	It("writes IPv6 endpoints as [addr]:port", func() {
		createPool(ns, llm, 8000, 8001)
		readyPod(ns, "a", "fd00:10::5", llm)
		readyPod(ns, "b", "10.0.0.2", llm)
		expectSet("10.0.0.2:8000", "10.0.0.2:8001", "[fd00:10::5]:8000", "[fd00:10::5]:8001")
	})
})
