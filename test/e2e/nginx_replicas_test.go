package e2e

import (
	"fmt"
	"net/netip"
	"slices"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/tallyepp/tally/internal/ngfshim/nginx"
	"github.com/tallyepp/tally/internal/stack"
)

// nginxReplicasFirstPodIP keeps this pool's pods off the other specs' addresses.
var nginxReplicasFirstPodIP = netip.MustParseAddr("127.0.53.2")

// The burst's streams end at the pick, so its reservations are the ledger's
// model's alone: a pod's first request (3,072 tokens, none cached) is
// modelled prefilled after 3072 / prefillTokensPerSecond. At the default
// 10,000 tokens/s that is 0.3 s, less than a busy machine can take to pass
// the 96 picks through NGINX and its shim (0.49 s, the first picks 0.3 s
// ahead of the rest): the pods that took the first picks then looked
// lighter, and took more (33 / 30 / 33). At 2,000 tokens/s no request's
// prefill ends within 1.5 s of the burst's start, and the model still ends
// the whole burst (32 × 1,024 tokens a pod, then its decode) well within
// the drain's minute.
const nginxReplicasPickerConfig = `apiVersion: tally.tallyepp.io/v1alpha1
kind: PickerConfig
prefillTokensPerSecond: 2000
`

// NGF names the picker's Service to its shim, which dials the name anew
// for each request: its streams spread over every ready replica, and each
// ends at the pick (the picker detaches the reservation). Here the shim
// resolves the Service's name to the three replicas, as cluster DNS would.
var _ = Describe("Through NGINX as NGINX Gateway Fabric drives it, spread over three picker replicas", Ordered, func() {
	var rs *stack.Stack
	var gw *stack.NGINX
	var fronts []replicaFront

	BeforeAll(func(ctx SpecContext) {
		if _, _, err := nginx.Find(); err != nil {
			if nginx.Optional() {
				Skip(fmt.Sprintf("NGINX is not installed, and $%s=1 allows skipping: %v", nginx.OptionalEnv, err))
			}
			Fail(fmt.Sprintf("these specs need NGINX and its NJS module: run hack/nginx.sh (`make test` does), or set $%s=1 to skip them: %v", nginx.OptionalEnv, err))
		}
		rs = startStack(ctx, stack.Options{
			Namespace:  "e2e-nginx-replicas",
			PoolName:   "nginx-replicas-pool",
			Pods:       3,
			FirstPodIP: nginxReplicasFirstPodIP,
			TimeScale:  10,
			Peers:      true,
			// A follower must not place a pick itself while the leader
			// answers: on a busy machine an answer can take longer than
			// the default bound.
			PickerArgs: append(slices.Clone(leaseArgs), "--config-text="+nginxReplicasPickerConfig, "--peer-pick-timeout=2s"),
		})
		fronts = []replicaFront{{name: "epp", gatewayURL: rs.GatewayURL(), metrics: rs.PickerMetrics, ledger: rs.Ledger}}
		for range 2 {
			r, err := rs.StartReplica(ctx)
			Expect(err).NotTo(HaveOccurred())
			fronts = append(fronts, replicaFront{name: r.Name(), gatewayURL: r.GatewayURL(), metrics: r.Metrics, ledger: r.Ledger})
			eventually(ctx, func(g Gomega) {
				ready, err := r.Ready(ctx)
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(ready).To(BeTrue())
			}).WithTimeout(30*time.Second).Should(Succeed(), "replica %s is ready: every replica serves", r.Name())
		}
		leaderOf(ctx, fronts, []int{0, 1, 2})
		var err error
		gw, err = rs.StartNGINX(ctx, stack.NGINXOptions{SpreadOverReplicas: true})
		Expect(err).NotTo(HaveOccurred())
	}, NodeTimeout(3*time.Minute))

	It("places a held burst spread over the three replicas as one ledger does, and every ledger drains", func(ctx SpecContext) {
		// 96 requests sharing a system prompt, each with 1,024 tokens of
		// its own, all through the one NGINX. Their streams end at the
		// pick, so the ledgers hold them until the model says they are
		// done, not until the pods answer: max_tokens of 1,000 (some 20 s
		// at the default decode speed) keeps them modelled as running
		// while the pods hold them. With 4, as the dev gateway's burst
		// has, the model ends them before the ledgers can be read.
		reqs := stack.Burst{Requests: 96, SystemTokens: 2048, UserTokens: 1024, MaxTokens: 1000, Model: stack.DefaultModel, Seed: 11}.Workload()
		decided := func() []float64 {
			counts := make([]float64, len(fronts))
			for i, f := range fronts {
				m, err := f.metrics(ctx)
				Expect(err).NotTo(HaveOccurred())
				counts[i], _ = m.Value("tally_requests_total", "code", "200")
			}
			return counts
		}
		before := decided()
		viaNGINX := func(int) string { return gw.URL() }
		// NGINX reads a request's body before it asks the shim: no stream
		// is open while the bodies are held.
		placed, ledgers, results := heldBurstThrough(ctx, rs, fronts, viaNGINX, false, reqs, "nginx-replicas")
		expectAllOK(results)
		after := decided()
		streams := map[string]float64{}
		for i, f := range fronts {
			streams[f.name] = after[i] - before[i]
		}
		AddReportEntry("nginx replicas burst", fmt.Sprintf("96 requests through NGINX over 3 replicas (streams %v) placed %v", streams, placed))
		for _, p := range rs.Pods() {
			Expect(placed[p.Name]).To(BeNumerically("~", 32, 1), "placement %v", placed)
		}
		// The shim takes the Service's addresses in turn: each replica
		// answered a third of the streams.
		for name, n := range streams {
			Expect(n).To(Equal(32.0), "streams replica %s decided; all %v", name, streams)
		}
		// While all 96 are held at the pods, every replica's copy of the
		// ledger holds each of them where it went (the streams ended at
		// the pick, the reservations did not), and the followers
		// forwarded their picks.
		forwarded := expectOneLedger(ctx, fronts, ledgers, placed, 64)
		// A detached reservation ends when the model says its request is
		// done, on every copy.
		start := time.Now()
		expectEveryLedgerDrainsWithin(ctx, fronts, time.Minute)
		AddReportEntry("nginx replicas drain", fmt.Sprintf("%.0f picks forwarded; every ledger idle %v after the burst was answered", forwarded, time.Since(start).Round(100*time.Millisecond)))
	}, SpecTimeout(3*time.Minute))
})
