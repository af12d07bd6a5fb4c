package replica

import (
	"context"
	"crypto/tls"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	testclock "k8s.io/utils/clock/testing"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/peercert"
	"github.com/tallyepp/tally/internal/testtier"
	"github.com/tallyepp/tally/picker"
	pb "github.com/tallyepp/tally/picker/replica/replicapb"
)

// writeCredentials writes a CA and a peer certificate it signed into a
// new directory.
func writeCredentials(t testing.TB) Credentials {
	t.Helper()
	dir := t.TempDir()
	if err := peercert.Write(dir, ServerName, 2*time.Hour); err != nil {
		t.Fatal(err)
	}
	return Credentials{Dir: dir}
}

// logFor logs to t; a benchmark logs nothing.
func logFor(t testing.TB) logr.Logger {
	if tt, ok := t.(*testing.T); ok {
		return testr.New(tt)
	}
	return logr.Discard()
}

func endpoints() []picker.Endpoint {
	eps := make([]picker.Endpoint, 3)
	for i := range eps {
		eps[i] = picker.Endpoint{Pod: fmt.Sprintf("pod-%d", i), Address: netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, byte(2 + i)}), 8000)}
	}
	return eps
}

// cluster is n replicas of one picker, each with its own ledger over the
// same three endpoints and its own peer server on loopback, on one clock
// that moves only when a test moves it.
type cluster struct {
	t       testing.TB
	creds   Credentials
	opts    Options
	cfg     v1alpha1.PickerConfig
	eps     []picker.Endpoint // default endpoints()
	clock   *testclock.FakeClock
	reps    []*Replica
	pickers []*picker.Picker
	regs    []*prometheus.Registry
	servers []*grpc.Server
	stops   []context.CancelFunc
	peers   []Peer
	// follows counts the peer streams the replicas' servers took.
	follows atomic.Int64
}

func newCluster(t testing.TB, n int, creds Credentials, opts Options) *cluster {
	t.Helper()
	return newClusterWith(t, n, creds, opts, v1alpha1.PickerConfig{})
}

// newClusterWith is newCluster with every picker configured by cfg.
func newClusterWith(t testing.TB, n int, creds Credentials, opts Options, cfg v1alpha1.PickerConfig, eps ...picker.Endpoint) *cluster {
	t.Helper()
	c := &cluster{t: t, clock: testclock.NewFakeClock(time.Now()), creds: creds, opts: opts, cfg: cfg, eps: eps}
	for i := range n {
		c.reps, c.pickers, c.regs = append(c.reps, nil), append(c.pickers, nil), append(c.regs, nil)
		c.servers, c.stops, c.peers = append(c.servers, nil), append(c.stops, nil), append(c.peers, Peer{})
		c.start(i)
	}
	for _, x := range c.reps {
		x.SetPeers(c.peers)
	}
	t.Cleanup(func() {
		for i := range c.reps {
			c.kill(i)
		}
	})
	return c
}

// start starts replica i, a new process of it: its own picker (an empty
// ledger), peer server and streams.
func (c *cluster) start(i int) {
	t := c.t
	p := picker.New(c.cfg, picker.Options{Clock: c.clock, Rand: mrand.New(mrand.NewPCG(uint64(i), 1))})
	eps := c.eps
	if eps == nil {
		eps = endpoints()
	}
	p.Replace(eps)
	reg := prometheus.NewRegistry()
	o := c.opts
	o.Self, o.Dial, o.Registerer, o.Log = fmt.Sprintf("tally-%d", i), c.creds.Dial, reg, logFor(t).WithName(fmt.Sprint(i))
	x := New(p, o)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	count := func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		c.follows.Add(1)
		return handler(srv, ss)
	}
	s := grpc.NewServer(append(ServerOptions(c.creds.Server()), grpc.StreamInterceptor(count))...)
	x.Register(s)
	go func() { _ = s.Serve(lis) }()
	ctx, stop := context.WithCancel(context.Background())
	go x.Run(ctx)
	c.reps[i], c.pickers[i], c.regs[i], c.servers[i], c.stops[i] = x, p, reg, s, stop
	c.peers[i] = Peer{Name: o.Self, Addr: netip.MustParseAddrPort(lis.Addr().String())}
}

// restart kills replica i and starts a new process of it, under the same
// name at a new address, which every replica then follows.
func (c *cluster) restart(i int) {
	c.kill(i)
	c.start(i)
	for _, x := range c.reps {
		x.SetPeers(c.peers)
	}
}

// kill stops replica i as a SIGKILL would: its server and its streams end.
func (c *cluster) kill(i int) {
	c.stops[i]()
	c.servers[i].Stop()
}

// lead makes replica i the leader and waits until every live replica
// follows it.
func (c *cluster) lead(i int, live ...int) {
	c.t.Helper()
	c.reps[i].Lead()
	c.eventually("every replica follows "+c.reps[i].opts.Self, func() bool {
		for _, j := range live {
			if c.reps[j].Leader() != c.reps[i].opts.Self {
				return false
			}
		}
		return true
	})
}

