package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/picker/debugledger"
	"github.com/tallyepp/tally/picker/replica"
	"github.com/tallyepp/tally/picker/replica/replicapb"
)

// replicasFirstPodIP keeps this pool's pods off the other specs' addresses.
var replicasFirstPodIP = netip.MustParseAddr("127.0.47.2")

// replicaFront is one picker replica as a test reaches it: its gateway,
// its metrics and its ledger.
type replicaFront struct {
	name       string
	gatewayURL string
	metrics    func(context.Context) (stack.Metrics, error)
	ledger     func(context.Context) (debugledger.Ledger, error)
}

var _ = Describe("Three picker replicas sharing one ledger", Ordered, func() {
	var rs *stack.Stack
	var fronts []replicaFront
	var replicas []*stack.Replica

	BeforeAll(func(ctx SpecContext) {
		rs = startStack(ctx, stack.Options{
			Namespace:  "e2e-replicas",
			PoolName:   "replicas-pool",
			Pods:       3,
			FirstPodIP: replicasFirstPodIP,
			TimeScale:  10,
			Peers:      true,
			// The specs check that a follower never places a pick itself
			// while the leader answers: on a machine this busy (three
			// pickers, their gateways and the engines on two cores) an
			// answer can take longer than the default 250 ms.
			//
			// A replica told to stop keeps taking new streams for a second
			// (the chart's default is 5 s), while the gateway's health
			// checks (every 500 ms) see it draining.
			PickerArgs: append(slices.Clone(leaseArgs), "--peer-pick-timeout=2s", "--shutdown-delay=1s"),
		})
		fronts = []replicaFront{{name: "epp", gatewayURL: rs.GatewayURL(), metrics: rs.PickerMetrics, ledger: rs.Ledger}}
		for range 2 {
			r, err := rs.StartReplica(ctx)
			Expect(err).NotTo(HaveOccurred())
			replicas = append(replicas, r)
			fronts = append(fronts, replicaFront{name: r.Name(), gatewayURL: r.GatewayURL(), metrics: r.Metrics, ledger: r.Ledger})
			eventually(ctx, func(g Gomega) {
				ready, err := r.Ready(ctx)
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(ready).To(BeTrue())
			}).WithTimeout(30*time.Second).Should(Succeed(), "replica %s is ready: every replica serves", r.Name())
		}
		// Every replica follows the same leader.
		eventually(ctx, func(g Gomega) {
			leaders := map[string]bool{}
			for _, f := range fronts {
				l, err := f.ledger(ctx)
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(l.Replica).NotTo(BeNil(), "replica %s says nothing of its peers", f.name)
				g.Expect(l.Replica.Peers).To(Equal(2), "replica %s's peers", f.name)
				leaders[l.Replica.Leader] = true
			}
			g.Expect(leaders).To(HaveLen(1))
			g.Expect(leaders).NotTo(HaveKey(""))
		}).WithTimeout(30 * time.Second).Should(Succeed())
	}, NodeTimeout(3*time.Minute))

	It("refuses the peer port to a client without the pool's peer credentials", func(ctx SpecContext) {
		for _, name := range []string{"epp", fronts[1].name} {
			addr, ok := rs.PeerAddr(name)
			Expect(ok).To(BeTrue())
			peerRefuses(ctx, addr, rs.PeerCredentials())
		}
	}, SpecTimeout(time.Minute))

	It("places a held burst spread over the three as one ledger does", func(ctx SpecContext) {
		// 96 requests sharing a system prompt, each with 1,024 tokens of
		// its own, sent round-robin through the three replicas' gateways.
		reqs := stack.Burst{Requests: 96, SystemTokens: 2048, UserTokens: 1024, MaxTokens: 4, Model: stack.DefaultModel, Seed: 11}.Workload()
		urls := make([]string, len(fronts))
		for i, f := range fronts {
			urls[i] = f.gatewayURL
		}
		placed, ledgers, results := heldBurstOver(ctx, rs, fronts, reqs, "replicas")
		expectAllOK(results)
		AddReportEntry("replicas burst", fmt.Sprintf("96 requests through 3 replicas placed %v", placed))
		for _, p := range rs.Pods() {
			Expect(placed[p.Name]).To(BeNumerically("~", 32, 1), "placement %v", placed)
		}
		// While all 96 are in flight, every replica's copy of the ledger
		// holds each of them where it went, and the followers forwarded
		// every pick.
		expectOneLedger(ctx, fronts, ledgers, placed, 64)
		expectEveryLedgerDrains(ctx, fronts)
	}, SpecTimeout(2*time.Minute))

	It("loses no request when the leader is SIGKILLed amid steady traffic and a burst, and every ledger drains", func(ctx SpecContext) {
		url, err := rs.StartSpreadGateway(ctx)
		Expect(err).NotTo(HaveOccurred())
		all := []int{0, 1, 2}
		leader := leaderOf(ctx, fronts, all)
		stop := steady(url, 50*time.Millisecond, "failover-steady")

		// A burst of 60 requests long enough to be in flight together
		// (about a second of generation each), the leader killed while
		// it comes.
		const burstSize = 60
		ids := make([]string, burstSize)
		results := make([]stack.Result, burstSize)
		var wg sync.WaitGroup
		for i := range burstSize {
			ids[i] = nextID("failover-burst")
			wg.Go(func() {
				results[i] = stack.Send(ctx, rs.HTTPClient(), url, ids[i], steadyRequest("failover-burst", 500, true))
			})
			if i == burstSize/2 {
				if leader == 0 {
					rs.KillPicker()
				} else {
					replicas[leader-1].Kill()
				}
			}
		}
		wg.Wait()
		var alive []int
		for _, i := range all {
			if i != leader {
				alive = append(alive, i)
			}
		}
		// The traffic goes on until a new leader is elected, and past.
		newLeader := leaderOf(ctx, fronts, alive)
		time.Sleep(2 * time.Second)
		expectNoneFailed(stop(), "of steady traffic")
		expectNoneFailed(results, "of the burst")

		placed := map[string]int{}
		for _, id := range ids {
			placed[rs.ServedBy(id)]++
		}
		AddReportEntry("failover", fmt.Sprintf("leader %s killed in a burst of %d: placed %v; %s leads after", fronts[leader].name, burstSize, placed, fronts[newLeader].name))
		for _, p := range rs.Pods() {
			// Within 10% of even: 20 ± 2.
			Expect(10*placed[p.Name]).To(BeNumerically("~", 10*burstSize/3, burstSize), "burst placement %v", placed)
		}
		// What the dead leader placed is left to the model once its
		// grace (the lease duration) is over: every copy drains.
		var survivors []replicaFront
		for _, i := range alive {
			survivors = append(survivors, fronts[i])
		}
		expectEveryLedgerDrainsWithin(ctx, survivors, leaseDuration+30*time.Second)

		// The killed replica comes back, and follows.
		if leader == 0 {
			Expect(rs.StartPicker(ctx)).To(Succeed())
		} else {
			Expect(replicas[leader-1].Restart(ctx)).To(Succeed())
		}
		Expect(leaderOf(ctx, fronts, all)).To(Equal(newLeader))
	}, SpecTimeout(3*time.Minute))

	It("loses no request in a rolling restart of all three under steady traffic", func(ctx SpecContext) {
		url, err := rs.StartSpreadGateway(ctx)
		Expect(err).NotTo(HaveOccurred())
		stop := steady(url, 50*time.Millisecond, "rolling")
		time.Sleep(time.Second)
		for i := range fronts {
			if i == 0 {
				Expect(rs.Picker().Stop()).To(Succeed())
				Expect(rs.StartPicker(ctx)).To(Succeed())
			} else {
				Expect(replicas[i-1].Restart(ctx)).To(Succeed())
			}
			// Ready and following before the next one goes.
			leaderOf(ctx, fronts, []int{0, 1, 2})
		}
		time.Sleep(time.Second)
		results := stop()
		AddReportEntry("rolling restart", fmt.Sprintf("%d requests during a rolling restart of 3 replicas", len(results)))
		expectNoneFailed(results, "during the rolling restart")
		expectEveryLedgerDrainsWithin(ctx, fronts, leaseDuration+30*time.Second)
	}, SpecTimeout(4*time.Minute))
})

