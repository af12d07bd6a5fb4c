package replica

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
	pb "github.com/tallyepp/tally/picker/replica/replicapb"
)

// fakeLeader serves the peer protocol as a leader whose Hello says it
// leads, and answers each pick with what answer returns.
type fakeLeader struct {
	pb.UnimplementedPeerServer
	name   string
	answer func(*pb.Pick) []*pb.FromLeader
	// ops, if set, are sent as they come.
	ops <-chan *pb.FromLeader
}

func (f fakeLeader) Follow(stream grpc.BidiStreamingServer[pb.FromFollower, pb.FromLeader]) error {
	if _, err := stream.Recv(); err != nil {
		return err
	}
	if err := stream.Send(&pb.FromLeader{Msg: &pb.FromLeader_Hello{Hello: &pb.Hello{Version: Version, Replica: f.name, Leading: true, Instance: "1"}}}); err != nil {
		return err
	}
	if f.ops != nil {
		go func() {
			for m := range f.ops {
				_ = stream.Send(m)
			}
		}()
	}
	for {
		m, err := stream.Recv()
		if err != nil {
			return nil
		}
		if p := m.GetPick(); p != nil {
			for _, out := range f.answer(p) {
				if err := stream.Send(out); err != nil {
					return nil
				}
			}
		}
	}
}

// serveFake serves f on loopback with the pool's peer credentials; stop
// ends its server and its streams.
func serveFake(t *testing.T, creds Credentials, f fakeLeader) (p Peer, stop func()) {
	t.Helper()
	return servePeer(t, creds, f.name, f)
}

// servePeer serves srv, the peer named name, on loopback with the pool's
// peer credentials; stop ends its server and its streams.
func servePeer(t *testing.T, creds Credentials, name string, srv pb.PeerServer) (p Peer, stop func()) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(ServerOptions(creds.Server())...)
	pb.RegisterPeerServer(s, srv)
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	return Peer{Name: name, Addr: netip.MustParseAddrPort(lis.Addr().String())}, s.Stop
}

// handFollower opens a Follow stream, with the pool's peer credentials,
// to the peer at addr: a test speaks on it as a follower, by hand.
func handFollower(t *testing.T, ctx context.Context, creds Credentials, addr string) pb.Peer_FollowClient {
	t.Helper()
	dial, err := creds.Dial()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(dial))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	s, err := pb.NewPeerClient(conn).Follow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// lonelyFollower is replica tally-0, with opts and a picker of its own,