func (c *cluster) eventually(what string, ok func() bool) {
	c.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			c.t.Fatalf("after 10s: not %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// inFlight is each endpoint's in-flight count in replica i's ledger.
func (c *cluster) inFlight(i int) [3]int {
	var n [3]int
	for _, e := range c.pickers[i].Snapshot().Endpoints {
		n[int(e.Endpoint.Address.Addr().As4()[3])-2] = e.InFlight
	}
	return n
}

func (c *cluster) local(i int, reason string) float64 {
	m := newMetricsFor(c.regs[i])
	return testutil.ToFloat64(m.WithLabelValues(reason))
}

// metric reads the one series of reg's metric name.
func metric(t testing.TB, reg *prometheus.Registry, name string) *dto.Metric {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0]
		}
	}
	t.Fatalf("no %s", name)
	return nil
}

// histogram reads the count and sum of reg's histogram name.
func histogram(t *testing.T, reg *prometheus.Registry, name string) (uint64, float64) {
	t.Helper()
	h := metric(t, reg, name).GetHistogram()
	return h.GetSampleCount(), h.GetSampleSum()
}

// newMetricsFor reads the local placements counter from reg.
func newMetricsFor(reg *prometheus.Registry) *prometheus.CounterVec {
	v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tally_peer_local_placements_total"}, []string{"reason"})
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "tally_peer_local_placements_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			v.WithLabelValues(m.GetLabel()[0].GetValue()).Add(m.GetCounter().GetValue())
		}
	}
	return v
}

// prompt is a prompt of about tokens tokens: the shared text, then text
// of its own.
func prompt(shared string, own, tokens int) []byte {
	var b strings.Builder
	b.WriteString(shared)
	for b.Len() < 4*tokens {
		fmt.Fprintf(&b, "request %d says word %d. ", own, b.Len())
	}
	return []byte(b.String())
}

type pick struct {
	via int
	r   *picker.Reservation
}