// steady sends a request every interval through url until stop is called,
// which waits for every request sent to end and returns their results.
func steady(url string, interval time.Duration, what string) (stop func() []stack.Result) {
	ctx, cancel := context.WithCancel(context.Background())
	var mu sync.Mutex
	var results []stack.Result
	var wg sync.WaitGroup
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			wg.Go(func() {
				r := stack.Send(context.Background(), st.HTTPClient(), url, nextID(what), steadyRequest(what, 8, true))
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
			})
		}
	}()
	return func() []stack.Result {
		cancel()
		<-done
		wg.Wait()
		return results
	}
}

// expectNoneFailed checks that every request got a 200.
func expectNoneFailed(results []stack.Result, what string) {
	GinkgoHelper()
	var failed []string
	for _, r := range results {
		if r.Err != nil || r.Status != http.StatusOK {
			failed = append(failed, fmt.Sprintf("%s: %d %v", r.ID, r.Status, r.Err))
		}
	}
	Expect(failed).To(BeEmpty(), "of %d requests %s, these failed", len(results), what)
}

// leaderOf is the index in fronts of the replica that leads, once the
// replicas alive agree on it.
func leaderOf(ctx context.Context, fronts []replicaFront, alive []int) int {
	GinkgoHelper()
	leader := -1
	eventually(ctx, func(g Gomega) {
		leader = -1
		for _, i := range alive {
			l, err := fronts[i].ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(l.Replica).NotTo(BeNil())
			if l.Replica.Leading {
				g.Expect(leader).To(Equal(-1), "two replicas lead")
				leader = i
			}
		}
		g.Expect(leader).NotTo(Equal(-1), "no replica leads")
		for _, i := range alive {
			l, err := fronts[i].ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(l.Replica.Leader).To(Equal(fronts[leader].name), "replica %s's leader", fronts[i].name)
			g.Expect(l.Replica.Peers).To(BeNumerically(">=", len(alive)-1), "replica %s's peers", fronts[i].name)
		}
	}).WithTimeout(30 * time.Second).Should(Succeed())
	return leader
}

