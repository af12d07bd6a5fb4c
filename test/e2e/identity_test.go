package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/picker/debugledger"
)

// identityFirstPodIP keeps this pool's pods off the routing specs' addresses.
var identityFirstPodIP = netip.MustParseAddr("127.0.43.2")

// Held requests never reach an engine, so nothing ever tells the picker
// their prefill is done; a starting prefill rate of 100 tokens/s keeps the
// picker's drain model (which would otherwise release 10,000 tokens/s per
// endpoint from the ledger) from moving their cost during a spec's few
// seconds. These specs measure whose load the ledger remembers, not the drain.
const identityPickerConfig = `apiVersion: tally.tallyepp.io/v1alpha1
kind: PickerConfig
prefillTokensPerSecond: 100
`

// longPromptTokens is long enough that one request's prefill outweighs any
// decode weight: where requests go is decided by the prefill reserved.
const longPromptTokens = 32_000

// longRequest is a streaming request of longPromptTokens tokens whose first
// block is its own, so it matches no other prompt; every one has the same
// length, so equal counts are equal costs.
func longRequest(what string) stack.Request {
	head := fmt.Sprintf("%s %08d: ", what, requestSeq.Add(1))
	const unit = "tell me about routing "
	text := head + strings.Repeat(unit, longPromptTokens*4/len(unit)+1)
	return stack.Completion(stack.DefaultModel, text[:longPromptTokens*4], 16, true)
}

func longRequests(n int, what string) []stack.Request {
	reqs := make([]stack.Request, n)
	for i := range reqs {
		reqs[i] = longRequest(what)
	}
	return reqs
}

// holding keeps every request sent through a stack at its pod, burst after
// burst, so a spec can read where all of them went while all are in
// flight. stop cancels them all, as clients going away would.
type holding struct {
	st      *stack.Stack
	release func()
	ctx     context.Context
	cancel  context.CancelFunc
	base    map[string]int // requests each pod had received when holding began
	sent    int
	ended   chan stack.Result
	wg      sync.WaitGroup
}

func hold(s *stack.Stack) *holding {
	ctx, cancel := context.WithCancel(context.Background())
	h := &holding{st: s, ctx: ctx, cancel: cancel, base: servedOn(s), ended: make(chan stack.Result, 1024)}
	h.release = s.Hold()
	return h
}

// send sends reqs and waits until every request sent so far has reached a
// pod; it returns where these went.
func (h *holding) send(ctx context.Context, reqs []stack.Request, what string) map[string]int {
	GinkgoHelper()
	before := servedOn(h.st)
	h.sent += len(reqs)
	for _, r := range reqs {
		h.wg.Go(func() {
			h.ended <- stack.Send(h.ctx, h.st.HTTPClient(), h.st.GatewayURL(), nextID(what), r)
		})
	}
	eventually(ctx, func() int {
		// While held, a request only ends by failing: stop at once.
		select {
		case r := <-h.ended:
			StopTrying(fmt.Sprintf("request %s ended while the pods held every request: status %d, %v", r.ID, r.Status, r.Err)).Now()
		default:
		}
		return total(delta(h.base, servedOn(h.st)))
	}).WithTimeout(30*time.Second).Should(Equal(h.sent), "requests that reached a pod")
	return delta(before, servedOn(h.st))
}

// stop cancels every held request, waits until each has ended at its
// client and at its pod, and lifts the hold: no request reaches an engine
// (whose prefill timing would then teach the picker a rate the specs'
// frozen drain model must not have).
func (h *holding) stop() {
	GinkgoHelper()
	h.cancel()
	h.wg.Wait()
	Eventually(h.st.Held).WithTimeout(30*time.Second).WithPolling(10*time.Millisecond).Should(BeZero(), "requests the pods still hold")
	h.release()
}

// servedOn snapshots how many completion requests each pod of s has received.
func servedOn(s *stack.Stack) map[string]int {
	out := map[string]int{}
	for _, p := range s.Pods() {
		out[p.Name] = p.Served()
	}
	return out
}

