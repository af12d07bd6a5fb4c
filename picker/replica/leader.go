package replica

import (
	"context"
	"errors"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tallyepp/tally/picker"
	pb "github.com/tallyepp/tally/picker/replica/replicapb"
)

// follower is a follower's stream as a replica serves it: what the replica
// sends it waits in out, sent by one goroutine, so that the replica never
// blocks on a slow peer.
type follower struct {
	name   string
	out    chan *pb.FromLeader
	cancel context.CancelCauseFunc
	// The stream, sent on by the outbox's goroutine and, for the answer
	// to the follower's own pick, by the goroutine that placed it.
	stream grpc.BidiStreamingServer[pb.FromFollower, pb.FromLeader]
	sendMu sync.Mutex
	// The stream is ending: it takes no more sends (read under sendMu).
	closed atomic.Bool
}

// sendNow sends m at once, from the calling goroutine: the answer to a
// pick, which waits on no broadcast queued before it (the follower
// matches it by id). A follower that does not read blocks only this
// follower's picks, until its stream is cut.
func (f *follower) sendNow(m *pb.FromLeader) {
	f.sendMu.Lock()
	var err error
	if !f.closed.Load() {
		err = f.stream.Send(m)
	}
	f.sendMu.Unlock()
	if err != nil {
		f.cancel(err)
	}
}

// send queues m for the follower; a follower too far behind is cut off
// (it resyncs when it reconnects).
func (f *follower) send(m *pb.FromLeader) {
	select {
	case f.out <- m:
	default:
		f.cancel(errOutboxFull)
	}
}

// stuckSendGrace is how long a follower's ending stream waits for a send
// under way before the handler returns under it.
const stuckSendGrace = 5 * time.Second

// Register serves the peer protocol on s.
func (x *Replica) Register(s *grpc.Server) { pb.RegisterPeerServer(s, server{x: x}) }

type server struct {
	pb.UnimplementedPeerServer
	x *Replica
}

// Follow serves one follower's stream: its picks are placed here while
// this replica leads, and every change of the ledger is sent to it.
func (s server) Follow(stream grpc.BidiStreamingServer[pb.FromFollower, pb.FromLeader]) error {
	x := s.x
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	h := first.GetHello()
	if h == nil || h.Replica == "" {
		return status.Error(codes.InvalidArgument, "the first message of a peer stream is a Hello naming the replica")
	}
	if h.Version != Version {
		// Say which version this replica speaks, so the follower knows why.
		_ = stream.Send(&pb.FromLeader{Msg: &pb.FromLeader_Hello{Hello: x.hello()}})
		return status.Errorf(codes.FailedPrecondition, "peer protocol version %d is not spoken here (%d)", h.Version, Version)
	}
	ctx, cancel := context.WithCancelCause(stream.Context())
	defer cancel(nil)
	f := &follower{name: h.Replica, out: make(chan *pb.FromLeader, outboxSize), cancel: cancel, stream: stream}
	x.restarted(f.name, h.Instance)
	x.mu.Lock()
	x.followers[f] = struct{}{}
	delete(x.gone, f.name)
	f.send(&pb.FromLeader{Msg: &pb.FromLeader_Hello{Hello: x.hello()}})
	if x.leading.Load() {
		f.send(x.sync())
	}
	x.mu.Unlock()
	defer func() {
		x.mu.Lock()
		delete(x.followers, f)
		x.gone[f.name] = time.Now()
		x.mu.Unlock()
	}()

	sent := make(chan error, 1)
	go func() {
		err := drainOutbox(ctx, f.out, peerCoalesce, answersAPick, func(m *pb.FromLeader) error {
			f.sendMu.Lock()
			defer f.sendMu.Unlock()
			return stream.Send(m)
		})
		cancel(err)
		sent <- err
	}()
	// The follower's messages are handled as they are read, in order, on
	// the reading goroutine: no hand-off. The handler returns when the
	// stream ends or the follower is cut off (its Recv then ends too).
	go func() {
		defer cancel(nil)
		for {
			m, err := stream.Recv()
			if err != nil || ctx.Err() != nil {
				return
			}
			x.fromFollower(ctx, f, m)
		}
	}()
	<-ctx.Done()
	// A pick still being placed (or waiting in the queue) answers no one.
	f.closed.Store(true)
	// Wait for the sends under way: the outbox's and a pick's answer.
	idle := make(chan struct{})
	go func() {
		<-sent
		f.sendMu.Lock()
		f.sendMu.Unlock()
		close(idle)
	}()
	select {
	case <-idle:
	case <-time.After(stuckSendGrace):
		// A send waits on flow control that a follower reading nothing
		// never opens, and only the stream's end ends it: the handler
		// returns, and gRPC ends the stream.
		x.opts.Log.Info("a follower reads nothing: ending its peer stream under a send", "follower", f.name)
	}
	if why := context.Cause(ctx); errors.Is(why, errOutboxFull) {
		x.opts.Log.Info("cut a follower's peer stream; it resyncs when it reconnects", "follower", f.name, "reason", why)
	}
	return nil
}