// expectEveryLedgerDrainsWithin waits up to timeout until every replica's
// ledger is idle.
func expectEveryLedgerDrainsWithin(ctx context.Context, fronts []replicaFront, timeout time.Duration) {
	GinkgoHelper()
	for _, f := range fronts {
		eventually(ctx, func(g Gomega) {
			l, err := f.ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(l.Idle()).To(BeTrue(), "replica %s's ledger %+v", f.name, l)
		}).WithTimeout(timeout).Should(Succeed(), "replica %s's ledger drains", f.name)
	}
}

// peerRefuses checks that the peer port at addr refuses a client without
// the pool's peer credentials: in plain text, and over TLS without a
// client certificate.
func peerRefuses(ctx context.Context, addr netip.AddrPort, credDir string) {
	GinkgoHelper()
	ca, err := os.ReadFile(filepath.Join(credDir, "ca.crt"))
	Expect(err).NotTo(HaveOccurred())
	roots := x509.NewCertPool()
	Expect(roots.AppendCertsFromPEM(ca)).To(BeTrue())
	for name, creds := range map[string]credentials.TransportCredentials{
		"plain text":          insecure.NewCredentials(),
		"TLS, no client cert": credentials.NewTLS(&tls.Config{RootCAs: roots, ServerName: replica.ServerName}),
	} {
		conn, err := grpc.NewClient(addr.String(), grpc.WithTransportCredentials(creds))
		Expect(err).NotTo(HaveOccurred())
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		s, err := replicapb.NewPeerClient(conn).Follow(ctx)
		if err == nil {
			_ = s.Send(&replicapb.FromFollower{Msg: &replicapb.FromFollower_Hello{Hello: &replicapb.Hello{Version: replica.Version, Replica: "intruder"}}})
			var m *replicapb.FromLeader
			m, err = s.Recv()
			Expect(err).To(HaveOccurred(), "%s: a client without the peer credentials was answered %v", name, m)
		}
		cancel()
		conn.Close()
	}
}

// expectOneLedger checks that every replica's ledger (read while the burst
// placed was held) holds each request where it went, that no replica
// placed a pick itself while the leader answered, and that the followers
// forwarded at least atLeast picks; it returns how many they forwarded.
func expectOneLedger(ctx context.Context, fronts []replicaFront, ledgers []debugledger.Ledger, placed map[string]int, atLeast float64) (forwarded float64) {
	GinkgoHelper()
	for i, l := range ledgers {
		for _, e := range l.Endpoints {
			Expect(e.InFlight).To(Equal(placed[e.Pod]), "replica %s's ledger row %+v; placement %v", fronts[i].name, e, placed)
		}
	}
	for _, f := range fronts {
		m, err := f.metrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		for _, reason := range []string{"no_leader", "timeout", "version"} {
			v, _ := m.Value("tally_peer_local_placements_total", "reason", reason)
			Expect(v).To(BeZero(), "replica %s placed picks itself (%s) while the leader answered", f.name, reason)
		}
		v, _ := m.Value("tally_peer_forwarded_picks_total")
		forwarded += v
	}
	Expect(forwarded).To(BeNumerically(">=", atLeast), "picks the followers forwarded")
	return forwarded
}

