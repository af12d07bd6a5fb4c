package controllers_test

import (
	"context"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	eventsv1 "k8s.io/api/events/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tallyepp/tally/controllers"
)

var _ = Describe("A pool the picker cannot serve from", func() {
	const interval = 300 * time.Millisecond
	llm := map[string]string{"app": "llm"}
	var (
		ns   string
		logs *logRecorder
		run  pickerRun
	)

	BeforeEach(func() {
		ns = newNamespace()
		logs = &logRecorder{}
	})
	start := func() {
		run = startPickerWith(ns, controllers.Options{ReportInterval: interval}, logs.logger())
	}
	count := func(subs ...string) func() int {
		return func() int { return len(logs.Matching(subs...)) }
	}
	// poolEvents returns the reasons and notes of the events/v1 Events
	// recorded on the pool, as "Type Reason: note".
	poolEvents := func() []string {
		var list eventsv1.EventList
		Expect(k8s.List(context.Background(), &list, client.InNamespace(ns))).To(Succeed())
		var out []string
		for _, e := range list.Items {
			if e.Regarding.Kind == "InferencePool" && e.Regarding.Name == poolName {
				out = append(out, e.Type+" "+e.Reason+": "+e.Note)
			}
		}
		return out
	}

	It("keeps the picker not ready while the pool does not exist, says so at the default verbosity at a bounded rate, and is ready once it is created", func() {
		start()
		missing := []string{"does not exist", `"pool"="` + ns + `/` + poolName + `"`, `"warning"=true`}
		// Read, and found missing: the set is the empty set, but the
		// picker must not be ready.
		Eventually(run.set.Synced).Should(BeTrue())
		Eventually(count(missing...)).Should(BeNumerically(">=", 1))
		Expect(run.status.Ready()).To(BeFalse())
		// Nothing changes in the cluster, yet it is said again.
		Eventually(count(missing...)).Should(BeNumerically(">=", 3))
		Expect(run.status.Ready()).To(BeFalse())

		// A burst of pod events wakes the reconcilers many times; the
		// line still comes at most once per interval (plus the one due
		// when the window opens).
		before, t0 := len(logs.Matching(missing...)), time.Now()
		for _, name := range []string{"a", "b", "c", "d", "e", "f", "g", "h"} {
			readyPod(ns, name, "10.0.0.1", llm)
		}
		Consistently(run.status.Ready, interval).Should(BeFalse())
		said, elapsed := len(logs.Matching(missing...))-before, time.Since(t0)
		Expect(said).To(BeNumerically("<=", int(elapsed/interval)+1), "lines said in %v", elapsed)

		createPool(ns, llm, 8000)
		Eventually(run.status.Ready).Should(BeTrue())
		Eventually(count("offers endpoints again", ns+"/"+poolName)).Should(Equal(1))
		Eventually(run.set.Addresses).ShouldNot(BeEmpty())
		// Found: the line stops.
		n := len(logs.Matching(missing...))
		Consistently(count(missing...), 3*interval).Should(Equal(n))
	})

	It("records a Warning Event on the pool, and logs, while its selector matches no pod, then no Ready pod", func() {
		createPool(ns, llm, 8000)
		start()
		Eventually(poolEvents).Should(ContainElement(And(
			HavePrefix("Warning NoPods: "), ContainSubstring("selects no pod"), ContainSubstring("app=llm"))))
		Eventually(count("selects no pod", ns+"/"+poolName, `"warning"=true`)).Should(BeNumerically(">=", 1))
		// The pool exists: the picker is ready; its answers say why they fail.
		Expect(run.status.Ready()).To(BeTrue())
		Expect(run.status.NoEndpointReason()).To(ContainSubstring("selects no pod"))

		createPod(ns, "a", llm)
		setPodStatus(ns, "a", "10.0.0.1", false)
		Eventually(poolEvents).Should(ContainElement(And(
			HavePrefix("Warning NoReadyPods: "), ContainSubstring("selects 1 pod(s), none of them Ready"))))
		Eventually(count("none of them Ready", `"readyPods"=0`)).Should(BeNumerically(">=", 1))

		setPodStatus(ns, "a", "10.0.0.1", true)
		Eventually(count("offers endpoints again")).Should(Equal(1))
		Expect(run.status.NoEndpointReason()).To(BeEmpty())
		Expect(run.status.Load()).To(And(
			HaveField("Pods", 1), HaveField("ReadyPods", 1), HaveField("Endpoints", 1)))
		// No new problem is reported once the pool has endpoints.
		n := len(poolEvents())
		Consistently(func() int { return len(poolEvents()) }, 3*interval).Should(Equal(n))
	})

	It("is read as not ready from the zero PoolStatus, before any reconcile", func() {
		var s controllers.PoolStatus
		Expect(s.Ready()).To(BeFalse())
		Expect(s.NoEndpointReason()).To(ContainSubstring("has not read"))
	})
})