func sum(a, b map[string]int) map[string]int {
	out := map[string]int{}
	for k, v := range a {
		out[k] += v
	}
	for k, v := range b {
		out[k] += v
	}
	return out
}

// rowsAt returns the ledger's current rows for one endpoint address.
func rowsAt(l debugledger.Ledger, addr netip.AddrPort) []debugledger.Endpoint {
	var rows []debugledger.Endpoint
	for _, e := range l.Endpoints {
		if e.Endpoint == addr.String() {
			rows = append(rows, e)
		}
	}
	return rows
}

// expectLedgerDrains waits until s's ledger holds nothing and the picker's
// last scrape of each engine saw it idle. A held request cancelled as the
// hold lifts may still reach its engine and run there for a moment after
// the picker released it: until a scrape sees it gone, the picker counts it
// as foreign load, and the next spec's placement with it. A scrape from
// before the ledger drained shows no foreign load (it is counted against
// the ledger of its time), so only an idle engine at the last scrape
// says that none is coming.
func expectLedgerDrains(ctx context.Context, s *stack.Stack) {
	GinkgoHelper()
	expectLedgerDrainsWithin(ctx, s, 15*time.Second)
}

// expectLedgerDrainsWithin is expectLedgerDrains with a bound of the
// spec's own, for ledgers whose drain a model times (detached
// reservations).
func expectLedgerDrainsWithin(ctx context.Context, s *stack.Stack, timeout time.Duration) {
	GinkgoHelper()
	eventually(ctx, func(g Gomega) {
		l, err := s.Ledger(ctx)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(l.Idle()).To(BeTrue(), "ledger %+v", l)
		for _, e := range l.Endpoints {
			if e.Engine != nil {
				g.Expect(e.Engine.ForeignRequests).To(BeZero(), "%s's engine at the last scrape: %+v", e.Pod, *e.Engine)
				g.Expect(e.Engine.Running+e.Engine.Waiting).To(BeZero(), "%s's engine at the last scrape: %+v", e.Pod, *e.Engine)
			}
		}
	}).WithTimeout(timeout).Should(Succeed())
}

