package e2e

import (
	"fmt"
	"net/http"
	"net/netip"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/tallyepp/tally/internal/ngfshim/nginx"
	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/picker/protocol"
)

// disaggNGINXFirstPodIP keeps this pool's pods off the other specs' addresses.
var disaggNGINXFirstPodIP = netip.MustParseAddr("127.0.55.2")

const (
	// sweeperTick is how often the picker's sweeper runs at the default
	// --max-request-lifetime (a tenth of it, at most 10 s): an idle
	// picker applies its model's end of a split detached reservation then.
	sweeperTick = 10 * time.Second
	// engineScrapeMargin covers a few of the picker's engine scrapes
	// (250 ms apart) and the polls that read them.
	engineScrapeMargin = time.Second
)

// engineWork is what a pod's engine has computed: prompt tokens prefilled
// there, and KV blocks its decode legs pulled from a prefill pod.
type engineWork struct{ prefilled, pulled int64 }

// The disaggregated pool of disagg_test.go behind NGINX as NGINX Gateway
// Fabric drives it. NGF's shim reads one header of the picker's answer, the
// destination, and NGINX proxies the client's own headers: an
// x-prefiller-host-port in the answer would never reach the decode pod's
// sidecar, which would serve the request as a plain one, its vLLM
// prefilling the prompt itself. The picker knows such a gateway (it sends
// no pseudo-headers) and does not split its requests: it reserves their
// prefill on the decode pod that does it. These specs check that: every
// response whole, no prefill pod reached or named, and the picker's
// reservations, detached at the pick, ended by its model.
var _ = Describe("Prefill/decode disaggregation through NGINX as NGINX Gateway Fabric drives it", Ordered, ContinueOnFailure, func() {
	var ds *stack.Stack
	var gw *stack.NGINX
	prefill := []string{"sim-0", "sim-1"}
	decode := []string{"sim-2", "sim-3"}

	BeforeAll(func(ctx SpecContext) {
		if _, _, err := nginx.Find(); err != nil {
			if nginx.Optional() {
				Skip(fmt.Sprintf("NGINX is not installed, and $%s=1 allows skipping: %v", nginx.OptionalEnv, err))
			}
			Fail(fmt.Sprintf("these specs need NGINX and its NJS module: run hack/nginx.sh (`make test` does), or set $%s=1 to skip them: %v", nginx.OptionalEnv, err))
		}
		ds = disaggStack(ctx, "e2e-disagg-nginx", "disagg-nginx-pool", disaggNGINXFirstPodIP)
		var err error
		gw, err = ds.StartNGINX(ctx, stack.NGINXOptions{})
		Expect(err).NotTo(HaveOccurred())
	}, NodeTimeout(2*time.Minute))

	pod := func(name string) *stack.Pod { return podNamed(ds, name) }
	// stats is what each pod's engine has computed so far.
	stats := func() map[string]engineWork {
		GinkgoHelper()
		out := map[string]engineWork{}
		for _, p := range ds.Pods() {
			s, ok := p.Stats()
			Expect(ok).To(BeTrue(), "pod %s has a simulator", p.Name)
			out[p.Name] = engineWork{prefilled: s.PrefillTokens, pulled: s.KVBlocksPulled}
		}
		return out
	}
	// legs is how many split requests the picker placed with each prefill
	// pod as their prefill pod, and detachedEnds why its detached
	// reservations ended, so far.
	// gatewayDecisions is how many picks the picker left unsplit because
	// the gateway takes only the destination.
	gatewayDecisions := func(ctx SpecContext) float64 {
		GinkgoHelper()
		m, err := ds.PickerMetrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		v, _ := m.Value("tally_split_decisions_total", "decision", "gateway")
		return v
	}
	legs := func(ctx SpecContext) map[string]int {
		GinkgoHelper()
		m, err := ds.PickerMetrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		out := map[string]int{}
		for _, name := range prefill {
			v, _ := m.Value("tally_prefill_legs_total", "endpoint", pod(name).Addr.String())
			out[name] = int(v)
		}
		return out
	}
	detachedEnds := func(ctx SpecContext) map[string]float64 {
		GinkgoHelper()
		m, err := ds.PickerMetrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		out := map[string]float64{}
		for _, reason := range []string{"model", "engine", "swept"} {
			out[reason], _ = m.Value("tally_detached_reservation_ends_total", "reason", reason)
		}
		return out
	}
	// expectDrainedByTheModel waits until the ledger holds nothing on any
	// pod, neither in flight nor prefill, within the detach model's time,
	// and checks that the sweeper (the backstop for a reservation nothing
	// else would end) ended none of the detached reservations since
	// before. prefilled is how many requests the picker's model prefills
	// on each pod, each of promptTokens and maxTokens.
	//
	// The model's time: a pod drains its prefills one after another at
	// its prefill rate (the starting rate: no first byte reaches the
	// picker to teach it), then each request decodes maxTokens at the
	// pool's decode speed. /debug/ledger works out the prefill parts' end
	// as it is read, but a split request's decode part ends only when the
	// picker next drains its rows: at a pick, or at the sweeper's tick when
	// none comes. So the ledger is idle at most a tick after the model's
	// end, plus a scrape of each engine (expectLedgerDrains).
	expectDrainedByTheModel := func(ctx SpecContext, before map[string]float64, prefilled map[string]int, promptTokens, maxTokens int) {
		GinkgoHelper()
		m, err := ds.PickerMetrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		var prefillSeconds float64
		for name, n := range prefilled {
			rate, ok := m.Value("tally_endpoint_prefill_tokens_per_second", "endpoint", pod(name).Addr.String())
			Expect(ok).To(BeTrue(), "%s's prefill rate is not published", name)
			prefillSeconds = max(prefillSeconds, float64(n*promptTokens)/rate)
		}
		perToken, ok := m.Value("tally_decode_seconds_per_token")
		Expect(ok).To(BeTrue(), "tally_decode_seconds_per_token is not published")
		modelled := time.Duration((prefillSeconds + float64(maxTokens)*perToken) * float64(time.Second))
		start := time.Now()
		expectLedgerDrainsWithin(ctx, ds, modelled+sweeperTick+engineScrapeMargin)
		took := time.Since(start)
		l, err := ds.Ledger(ctx)
		Expect(err).NotTo(HaveOccurred())
		for _, e := range l.Endpoints {
			Expect(e.InFlight).To(BeZero(), "%s's row: %+v", e.Pod, e)
			Expect(e.PrefillTokens).To(BeZero(), "%s's row: %+v", e.Pod, e)
			Expect(e.PrefillLegs).To(BeZero(), "%s's row: %+v", e.Pod, e)
		}
		after := detachedEnds(ctx)
		Expect(after["swept"]).To(Equal(before["swept"]), "detached reservations the sweeper ended: before %v, after %v", before, after)
		By(fmt.Sprintf("ledger idle %v after the responses (the model's time %v); detached reservations ended by the model %.0f, by engine scrapes %.0f",
			took.Round(10*time.Millisecond), modelled.Round(10*time.Millisecond), after["model"]-before["model"], after["engine"]-before["engine"]))
	}

	It("serves a long fresh prompt on a decode pod, which prefills it itself: NGINX could not carry a prefill pod, and the picker names none", func(ctx SpecContext) {
		const maxTokens = 12
		wantPrompt := disaggPromptChars / 4
		endsBefore, legsBefore, statsBefore, servedBefore := detachedEnds(ctx), legs(ctx), stats(), servedOn(ds)
		gatewayBefore := gatewayDecisions(ctx)

		id := nextID("ngf-pd-one")
		req := stack.Completion(stack.DefaultModel, disaggPrompt("ngf-pd-one"), maxTokens, true)
		status, body := postVia(ctx, ds, gw.URL(), req.Path, req.Body, id)
		Expect(status).To(Equal(http.StatusOK), "body: %.300s", body)
		servedBy := ds.ServedBy(id)
		By(fmt.Sprintf("served by %s, prefilled by %q", servedBy, ds.PrefilledBy(id)))
		Expect(decode).To(ContainElement(servedBy), "the request's destination is a decode pod")

		// The picker did not split it, for the gateway's sake: no prefill
		// pod was named, no prefill leg reached one, and the decode pod
		// computed the whole prompt.
		named := delta(legsBefore, legs(ctx))
		Expect(total(named)).To(BeZero(), "prefill pods the picker named %v", named)
		Expect(gatewayDecisions(ctx)-gatewayBefore).To(Equal(1.0), "picks left unsplit for the gateway")
		Expect(ds.PrefilledBy(id)).To(BeEmpty(), "a prefill pod ran a leg of %s", id)
		statsAfter, served := stats(), delta(servedBefore, servedOn(ds))
		for _, name := range prefill {
			Expect(served[name]).To(BeZero(), "requests that reached %s: %v", name, served)
			Expect(statsAfter[name].prefilled-statsBefore[name].prefilled).To(BeZero(), "tokens %s prefilled", name)
		}
		Expect(statsAfter[servedBy].prefilled-statsBefore[servedBy].prefilled).To(BeNumerically("==", wantPrompt), "tokens the decode pod prefilled")
		Expect(statsAfter[servedBy].pulled-statsBefore[servedBy].pulled).To(BeZero(), "KV blocks the decode pod pulled")

		expectWholeResponse(ctx, ds, body, pod(prefill[0]).URL(), "ngf-pd-one-direct", wantPrompt, maxTokens)

		expectDrainedByTheModel(ctx, endsBefore, map[string]int{servedBy: 1}, wantPrompt, maxTokens)
	}, SpecTimeout(time.Minute))

	It("spreads a held burst of 32 long requests evenly over the decode pods, none split", func(ctx SpecContext) {
		reqs := make([]stack.Request, 32)
		for i := range reqs {
			reqs[i] = stack.Completion(stack.DefaultModel, disaggPrompt("ngf-pd-burst"), 4, true)
		}
		endsBefore, legsBefore, statsBefore := detachedEnds(ctx), legs(ctx), stats()
		gatewayBefore := gatewayDecisions(ctx)
		placed, ledger, results := heldBurstVia(ctx, ds, gw.URL(), reqs, "ngf-pd-burst")
		expectAllOK(results)
		named := delta(legsBefore, legs(ctx))
		statsAfter := stats()
		By(fmt.Sprintf("destinations %v, prefill pods named %v", placed, named))
		for _, r := range results {
			Expect(decode).To(ContainElement(ds.ServedBy(r.ID)), "request %s's destination", r.ID)
			Expect(ds.PrefilledBy(r.ID)).To(BeEmpty(), "a prefill pod ran a leg of %s", r.ID)
			Expect(r.PromptTokens).To(Equal(disaggPromptChars / 4))
		}
		for _, name := range decode {
			Expect(placed[name]).To(BeNumerically("~", 16, 1), "destinations %v; ledger %+v", placed, ledger.Endpoints)
			// Each decode pod prefilled each of its requests whole: the
			// prompts share no first block, so none is cached.
			Expect(statsAfter[name].prefilled-statsBefore[name].prefilled).To(BeNumerically("==", placed[name]*disaggPromptChars/4), "tokens %s prefilled", name)
		}
		for _, name := range prefill {
			Expect(placed[name]).To(BeZero(), "requests that reached prefill pod %s: %v", name, placed)
			Expect(statsAfter[name].prefilled-statsBefore[name].prefilled).To(BeZero(), "tokens %s prefilled", name)
		}
		Expect(total(named)).To(BeZero(), "prefill pods the picker named %v", named)
		Expect(gatewayDecisions(ctx)-gatewayBefore).To(Equal(float64(len(reqs))), "picks left unsplit for the gateway")
		expectDrainedByTheModel(ctx, endsBefore, map[string]int{decode[0]: placed[decode[0]], decode[1]: placed[decode[1]]}, disaggPromptChars/4, 4)
	}, SpecTimeout(2*time.Minute))

	It("passes a client's own x-prefiller-host-port on to the decode pod's sidecar: NGINX applies none of the picker's header mutations", func(ctx SpecContext) {
		// Through Envoy the picker removes or overwrites the header; NGF
		// applies no header mutation, so the client's copy reaches the
		// sidecar, which sends the prefill leg where the client said.
		endsBefore := detachedEnds(ctx)
		named := pod(prefill[1])
		req := stack.Completion(stack.DefaultModel, disaggPrompt("ngf-pd-client"), 4, true)
		req.Headers = map[string]string{protocol.PrefillerHeader: named.Addr.String()}
		r := stack.Send(ctx, ds.HTTPClient(), gw.URL(), nextID("ngf-pd-client"), req)
		Expect(r.Err).NotTo(HaveOccurred())
		Expect(r.Status).To(Equal(http.StatusOK))
		Expect(decode).To(ContainElement(ds.ServedBy(r.ID)), "the request's destination")
		Expect(ds.PrefilledBy(r.ID)).To(Equal(named.Name), "the prefill pod the client named ran the prefill leg")
		// The picker's model prefills it on its destination.
		expectDrainedByTheModel(ctx, endsBefore, map[string]int{ds.ServedBy(r.ID): 1}, disaggPromptChars/4, 4)
	}, SpecTimeout(time.Minute))
})
