package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/internal/stack"
)

// loraFirstPodIP keeps this pool's pods off the other specs' addresses.
var loraFirstPodIP = netip.MustParseAddr("127.0.49.2")

// adapterRequest is a short streamed completion for model (an adapter or
// the base model).
func adapterRequest(model, what string, maxTokens int) stack.Request {
	return stack.Completion(model, fmt.Sprintf("%s %s please answer briefly.", what, nextID(what)), maxTokens, true)
}

// sendAllVia sends reqs concurrently through s's gateway.
func sendAllVia(ctx context.Context, s *stack.Stack, reqs []stack.Request, what string) []stack.Result {
	results := make([]stack.Result, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Go(func() { results[i] = stack.Send(ctx, s.HTTPClient(), s.GatewayURL(), nextID(what), r) })
	}
	wg.Wait()
	return results
}

// busyWith keeps a long request for model running on pod p, sent to the pod
// directly (past the picker, as traffic that bypasses it would), until the
// returned stop is called.
func busyWith(s *stack.Stack, p *stack.Pod, model string) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		stack.Send(ctx, s.HTTPClient(), p.URL(), nextID("busy"), adapterRequest(model, "busy", 100_000))
	})
	return func() { cancel(); wg.Wait() }
}

var _ = Describe("LoRA adapters", Ordered, func() {
	var ls *stack.Stack

	BeforeAll(func(ctx SpecContext) {
		ls = startStack(ctx, stack.Options{
			Namespace:    "e2e-lora",
			FirstPodIP:   loraFirstPodIP,
			Pods:         3,
			LoRAAdapters: []string{"sql", "chat", "tools"},
			MaxLoRAs:     1,
			LoRALoadTime: 2 * time.Second,
			// Scrape often, so the engines' adapters reach the picker soon.
			PickerArgs: []string{"--refresh-metrics-interval=50ms"},
		})
	})

	// served is how many completions each pod of ls has received.
	served := func() map[string]int { return servedOn(ls) }

	It("sends an adapter's requests where it is loaded, and keeps them off a pod whose one slot holds another", func(ctx SpecContext) {
		pods := ls.Pods()
		stopSQL := busyWith(ls, pods[0], "sql")
		defer stopSQL()
		stopChat := busyWith(ls, pods[1], "chat")
		defer stopChat()
		// The picker has seen each engine's adapter (a request counts as
		// waiting until its first token, as in vLLM).
		eventually(ctx, func(g Gomega) {
			l, err := ls.Ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			want := map[string]string{pods[0].Name: "sql", pods[1].Name: "chat"}
			for _, e := range l.Endpoints {
				g.Expect(e.Engine).NotTo(BeNil())
				if a := want[e.Pod]; a != "" {
					g.Expect(e.Engine.RunningAdapters).To(ConsistOf(a), "%s", e.Pod)
				}
			}
		}).WithTimeout(30 * time.Second).Should(Succeed())

		// sql is loaded on pod 0 alone: a load elsewhere costs 2 s, more
		// than queueing these there.
		before := served()
		results := sendAllVia(ctx, ls, []stack.Request{adapterRequest("sql", "q1", 4), adapterRequest("sql", "q2", 4),
			adapterRequest("sql", "q3", 4), adapterRequest("sql", "q4", 4)}, "sql")
		expectAllOK(results)
		got := delta(before, served())
		Expect(got[pods[0].Name]).To(Equal(4), "sql requests: %v", got)

		// tools is loaded nowhere; pod 1's one slot holds chat, so it is
		// no candidate for tools while another pod has room.
		before = served()
		results = sendAllVia(ctx, ls, []stack.Request{adapterRequest("tools", "t1", 4), adapterRequest("tools", "t2", 4),
			adapterRequest("tools", "t3", 4)}, "tools")
		expectAllOK(results)
		got = delta(before, served())
		Expect(got[pods[1].Name]).To(BeZero(), "tools requests on the pod whose one slot holds chat: %v", got)
		Expect(total(got)).To(Equal(3))
	})

	It("routes base-model requests on load alone, wherever adapters run", func(ctx SpecContext) {
		before := served()
		var reqs []stack.Request
		for i := range 9 {
			reqs = append(reqs, adapterRequest(ls.Options().Model, fmt.Sprint("base", i), 4))
		}
		results := sendAllVia(ctx, ls, reqs, "base")
		expectAllOK(results)
		Expect(total(delta(before, served()))).To(Equal(9))
		for _, r := range results {
			Expect(r.Status).To(Equal(http.StatusOK))
		}
		expectLedgerDrains(ctx, ls)
	})

	It("sends a rewritten model on as its target and answers with the model asked for", func(ctx SpecContext) {
		// The simulators serve no model "assistant": a request for it
		// succeeds only if the body sent on names the adapter.
		Expect(ls.Client().Create(ctx, &v1alpha2.InferenceModelRewrite{
			ObjectMeta: metav1.ObjectMeta{Name: "assistant", Namespace: ls.Options().Namespace},
			Spec: v1alpha2.InferenceModelRewriteSpec{
				PoolRef: &v1alpha2.PoolObjectReference{Name: v1alpha2.ObjectName(ls.Options().PoolName)},
				Rules: []v1alpha2.InferenceModelRewriteRule{{
					Matches: []v1alpha2.Match{{Model: &v1alpha2.ModelMatch{Value: "assistant"}}},
					Targets: []v1alpha2.TargetModel{{ModelRewrite: "sql"}},
				}},
			},
		})).To(Succeed())
		for _, streamed := range []bool{false, true} {
			var body []byte
			// Until the picker has the rewrite, the simulator answers 404.
			eventually(ctx, func(g Gomega) {
				r := stack.Completion("assistant", "Rewritten, please answer briefly "+nextID("assistant"), 4, streamed)
				var status int
				status, body = postVia(ctx, ls, ls.GatewayURL(), r.Path, r.Body, nextID("assistant"))
				g.Expect(status).To(Equal(http.StatusOK), "body: %.300s", body)
			}).WithTimeout(30 * time.Second).Should(Succeed())
			var models []string
			if streamed {
				for _, e := range parseSSE(body) {
					models = append(models, e.Model)
				}
			} else {
				var r completionResponse
				Expect(json.Unmarshal(body, &r)).To(Succeed())
				models = append(models, r.Model)
			}
			Expect(models).NotTo(BeEmpty())
			Expect(models).To(HaveEach("assistant"), "streamed %v: the model field of every answer; body %.300s", streamed, body)
		}
		// The picker marks the rewrite it applies Accepted.
		eventually(ctx, func(g Gomega) {
			var rw v1alpha2.InferenceModelRewrite
			g.Expect(ls.Client().Get(ctx, client.ObjectKey{Namespace: ls.Options().Namespace, Name: "assistant"}, &rw)).To(Succeed())
			g.Expect(rw.Status.Conditions).To(ContainElement(And(HaveField("Type", "Accepted"), HaveField("Status", metav1.ConditionTrue),
				HaveField("Reason", "Accepted"), HaveField("ObservedGeneration", rw.Generation))))
		}).WithTimeout(10 * time.Second).Should(Succeed())
		expectLedgerDrains(ctx, ls)
	})
})

