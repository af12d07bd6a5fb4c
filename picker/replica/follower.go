package replica

import (
	"context"
	"errors"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"

	"github.com/tallyepp/tally/picker"
	pb "github.com/tallyepp/tally/picker/replica/replicapb"
)

// Reconnecting to a peer backs off from the first to the last.
const (
	minRedial = 100 * time.Millisecond
	maxRedial = 2 * time.Second
)

// peerConn is this replica's stream to one peer. What it sends waits in
// out, sent by one goroutine.
type peerConn struct {
	peer   Peer
	out    chan *pb.FromFollower
	stop   context.CancelFunc
	cancel context.CancelCauseFunc // the current stream's
	// Guarded by the replica's mu: what the peer's Hello said.
	up      bool
	version uint32
	leading bool
}

// send queues m for the peer; a stream too far behind is cut (it resyncs
// on reconnecting). It reports whether m was queued. Called with mu held.
func (c *peerConn) send(m *pb.FromFollower) bool {
	if !c.up || c.cancel == nil {
		return false
	}
	select {
	case c.out <- m:
		return true
	default:
		c.cancel(errOutboxFull)
		return false
	}
}

// isPick: a pick waits for the leader's answer.
func isPick(m *pb.FromFollower) bool { return m.GetPick() != nil }

// Run follows the peers SetPeers names and, while this replica leads,
// leaves the reservations of replicas gone for good to the ledger's model,
// until ctx ends.
func (x *Replica) Run(ctx context.Context) {
	// Setting ctx and opening the streams to the peers named so far is one
	// step: a SetPeers between the two would be undone by a stale list.
	x.mu.Lock()
	x.ctx = ctx
	x.setPeers(x.wanted)
	x.mu.Unlock()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if n := x.detachOrphans(now); n > 0 {
				x.opts.Log.Info("reservations of replicas that are gone are left to the ledger's model", "reservations", n)
			}
		}
	}
}

// SetPeers makes peers the replicas this one follows (itself excluded):
// a stream is opened to each new one and closed to each that left.
func (x *Replica) SetPeers(peers []Peer) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.setPeers(peers)
}

// setPeers is SetPeers, called with mu held.
func (x *Replica) setPeers(peers []Peer) {
	x.wanted = peers
	if x.ctx == nil {
		return // Run starts them
	}
	keep := map[string]bool{}
	for _, p := range peers {
		if p.Name == x.opts.Self || !p.Addr.IsValid() {
			continue
		}
		keep[p.Name] = true
		if c, ok := x.peers[p.Name]; ok {
			if c.peer.Addr == p.Addr {
				continue
			}
			c.stop() // the pod came back at another address
		}
		ctx, stop := context.WithCancel(x.ctx)
		c := &peerConn{peer: p, out: make(chan *pb.FromFollower, outboxSize), stop: stop}
		x.peers[p.Name] = c
		go x.follow(ctx, c)
	}
	for name, c := range x.peers {
		if !keep[name] {
			c.stop()
			delete(x.peers, name)
		}
	}
}

// follow keeps a stream open to c's peer until ctx ends.
func (x *Replica) follow(ctx context.Context, c *peerConn) {
	wait := minRedial
	failing := false
	for ctx.Err() == nil {
		start := time.Now()
		err := x.stream(ctx, c)
		x.down(c)
		if ctx.Err() != nil {
			return
		}
		if time.Since(start) > maxRedial {
			wait, failing = minRedial, false
		}
		// The first failure of a run is said at the default verbosity
		// (a refused handshake: credentials that differ), the retries
		// only at -v=1.
		log := x.opts.Log.V(1)
		if !failing {
			log = x.opts.Log
		}
		failing = true
		log.Info("peer stream ended; reconnecting", "peer", c.peer.Name, "addr", c.peer.Addr, "err", err, "in", wait)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
		}
		wait = min(2*wait, maxRedial)
	}
}

// stream runs one stream to c's peer, until it breaks or ctx ends.
func (x *Replica) stream(ctx context.Context, c *peerConn) error {
	creds := insecure.NewCredentials()
	if x.opts.Dial != nil {
		var err error
		if creds, err = x.opts.Dial(); err != nil {
			return err
		}
	}
	conn, err := grpc.NewClient(c.peer.Addr.String(), grpc.WithTransportCredentials(creds),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: peerPing, Timeout: peerPingTimeout}),
		grpc.WithStaticStreamWindowSize(peerWindowBytes), grpc.WithStaticConnWindowSize(peerWindowBytes),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxPeerMessageBytes), grpc.MaxCallSendMsgSize(maxPeerMessageBytes)))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	s, err := pb.NewPeerClient(conn).Follow(ctx)
	if err != nil {
		return err
	}
	if err := s.Send(&pb.FromFollower{Msg: &pb.FromFollower_Hello{Hello: &pb.Hello{Version: Version, Replica: x.opts.Self, Instance: x.instance}}}); err != nil {
		return err
	}
	x.mu.Lock()
	c.cancel = cancel
	// Drop what an earlier stream left unsent: the Claim on the next Sync
	// says it all again.
	for len(c.out) > 0 {
		<-c.out
	}
	x.mu.Unlock()
	go func() {
		cancel(drainOutbox(ctx, c.out, peerCoalesce, isPick, s.Send))
	}()
	for {
		m, err := s.Recv()
		if err != nil {
			// Why this side cut it, if it did.
			if why := context.Cause(ctx); why != nil && !errors.Is(why, context.Canceled) {
				return why
			}
			return err
		}
		x.fromLeader(c, m)
	}
}