// burst admits n requests at once, spread round-robin over the replicas
// in via, and returns them placed (none has ended).
func (c *cluster) burst(n int, shared string, via ...int) []pick {
	c.t.Helper()
	out := make([]pick, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for k := range n {
		wg.Go(func() {
			i := via[k%len(via)]
			r, err := c.reps[i].Admit(context.Background(), picker.Request{Model: "m", Prompt: prompt(shared, k, 32_000), Stream: true})
			if err != nil {
				errs <- err
				return
			}
			out[k] = pick{via: i, r: r}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		c.t.Fatal(err)
	}
	return out
}

func counts(ps []pick) [3]int {
	var n [3]int
	for _, p := range ps {
		n[int(p.r.Endpoints()[0].Addr().As4()[3])-2]++
	}
	return n
}

func within(n [3]int, total, slack int) bool {
	for _, v := range n {
		if v*3 < total-3*slack || v*3 > total+3*slack {
			return false
		}
	}
	return true
}

func (c *cluster) end(ps []pick) {
	for _, p := range ps {
		c.reps[p.via].End(p.r, picker.Outcome{})
	}
}

// newSaturated is n replicas with flow control on, replica 0 leading and
// followed, and the pool saturated: one request decoding on each pod
// (fill, placed through replica 0).
func newSaturated(t *testing.T, n int, opts Options) (c *cluster, fill []pick) {
	t.Helper()
	cfg := v1alpha1.PickerConfig{FlowControl: v1alpha1.FlowControl{Enabled: true, MaxDecodingRequests: 1, RequestTTLSeconds: 600}}
	c = newClusterWith(t, n, writeCredentials(t), opts, cfg)
	followers := make([]int, 0, n)
	for i := 1; i < n; i++ {
		followers = append(followers, i)
	}
	c.lead(0, followers...)
	fill = c.burst(3, "", 0)
	for _, p := range fill {
		c.reps[0].FirstByte(p.r)
	}
	return c, fill
}

// admitLater admits a prompt of 100 tokens (own text k) through replica i
// on a goroutine of its own; its reservation comes on the channel (nil
// after an error, which fails the test).
func (c *cluster) admitLater(i, k int) <-chan *picker.Reservation {
	placed := make(chan *picker.Reservation, 1)
	go func() {
		r, err := c.reps[i].Admit(context.Background(), picker.Request{Model: "m", Prompt: prompt("", k, 100)})
		if err != nil {
			c.t.Error(err)
		}
		placed <- r
	}()
	return placed
}

func TestThreeReplicasPlaceABurstAsOneLedger(t *testing.T) {
	creds := writeCredentials(t)
	for _, kind := range []string{"fresh", "shared"} {
		t.Run(kind, func(t *testing.T) {
			c := newCluster(t, 3, creds, Options{PickTimeout: time.Minute})
			c.lead(0, 1, 2)
			shared := ""
			if kind == "shared" {
				shared = string(prompt("", -1, 2_000))
			}
			ps := c.burst(128, shared, 0, 1, 2)
			n := counts(ps)
			if !within(n, 128, 1) {
				t.Errorf("placed %v, want each within 1 of 128/3", n)
			}
			for i := range 3 {
				if i > 0 && c.local(i, reasonNoLeader)+c.local(i, reasonTimeout)+c.local(i, reasonVersion) > 0 {
					t.Errorf("replica %d placed picks itself while the leader answered: %v no leader, %v timeout, %v version", i,
						c.local(i, reasonNoLeader), c.local(i, reasonTimeout), c.local(i, reasonVersion))
				}
				c.eventually(fmt.Sprintf("replica %d's ledger holds the burst as placed", i), func() bool { return c.inFlight(i) == n })
			}
			c.end(ps)
			for i := range 3 {
				c.eventually(fmt.Sprintf("replica %d's ledger empty", i), func() bool { return c.inFlight(i) == [3]int{} })
			}
		})
	}
}

func TestAHeldPrefixTakesAtMostHalfThroughReplicas(t *testing.T) {
	c := newCluster(t, 3, writeCredentials(t), Options{PickTimeout: time.Minute})
	c.lead(0, 1, 2)
	shared := string(prompt("", -1, 30_000))
	// One pod holds the prefix, and has finished with it.
	warm := c.burst(1, shared, 1)
	c.reps[1].FirstByte(warm[0].r)
	c.end(warm)
	ps := c.burst(128, shared, 0, 1, 2)
	n := counts(ps)
	holder := int(warm[0].r.Endpoints()[0].Addr().As4()[3]) - 2
	if n[holder] > 64 || min(n[0], n[1], n[2]) == 0 {
		t.Errorf("placed %v with the prefix on pod %d: want the holder at most half and no pod idle", n, holder)
	}
	c.end(ps)
}

func TestTheLeaderLostFollowersPlaceAtOnceAndTheNextLeaderReconciles(t *testing.T) {
	c := newCluster(t, 3, writeCredentials(t), Options{PickTimeout: time.Minute, OrphanGrace: 200 * time.Millisecond})
	c.lead(0, 1, 2)
	before := c.burst(30, "", 0, 1, 2)
	for i := range 3 {
		c.eventually("the burst replicated", func() bool { return sum(c.inFlight(i)) == 30 })
	}
	// Some of those before end while the leader lives, some after.
	c.end(before[:6])
	for i := range 3 {
		c.eventually("the ends replicated", func() bool { return sum(c.inFlight(i)) == 24 })
	}
	c.kill(0)
	c.eventually("no leader", func() bool { return c.reps[1].Leader() == "" && c.reps[2].Leader() == "" })
	gap := c.burst(30, "", 1, 2)
	if got := c.local(1, reasonNoLeader) + c.local(2, reasonNoLeader); got != 30 {
		t.Errorf("%v picks placed locally without a leader, want 30", got)
	}
	c.end(before[6:9]) // ends no leader hears
	// In the gap each live replica's copy holds the other's placements
	// and ends too: 24 of before less the 2 ended by live replicas, and
	// the 30 of the gap (the dead leader's end is never heard).
	for _, i := range []int{1, 2} {
		c.eventually(fmt.Sprintf("replica %d holds the gap's placements of both", i), func() bool { return sum(c.inFlight(i)) == 52 })
	}
	c.lead(1, 2)
	// The new leader holds each open reservation once: the 30 of before
	// less the 6 ended while the leader lived and the 2 the live replicas
	// ended in the gap (the dead leader's end of one of its own is never
	// heard: its 8 are left to the model after the grace), and the 30 of
	// the gap.
	want := 30 - 6 - 2 + 30
	for _, i := range []int{1, 2} {
		c.eventually(fmt.Sprintf("replica %d holds %d", i, want), func() bool { return sum(c.inFlight(i)) == want })
	}
	after := c.burst(12, "", 1, 2)
	if got := c.local(2, reasonNoLeader) + c.local(2, reasonTimeout); got != 15 {
		t.Errorf("replica 2 placed %v picks itself, want only its 15 of the gap", got)
	}
	var alive []pick
	for _, p := range append(append(before[9:], gap...), after...) {
		if p.via != 0 {
			alive = append(alive, p)
		}
	}
	c.end(alive)
	// What the dead leader served is left to the model: it drains once
	// the grace has passed and the model's time has.
	time.Sleep(1500 * time.Millisecond)
	c.clock.Step(time.Hour)
	for _, i := range []int{1, 2} {
		c.eventually(fmt.Sprintf("replica %d's ledger empty", i), func() bool { return sum(c.inFlight(i)) == 0 })
	}
}

func sum(n [3]int) int { return n[0] + n[1] + n[2] }

func TestOnlyPeersReachThePeerPort(t *testing.T) {
	creds := writeCredentials(t)
	c := newCluster(t, 1, creds, Options{})
	c.reps[0].Lead()
	addr := c.peers[0].Addr.String()
	other := writeCredentials(t) // another pool's credentials
	ca, _, err := creds.load()
	if err != nil {
		t.Fatal(err)
	}
	_ = ca
	_, pool, _ := creds.load()
	otherCert, _, _ := other.load()
	for name, dial := range map[string]credentials.TransportCredentials{
		"plaintext":           insecure.NewCredentials(),
		"no client cert":      credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: ServerName}),
		"another pool's cert": credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: ServerName, Certificates: []tls.Certificate{otherCert}}),
	} {
		t.Run(name, func(t *testing.T) {
			conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(dial))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			s, err := pb.NewPeerClient(conn).Follow(ctx)
			if err == nil {
				_ = s.Send(&pb.FromFollower{Msg: &pb.FromFollower_Hello{Hello: &pb.Hello{Version: Version, Replica: "intruder"}}})
				var m *pb.FromLeader
				if m, err = s.Recv(); err == nil {
					t.Fatalf("a client without the pool's peer credentials was answered: %v", m)
				}
			}
		})
	}
	// With them, it is answered.
	s := handFollower(t, context.Background(), creds, addr)
	_ = s.Send(&pb.FromFollower{Msg: &pb.FromFollower_Hello{Hello: &pb.Hello{Version: Version, Replica: "peer"}}})
	m, err := s.Recv()
	if err != nil || !m.GetHello().GetLeading() {
		t.Fatalf("a peer got %v, %v; want the leader's Hello", m, err)
	}
}