// answersAPick: a follower's pick waits for it (a refusal, or queued).
func answersAPick(m *pb.FromLeader) bool { return m.GetPlaced() != nil }

// hello is this replica's Hello. It reads only what needs no lock.
func (x *Replica) hello() *pb.Hello {
	return &pb.Hello{Version: Version, Replica: x.opts.Self, Leading: x.leading.Load(), Instance: x.instance}
}

// restarted leaves to the ledger's model the reservations of a follower
// that comes back as another process: its streams died with the old one,
// but their requests may still run on the engines.
func (x *Replica) restarted(name, instance string) {
	var orphans []*entry
	x.mu.Lock()
	before, seen := x.instances[name]
	x.instances[name] = instance
	if seen && before != instance {
		orphans = x.take(nil, true, func(e *entry) bool { return e.origin == name })
	}
	x.mu.Unlock()
	x.endTaken(orphans, true)
}

// take removes from the maps the placed reservations match selects and,
// while this replica leads, tells every follower but except that they
// ended (detached: left to the ledger's model). Called with mu held; the
// caller ends them here with endTaken once it has let go of mu.
func (x *Replica) take(except *follower, detached bool, match func(*entry) bool) []*entry {
	var out []*entry
	for id, e := range x.byID {
		if e.r == nil || !match(e) {
			continue
		}
		out = append(out, e)
		x.remove(e)
		if x.leading.Load() {
			ev := &pb.Event{Id: id, Kind: pb.Event_KIND_END}
			if detached {
				ev.Outcome = &pb.Outcome{Detached: true}
			}
			x.broadcast(except, opEvent(ev))
		}
	}
	return out
}

// endTaken ends in this replica's ledger the reservations take removed.
func (x *Replica) endTaken(taken []*entry, detached bool) {
	for _, e := range taken {
		x.p.End(e.r, picker.Outcome{Detached: detached})
	}
}

// sync is every reservation this replica holds. Called with mu held.
func (x *Replica) sync() *pb.FromLeader {
	s := &pb.Sync{}
	for _, e := range x.byID {
		if e.r != nil {
			s.Reservations = append(s.Reservations, toReservation(e))
		}
	}
	return &pb.FromLeader{Msg: &pb.FromLeader_Sync{Sync: s}}
}

// broadcast sends m to every follower but except. Called with mu held.
func (x *Replica) broadcast(except *follower, m *pb.FromLeader) {
	for f := range x.followers {
		if f != except {
			f.send(m)
		}
	}
}

func opPlaced(e *entry) *pb.FromLeader {
	return &pb.FromLeader{Msg: &pb.FromLeader_Op{Op: &pb.Op{Op: &pb.Op_Placed{Placed: toReservation(e)}, SentUnixNano: time.Now().UnixNano()}}}
}

func opEvent(ev *pb.Event) *pb.FromLeader {
	return &pb.FromLeader{Msg: &pb.FromLeader_Op{Op: &pb.Op{Op: &pb.Op_Event{Event: ev}, SentUnixNano: time.Now().UnixNano()}}}
}

// fromFollower handles one message of f's stream, in the stream's order.
func (x *Replica) fromFollower(ctx context.Context, f *follower, m *pb.FromFollower) {
	switch m := m.Msg.(type) {
	case *pb.FromFollower_Pick:
		x.placeFor(ctx, f, m.Pick)
	case *pb.FromFollower_Event:
		x.followerEvent(f, m.Event)
	case *pb.FromFollower_Adopt:
		x.adopt(f, m.Adopt)
	case *pb.FromFollower_Claim:
		x.claim(f, m.Claim)
	}
}

// placeFor places a follower's pick and answers it. A pick that waits in
// flow control's queue is answered queued at once, and placed later.
func (x *Replica) placeFor(ctx context.Context, f *follower, p *pb.Pick) {
	if !x.leading.Load() {
		f.send(placed(&pb.Placed{Id: p.Id, Refusal: pb.Refusal_REFUSAL_NOT_LEADING}))
		return
	}
	pr := fromRequest(p.Request)
	r, t, err := x.p.EnqueuePrepared(pr)
	e := &entry{id: p.Id, origin: f.name, pr: pr, shared: true}
	if t == nil {
		x.answer(f, e, r, err)
		return
	}
	e.ticket = t
	x.mu.Lock()
	x.byID[e.id] = e
	leading := x.leading.Load()
	if leading {
		f.send(placed(&pb.Placed{Id: p.Id, Queued: true}))
	}
	x.mu.Unlock()
	if !leading {
		// StepDown came between the check above and here, and cancelled
		// the tickets it found: this one too, so that answer refuses it
		// and its follower places it now, not when the queue moves.
		t.Cancel()
	}
	go func() {
		r, err := t.Wait(ctx)
		x.answer(f, e, r, err)
	}()
}