// down marks c's peer unreachable: if it led, no replica leads until one
// says so. The picks waiting for its answer are placed here, whoever leads
// now (a pick queued at a leader that another has replaced since waits
// for no one else).
func (x *Replica) down(c *peerConn) {
	x.mu.Lock()
	defer x.mu.Unlock()
	c.up, c.cancel = false, nil
	if c.version == Version {
		// A peer of another version ends each stream right after saying
		// that it leads: what it said holds (noLeaderReason) until it
		// says otherwise or leaves the peers.
		c.leading = false
	}
	if x.leader == c {
		x.leader = nil
	}
	for _, e := range x.byID {
		if e.answer != nil && e.via == c {
			select {
			case e.answer <- nil:
			default:
			}
		}
	}
}

// fromLeader handles one message from c's peer.
func (x *Replica) fromLeader(c *peerConn, m *pb.FromLeader) {
	switch m := m.Msg.(type) {
	case *pb.FromLeader_Hello:
		x.peerHello(c, m.Hello)
	case *pb.FromLeader_Placed:
		x.mu.Lock()
		if e := x.byID[m.Placed.Id]; e != nil && e.answer != nil {
			select {
			case e.answer <- m.Placed:
			default:
			}
		}
		x.mu.Unlock()
	case *pb.FromLeader_Sync:
		if x.follows(c) {
			x.applySync(c, m.Sync)
		}
	case *pb.FromLeader_Op:
		if !x.follows(c) {
			// A late change from a peer that no longer leads here: the
			// leader's Sync said what holds.
			return
		}
		lag := max(0, time.Since(time.Unix(0, m.Op.SentUnixNano)))
		x.setLag(lag)
		switch op := m.Op.Op.(type) {
		case *pb.Op_Placed:
			if op.Placed.Origin != x.opts.Self {
				x.mirror(op.Placed)
			}
		case *pb.Op_Event:
			x.mu.Lock()
			e := x.byID[op.Event.Id]
			if e == nil || e.origin == x.opts.Self {
				x.mu.Unlock()
				return
			}
			if op.Event.Kind == pb.Event_KIND_END {
				x.remove(e)
			}
			x.mu.Unlock()
			x.apply(e, op.Event)
		}
	}
}

// follows reports whether c's peer is the leader this replica follows.
func (x *Replica) follows(c *peerConn) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.leader == c
}

// peerHello records what c's peer said of itself: a leader that speaks this
// version is followed.
func (x *Replica) peerHello(c *peerConn, h *pb.Hello) {
	x.mu.Lock()
	defer x.mu.Unlock()
	said := c.leading && c.version == h.Version // the same as last time
	c.up, c.version, c.leading = true, h.Version, h.Leading
	switch {
	case x.leading.Load():
	case h.Leading && h.Version == Version:
		if x.leader != c {
			x.leader = c
			x.leaderIs(c.peer.Name)
			x.opts.Log.Info("following the leader", "leader", c.peer.Name, "addr", c.peer.Addr)
		}
	case h.Leading:
		if !said {
			x.opts.Log.Info("the leader speaks another peer protocol version: placing locally", "leader", c.peer.Name, "version", h.Version, "ours", Version)
		}
		fallthrough
	case x.leader == c:
		if x.leader == c {
			x.leader = nil
		}
	}
}

// mirror holds, in this follower's ledger, a placement the leader made.
func (x *Replica) mirror(res *pb.Reservation) {
	eps := toAddrs(res.Endpoints)
	if len(eps) == 0 {
		return
	}
	x.mu.Lock()
	old := x.byID[res.Id]
	if old != nil {
		x.remove(old)
	}
	x.mu.Unlock()
	if old != nil && old.r != nil {
		x.p.End(old.r, picker.Outcome{})
	}
	e := x.holdAt(res, eps)
	e.shared = false
	x.mu.Lock()
	// Another stream's copy of it may have come meanwhile (the old
	// leader's change and the new one's Sync): one is held.
	twin := x.byID[res.Id]
	if twin != nil {
		x.remove(twin)
	}
	x.add(e)
	x.mu.Unlock()
	if twin != nil && twin.r != nil {
		x.p.End(twin.r, picker.Outcome{})
	}
}

// applySync makes this follower's copy the leader's: mirrors the leader no
// longer holds end, those it holds and this copy lacks are held; then the
// follower claims every reservation whose stream it serves.
func (x *Replica) applySync(c *peerConn, s *pb.Sync) {
	held := make(map[string]*pb.Reservation, len(s.Reservations))
	for _, res := range s.Reservations {
		held[res.Id] = res
	}
	var stale, kept []*entry
	var missing []*pb.Reservation
	claim := &pb.Claim{}
	x.mu.Lock()
	for id, e := range x.byID {
		switch {
		case e.origin == x.opts.Self:
			e.shared, e.gossiped = true, false
			claim.Reservations = append(claim.Reservations, toReservation(e))
		case e.ticket != nil:
			// A follower's pick still in this replica's queue from when it
			// led: answer settles it.
		case held[id] == nil:
			stale = append(stale, e)
			x.remove(e)
		default:
			kept = append(kept, e)
		}
	}
	for id, res := range held {
		if res.Origin != x.opts.Self && x.byID[id] == nil {
			missing = append(missing, res)
		}
	}
	slices.SortFunc(claim.Reservations, func(a, b *pb.Reservation) int { return compareIDs(a.Id, b.Id) })
	c.send(&pb.FromFollower{Msg: &pb.FromFollower_Claim{Claim: claim}})
	x.mu.Unlock()
	for _, e := range stale {
		if e.r != nil {
			x.p.End(e.r, picker.Outcome{})
		}
	}
	for _, res := range missing {
		x.mirror(res)
	}
	// A change this copy missed (sent while its stream was down) is in
	// the Sync.
	for _, e := range kept {
		x.catchUp(e, held[e.id])
	}
}