func TestAFollowerOfAnotherVersionPlacesLocally(t *testing.T) {
	c := newCluster(t, 2, writeCredentials(t), Options{})
	c.lead(0, 1)
	// The leader now says it speaks another version, as a newer build would.
	c.reps[1].peerHello(c.reps[1].leader, &pb.Hello{Version: Version + 1, Replica: "tally-0", Leading: true})
	if l := c.reps[1].Leader(); l != "" {
		t.Fatalf("following %q, a leader of another version", l)
	}
	ps := c.burst(3, "", 1)
	if got := c.local(1, reasonVersion); got != 3 {
		t.Errorf("%v local placements for the version, want 3", got)
	}
	c.end(ps)
}

// leaderChanges reads replica i's tally_peer_leader_changes_total.
func (c *cluster) leaderChanges(i int) float64 {
	return metric(c.t, c.regs[i], "tally_peer_leader_changes_total").GetCounter().GetValue()
}

// The first leader is no change, nor a follower's reconnection to the
// same leader; a new leader is one change on every replica that sees it,
// and a replica that leads reports no lag.
func TestLeaderChangesCountNewLeadersOnly(t *testing.T) {
	c := newCluster(t, 3, writeCredentials(t), Options{})
	c.lead(0, 1, 2)
	c.end(c.burst(6, "", 0, 1, 2))
	c.eventually("replica 1 applied the leader's changes", func() bool { return c.reps[1].Status().LagSeconds > 0 })

	// Replica 1 drops its stream to the leader and opens another.
	c.reps[1].SetPeers([]Peer{c.peers[1], c.peers[2]})
	c.eventually("replica 1 follows no one", func() bool { return c.reps[1].Leader() == "" })
	c.reps[1].SetPeers(c.peers)
	c.eventually("replica 1 follows tally-0 again", func() bool { return c.reps[1].Leader() == "tally-0" })
	for i := range 3 {
		if got := c.leaderChanges(i); got != 0 {
			t.Errorf("replica %d counted %v leader changes with one leader all along, want 0", i, got)
		}
	}

	c.kill(0)
	c.lead(1, 2)
	for i := 1; i < 3; i++ {
		if got := c.leaderChanges(i); got != 1 {
			t.Errorf("replica %d counted %v leader changes after tally-1 took over, want 1", i, got)
		}
	}
	if lag := c.reps[1].Status().LagSeconds; lag != 0 {
		t.Errorf("the new leader reports a lag of %vs, want 0", lag)
	}
}