// answer tells f where its pick e went (r), or why not (err), and every
// other follower of the placement.
func (x *Replica) answer(f *follower, e *entry, r *picker.Reservation, err error) {
	x.mu.Lock()
	queued := e.ticket != nil
	e.ticket = nil
	if (queued && x.byID[e.id] != e) || !x.leading.Load() {
		// While it waited, its follower ended it (its client left) or
		// placed it itself (Adopt); or this replica stepped down while it
		// placed it, and the next leader would not know of it. This
		// placement is no one's. The refusal is for a follower that still
		// waits: it places the pick, and the next leader adopts it.
		if x.byID[e.id] == e {
			delete(x.byID, e.id)
		}
		x.mu.Unlock()
		if r != nil {
			x.p.End(r, picker.Outcome{})
		}
		f.sendNow(placed(&pb.Placed{Id: e.id, Refusal: pb.Refusal_REFUSAL_NOT_LEADING}))
		return
	}
	if err != nil {
		if x.byID[e.id] == e {
			delete(x.byID, e.id)
		}
		x.mu.Unlock()
		f.sendNow(placed(&pb.Placed{Id: e.id, Refusal: refusalOf(err)}))
		return
	}
	e.r = r
	x.add(e)
	answer := &pb.Placed{Id: e.id, Endpoints: toStrings(r.Endpoints())}
	if a, ok := r.Prefiller(); ok {
		answer.Prefiller = a.String()
	}
	x.broadcast(f, opPlaced(e))
	x.mu.Unlock()
	// Outside the replica's lock: a send may wait on the follower.
	f.sendNow(placed(answer))
}

func placed(p *pb.Placed) *pb.FromLeader {
	return &pb.FromLeader{Msg: &pb.FromLeader_Placed{Placed: p}}
}

// followerEvent applies an event of one of f's reservations here, and
// sends it to the other followers.
func (x *Replica) followerEvent(f *follower, ev *pb.Event) {
	x.mu.Lock()
	e := x.byID[ev.Id]
	if e == nil {
		x.mu.Unlock()
		return
	}
	if ev.Kind == pb.Event_KIND_END {
		x.remove(e)
	}
	t := e.ticket
	if x.leading.Load() {
		x.broadcast(f, opEvent(ev))
	}
	x.mu.Unlock()
	if t != nil && ev.Kind == pb.Event_KIND_END {
		t.Cancel() // its client left while it waited
		return
	}
	x.apply(e, ev)
}

// apply applies ev to e's reservation in this replica's ledger: e's
// fields under the replica's lock (a Sync reads them), the ledger's calls
// outside it.
func (x *Replica) apply(e *entry, ev *pb.Event) {
	x.mu.Lock()
	r := e.r
	if r == nil {
		x.mu.Unlock()
		return
	}
	var addr netip.AddrPort
	switch ev.Kind {
	case pb.Event_KIND_FIRST_BYTE:
		e.firstByte = true
	case pb.Event_KIND_SERVED_BY:
		if a, err := netip.ParseAddrPort(ev.Addr); err == nil {
			e.servedBy, addr = a, a
		}
	}
	x.mu.Unlock()
	switch ev.Kind {
	case pb.Event_KIND_FIRST_BYTE:
		x.p.FirstByte(r)
	case pb.Event_KIND_SERVED_BY:
		if addr.IsValid() {
			x.p.ServedBy(r, addr)
		}
	case pb.Event_KIND_END:
		x.p.End(r, fromOutcome(ev.Outcome))
	}
}