// expectEveryLedgerDrains waits until every replica's ledger is idle.
func expectEveryLedgerDrains(ctx context.Context, fronts []replicaFront) {
	GinkgoHelper()
	for _, f := range fronts {
		eventually(ctx, func(g Gomega) {
			l, err := f.ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(l.Idle()).To(BeTrue(), "replica %s's ledger %+v", f.name, l)
		}).WithTimeout(15*time.Second).Should(Succeed(), "replica %s's ledger drains", f.name)
	}
}

// heldBurstOver is heldBurstVia over several replicas: reqs are sent
// round-robin through their gateways while the pods hold every request,
// and the ledgers are read, every replica's, once all have reached a pod.
func heldBurstOver(ctx context.Context, s *stack.Stack, fronts []replicaFront, reqs []stack.Request, what string) (map[string]int, []debugledger.Ledger, []stack.Result) {
	GinkgoHelper()
	viaGateways := func(i int) string { return fronts[i%len(fronts)].gatewayURL }
	return heldBurstThrough(ctx, s, fronts, viaGateways, true, reqs, what)
}

// heldBurstThrough is heldBurstOver with request i sent to urlOf(i). Only
// when streamsOnHeaders (the dev gateways, which open a request's stream
// on its headers) does it wait for every stream to be open before the
// bodies go: a front that reads the body first (NGINX) opens none until then.
func heldBurstThrough(ctx context.Context, s *stack.Stack, fronts []replicaFront, urlOf func(i int) string, streamsOnHeaders bool, reqs []stack.Request, what string) (map[string]int, []debugledger.Ledger, []stack.Result) {
	GinkgoHelper()
	expectEveryLedgerDrains(ctx, fronts)
	before := servedOn(s)
	release := s.Hold()
	defer release()
	gate := stack.NewBodyGate(len(reqs))
	defer gate.Open()
	results := make([]stack.Result, len(reqs))
	finished := make(chan int, len(reqs))
	for i, r := range reqs {
		go func() {
			results[i] = gate.Send(ctx, urlOf(i), nextID(what), r)
			finished <- i
		}()
	}
	failed := func(i int) string {
		return fmt.Sprintf("request %d finished while the pods held every request: status %d, %v", i, results[i].Status, results[i].Err)
	}
	select {
	case <-gate.Waiting():
	case i := <-finished:
		Fail(failed(i))
	case <-time.After(30 * time.Second):
		Fail("the burst's requests did not all reach the gate in 30 s")
	}
	if streamsOnHeaders {
		eventually(ctx, func(g Gomega) int {
			n := 0
			for _, f := range fronts {
				m, err := f.metrics(ctx)
				g.Expect(err).NotTo(HaveOccurred())
				n += int(m.Sum("tally_streams_active"))
			}
			return n
		}).WithTimeout(30*time.Second).Should(BeNumerically(">=", len(reqs)), "ext_proc streams open at the pickers")
	}
	gate.Open()
	eventually(ctx, func() int {
		select {
		case i := <-finished:
			StopTrying(failed(i)).Now()
		default:
		}
		return total(delta(before, servedOn(s)))
	}).WithTimeout(30*time.Second).Should(Equal(len(reqs)), "requests that reached a pod")
	placed := delta(before, servedOn(s))
	// The followers' copies follow the leader's changes within moments.
	ledgers := make([]debugledger.Ledger, len(fronts))
	for i, f := range fronts {
		eventually(ctx, func(g Gomega) int {
			l, err := f.ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			ledgers[i] = l
			return l.InFlight
		}).WithTimeout(5*time.Second).Should(Equal(len(reqs)), "replica %s's ledger holds the burst", f.name)
	}
	release()
	for range reqs {
		<-finished
	}
	return placed, ledgers, results
}