// A follower that reads nothing (its window full, then its outbox) is cut:
// the leader's handler ends even though a send waits on the follower's
// flow control, so the follower is counted gone and its stream freed.
func TestAFollowerThatReadsNothingIsCut(t *testing.T) {
	c := newCluster(t, 1, writeCredentials(t), Options{PickTimeout: time.Minute})
	c.lead(0)
	s := handFollower(t, context.Background(), c.creds, c.peers[0].Addr.String())
	if err := s.Send(&pb.FromFollower{Msg: &pb.FromFollower_Hello{Hello: &pb.Hello{Version: Version, Replica: "deaf", Instance: "1"}}}); err != nil {
		t.Fatal(err)
	}
	x := c.reps[0]
	// followers is how many followers the leader serves, and full whether
	// one's outbox is full.
	state := func() (followers int, full bool) {
		x.mu.Lock()
		defer x.mu.Unlock()
		for f := range x.followers {
			full = full || len(f.out) == cap(f.out)
		}
		return len(x.followers), full
	}
	c.eventually("the leader serves the deaf follower", func() bool { n, _ := state(); return n == 1 })
	// Placements and ends, of long prompts (large messages), until the
	// outbox is full, and one more that overflows it.
	long := prompt("", 0, 32_000)
	for k, over := 0, false; !over; k++ {
		_, over = state()
		if k == 20_000 {
			t.Fatal("the outbox of a follower that reads nothing did not fill in 20,000 picks")
		}
		r, err := x.Admit(context.Background(), picker.Request{Model: "m", Prompt: long, Stream: true})
		if err != nil {
			t.Fatal(err)
		}
		x.End(r, picker.Outcome{})
	}
	// Within the grace of a stuck send, and some.
	deadline := time.Now().Add(stuckSendGrace + 20*time.Second)
	for {
		x.mu.Lock()
		_, gone := x.gone["deaf"]
		n := len(x.followers)
		x.mu.Unlock()
		if n == 0 && gone {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v after its outbox filled the leader still serves the deaf follower", stuckSendGrace+20*time.Second)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// newerLeader answers a follower as a leader of the next peer protocol
// version does: its Hello, then the end of the stream.
type newerLeader struct {
	pb.UnimplementedPeerServer
	streams atomic.Int64
}

func (n *newerLeader) Follow(stream grpc.BidiStreamingServer[pb.FromFollower, pb.FromLeader]) error {
	defer n.streams.Add(1)
	if _, err := stream.Recv(); err != nil {
		return err
	}
	_ = stream.Send(&pb.FromLeader{Msg: &pb.FromLeader_Hello{Hello: &pb.Hello{Version: Version + 1, Replica: "newer", Leading: true, Instance: "1"}}})
	return status.Errorf(codes.FailedPrecondition, "peer protocol version %d is not spoken here (%d)", Version, Version+1)
}

// A leader of another version ends each stream after its Hello: the picks
// placed here meanwhile are counted for the version, not for want of a
// leader.
func TestPicksPlacedBesideALeaderOfAnotherVersionSaySo(t *testing.T) {
	creds := writeCredentials(t)
	newer := &newerLeader{}
	peer, _ := servePeer(t, creds, "newer", newer)
	p := picker.New(v1alpha1.PickerConfig{}, picker.Options{})
	p.Replace(endpoints())
	reg := prometheus.NewRegistry()
	x := New(p, Options{Self: "tally-0", Dial: creds.Dial, Registerer: reg, Log: logFor(t)})
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go x.Run(ctx)
	x.SetPeers([]Peer{{Name: "tally-0"}, peer})
	// Two streams ended: the follower has heard the leader and lost its
	// stream since.
	deadline := time.Now().Add(20 * time.Second)
	for newer.streams.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the follower did not reconnect to the leader of another version")
		}
		time.Sleep(5 * time.Millisecond)
	}
	for i := range 5 {
		r, err := x.Admit(context.Background(), picker.Request{Model: "m", Prompt: prompt("", i, 100)})
		if err != nil {
			t.Fatal(err)
		}
		x.End(r, picker.Outcome{})
	}
	local := newMetricsFor(reg)
	if v, n := testutil.ToFloat64(local.WithLabelValues(reasonVersion)), testutil.ToFloat64(local.WithLabelValues(reasonNoLeader)); v != 5 || n != 0 {
		t.Errorf("placed here for the version %v, for want of a leader %v: want 5 and 0", v, n)
	}
}

func TestAForwardedPickWaitsInTheLeadersQueue(t *testing.T) {
	// A pick unanswered for a second is placed locally, unless the leader
	// says it waits in its queue. (At 50 ms, a busy machine once delayed
	// the leader's "queued" past the bound.)
	c, fill := newSaturated(t, 2, Options{PickTimeout: time.Second})
	waiting := func(i int) int { return c.pickers[i].Snapshot().Waiting }

	placed := c.admitLater(1, 1000)
	c.eventually("the follower's pick waits in the leader's queue", func() bool { return waiting(0) == 1 })
	time.Sleep(1500 * time.Millisecond) // past the bound
	select {
	case r := <-placed:
		t.Fatalf("placed on %v while the pool was saturated", r.Endpoints())
	default:
	}
	if got := c.local(1, reasonTimeout) + c.local(1, reasonNoLeader); got != 0 {
		t.Fatalf("the follower placed %v picks itself while the leader held them in its queue", got)
	}
	// A request that waits and whose client leaves is gone from the queue.
	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan error, 1)
	go func() {
		_, err := c.reps[1].Admit(ctx, picker.Request{Model: "m", Prompt: prompt("", 1001, 100)})
		left <- err
	}()
	c.eventually("both wait", func() bool { return waiting(0) == 2 })
	cancel()
	if err := <-left; err == nil {
		t.Fatal("a cancelled pick was placed")
	}
	c.eventually("the cancelled pick leaves the leader's queue", func() bool { return waiting(0) == 1 })

	// Capacity frees: the waiting pick is placed where it freed.
	c.end(fill[:1])
	r := <-placed
	if got, want := r.Endpoints()[0], fill[0].r.Endpoints()[0]; got != want {
		t.Errorf("placed on %v, want %v, the endpoint that freed", got, want)
	}
	// Each forward's round trip (this one's and the cancelled one's) was
	// timed to the leader's "queued", once, not through the wait (over
	// 1.5 s).
	if n, secs := histogram(t, c.regs[1], "tally_peer_forward_duration_seconds"); n != 2 || secs >= 1.5 {
		t.Errorf("forward round trips: %d observed, %.3f s in all; want 2, under the 1.5 s the first waited", n, secs)
	}
	for i := range 2 {
		c.eventually(fmt.Sprintf("replica %d holds the 3 in flight", i), func() bool { return sum(c.inFlight(i)) == 3 })
	}
	c.reps[1].End(r, picker.Outcome{})
	c.end(fill[1:])
	for i := range 2 {
		c.eventually(fmt.Sprintf("replica %d's ledger empty", i), func() bool { return sum(c.inFlight(i)) == 0 && waiting(i) == 0 })
	}
}

