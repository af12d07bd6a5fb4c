package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
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

	BeforeAll(func(ctx SpecContext) {
		rs = startStack(ctx, stack.Options{
			Namespace:  "e2e-replicas",
			PoolName:   "replicas-pool",
			Pods:       3,
			FirstPodIP: replicasFirstPodIP,
			TimeScale:  10,
			Peers:      true,
			PickerArgs: leaseArgs,
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
		// holds each of them where it went.
		for i, l := range ledgers {
			for _, e := range l.Endpoints {
				Expect(e.InFlight).To(Equal(placed[e.Pod]), "replica %s's ledger row %+v; placement %v", fronts[i].name, e, placed)
			}
		}
		// The followers forwarded every pick: none placed one itself.
		forwarded := 0.0
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
		Expect(forwarded).To(BeNumerically(">=", 64), "picks the two followers forwarded")
		expectEveryLedgerDrains(ctx, fronts)
	}, SpecTimeout(2*time.Minute))
})

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
			results[i] = gate.Send(ctx, fronts[i%len(fronts)].gatewayURL, nextID(what), r)
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
	// The dev gateways open a request's stream on its headers.
	eventually(ctx, func(g Gomega) int {
		n := 0
		for _, f := range fronts {
			m, err := f.metrics(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			n += int(m.Sum("tally_streams_active"))
		}
		return n
	}).WithTimeout(30*time.Second).Should(BeNumerically(">=", len(reqs)), "ext_proc streams open at the pickers")
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
