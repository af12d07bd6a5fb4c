package e2e

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/internal/modelsim/server"
	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/picker/debugledger"
)

// engineFirstPodIP keeps this pool's pods off the other specs' addresses.
var engineFirstPodIP = netip.MustParseAddr("127.0.45.2")

// engineKVBlocks sizes each simulator's KV cache: 96,000 tokens, a size no
// default of the picker's matches.
const engineKVBlocks = 6000

// steadyPromptTokens is every prompt's length in these specs: the picker's
// starting size of a foreign request (what it weighs a request it did not
// place by, before the moving mean of placed prompts has moved), so that the
// mean stays exact and one foreign request weighs as much as one placed.
const steadyPromptTokens = 1024

// The picker's prefix blocks and fallback capacity, named in its
// configuration so that the figures below do not move with the defaults.
const (
	engineBlockSizeChars    = 256
	engineCharsPerToken     = server.DefaultCharsPerToken
	engineLRUCapacityBlocks = 25_000
)

// As in the identity specs, a starting prefill rate of 100 tokens/s keeps
// the picker's drain model from releasing the prefill of requests it placed
// during a spec's few seconds: a placed request weighs its prompt until it
// ends, as a foreign one does.
var enginePickerConfig = fmt.Sprintf(`apiVersion: tally.tallyepp.io/v1alpha1
kind: PickerConfig
prefillTokensPerSecond: 100
blockSizeChars: %d
charsPerToken: %d
lruCapacityBlocks: %d
`, engineBlockSizeChars, engineCharsPerToken, engineLRUCapacityBlocks)

// steadyRequest is a completion of steadyPromptTokens tokens whose first
// block is its own, so it shares no prefix with any other.
func steadyRequest(what string, maxTokens int, stream bool) stack.Request {
	head := fmt.Sprintf("%s %08d: ", what, requestSeq.Add(1))
	return sameRequest(head, maxTokens, stream)
}

// sameRequest is the completion of steadyPromptTokens tokens that starts
// with head: the same head gives the same prompt.
func sameRequest(head string, maxTokens int, stream bool) stack.Request {
	const unit = "what does the engine hold "
	text := head + strings.Repeat(unit, steadyPromptTokens*server.DefaultCharsPerToken/len(unit)+1)
	return stack.Completion(stack.DefaultModel, text[:steadyPromptTokens*server.DefaultCharsPerToken], maxTokens, stream)
}

func steadyRequests(n int, what string) []stack.Request {
	reqs := make([]stack.Request, n)
	for i := range reqs {
		reqs[i] = steadyRequest(what, 4, false)
	}
	return reqs
}

// await is eventually(f) that returns its failure instead of failing the
// spec, with how long it waited: the spec then reports what followed (a
// placement measured either way) before it asserts.
func await(ctx context.Context, timeout time.Duration, f func(g Gomega)) (time.Duration, error) {
	start := time.Now()
	err := InterceptGomegaFailure(func() {
		eventually(ctx, f).WithTimeout(timeout).Should(Succeed())
	})
	return time.Since(start), err
}

// engineLoad is each pod's engine's running and waiting requests.
func engineLoad(s *stack.Stack) map[string]int {
	GinkgoHelper()
	out := map[string]int{}
	for _, p := range s.Pods() {
		st, ok := p.Stats()
		Expect(ok).To(BeTrue(), "pod %s has a simulator", p.Name)
		out[p.Name] = st.RunningRequests + st.WaitingRequests
	}
	return out
}

// expectEnginesIdle waits until no engine of s runs or queues a request.
func expectEnginesIdle(ctx context.Context, s *stack.Stack) {
	GinkgoHelper()
	eventually(ctx, func() int { return total(engineLoad(s)) }).WithTimeout(15*time.Second).Should(BeZero(), "requests on the engines")
}

// direct sends requests straight to pods, bypassing the gateway and the
// picker, as a batch job calling the model servers' Service would. stop
// cancels them all and waits until each has ended.
type direct struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func newDirect() *direct {
	ctx, cancel := context.WithCancel(context.Background())
	return &direct{ctx: ctx, cancel: cancel}
}