func TestAPickTheLeaderAnsweredLateIsCountedOnce(t *testing.T) {
	// Every forwarded pick times out at once: the follower places it
	// itself, and the leader, which placed it too, keeps only the
	// follower's placement.
	c := newCluster(t, 2, writeCredentials(t), Options{PickTimeout: time.Nanosecond})
	c.lead(0, 1)
	ps := c.burst(30, "", 1)
	if got := c.local(1, reasonTimeout); got == 0 {
		t.Fatal("no pick timed out: the test proves nothing")
	}
	n := counts(ps)
	for i := range 2 {
		c.eventually(fmt.Sprintf("replica %d holds each pick once, where the follower placed it", i), func() bool { return c.inFlight(i) == n })
	}
	c.end(ps)
	for i := range 2 {
		c.eventually(fmt.Sprintf("replica %d's ledger empty", i), func() bool { return sum(c.inFlight(i)) == 0 })
	}
}

func TestADetachedStreamThroughAFollowerStaysInEveryLedgerUntilTheModelEndsIt(t *testing.T) {
	// NGINX Gateway Fabric ends the stream at the pick: the reservation
	// stays, on the leader's ledger and every copy, until the model says
	// the request is done.
	c := newCluster(t, 3, writeCredentials(t), Options{PickTimeout: time.Minute})
	c.lead(0, 1, 2)
	ps := c.burst(6, "", 1)
	for _, p := range ps {
		c.reps[1].End(p.r, picker.Outcome{Detached: true})
	}
	for i := range 3 {
		c.eventually(fmt.Sprintf("replica %d holds the 6 detached", i), func() bool {
			l := c.pickers[i].Snapshot()
			return l.InFlight == 6 && l.Detached == 6
		})
	}
	c.clock.Step(time.Hour)
	for i := range 3 {
		c.eventually(fmt.Sprintf("replica %d's ledger empty", i), func() bool { return c.pickers[i].Snapshot().InFlight == 0 })
	}
}

func TestAFollowerBackAsAnotherProcessLeavesItsOldReservationsToTheModel(t *testing.T) {
	// The grace for replicas that are gone is an hour: what ends the old
	// process's reservations is its successor's arrival.
	c := newCluster(t, 2, writeCredentials(t), Options{PickTimeout: time.Minute, OrphanGrace: time.Hour})
	c.lead(0, 1)
	c.burst(5, "", 1)
	c.eventually("the leader holds the follower's 5", func() bool { return sum(c.inFlight(0)) == 5 })
	c.restart(1)
	c.lead(0, 1)
	c.eventually("the old process's 5 are detached on the leader", func() bool {
		l := c.pickers[0].Snapshot()
		return l.InFlight == 5 && l.Detached == 5
	})
	c.clock.Step(time.Hour)
	c.eventually("and end by the model", func() bool { return c.pickers[0].Snapshot().InFlight == 0 })
}