var _ = Describe("An endpoint's identity in the ledger", Ordered, ContinueOnFailure, func() {
	var ids *stack.Stack
	var pods []string

	BeforeAll(func(ctx SpecContext) {
		ids = startStack(ctx, stack.Options{
			Namespace:  "e2e-identity",
			PoolName:   "identity-pool",
			Pods:       3,
			FirstPodIP: identityFirstPodIP,
			TimeScale:  10,
			PickerArgs: []string{"--config-text=" + identityPickerConfig},
		})
		pods = ids.PodNames()
	}, NodeTimeout(2*time.Minute))

	It("a readiness flap under load keeps the pod's load", func(ctx SpecContext) {
		h := hold(ids)
		DeferCleanup(func(ctx SpecContext) {
			h.stop()
			expectLedgerDrains(ctx, ids)
		})
		first := h.send(ctx, longRequests(30, "flap"), "flap")
		Expect(first).To(Equal(map[string]int{pods[0]: 10, pods[1]: 10, pods[2]: 10}), "30 equal requests over 3 idle pods")

		// Pod 0 turns NotReady with its 10 requests still running, and is
		// Ready again 1.5 s later: a readiness probe that timed out once.
		pod0 := ids.Pods()[0]
		flapped := time.Now()
		Expect(ids.SetReady(ctx, pod0, false)).To(Succeed())
		Expect(ids.WaitForEndpoints(ctx, pods[1], pods[2])).To(Succeed())
		whileOut, err := ids.Ledger(ctx)
		Expect(err).NotTo(HaveOccurred())
		time.Sleep(time.Until(flapped.Add(1500 * time.Millisecond))) // the flap's length, not an assertion
		Expect(ids.SetReady(ctx, pod0, true)).To(Succeed())
		Expect(ids.WaitForEndpoints(ctx, pods...)).To(Succeed())

		second := h.send(ctx, longRequests(30, "flap"), "flap")
		totals := sum(first, second)
		ledger, err := ids.Ledger(ctx)
		Expect(err).NotTo(HaveOccurred())
		AddReportEntry("flap placement", fmt.Sprintf("first burst %v, second burst %v, in flight per pod %v, ledger %+v", first, second, totals, ledger.Endpoints))
		// A picker that forgot pod 0's 10 requests would see it idle and
		// send it about 17 of the 30: 27/17/16.
		for _, name := range pods {
			Expect(totals[name]).To(BeNumerically("~", 20, 1), "requests in flight per pod after the flap: %v (second burst %v)", totals, second)
		}
		for _, e := range ledger.Endpoints {
			Expect(e.InFlight).To(Equal(totals[e.Pod]), "the ledger counts every request in flight on %s: %+v", e.Pod, ledger.Endpoints)
		}
		row, current, ok := whileOut.Row(string(pod0.UID()))
		Expect(ok && !current).To(BeTrue(), "pod 0's row was kept aside while it was NotReady: %+v", whileOut)
		Expect(row.InFlight).To(Equal(10), "pod 0's row while it was NotReady: %+v", row)
	}, SpecTimeout(2*time.Minute))

	It("a same-address pod with a new UID starts from zero", func(ctx SpecContext) {
		h := hold(ids)
		DeferCleanup(func(ctx SpecContext) {
			h.stop()
			expectLedgerDrains(ctx, ids)
		})
		first := h.send(ctx, longRequests(30, "replaced"), "replaced")
		Expect(first).To(Equal(map[string]int{pods[0]: 10, pods[1]: 10, pods[2]: 10}), "30 equal requests over 3 idle pods")

		// Pod 0 is replaced by a new pod of the same name at the same IP (a
		// StatefulSet's replacement); the old one's 10 requests are still
		// held at the address. The new pod's engine has none of them.
		pod0 := ids.Pods()[0]
		oldUID := pod0.UID()
		Expect(ids.DeletePod(ctx, pod0)).To(Succeed())
		Expect(ids.WaitForEndpoints(ctx, pods[1], pods[2])).To(Succeed())
		Expect(ids.RecreatePod(ctx, pod0, true)).To(Succeed())
		Expect(pod0.UID()).NotTo(Equal(oldUID))
		Expect(ids.WaitForEndpoints(ctx, pods...)).To(Succeed())

		ledger, err := ids.Ledger(ctx)
		Expect(err).NotTo(HaveOccurred())

		// Pods 1 and 2 hold 10 requests each; the new pod is idle, so 10
		// more all go to it.
		next := h.send(ctx, longRequests(10, "replaced"), "replaced")
		AddReportEntry("replaced placement", fmt.Sprintf("before %v, after the replacement %v, ledger then %+v", first, next, ledger))
		Expect(next).To(HaveKeyWithValue(pods[0], 10), "placement after the replacement: %v", next)

		Expect(rowsAt(ledger, pod0.Addr)).To(HaveLen(1), "one current row for %s: %+v", pod0.Addr, ledger)
		row, current, ok := ledger.Row(string(pod0.UID()))
		Expect(ok && current).To(BeTrue(), "the new pod has a current row: %+v", ledger)
		Expect(row.InFlight).To(BeZero(), "the new pod's row: %+v", row)
		Expect(row.PrefillTokens).To(BeZero(), "the new pod's row: %+v", row)
		// The old pod's requests are still in flight: its row is kept
		// aside, never given to the new pod.
		old, current, ok := ledger.Row(string(oldUID))
		Expect(ok && !current).To(BeTrue(), "the old pod's row is retained: %+v", ledger)
		Expect(old.InFlight).To(Equal(10), "the old pod's row: %+v", old)
	}, SpecTimeout(2*time.Minute))
})