func (d *direct) send(c *http.Client, baseURL string, reqs []stack.Request, what string) {
	for _, r := range reqs {
		d.wg.Go(func() { stack.Send(d.ctx, c, baseURL, nextID(what), r) })
	}
}

func (d *direct) stop() {
	d.cancel()
	d.wg.Wait()
}

// foreignOf returns each pod's foreign requests as a ledger reports them
// (-1 for a pod never scraped).
func foreignOf(l debugledger.Ledger, pods []*stack.Pod) map[string]int {
	out := map[string]int{}
	for _, p := range pods {
		out[p.Name] = -1
		if row, ok := l.RowAt(p.Addr); ok && row.Engine != nil {
			out[p.Name] = row.Engine.ForeignRequests
		}
	}
	return out
}

// expectShortfallBooked sends one prompt through es's gateway four times:
// once to place it, once to find it cached, once more after the engine that
// holds it restarted (it delivers nothing from its cache, the picker
// predicted the whole prompt, and both are booked) and once to see that the
// picker still predicts it there, where the restarted engine has computed it
// again. Streamed, the usage is in the last event
// (stream_options.include_usage).
func expectShortfallBooked(ctx context.Context, es *stack.Stack, pods []*stack.Pod, stream bool) {
	GinkgoHelper()
	req := sameRequest(fmt.Sprintf("shortfall (stream %v): ", stream), 4, stream)
	wantBlocks := steadyPromptTokens * engineCharsPerToken / engineBlockSizeChars
	type step struct {
		pod               string
		cached, predicted int
		// read and readPredicted are the delivered and predicted cached
		// tokens the picker counted from the response's usage.
		read, readPredicted int
	}
	// sendOne sends the prompt through the gateway, waits until the
	// picker has released it (the usage is read then), and returns
	// where it went, what the engine delivered from its cache, what
	// the picker predicted and what it read of the usage.
	sendOne := func(what string) step {
		GinkgoHelper()
		before, err := es.PickerMetrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		r := stack.Send(ctx, es.HTTPClient(), es.GatewayURL(), nextID(what), req)
		Expect(r.Err).NotTo(HaveOccurred())
		expectLedgerDrains(ctx, es)
		after, err := es.PickerMetrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		counter := func(m stack.Metrics, name string) float64 { v, _ := m.Value(name); return v }
		return step{
			pod:           es.ServedBy(r.ID),
			cached:        r.CachedTokens,
			predicted:     int(counter(after, "tally_prefix_cached_tokens_total") - counter(before, "tally_prefix_cached_tokens_total")),
			read:          int(after.Sum("tally_endpoint_delivered_cached_tokens_total") - before.Sum("tally_endpoint_delivered_cached_tokens_total")),
			readPredicted: int(after.Sum("tally_endpoint_predicted_cached_tokens_total") - before.Sum("tally_endpoint_predicted_cached_tokens_total")),
		}
	}
	first := sendOne("shortfall-first")
	repeat := sendOne("shortfall-repeat")
	// The engine that served the prompt restarts: its cache is empty,
	// and nothing tells the picker but the next response's usage.
	var held *stack.Pod
	for _, p := range pods {
		if p.Name == first.pod {
			held = p
		}
	}
	Expect(held).NotTo(BeNil(), "the first request was served: %+v", first)
	Expect(held.ResetEngine()).To(Succeed())
	shortfall := sendOne("shortfall-after-reset")
	next := sendOne("shortfall-next")
	l, err := es.Ledger(ctx)
	Expect(err).NotTo(HaveOccurred())
	row, _ := l.RowAt(held.Addr)
	AddReportEntry("delivered-cache feedback", fmt.Sprintf("stream %v: a %d-token prompt (%d index blocks): first %+v; repeated %+v; after %s's engine reset %+v; next %+v; %s's ledger row delivered %d / predicted %d cached tokens",
		stream, steadyPromptTokens, wantBlocks, first, repeat, held.Name, shortfall, next, held.Name, row.DeliveredCachedTokens, row.PredictedCachedTokens))

	Expect(repeat.pod).To(Equal(first.pod), "the repeat goes where the prefix is")
	Expect(repeat.predicted).To(BeNumerically(">", 0), "the picker predicts the repeat's cached prefix: %+v", repeat)
	Expect(repeat.cached).To(BeNumerically(">", 0), "the engine delivers it: %+v", repeat)
	Expect(repeat.read).To(Equal(repeat.cached), "the picker reads the repeat's usage: %+v", repeat)
	Expect(repeat.readPredicted).To(Equal(repeat.predicted), "%+v", repeat)
	Expect(shortfall.pod).To(Equal(first.pod), "the picker still believed %s held the prefix: %+v", first.pod, shortfall)
	Expect(shortfall.predicted).To(BeNumerically(">", 0), "%+v", shortfall)
	Expect(shortfall.cached).To(BeZero(), "the reset engine had nothing cached: %+v", shortfall)
	Expect(shortfall.read).To(BeZero(), "the picker books what the engine delivered: %+v", shortfall)
	Expect(shortfall.readPredicted).To(Equal(shortfall.predicted), "and what it predicted: %+v", shortfall)
	// The engine computed the whole prompt for the shortfall's request and
	// keeps it: the next pick predicts it there, and the engine delivers it.
	Expect(next.pod).To(Equal(first.pod), "the next request goes where the prefix is again: %+v", next)
	Expect(next.predicted).To(BeNumerically(">", 0), "%+v", next)
	Expect(next.cached).To(BeNumerically(">", 0), "the restarted engine holds the prompt it computed: %+v", next)
}

