package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/picker/debugledger"
)

// disaggFirstPodIP keeps this pool's pods off the other specs' addresses.
var disaggFirstPodIP = netip.MustParseAddr("127.0.54.2")

// disaggNonCachedTokens is the fewest uncached tokens that split a request.
const disaggNonCachedTokens = 16

// disaggBlockSizeChars is the picker's prefix block, named so that a prompt
// of whole blocks is known to be cached whole once it has been served.
const disaggBlockSizeChars = 512

var disaggPickerConfig = fmt.Sprintf(`apiVersion: tally.tallyepp.io/v1alpha1
kind: PickerConfig
blockSizeChars: %d
disaggregation:
  nonCachedTokens: %d
`, disaggBlockSizeChars, disaggNonCachedTokens)

// disaggPromptChars is a long prompt (2048 tokens) of whole prefix blocks:
// far above the split threshold while fresh, wholly cached once served.
const disaggPromptChars = 4 * disaggBlockSizeChars * 4

// disaggPrompt is a prompt of disaggPromptChars whose first block is its
// own, so it shares no prefix with any other.
func disaggPrompt(what string) string {
	head := fmt.Sprintf("%s %08d: ", what, requestSeq.Add(1))
	const unit = "split the prefill from the decode "
	text := head + strings.Repeat(unit, disaggPromptChars/len(unit)+1)
	return text[:disaggPromptChars]
}

// expectWholeResponse checks a streamed completion's body: one event per
// token, the text the simulator generates for this prompt (as the plain pod
// at direct answers it), and the usage of the whole prompt.
func expectWholeResponse(ctx SpecContext, ds *stack.Stack, body []byte, direct, tag string, wantPrompt, maxTokens int) {
	GinkgoHelper()
	events := parseSSE(body)
	Expect(events).NotTo(BeEmpty())
	var text strings.Builder
	for _, e := range events[:len(events)-1] {
		Expect(e.Choices).To(HaveLen(1))
		text.WriteString(e.Choices[0].Text)
	}
	Expect(events[:len(events)-1]).To(HaveLen(maxTokens), "one event per generated token")
	last := events[len(events)-1]
	Expect(last.Usage).NotTo(BeNil(), "the last event before [DONE] carries usage")
	Expect(last.Usage.PromptTokens).To(Equal(wantPrompt))
	Expect(last.Usage.CompletionTokens).To(Equal(maxTokens))
	plain := stack.Completion(stack.DefaultModel, disaggPrompt(tag), maxTokens, false)
	status, answer := postVia(ctx, ds, direct, plain.Path, plain.Body, nextID(tag))
	Expect(status).To(Equal(http.StatusOK))
	var c completionResponse
	Expect(json.Unmarshal(answer, &c)).To(Succeed())
	Expect(text.String()).To(Equal(c.Choices[0].Text), "the streamed text is the simulator's text")
}

// podNamed is s's pod called name.
func podNamed(s *stack.Stack, name string) *stack.Pod {
	GinkgoHelper()
	for _, p := range s.Pods() {
		if p.Name == name {
			return p
		}
	}
	Fail("no pod " + name)
	return nil
}

// disaggStack starts the disaggregated pool the P/D specs run: prefill pods
// sim-0 and sim-1, decode pods sim-2 and sim-3 (each with the sidecar in
// front of its simulator), from firstPodIP, splitting at
// disaggNonCachedTokens.
func disaggStack(ctx SpecContext, namespace, pool string, firstPodIP netip.Addr) *stack.Stack {
	GinkgoHelper()
	s := startStack(ctx, stack.Options{
		Namespace:  namespace,
		PoolName:   pool,
		Pods:       4,
		Roles:      []string{stack.RolePrefill, stack.RolePrefill, stack.RoleDecode, stack.RoleDecode},
		FirstPodIP: firstPodIP,
		TimeScale:  10,
		PickerArgs: []string{"--config-text=" + disaggPickerConfig},
	})
	Expect(s.WaitForEndpoints(ctx, "sim-0", "sim-1", "sim-2", "sim-3")).To(Succeed())
	return s
}