// following leader and no other peer, once it follows it.
func lonelyFollower(t *testing.T, creds Credentials, leader Peer, opts Options) (*Replica, *picker.Picker, *prometheus.Registry) {
	t.Helper()
	p := picker.New(v1alpha1.PickerConfig{}, picker.Options{})
	p.Replace(endpoints())
	reg := prometheus.NewRegistry()
	opts.Self, opts.Dial, opts.Registerer = "tally-0", creds.Dial, reg
	if opts.Log.GetSink() == nil {
		opts.Log = logFor(t)
	}
	x := New(p, opts)
	ctx, stop := context.WithCancel(context.Background())
	t.Cleanup(stop)
	go x.Run(ctx)
	x.SetPeers([]Peer{{Name: "tally-0"}, leader})
	deadline := time.Now().Add(10 * time.Second)
	for x.Leader() != leader.Name {
		if time.Now().After(deadline) {
			t.Fatalf("the follower does not follow %s", leader.Name)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return x, p, reg
}

// A leader that steps down refuses the picks that reach it after (its
// followers sent them before its Hello said so): each is placed on the
// follower, none fails.
func TestAPickTheSteppedDownLeaderRefusesIsPlacedHere(t *testing.T) {
	creds := writeCredentials(t)
	old, _ := serveFake(t, creds, fakeLeader{name: "old", answer: func(p *pb.Pick) []*pb.FromLeader {
		return []*pb.FromLeader{
			{Msg: &pb.FromLeader_Hello{Hello: &pb.Hello{Version: Version, Replica: "old", Instance: "1"}}},
			placed(&pb.Placed{Id: p.Id, Refusal: pb.Refusal_REFUSAL_NOT_LEADING}),
		}
	}})
	x, p, reg := lonelyFollower(t, creds, old, Options{PickTimeout: time.Minute})
	r, err := x.Admit(context.Background(), picker.Request{Model: "m", Prompt: prompt("", 1, 100)})
	if err != nil {
		t.Fatalf("a pick that reached the leader as it stepped down failed: %v", err)
	}
	if got := testutil.ToFloat64(newMetricsFor(reg).WithLabelValues(reasonNoLeader)); got != 1 {
		t.Errorf("%v picks placed here for want of a leader, want 1", got)
	}
	if got := p.Snapshot().InFlight; got != 1 {
		t.Errorf("the follower's ledger holds %d in flight, want 1", got)
	}
	x.End(r, picker.Outcome{})
}

// A pick queued at a leader that another replaced, and that is then lost,
// waits for no one: it is placed here and the new leader adopts it.
func TestAPickQueuedAtALeaderReplacedAndThenLostIsPlacedHere(t *testing.T) {
	creds := writeCredentials(t)
	c := newCluster(t, 2, creds, Options{PickTimeout: time.Minute})
	got := make(chan struct{}, 1)
	old, stopOld := serveFake(t, creds, fakeLeader{name: "old", answer: func(p *pb.Pick) []*pb.FromLeader {
		got <- struct{}{}
		return []*pb.FromLeader{placed(&pb.Placed{Id: p.Id, Queued: true})}
	}})
	c.reps[1].SetPeers(append(append([]Peer(nil), c.peers...), old))
	c.eventually("replica 1 follows the old leader", func() bool { return c.reps[1].Leader() == "old" })
	placed := c.admitLater(1, 1)
	<-got
	c.lead(0, 1)
	stopOld()
	c.holdsOnlyThenEnds(1, awaitPlaced(t, placed))
}

// A follower's pick waits in the leader's queue past the follower's bound,
// so the follower places it itself and the leader adopts that placement:
// the queued pick is withdrawn, and once capacity frees nothing of it is
// placed again, counted twice or left behind.
func TestAQueuedPickTheFollowerPlacedItselfIsCountedOnce(t *testing.T) {
	c, fill := newSaturated(t, 1, Options{PickTimeout: time.Minute})

	// A follower, spoken by hand.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := handFollower(t, ctx, c.creds, c.peers[0].Addr.String())
	send := func(m *pb.FromFollower) {
		t.Helper()
		if err := s.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	send(&pb.FromFollower{Msg: &pb.FromFollower_Hello{Hello: &pb.Hello{Version: Version, Replica: "f", Instance: "1"}}})
	queued := make(chan struct{})
	go func() {
		for {
			m, err := s.Recv()
			if err != nil {
				return
			}
			if m.GetPlaced().GetQueued() {
				close(queued)
			}
		}
	}()
	req := toRequest(c.pickers[0].Prepare(picker.Request{Model: "m", Prompt: prompt("", 1000, 100)}))
	send(&pb.FromFollower{Msg: &pb.FromFollower_Pick{Pick: &pb.Pick{Id: "f/1/1", Request: req}}})
	select {
	case <-queued:
	case <-time.After(10 * time.Second):
		t.Fatal("the leader did not queue the pick")
	}
	// The follower's bound passed: it placed the pick itself.
	ep := c.eps
	if ep == nil {
		ep = endpoints()
	}
	send(&pb.FromFollower{Msg: &pb.FromFollower_Adopt{Adopt: &pb.Reservation{Id: "f/1/1", Origin: "f", Request: req, Endpoints: []string{ep[1].Address.String()}}}})
	c.eventually("the leader withdraws the queued pick", func() bool { return c.pickers[0].Snapshot().Waiting == 0 })
	c.eventually("the leader holds the adopted placement", func() bool { return c.pickers[0].Snapshot().InFlight == 4 })
	c.end(fill)
	c.eventually("the leader holds the adopted placement alone", func() bool { return c.pickers[0].Snapshot().InFlight == 1 })
	send(&pb.FromFollower{Msg: &pb.FromFollower_Event{Event: &pb.Event{Id: "f/1/1", Kind: pb.Event_KIND_END}}})
	c.eventually("the leader's ledger empty", func() bool { return c.pickers[0].Snapshot().InFlight == 0 })
	// Nothing placed later either.
	time.Sleep(200 * time.Millisecond)
	if l := c.pickers[0].Snapshot(); l.InFlight != 0 || l.Waiting != 0 {
		t.Fatalf("after the end the leader holds %d in flight and %d waiting", l.InFlight, l.Waiting)
	}
}

// A pick that waited in the leader's own queue while it stepped down is
// placed there after: the next leader holds it, and its end too.
func TestAPickPlacedFromTheQueueAfterSteppingDownReachesTheNextLeader(t *testing.T) {
	c, fill := newSaturated(t, 2, Options{PickTimeout: time.Minute})
	placed := c.admitLater(0, 1000)
	c.eventually("the pick waits in the leader's queue", func() bool { return c.pickers[0].Snapshot().Waiting == 1 })
	c.reps[0].StepDown()
	c.lead(1, 0, 1)
	c.end(fill)
	r := awaitPlaced(t, placed)
	c.holdsOnlyThenEnds(0, r)
}

// A peer that led once and still sends changes after another took over
// (it has not yet learnt it lost the Lease) changes no copy: the leader
// followed is the one whose Sync holds.
func TestChangesFromAPeerNoLongerFollowedAreIgnored(t *testing.T) {
	creds := writeCredentials(t)
	c := newCluster(t, 2, creds, Options{PickTimeout: time.Minute})
	ops := make(chan *pb.FromLeader, 1)
	t.Cleanup(func() { close(ops) })
	old, _ := serveFake(t, creds, fakeLeader{name: "old", ops: ops, answer: func(*pb.Pick) []*pb.FromLeader { return nil }})
	c.reps[1].SetPeers(append(append([]Peer(nil), c.peers...), old))
	c.eventually("replica 1 follows the old leader", func() bool { return c.reps[1].Leader() == "old" })
	c.lead(0, 1)
	req := toRequest(c.pickers[1].Prepare(picker.Request{Model: "m", Prompt: prompt("", 7, 100)}))
	ops <- &pb.FromLeader{Msg: &pb.FromLeader_Op{Op: &pb.Op{Op: &pb.Op_Placed{Placed: &pb.Reservation{
		Id: "old/1/1", Origin: "old", Request: req, Endpoints: []string{endpoints()[0].Address.String()},
	}}, SentUnixNano: time.Now().UnixNano()}}}
	// Nothing on another stream can say the change was read: give it
	// time (on loopback it takes well under a millisecond).
	time.Sleep(500 * time.Millisecond)
	if got := c.pickers[1].Snapshot().InFlight; got != 0 {
		t.Fatalf("replica 1's copy holds %d in flight: it took a change from a peer it no longer follows", got)
	}
}

// A follower's pick that waits in the leader's queue when the leader
// steps down goes back to the follower, which places it: the next leader
// holds it, and every copy holds it once.
func TestAPickQueuedAtALeaderThatStepsDownReachesTheNextLeader(t *testing.T) {
	c, fill := newSaturated(t, 3, Options{PickTimeout: time.Minute})
	placed := c.admitLater(1, 1000)
	c.eventually("the follower's pick waits in the leader's queue", func() bool { return c.pickers[0].Snapshot().Waiting == 1 })
	c.reps[0].StepDown()
	c.lead(2, 0, 1, 2)
	c.eventually("the old leader's queue is empty", func() bool { return c.pickers[0].Snapshot().Waiting == 0 })
	c.end(fill)
	r := awaitPlaced(t, placed)
	c.holdsOnlyThenEnds(1, r)
}

// awaitPlaced is the pick placed on placed, failing the test after 10s.
func awaitPlaced(t *testing.T, placed <-chan *picker.Reservation) *picker.Reservation {
	t.Helper()
	select {
	case r := <-placed:
		if r == nil {
			t.FailNow() // its error is reported
		}
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("after 10s the pick is not placed")
		return nil
	}
}

// A replica that takes the Lease while the old leader still places its
// forwarded pick holds the old leader's answer and shares it as the
// leader: its followers' copies hold the pick too.
func TestAPickAnsweredAfterItsReplicaLeadsReachesItsFollowers(t *testing.T) {
	creds := writeCredentials(t)
	c := newCluster(t, 2, creds, Options{PickTimeout: time.Minute})
	got, release := make(chan struct{}, 1), make(chan struct{})
	old, _ := serveFake(t, creds, fakeLeader{name: "old", answer: func(p *pb.Pick) []*pb.FromLeader {
		got <- struct{}{}
		<-release
		return []*pb.FromLeader{placed(&pb.Placed{Id: p.Id, Endpoints: []string{endpoints()[2].Address.String()}})}
	}})
	c.reps[1].SetPeers(append(append([]Peer(nil), c.peers...), old))
	c.eventually("replica 1 follows the old leader", func() bool { return c.reps[1].Leader() == "old" })
	placed := c.admitLater(1, 1)
	<-got // the old leader places it, slowly
	c.lead(1, 0)
	close(release)
	r := awaitPlaced(t, placed)
	c.holdsOnlyThenEnds(1, r)
}

// holdsOnlyThenEnds waits until every replica holds r, and nothing else,
// at its endpoint; then ends r through replica via and waits until every
// ledger is empty.
func (c *cluster) holdsOnlyThenEnds(via int, r *picker.Reservation) {
	c.t.Helper()
	want := counts([]pick{{r: r}})
	for i := range c.reps {
		c.eventually(fmt.Sprintf("replica %d holds the pick, and only it, at %v", i, r.Endpoints()[0]), func() bool { return c.inFlight(i) == want })
	}
	c.reps[via].End(r, picker.Outcome{})
	for i := range c.reps {
		c.eventually(fmt.Sprintf("replica %d's ledger empty", i), func() bool { return c.pickers[i].Snapshot().InFlight == 0 })
	}
}

// keptStream is a follower's stream on the leader's side that keeps what
// is sent on it.
type keptStream struct {
	grpc.ServerStream
	mu   sync.Mutex
	sent []*pb.FromLeader
}

func (s *keptStream) Send(m *pb.FromLeader) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sent = append(s.sent, m)
	return nil
}

func (s *keptStream) Recv() (*pb.FromFollower, error) { select {} }

// A follower's pick queued just as its leader steps down is handed back at
// once (refused, for the follower to place), never left in the queue of a
// replica that no longer leads until the queue moves. The window between
// the leader's check and the queuing is narrow: many tries.
func TestAPickQueuedAsItsLeaderStepsDownIsHandedBack(t *testing.T) {
	cfg := v1alpha1.PickerConfig{FlowControl: v1alpha1.FlowControl{Enabled: true, MaxDecodingRequests: 1, RequestTTLSeconds: 600}}
	for try := range 2000 {
		p := picker.New(cfg, picker.Options{})
		p.Replace(endpoints())
		for k := range len(endpoints()) {
			r, err := p.Admit(context.Background(), picker.Request{Model: "m", Prompt: prompt("", k, 1000), Stream: true})
			if err != nil {
				t.Fatal(err)
			}
			p.FirstByte(r)
		}
		x := New(p, Options{Self: "tally-0"})
		x.Lead()
		ctx, cancel := context.WithCancelCause(context.Background())
		f := &follower{name: "tally-1", out: make(chan *pb.FromLeader, 16), cancel: cancel, stream: &keptStream{}}
		x.mu.Lock()
		x.followers[f] = struct{}{}
		x.mu.Unlock()
		pick := &pb.Pick{Id: fmt.Sprintf("tally-1/1/%d", try), Request: toRequest(p.Prepare(picker.Request{Model: "m", Prompt: prompt("", 99, 100)}))}
		var wg sync.WaitGroup
		wg.Go(func() { x.placeFor(ctx, f, pick) })
		wg.Go(x.StepDown)
		wg.Wait()
		if w := p.Snapshot().Waiting; w != 0 {
			t.Fatalf("try %d: %d picks wait in the queue of a replica that stepped down", try, w)
		}
		cancel(nil)
	}
}

// A follower's Adopt of its own placement and another stream's copy of the
// same placement (the leader's change, or its Sync) racing on one replica
// leave one reservation held, not two. The window is narrow: many tries.
func TestAnAdoptRacingAMirrorOfTheSamePickHoldsOne(t *testing.T) {
	eps := endpoints()
	for try := range 5000 {
		p := picker.New(v1alpha1.PickerConfig{}, picker.Options{})
		p.Replace(eps)
		x := New(p, Options{Self: "tally-2"})
		req := toRequest(p.Prepare(picker.Request{Model: "m", Prompt: prompt("", try, 100)}))
		id := fmt.Sprintf("tally-1/1/%d", try)
		adopted := &pb.Reservation{Id: id, Origin: "tally-1", Request: req, Endpoints: []string{eps[0].Address.String()}}
		mirrored := &pb.Reservation{Id: id, Origin: "tally-1", Request: req, Endpoints: []string{eps[1].Address.String()}}
		var wg sync.WaitGroup
		wg.Go(func() { x.adopt(nil, adopted) })
		wg.Go(func() { x.mirror(mirrored) })
		wg.Wait()
		if n := p.Snapshot().InFlight; n != 1 {
			t.Fatalf("try %d: %d reservations held for one pick", try, n)
		}
	}
}

// A leader that steps down keeps serving its streams: the endpoint that
// serves one of its requests and that request's first byte, heard after
// it stepped down and before the next leader took over, reach the next
// leader (with its Claim) and that leader's followers.
func TestWhatTheOldLeaderHearsInTheHandoverReachesTheNext(t *testing.T) {
	c := newCluster(t, 3, writeCredentials(t), Options{PickTimeout: time.Minute})
	c.lead(0, 1, 2)
	r, err := c.reps[0].Admit(context.Background(), picker.Request{Model: "m", Prompt: prompt("", 1, 100), Stream: true})
	if err != nil {
		t.Fatal(err)
	}
	c.eventually("every copy holds the pick", func() bool { return sum(c.inFlight(1)) == 1 && sum(c.inFlight(2)) == 1 })
	c.reps[0].StepDown()
	c.eventually("replica 0 no longer leads", func() bool { return !c.reps[0].Status().Leading })
	other := endpoints()[0].Address
	if r.Endpoints()[0] == other {
		other = endpoints()[1].Address
	}
	c.reps[0].ServedBy(r, other)
	c.reps[0].FirstByte(r)
	c.lead(1, 0, 2)
	var want [3]int
	want[int(other.Addr().As4()[3])-2] = 1
	decoding := func(i int) int {
		n := 0
		for _, e := range c.pickers[i].Snapshot().Endpoints {
			n += e.Decoding
		}
		return n
	}
	c.eventually("every replica holds the request where it is served, past its first byte", func() bool {
		for i := range 3 {
			if c.inFlight(i) != want || decoding(i) != 1 {
				return false
			}
		}
		return true
	})
	c.reps[0].End(r, picker.Outcome{})
	c.eventually("every ledger is empty", func() bool {
		return sum(c.inFlight(0))+sum(c.inFlight(1))+sum(c.inFlight(2)) == 0
	})
}

// A pick answered by a leader that another has replaced since (the
// follower follows the new one, whose Sync came first) is adopted by the
// new leader: it counts the pick, and its end.
func TestAPickAnsweredByAReplacedLeaderReachesTheNewOne(t *testing.T) {
	creds := writeCredentials(t)
	c := newCluster(t, 2, creds, Options{PickTimeout: time.Minute})
	got := make(chan *pb.Pick, 1)
	release := make(chan struct{})
	old, _ := serveFake(t, creds, fakeLeader{name: "old", answer: func(p *pb.Pick) []*pb.FromLeader {
		got <- p
		<-release
		return []*pb.FromLeader{placed(&pb.Placed{Id: p.Id, Endpoints: []string{endpoints()[2].Address.String()}})}
	}})
	c.reps[1].SetPeers(append(append([]Peer(nil), c.peers...), old))
	c.eventually("replica 1 follows the old leader", func() bool { return c.reps[1].Leader() == "old" })
	placedAt := c.admitLater(1, 1)
	<-got
	c.lead(0, 1)
	close(release)
	r := awaitPlaced(t, placedAt)
	want := [3]int{0, 0, 1}
	c.eventually("the new leader holds the pick the old one placed", func() bool { return c.inFlight(0) == want && c.inFlight(1) == want })
	c.reps[1].End(r, picker.Outcome{})
	c.eventually("both ledgers are empty", func() bool { return sum(c.inFlight(0))+sum(c.inFlight(1)) == 0 })
}