var _ = Describe("The picker's loop with the engines", Ordered, ContinueOnFailure, func() {
	var es *stack.Stack
	var pods []*stack.Pod
	var names []string

	BeforeAll(func(ctx SpecContext) {
		// Real time, so that requests sent straight to an engine stay
		// running for seconds.
		es = startStack(ctx, stack.Options{
			Namespace:  "e2e-engine",
			PoolName:   "engine-pool",
			Pods:       3,
			FirstPodIP: engineFirstPodIP,
			TimeScale:  1,
			KVBlocks:   engineKVBlocks,
			PickerArgs: []string{"--config-text=" + enginePickerConfig},
		})
		pods = es.Pods()
		names = es.PodNames()
	}, NodeTimeout(2*time.Minute))

	It("sizes each endpoint's prefix index from its engine's KV cache", func(ctx SpecContext) {
		// The engine's tokens in the picker's blocks of prompt characters.
		want := engineKVBlocks * engine.DefaultBlockSizeTokens * engineCharsPerToken / engineBlockSizeChars
		capacities := func(l debugledger.Ledger) map[string]int {
			out := map[string]int{}
			for _, p := range pods {
				row, _ := l.RowAt(p.Addr)
				out[p.Name] = row.PrefixCapacityBlocks
			}
			return out
		}
		var last debugledger.Ledger
		took, learnErr := await(ctx, 5*time.Second, func(g Gomega) {
			l, err := es.Ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			last = l
			for _, c := range capacities(l) {
				g.Expect(c).To(Equal(want))
			}
		})
		m, err := es.PickerMetrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		gauges := map[string]float64{}
		for _, p := range pods {
			gauges[p.Name], _ = m.Value("tally_endpoint_prefix_capacity_blocks", "endpoint", p.Addr.String())
		}
		AddReportEntry("prefix capacity", fmt.Sprintf("engines of %d blocks of %d tokens: want %d index blocks of %d characters; ledger %v after %v, tally_endpoint_prefix_capacity_blocks %v (lruCapacityBlocks %d)",
			engineKVBlocks, engine.DefaultBlockSizeTokens, want, engineBlockSizeChars, capacities(last), took.Round(time.Millisecond), gauges, engineLRUCapacityBlocks))
		// Without scrapes every endpoint keeps lruCapacityBlocks.
		Expect(learnErr).NotTo(HaveOccurred(), "every endpoint's capacity comes from its engine: %v", capacities(last))
		for name, g := range gauges {
			Expect(g).To(Equal(float64(want)), "tally_endpoint_prefix_capacity_blocks of %s", name)
		}
	}, SpecTimeout(time.Minute))

	It("steers picks away from a pod busy with requests that did not come through the picker", func(ctx SpecContext) {
		const foreign = 12
		pod0 := pods[0]
		d := newDirect()
		DeferCleanup(func(ctx SpecContext) {
			d.stop()
			expectEnginesIdle(ctx, es)
			expectLedgerDrains(ctx, es)
		})
		// Long generations (about 27 s at 6.8 ms a step) keep them running
		// for the whole spec; stop cancels them.
		reqs := make([]stack.Request, foreign)
		for i := range reqs {
			reqs[i] = steadyRequest("foreign", 4000, false)
		}
		d.send(es.HTTPClient(), pod0.URL(), reqs, "foreign")
		eventually(ctx, func() int { return engineLoad(es)[pod0.Name] }).WithTimeout(10*time.Second).Should(Equal(foreign), "requests running on %s", pod0.Name)
		var seen debugledger.Ledger
		took, seenErr := await(ctx, 5*time.Second, func(g Gomega) {
			l, err := es.Ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			seen = l
			g.Expect(foreignOf(l, pods)).To(Equal(map[string]int{names[0]: foreign, names[1]: 0, names[2]: 0}))
		})

		// 24 held requests: the engines never see them, so the engine's
		// 12 stay foreign all along. The even spread of 36 is 12 each: all
		// 24 on the two other pods. A picker blind to the 12 (no scrapes)
		// placed 8/8/8: 20/8/8 in flight.
		h := hold(es)
		DeferCleanup(h.stop)
		placed := h.send(ctx, steadyRequests(24, "steer"), "steer")
		totals := sum(placed, map[string]int{pod0.Name: foreign})
		AddReportEntry("foreign load", fmt.Sprintf("%d requests straight to %s; the picker's foreign requests per pod %v (seen after %v); the next 24 placed %v; in flight per pod %v",
			foreign, pod0.Name, foreignOf(seen, pods), took.Round(time.Millisecond), placed, totals))
		Expect(seenErr).NotTo(HaveOccurred(), "the picker sees the requests it did not place")
		Expect(placed[pod0.Name]).To(BeNumerically("<=", 1), "placement %v", placed)
		for _, name := range names {
			Expect(totals[name]).To(BeNumerically("~", 12, 1), "requests per pod, foreign ones included: %v", totals)
		}
	}, SpecTimeout(2*time.Minute))

	It("books an engine's shortfall of cached tokens and keeps the prompt it recomputed", func(ctx SpecContext) {
		expectShortfallBooked(ctx, es, pods, false)
	}, SpecTimeout(time.Minute))

	It("leaves a pod whose metrics fail out of the picks until they succeed again", func(ctx SpecContext) {
		pod1 := pods[1]
		// The last scrape before the metrics fail stays the picker's view
		// of pod1's engine: it must see the engine idle, not still running
		// a request of the spec before (the bursts below wait for every
		// engine's last scrape to be idle).
		expectLedgerDrains(ctx, es)
		pod1.FailMetrics(true)
		DeferCleanup(func() { pod1.FailMetrics(false) })
		unhealthy := func(want bool) func(g Gomega) {
			return func(g Gomega) {
				l, err := es.Ledger(ctx)
				g.Expect(err).NotTo(HaveOccurred())
				row, ok := l.RowAt(pod1.Addr)
				g.Expect(ok).To(BeTrue(), "%s has a row: %+v", pod1.Name, l)
				g.Expect(row.Unhealthy).To(Equal(want), "%s's row: %+v", pod1.Name, row)
			}
		}
		healthyGauge := func() float64 {
			m, err := es.PickerMetrics(ctx)
			Expect(err).NotTo(HaveOccurred())
			v, _ := m.Value("tally_endpoint_healthy", "endpoint", pod1.Addr.String())
			return v
		}
		burst := func(n int, what string) map[string]int {
			h := hold(es)
			defer func() {
				h.stop()
				expectLedgerDrains(ctx, es)
			}()
			return h.send(ctx, steadyRequests(n, what), what)
		}

		outAfter, outErr := await(ctx, 10*time.Second, unhealthy(true))
		gaugeOut := healthyGauge()
		whileFailing := burst(20, "failing-metrics")
		pod1.FailMetrics(false)
		backAfter, backErr := await(ctx, 10*time.Second, unhealthy(false))
		gaugeBack := healthyGauge()
		afterRecovery := burst(30, "recovered-metrics")
		AddReportEntry("failing metrics", fmt.Sprintf("%s's /metrics answering 500: unhealthy after %v (tally_endpoint_healthy %v), 20 held requests placed %v; metrics back: healthy after %v (gauge %v), 30 held requests placed %v",
			pod1.Name, outAfter.Round(time.Millisecond), gaugeOut, whileFailing, backAfter.Round(time.Millisecond), gaugeBack, afterRecovery))

		// Without scrapes the pod stays a candidate: 6/7/7.
		Expect(outErr).NotTo(HaveOccurred(), "failing scrapes take %s out", pod1.Name)
		Expect(gaugeOut).To(BeZero())
		Expect(whileFailing).To(HaveKeyWithValue(pod1.Name, 0), "placement while %s's metrics fail: %v", pod1.Name, whileFailing)
		for _, name := range []string{names[0], names[2]} {
			Expect(whileFailing[name]).To(BeNumerically("~", 10, 1), "placement while %s's metrics fail: %v", pod1.Name, whileFailing)
		}
		Expect(backErr).NotTo(HaveOccurred(), "a successful scrape brings %s back", pod1.Name)
		Expect(gaugeBack).To(Equal(1.0))
		for _, name := range names {
			Expect(afterRecovery[name]).To(BeNumerically("~", 10, 1), "placement once %s's metrics are back: %v", pod1.Name, afterRecovery)
		}
	}, SpecTimeout(time.Minute))

	// Last: streamed responses teach the picker the engines' prefill rate,
	// which would drain the held requests of the specs above.
	It("books them when the usage comes at the end of a stream too", func(ctx SpecContext) {
		expectShortfallBooked(ctx, es, pods, true)
	}, SpecTimeout(time.Minute))
})