// adopt holds a reservation a follower placed itself, in place of any this
// replica holds under its id, and tells the other followers.
func (x *Replica) adopt(f *follower, res *pb.Reservation) {
	eps := toAddrs(res.Endpoints)
	if len(eps) == 0 {
		return // a pick still waiting for its answer: nothing to hold
	}
	x.mu.Lock()
	var oldR *picker.Reservation
	var waiting *picker.Ticket
	old := x.byID[res.Id]
	if old != nil {
		oldR, waiting = old.r, old.ticket
		if waiting != nil {
			// Its pick waits in the queue here, and the follower placed
			// it itself: the queued one is withdrawn (answer ends it if
			// it is placed meanwhile).
			delete(x.byID, res.Id)
		}
	}
	x.mu.Unlock()
	if waiting != nil {
		waiting.Cancel()
	}
	if oldR != nil {
		if held := oldR.Endpoints(); len(held) > 0 && held[0] == eps[0] {
			// The same placement, already counted; what its replica saw
			// of it since (while no leader heard) is applied.
			if evs := x.catchUp(old, res); len(evs) > 0 {
				x.mu.Lock()
				if x.leading.Load() {
					for _, ev := range evs {
						x.broadcast(f, opEvent(ev))
					}
				}
				x.mu.Unlock()
			}
			return
		}
		x.p.End(oldR, picker.Outcome{})
	}
	e := x.holdAt(res, eps)
	x.mu.Lock()
	if oldR != nil {
		delete(x.byRes, oldR)
	}
	// Another stream's copy of it may have come meanwhile (the leader's
	// change or Sync, mirrored): one is held, as in mirror.
	twin := x.byID[res.Id]
	if twin == old {
		twin = nil
	} else if twin != nil {
		x.remove(twin)
	}
	x.add(e)
	if x.leading.Load() {
		x.broadcast(f, opPlaced(e))
	}
	x.mu.Unlock()
	if twin != nil && twin.r != nil {
		x.p.End(twin.r, picker.Outcome{})
	}
}

// catchUp applies to e what res says of its request that e has not seen
// (the endpoint that serves it, its first byte), and returns those events.
func (x *Replica) catchUp(e *entry, res *pb.Reservation) []*pb.Event {
	var evs []*pb.Event
	x.mu.Lock()
	if a, err := netip.ParseAddrPort(res.ServedBy); err == nil && a != e.servedBy {
		evs = append(evs, &pb.Event{Id: e.id, Kind: pb.Event_KIND_SERVED_BY, Addr: res.ServedBy})
	}
	if res.FirstByte && !e.firstByte {
		evs = append(evs, &pb.Event{Id: e.id, Kind: pb.Event_KIND_FIRST_BYTE})
	}
	x.mu.Unlock()
	for _, ev := range evs {
		x.apply(e, ev)
	}
	return evs
}

// holdAt holds res on eps in this replica's ledger, with the events it
// has already seen.
func (x *Replica) holdAt(res *pb.Reservation, eps []netip.AddrPort) *entry {
	pr := fromRequest(res.Request)
	r, _ := x.p.Hold(pr, eps, toAddr(res.Prefiller))
	e := &entry{id: res.Id, origin: res.Origin, r: r, pr: pr, shared: true}
	if res.ServedBy != "" {
		if a, err := netip.ParseAddrPort(res.ServedBy); err == nil {
			e.servedBy = a
			x.p.ServedBy(r, a)
		}
	}
	if res.FirstByte {
		e.firstByte = true
		x.p.FirstByte(r)
	}
	return e
}

// claim reconciles what f serves with what this replica holds of f: the
// claimed reservations it lacks are adopted, and those of f it holds that
// f no longer claims ended while no leader heard (they are released).
func (x *Replica) claim(f *follower, c *pb.Claim) {
	claimed := make(map[string]bool, len(c.Reservations))
	for _, res := range c.Reservations {
		claimed[res.Id] = true
		x.adopt(f, res)
	}
	x.mu.Lock()
	ended := x.take(f, false, func(e *entry) bool { return e.origin == f.name && !claimed[e.id] && e.ticket == nil })
	x.mu.Unlock()
	x.endTaken(ended, false)
}

// Lead makes this replica the leader: it places every pick from now on,
// and its followers start from its ledger (Sync). A replica that stepped
// down leads no more.
func (x *Replica) Lead() {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.leading.Load() || x.steppedDown {
		return
	}
	x.leading.Store(true)
	x.leadSince = time.Now()
	x.leader = nil
	x.leaderIs(x.opts.Self)
	x.setLag(0)
	for f := range x.followers {
		f.send(&pb.FromLeader{Msg: &pb.FromLeader_Hello{Hello: x.hello()}})
		f.send(x.sync())
	}
	x.opts.Log.Info("leading: this replica places every pick; its followers forward theirs", "followers", len(x.followers))
}

// detachOrphans leaves to the ledger's model the reservations of replicas
// that have been gone longer than the grace: their streams died with them,
// but their requests may still run on the engines. It reports how many.
func (x *Replica) detachOrphans(now time.Time) int {
	if !x.leading.Load() {
		return 0
	}
	connected := map[string]bool{x.opts.Self: true}
	x.mu.Lock()
	for f := range x.followers {
		connected[f.name] = true
	}
	orphans := x.take(nil, true, func(e *entry) bool {
		if connected[e.origin] {
			return false
		}
		since, ok := x.gone[e.origin]
		if !ok || since.Before(x.leadSince) {
			since = x.leadSince
		}
		return now.Sub(since) >= x.opts.OrphanGrace
	})
	x.mu.Unlock()
	x.endTaken(orphans, true)
	return len(orphans)
}