func TestASplitRequestIsHeldAsSplitOnEveryCopy(t *testing.T) {
	// Two prefill pods and two decode pods: the leader splits each long
	// cold request, and every copy holds its prefill on the prefill pod
	// the leader chose and its decoding on the decode pod, naming the
	// prefiller to the follower's gateway.
	eps := make([]picker.Endpoint, 4)
	for i := range eps {
		role := "decode"
		if i < 2 {
			role = "prefill"
		}
		eps[i] = picker.Endpoint{Pod: fmt.Sprintf("pod-%d", i), Role: role,
			Address: netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, byte(2 + i)}), 8000)}
	}
	cfg := v1alpha1.PickerConfig{Disaggregation: v1alpha1.Disaggregation{NonCachedTokens: 16}}
	c := newClusterWith(t, 2, writeCredentials(t), Options{PickTimeout: time.Minute}, cfg, eps...)
	c.lead(0, 1)
	ps := c.burst(8, "", 0, 1)
	for _, p := range ps {
		if _, ok := p.r.Prefiller(); !ok {
			t.Fatalf("a request through replica %d was not split: %v", p.via, p.r.Endpoints())
		}
	}
	rows := func(i int) map[string][2]int {
		out := map[string][2]int{}
		for _, e := range c.pickers[i].Snapshot().Endpoints {
			out[e.Endpoint.Pod] = [2]int{e.InFlight, e.PrefillTokens}
		}
		return out
	}
	c.eventually("both copies hold the same rows", func() bool {
		a, b := rows(0), rows(1)
		return fmt.Sprint(a) == fmt.Sprint(b) && a["pod-0"][0]+a["pod-1"][0] == 8 && a["pod-2"][0]+a["pod-3"][0] == 8
	})
	for _, p := range ps {
		c.reps[p.via].FirstByte(p.r)
	}
	c.eventually("the prefill parts released on both at the first bytes", func() bool {
		for i := range 2 {
			r := rows(i)
			if r["pod-0"][0]+r["pod-1"][0] != 0 || r["pod-2"][0]+r["pod-3"][0] != 8 {
				return false
			}
		}
		return true
	})
	c.end(ps)
	// A request from a gateway that takes only the destination, through
	// the follower: the leader does not split it.
	r, err := c.reps[1].Admit(context.Background(), picker.Request{Model: "m", Prompt: prompt("", 99, 32_000), DestinationOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if a, ok := r.Prefiller(); ok {
		t.Errorf("a request from a gateway that takes only the destination was split onto %s through the follower", a)
	}
	c.reps[1].End(r, picker.Outcome{})
	c.eventually("both ledgers empty", func() bool {
		return c.pickers[0].Snapshot().InFlight == 0 && c.pickers[1].Snapshot().InFlight == 0
	})
}

// A follower that joins while thousands of requests are in flight gets
// them all in one Sync: a message larger than gRPC's default 4 MiB.
func TestAFollowerJoiningAFullLedgerGetsItWhole(t *testing.T) {
	c := newCluster(t, 2, writeCredentials(t), Options{PickTimeout: time.Minute})
	c.lead(0, 1)
	const n = 2500 // about 2 KB of block hashes each
	long := prompt("", 0, 32_000)
	var ps []pick
	for range n {
		r, err := c.reps[0].Admit(context.Background(), picker.Request{Model: "m", Prompt: long, Stream: true})
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, pick{via: 0, r: r})
	}
	c.restart(1)
	c.lead(0, 1)
	c.eventually(fmt.Sprintf("the new follower's copy holds the %d", n), func() bool { return c.pickers[1].Snapshot().InFlight == n })
	c.end(ps)
	c.eventually("every copy is idle", func() bool {
		return c.pickers[0].Snapshot().InFlight == 0 && c.pickers[1].Snapshot().InFlight == 0
	})
}

// A quiet pool sends nothing on its peer streams for minutes: the
// follower's keepalive pings must not make the leader's server take it
// for abuse and cut the stream (gRPC's default policy did, after the
// fourth ping), or the follower places picks alone until it reconnects.
func TestAQuietPeerStreamStaysOpen(t *testing.T) {
	testtier.SkipIfShort(t, "45 s of wall time: 4.5 keepalive intervals")
	t.Parallel()
	c := newCluster(t, 2, writeCredentials(t), Options{})
	c.lead(0, 0, 1)
	// Each replica follows the other: two streams, the leader's own to its
	// follower perhaps not up yet when the follower follows.
	c.eventually("both peer streams up", func() bool { return c.follows.Load() >= 2 })
	streams := c.follows.Load()
	time.Sleep(peerPing*4 + peerPing/2)
	if n := c.follows.Load(); n != streams {
		t.Fatalf("the replicas' servers took %d peer streams while nothing happened, after %d: a quiet stream was cut", n-streams, streams)
	}
	if c.reps[1].Leader() != c.reps[0].opts.Self {
		t.Fatalf("the follower follows %q after a quiet spell, not the leader", c.reps[1].Leader())
	}
	ps := c.burst(3, "quiet", 1)
	if got := c.local(1, reasonNoLeader); got != 0 {
		t.Fatalf("after a quiet spell, the follower placed %v picks alone", got)
	}
	c.end(ps)
}