// failoverFirstPodIP keeps this pool's pods off the other specs' addresses.
var failoverFirstPodIP = netip.MustParseAddr("127.0.46.2")

// The pickers' lease, shorter than the default 15 s so that the spec runs
// quicker (the chart's test checks the defaults reach the flags). Candidates
// retry every leaseRetryPeriod plus a jitter of up to 1.2 times it, so up
// to 2.2 times it between tries (k8s.io/client-go/tools/leaderelection's
// JitterFactor, through wait.Jitter: period + rand*1.2*period).
const (
	leaseDuration    = 8 * time.Second
	leaseRetryPeriod = time.Second
)

var leaseArgs = []string{"--ha-enable-leader-election", "--ha-lease-duration=" + leaseDuration.String(),
	"--ha-renew-deadline=5s", "--ha-retry-period=" + leaseRetryPeriod.String()}

// takeoverBound is the longest a standby can take to lead after a leader's
// crash: client-go counts the lease from when the standby saw it renewed,
// up to one jittered retry after the crash; it waits leaseDuration from
// then, and tries again within one more jittered retry. The standby's
// readiness is polled within 500 ms more. (With the retries counted at 1.2
// times the period, a clean-clone run beside a busy machine took over in
// 11.33 s against 10.9: two tries jittered late, as client-go may.)
const takeoverBound = leaseDuration + 2*leaseRetryPeriod*22/10 + 500*time.Millisecond