var _ = Describe("Prefill/decode disaggregation", Ordered, ContinueOnFailure, func() {
	var ds *stack.Stack
	// The pool: prefill pods sim-0 and sim-1, decode pods sim-2 and sim-3
	// (each with the sidecar in front of its simulator).
	prefill := []string{"sim-0", "sim-1"}
	decode := []string{"sim-2", "sim-3"}

	BeforeAll(func(ctx SpecContext) {
		ds = disaggStack(ctx, "e2e-disagg", "disagg-pool", disaggFirstPodIP)
	}, NodeTimeout(2*time.Minute))

	pod := func(name string) *stack.Pod { return podNamed(ds, name) }

	It("prefills a long fresh prompt on a prefill pod and decodes it on a decode pod, the response whole", func(ctx SpecContext) {
		const maxTokens = 12
		prompt := disaggPrompt("pd-one")
		wantPrompt := disaggPromptChars / 4
		prefillTokensBefore := map[string]int64{}
		for _, name := range prefill {
			s, ok := pod(name).Stats()
			Expect(ok).To(BeTrue())
			prefillTokensBefore[name] = s.PrefillTokens
		}

		id := nextID("pd-one")
		req := stack.Completion(stack.DefaultModel, prompt, maxTokens, true)
		status, body := postVia(ctx, ds, ds.GatewayURL(), req.Path, req.Body, id)
		Expect(status).To(Equal(http.StatusOK), "body: %.300s", body)
		servedBy, prefilledBy := ds.ServedBy(id), ds.PrefilledBy(id)
		By(fmt.Sprintf("served by %s, prefilled by %s", servedBy, prefilledBy))
		Expect(decode).To(ContainElement(servedBy), "the request's destination is a decode pod")
		Expect(prefill).To(ContainElement(prefilledBy), "a prefill pod ran the prefill leg (the picker set %s)", "x-prefiller-host-port")

		// The prefill pod computed the whole prompt; the decode pod pulled
		// its KV blocks instead of computing them.
		s, _ := pod(prefilledBy).Stats()
		Expect(s.PrefillTokens-prefillTokensBefore[prefilledBy]).To(BeNumerically("==", wantPrompt), "tokens the prefill pod prefilled")
		d, _ := pod(servedBy).Stats()
		Expect(d.KVBlocksPulled).To(BeNumerically(">", 0), "KV blocks the decode pod pulled from the prefill pod")

		expectWholeResponse(ctx, ds, body, pod(prefill[0]).URL(), "pd-one-direct", wantPrompt, maxTokens)

		// Both parts of the split request are released: the prefill at the
		// decode pod's first bytes, the decode at the response's end.
		expectLedgerDrains(ctx, ds)
	}, SpecTimeout(time.Minute))

	It("spreads a held burst of 32 split requests evenly over the decode pods and their prefill legs over the prefill pods", func(ctx SpecContext) {
		// The pods hold each request where it arrives, before the decode
		// pod's sidecar sends the prefill leg: while held, every request
		// sits at its destination and none has reached a prefill pod. The
		// legs go once the hold is lifted (a prefill pod is not held then),
		// so a held split request never waits on its own prefill.
		reqs := make([]stack.Request, 32)
		for i := range reqs {
			reqs[i] = stack.Completion(stack.DefaultModel, disaggPrompt("pd-burst"), 4, true)
		}
		before := servedOn(ds)
		placed, ledger, results := heldBurstVia(ctx, ds, ds.GatewayURL(), reqs, "pd-burst")
		expectAllOK(results)
		legs := map[string]int{}
		for _, r := range results {
			Expect(decode).To(ContainElement(ds.ServedBy(r.ID)), "request %s's destination", r.ID)
			legs[ds.PrefilledBy(r.ID)]++
		}
		By(fmt.Sprintf("destinations %v, prefill legs %v", placed, legs))
		rows := map[string]debugledger.Endpoint{}
		for _, e := range ledger.Endpoints {
			rows[e.Pod] = e
		}
		for _, name := range prefill {
			Expect(placed[name]).To(BeZero(), "requests with prefill pod %s as destination; ledger %+v", name, ledger.Endpoints)
			Expect(legs[name]).To(BeNumerically("~", 16, 1), "prefill legs %v; ledger while held %+v", legs, ledger.Endpoints)
			// The picker's ledger, while all were held, had the prefill
			// part of each on the prefill pod that then ran its leg.
			Expect(rows[name].InFlight).To(Equal(legs[name]), "%s's row while held: %+v; prefill legs %v", name, rows[name], legs)
		}
		for _, name := range decode {
			Expect(placed[name]).To(BeNumerically("~", 16, 1), "destinations %v; ledger %+v", placed, ledger.Endpoints)
			Expect(rows[name].InFlight).To(Equal(placed[name]), "%s's row while held: %+v", name, rows[name])
		}
		Expect(legs).NotTo(HaveKey(""), "every request of the burst was split: prefill legs %v", legs)
		// Each prefill pod received its legs and nothing else.
		after := delta(before, servedOn(ds))
		for _, name := range prefill {
			Expect(after[name]).To(Equal(legs[name]), "requests that reached %s: %v", name, after)
		}
		expectLedgerDrains(ctx, ds)
	}, SpecTimeout(2*time.Minute))

	It("does not split a short prompt, nor one the decode pod has cached", func(ctx SpecContext) {
		short := stack.Completion(stack.DefaultModel, "hello, short prompt", 4, true) // 4 tokens
		r := stack.Send(ctx, ds.HTTPClient(), ds.GatewayURL(), nextID("pd-short"), short)
		Expect(r.Err).NotTo(HaveOccurred())
		Expect(decode).To(ContainElement(ds.ServedBy(r.ID)))
		Expect(ds.PrefilledBy(r.ID)).To(BeEmpty(), "a prompt of %d tokens, below %d, has no prefill leg", short.PromptTokens, disaggNonCachedTokens)

		// The same long prompt twice: split the first time; the second
		// goes where its prefix now is, whole, and is not split.
		prompt := disaggPrompt("pd-cached")
		first := stack.Send(ctx, ds.HTTPClient(), ds.GatewayURL(), nextID("pd-cached"), stack.Completion(stack.DefaultModel, prompt, 4, true))
		Expect(first.Err).NotTo(HaveOccurred())
		Expect(prefill).To(ContainElement(ds.PrefilledBy(first.ID)), "the fresh prompt is split")
		expectLedgerDrains(ctx, ds)
		again := stack.Send(ctx, ds.HTTPClient(), ds.GatewayURL(), nextID("pd-cached"), stack.Completion(stack.DefaultModel, prompt, 4, true))
		Expect(again.Err).NotTo(HaveOccurred())
		By(fmt.Sprintf("short: served by %s; long: served by %s, prefilled by %s; again: served by %s, prefilled by %q, %d of %d tokens cached",
			ds.ServedBy(r.ID), ds.ServedBy(first.ID), ds.PrefilledBy(first.ID), ds.ServedBy(again.ID), ds.PrefilledBy(again.ID), again.CachedTokens, again.PromptTokens))
		Expect(ds.ServedBy(again.ID)).To(Equal(ds.ServedBy(first.ID)), "the repeated prompt goes to the decode pod that holds its prefix")
		Expect(ds.PrefilledBy(again.ID)).To(BeEmpty(), "the repeated prompt, cached on its decode pod (%d of %d tokens reported cached), has no prefill leg", again.CachedTokens, again.PromptTokens)
		expectLedgerDrains(ctx, ds)
	}, SpecTimeout(time.Minute))

	It("serves every request on the decode pods when no prefill pod is Ready", func(ctx SpecContext) {
		for _, name := range prefill {
			Expect(ds.SetReady(ctx, pod(name), false)).To(Succeed())
		}
		DeferCleanup(func(ctx SpecContext) {
			for _, name := range prefill {
				Expect(ds.SetReady(ctx, pod(name), true)).To(Succeed())
			}
			Expect(ds.WaitForEndpoints(ctx, append(prefill, decode...)...)).To(Succeed())
		})
		Expect(ds.WaitForEndpoints(ctx, decode...)).To(Succeed())

		reqs := make([]stack.Request, 8)
		for i := range reqs {
			reqs[i] = stack.Completion(stack.DefaultModel, disaggPrompt("pd-alone"), 4, true)
		}
		before := servedOn(ds)
		results := sendAllVia(ctx, ds, reqs, "pd-alone")
		for _, r := range results {
			Expect(r.Err).NotTo(HaveOccurred(), "a long fresh prompt with no prefill pod Ready")
			Expect(r.Status).To(Equal(http.StatusOK))
			Expect(decode).To(ContainElement(ds.ServedBy(r.ID)), "request %s's destination", r.ID)
			Expect(ds.PrefilledBy(r.ID)).To(BeEmpty(), "request %s prefilled on its decode pod", r.ID)
			Expect(r.PromptTokens).To(Equal(disaggPromptChars / 4))
		}
		after := delta(before, servedOn(ds))
		By(fmt.Sprintf("requests per pod %v", after))
		for _, name := range prefill {
			Expect(after[name]).To(BeZero(), "requests that reached NotReady prefill pod %s: %v", name, after)
		}
		expectLedgerDrains(ctx, ds)
	}, SpecTimeout(time.Minute))
})