// hungLeader says it leads, then reads nothing more: a hung process whose
// connection, and its keepalive, live on.
type hungLeader struct {
	pb.UnimplementedPeerServer
}

func (hungLeader) Follow(stream grpc.BidiStreamingServer[pb.FromFollower, pb.FromLeader]) error {
	if _, err := stream.Recv(); err != nil {
		return err
	}
	if err := stream.Send(&pb.FromLeader{Msg: &pb.FromLeader_Hello{Hello: &pb.Hello{Version: Version, Replica: "hung", Leading: true, Instance: "1"}}}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

// A leader that stopped reading lets its flow control window fill; then
// the follower's sends wait, in the outbox's goroutine, and its picks do
// not: no pick waits past the pick bound, and each is placed here.
func TestPicksToALeaderThatStoppedReadingArePlacedHere(t *testing.T) {
	creds := writeCredentials(t)
	hung, _ := servePeer(t, creds, "hung", hungLeader{})
	// Whether the follower logged that it cut its stream for a full outbox.
	var cut atomic.Bool
	log := funcr.New(func(_, args string) {
		if strings.Contains(args, errOutboxFull.Error()) {
			cut.Store(true)
		}
	}, funcr.Options{})
	x, p, reg := lonelyFollower(t, creds, hung, Options{Log: log, PickTimeout: 50 * time.Millisecond})

	req := func(k int) picker.Request {
		return picker.Request{Model: "m", Prompt: prompt("", k, 32_000), Stream: true}
	}
	size := proto.Size(&pb.FromFollower{Msg: &pb.FromFollower_Pick{Pick: &pb.Pick{Id: x.newID(), Request: toRequest(p.Prepare(req(0)))}}})
	// Twice what the window lets go unread (the placements the follower
	// then shares with the leader fill it too).
	n := 2*peerWindowBytes/size + 1
	var (
		next   atomic.Int64
		placed atomic.Int64
		wg     sync.WaitGroup
		mu     sync.Mutex
		rs     []*picker.Reservation
	)
	for range 32 {
		wg.Go(func() {
			for k := int(next.Add(1)); k <= n; k = int(next.Add(1)) {
				r, err := x.Admit(context.Background(), req(k))
				if err != nil {
					t.Error(err)
					return
				}
				placed.Add(1)
				mu.Lock()
				rs = append(rs, r)
				mu.Unlock()
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatalf("after 2 minutes %d of %d picks are placed: the others wait on a send to a leader that reads nothing", placed.Load(), n)
	}
	m := newMetricsFor(reg)
	if local := testutil.ToFloat64(m.WithLabelValues(reasonTimeout)) + testutil.ToFloat64(m.WithLabelValues(reasonNoLeader)); int(local) != n {
		t.Errorf("%v of %d picks placed here", local, n)
	}
	if inFlight := p.Snapshot().InFlight; inFlight != n {
		t.Errorf("the follower's ledger holds %d in flight, want %d", inFlight, n)
	}
	for _, r := range rs {
		x.End(r, picker.Outcome{})
	}

	// What waits unsent grows with each pick placed here (its Adopt) and
	// each end, until the outbox is full: the stream is cut, and the log
	// says why.
	deadline := time.Now().Add(2 * time.Minute)
	for range 32 {
		wg.Go(func() {
			for !cut.Load() && time.Now().Before(deadline) {
				r, err := x.Admit(context.Background(), picker.Request{Model: "m", Prompt: prompt("", int(next.Add(1)), 100)})
				if err != nil {
					t.Error(err)
					return
				}
				x.End(r, picker.Outcome{})
			}
		})
	}
	wg.Wait()
	if !cut.Load() {
		t.Fatalf("after 2 minutes of picks the follower did not log that it cut its stream to a leader that reads nothing for a full outbox (%q)", errOutboxFull)
	}
}

// A replica shutting down steps down; the Lease it released may still
// reach it as a late Lead, which must not make it a second leader beside
// the next one.
func TestAReplicaThatSteppedDownLeadsNoMore(t *testing.T) {
	c := newCluster(t, 2, writeCredentials(t), Options{PickTimeout: time.Minute})
	c.lead(0, 1)
	c.reps[0].StepDown()
	c.eventually("the follower stops following the replica that stepped down", func() bool { return c.reps[1].Leader() == "" })
	c.reps[0].Lead()
	if got := c.reps[0].Leader(); got == "tally-0" {
		t.Fatal("a Lead after StepDown made the replica that is shutting down lead again")
	}
	c.lead(1, 0, 1)
	ps := c.burst(3, "", 0)
	if got := c.local(0, reasonNoLeader) + c.local(0, reasonTimeout); got != 0 {
		t.Fatalf("the replica that stepped down placed %v picks alone", got)
	}
	c.eventually("the next leader holds the 3 forwarded to it", func() bool { return c.pickers[1].Snapshot().InFlight == 3 })
	c.end(ps)
}