var _ = Describe("A standby picker taking over from a crashed leader", Ordered, func() {
	var fs *stack.Stack
	var standby *stack.Replica

	BeforeAll(func(ctx SpecContext) {
		// Two pods at first; a third joins just before the leader dies.
		fs = startStack(ctx, stack.Options{
			Namespace:  "e2e-failover",
			PoolName:   "failover-pool",
			Pods:       2,
			FirstPodIP: failoverFirstPodIP,
			TimeScale:  1,
			PickerArgs: slices.Concat(leaseArgs, []string{"--config-text=" + enginePickerConfig}),
		})
		var err error
		standby, err = fs.StartReplica(ctx)
		Expect(err).NotTo(HaveOccurred())
	}, NodeTimeout(2*time.Minute))

	It("is ready within the lease and spreads its first burst by the load the engines report", func(ctx SpecContext) {
		const oldLoad, burstSize = 20, 30
		ready, err := standby.Ready(ctx)
		Expect(err).NotTo(HaveOccurred())
		Expect(ready).To(BeFalse(), "the standby is not ready while the first picker leads")

		// The leader places 20 long requests (about 40 s of generation
		// each) over the two pods; they are still running when the
		// standby's first burst comes.
		old, viaStandby := newDirect(), newDirect()
		DeferCleanup(func(ctx SpecContext) {
			old.stop()
			viaStandby.stop()
			expectEnginesIdle(ctx, fs)
		})
		oldReqs := make([]stack.Request, oldLoad)
		for i := range oldReqs {
			oldReqs[i] = steadyRequest("old-leader", 6000, false)
		}
		old.send(fs.HTTPClient(), fs.GatewayURL(), oldReqs, "old-leader")
		eventually(ctx, func() int { return total(engineLoad(fs)) }).WithTimeout(15*time.Second).Should(Equal(oldLoad), "the old leader's requests on the engines")
		oldPlaced := engineLoad(fs)

		// A third pod joins; both pickers watch the pool.
		newPod, err := fs.AddPod(ctx, true)
		Expect(err).NotTo(HaveOccurred())
		Expect(fs.WaitForEndpoints(ctx, fs.PodNames()...)).To(Succeed())
		Expect(standby.WaitForEndpoints(ctx, fs.PodNames()...)).To(Succeed())
		pods := fs.Pods()
		var beforeKill debugledger.Ledger
		_, seenErr := await(ctx, 5*time.Second, func(g Gomega) {
			l, err := standby.Ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			beforeKill = l
			g.Expect(foreignOf(l, pods)).To(Equal(sum(oldPlaced, map[string]int{newPod.Name: 0})))
		})

		fs.KillPicker()
		killed := time.Now()
		eventually(ctx, func(g Gomega) {
			ready, err := standby.Ready(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(ready).To(BeTrue())
		}).WithTimeout(takeoverBound+5*time.Second).Should(Succeed(), "the standby takes over")
		takeover := time.Since(killed)
		atTakeover, err := standby.Ledger(ctx)
		Expect(err).NotTo(HaveOccurred())

		// The first burst through the new leader: long requests too, so
		// that the engines' counts at the end hold both leaders' requests.
		before := servedOn(fs)
		burst := make([]stack.Request, burstSize)
		for i := range burst {
			burst[i] = steadyRequest("new-leader", 6000, false)
		}
		viaStandby.send(fs.HTTPClient(), standby.GatewayURL(), burst, "new-leader")
		eventually(ctx, func() int { return total(delta(before, servedOn(fs))) }).WithTimeout(30*time.Second).Should(Equal(burstSize), "burst requests that reached a pod")
		placed := delta(before, servedOn(fs))
		eventually(ctx, func() int { return total(engineLoad(fs)) }).WithTimeout(15 * time.Second).Should(Equal(oldLoad + burstSize))
		load := engineLoad(fs)
		even := float64(oldLoad+burstSize) / float64(len(pods))
		AddReportEntry("failover", fmt.Sprintf("old leader's requests per pod %v; the standby's foreign requests before the kill %v; ready %v after SIGKILL (bound %v); foreign at takeover %v; first burst of %d placed %v; engines then %v (even %.1f)",
			oldPlaced, foreignOf(beforeKill, pods), takeover.Round(time.Millisecond), takeoverBound, foreignOf(atTakeover, pods), burstSize, placed, load, even))

		// A new leader without scrapes starts blind: it placed 10/10/10,
		// leaving the engines at 20/20/10.
		Expect(seenErr).NotTo(HaveOccurred(), "the standby scrapes the engines before it leads")
		Expect(takeover).To(BeNumerically("<=", takeoverBound), "the standby leads once the crashed leader's lease expires")
		// Within 10% of even, in whole numbers: as floats, 15 of 50 on 3
		// pods was 1.666666666666668 from even, past the bound of
		// 1.6666666666666667.
		for _, p := range pods {
			off := len(pods)*load[p.Name] - (oldLoad + burstSize)
			Expect(10*max(off, -off)).To(BeNumerically("<=", oldLoad+burstSize), "requests on the engines after the first burst: %v (the burst placed %v; even %.2f)", load, placed, even)
		}
	}, SpecTimeout(3*time.Minute))
})