// loraBurstFirstPodIP keeps the burst's pool off the other specs' addresses.
var loraBurstFirstPodIP = netip.MustParseAddr("127.0.51.2")

var _ = Describe("A burst for a LoRA adapter no pod has loaded", func() {
	It("lands on as few pods as keep each within twice the even share", func(ctx SpecContext) {
		const pods, requests = 4, 128
		bs := startStack(ctx, stack.Options{
			Namespace:    "e2e-lora-burst",
			FirstPodIP:   loraBurstFirstPodIP,
			Pods:         pods,
			TimeScale:    10,
			LoRAAdapters: []string{"fresh", "other"},
			MaxLoRAs:     2,
			PickerArgs:   []string{"--refresh-metrics-interval=50ms"},
		})
		// An engine publishes its adapters once it has run a request (as
		// vLLM): one base-model request to each pod, then the picker has
		// seen every engine's slots.
		for _, p := range bs.Pods() {
			r := adapterRequest(bs.Options().Model, "warm", 4)
			Expect(stack.Send(ctx, bs.HTTPClient(), p.URL(), nextID("warm"), r).Status).To(Equal(http.StatusOK))
		}
		eventually(ctx, func(g Gomega) {
			l, err := bs.Ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(l.Endpoints).To(HaveLen(pods))
			for _, e := range l.Endpoints {
				g.Expect(e.Engine).NotTo(BeNil(), "%s not scraped", e.Pod)
				g.Expect(e.Engine.MaxLoRAs).To(Equal(2), "%s", e.Pod)
			}
		}).WithTimeout(30 * time.Second).Should(Succeed())

		// 128 requests of 8,192 tokens sharing no prefix, all at once: the
		// even share is 32 requests a pod, and twice that is 64, so two
		// pods take them all, 64 each. The burst is held (heldBurstVia):
		// sent from goroutines as they start, on a loaded machine it
		// arrived over a time in which the pods served its first requests,
		// and the picker rightly weighed what each had left (62 / 66 with
		// two busy cores, 68 / 60 once in a CI run). The picker's model
		// drains the two pods alike while the picks go on: a request or
		// two may go either way.
		burst := stack.Burst{Requests: requests, UserTokens: 8192, MaxTokens: 8, Model: "fresh", Seed: 51}.Workload()
		got, _, results := heldBurstVia(ctx, bs, bs.GatewayURL(), burst, "fresh")
		AddReportEntry("burst per pod", got)
		expectAllOK(results)
		Expect(total(got)).To(Equal(requests))
		used := 0
		for _, n := range got {
			if n > 0 {
				used++
			}
			Expect(n).To(Or(BeZero(), BeNumerically("~", 2*requests/pods, 2)), "burst per pod: %v", got)
		}
		Expect(used).To(Equal(2), "burst per pod: %v", got)
		var loads int64
		for _, p := range bs.Pods() {
			st, ok := p.Stats()
			Expect(ok).To(BeTrue())
			loads += st.AdapterLoads
		}
		Expect(loads).To(BeEquivalentTo(2), "adapter loads over the pool")
		expectLedgerDrains(ctx, bs)
	})
})
