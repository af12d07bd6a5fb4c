// Package replica makes the replicas of one picker one ledger. The replica
// that holds the Lease leads: it places every pick. The others (followers)
// parse and hash their gateways' requests as ever, send the leader each
// prepared pick over one long-lived stream (the peer protocol, replicapb),
// and answer their gateways with the leader's choice; first bytes and ends
// travel the same way. The leader streams every placement and event to
// every follower, which holds each in its own ledger (Picker.Hold), so a
// follower's copy is current when the leader is lost: it then places on it
// at once, and the next leader reconciles (Sync and Claim) what was placed
// in the gap, counting nothing twice and leaking nothing.
//
// The Replica implements what the ext_proc server needs of a picker
// (extproc.Picker), in front of the replica's own *picker.Picker.
package replica

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/tallyepp/tally/picker"
	pb "github.com/tallyepp/tally/picker/replica/replicapb"
)

// Version is the peer protocol version this build speaks. A replica places
// locally rather than forward to a leader that speaks another.
const Version = 1

// Defaults of Options.
const (
	// A pick takes the leader well under a millisecond; a burst on busy
	// machines was seen past 100 ms, and every pick placed locally is a
	// pick the one ledger does not decide.
	DefaultPickTimeout = 250 * time.Millisecond
	DefaultOrphanGrace = 10 * time.Second
	// outboxSize bounds the messages waiting to be sent on one stream; a
	// peer that falls this far behind is disconnected (it resyncs when it
	// reconnects) rather than slow the picks.
	outboxSize = 4096
)

// Options configure a Replica.
type Options struct {
	// Self names this replica among its peers (its pod's name).
	Self string
	// PickTimeout bounds the wait for the leader's answer to a forwarded
	// pick; past it the pick is placed locally. Default DefaultPickTimeout.
	PickTimeout time.Duration
	// OrphanGrace is how long the leader keeps the reservations of a
	// replica it has no stream from (one that died with them) before it
	// leaves them to drain by the ledger's model. Default DefaultOrphanGrace.
	OrphanGrace time.Duration
	// Dial are the credentials a follower dials its peers with; nil dials
	// without TLS (tests only).
	Dial func() (credentials.TransportCredentials, error)
	// Registerer receives the replica's metrics; nil registers none.
	Registerer prometheus.Registerer
	Log        logr.Logger
}

// Peer is another replica: its name and its peer address.
type Peer struct {
	Name string
	Addr netip.AddrPort
}

// leaderIs records name as the leader and counts a change from another
// (not the first leader this replica sees). Called with mu held.
func (x *Replica) leaderIs(name string) {
	if x.lastLeader != "" && x.lastLeader != name {
		x.m.leaderChanges.Inc()
	}
	x.lastLeader = name
}

// setLag records how far this replica's copy is behind the leader's
// ledger, for /debug/ledger and the lag gauge.
func (x *Replica) setLag(lag time.Duration) {
	x.lagNs.Store(int64(lag))
	x.m.lag.Set(lag.Seconds())
}

// Replica is one replica of the picker: the leader, or a follower of it.
type Replica struct {
	opts     Options
	p        *picker.Picker
	m        *metrics
	leading  atomic.Bool
	ids      atomic.Uint64
	instance string       // this process, among its restarts
	lagNs    atomic.Int64 // of the last change applied from the leader

	mu sync.Mutex
	// Every reservation this replica holds that a peer may speak of: its
	// own picks and, on a follower, the leader's placements; on the
	// leader, everything it placed or adopted.
	byID  map[string]*entry
	byRes map[*picker.Reservation]*entry
	// Leading: the streams of the followers (server side), and when each
	// origin was last connected.
	followers map[*follower]struct{}
	gone      map[string]time.Time
	instances map[string]string // each follower's process, as last seen
	leadSince time.Time
	// StepDown was called: the process is shutting down and leads no more.
	steppedDown bool
	// lastLeader names the leader this replica last followed, or itself
	// since it last led: a leader's reconnection is no change of leader.
	lastLeader string
	// Following: the stream to each peer, and the one that leads.
	peers  map[string]*peerConn
	leader *peerConn
	// Run's context, and the peers SetPeers named.
	ctx    context.Context
	wanted []Peer
}

// entry is one reservation as the replicas know it.
type entry struct {
	id     string
	origin string
	r      *picker.Reservation // nil while a forwarded pick waits
	pr     picker.Prepared
	// The leader knows it (forwarded, or adopted since): events go there.
	shared bool
	// Placed here while no replica led, and sent to every peer: events go
	// to every peer too, until a leader's Sync has it claimed.
	gossiped  bool
	firstByte bool
	servedBy  netip.AddrPort
	ticket    *picker.Ticket // leader: waiting in its flow control queue
	// What the leader answers a forwarded pick (follower), and the
	// stream to the leader it was sent to.
	answer chan *pb.Placed
	via    *peerConn
}

// New returns a follower replica in front of p; Lead makes it the leader.
func New(p *picker.Picker, opts Options) *Replica {
	if opts.PickTimeout <= 0 {
		opts.PickTimeout = DefaultPickTimeout
	}
	if opts.OrphanGrace <= 0 {
		opts.OrphanGrace = DefaultOrphanGrace
	}
	x := &Replica{
		opts:      opts,
		p:         p,
		m:         newMetrics(opts.Registerer),
		byID:      map[string]*entry{},
		byRes:     map[*picker.Reservation]*entry{},
		followers: map[*follower]struct{}{},
		gone:      map[string]time.Time{},
		instances: map[string]string{},
		instance:  strconv.FormatInt(time.Now().UnixNano(), 36) + "-" + strconv.FormatUint(rand.Uint64(), 36),
		peers:     map[string]*peerConn{},
	}
	x.registerState(opts.Registerer)
	return x
}

// StepDown ends this replica's leading for good: it is shutting down and
// has released the Lease. Its followers stop forwarding to it at once, and
// it forwards its own picks to the next leader as a follower does. A Lead
// after it (one that raced the shutdown) does nothing.
func (x *Replica) StepDown() {
	x.mu.Lock()
	x.steppedDown = true
	if !x.leading.Load() {
		x.mu.Unlock()
		return
	}
	x.leading.Store(false)
	for f := range x.followers {
		f.send(&pb.FromLeader{Msg: &pb.FromLeader_Hello{Hello: x.hello()}})
	}
	// The followers' picks waiting in this replica's queue go back to
	// them (answer refuses them as not leading): each places its own, and
	// the next leader adopts it.
	var waiting []*picker.Ticket
	for _, e := range x.byID {
		if e.ticket != nil {
			waiting = append(waiting, e.ticket)
		}
	}
	x.mu.Unlock()
	for _, t := range waiting {
		t.Cancel()
	}
	x.opts.Log.Info("stepped down: no longer leading", "followersPicksReturned", len(waiting))
}

// Status is what a replica says of itself at /debug/ledger.
type Status struct {
	Self, Leader string
	Leading      bool
	// LagSeconds is the age of the leader's last change when this
	// follower applied it.
	LagSeconds float64
	// Peers is how many peers this replica has a working stream to.
	Peers int
}

// Status reports this replica's place among its peers.
func (x *Replica) Status() Status {
	s := Status{Self: x.opts.Self, Leader: x.Leader(), Leading: x.leading.Load(), LagSeconds: float64(x.lagNs.Load()) / 1e9}
	x.mu.Lock()
	for _, c := range x.peers {
		if c.up {
			s.Peers++
		}
	}
	x.mu.Unlock()
	return s
}

// Leading reports whether this replica leads.
func (x *Replica) Leading() bool { return x.leading.Load() }

// Leader names the replica this one follows ("" when none), or itself.
func (x *Replica) Leader() string {
	if x.leading.Load() {
		return x.opts.Self
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.leader != nil {
		return x.leader.peer.Name
	}
	return ""
}

// newID is a new reservation id, unique over the replicas and over a
// replica's restarts: "<replica>/<instance>/<n>".
func (x *Replica) newID() string {
	return x.opts.Self + "/" + x.instance + "/" + strconv.FormatUint(x.ids.Add(1), 10)
}

// Admit places req: on this replica's ledger when it leads, or when no
// leader answers; else at the leader, holding its choice here too.
func (x *Replica) Admit(ctx context.Context, req picker.Request) (*picker.Reservation, error) {
	pr := x.p.Prepare(req)
	if x.leading.Load() {
		return x.admitLocal(ctx, pr, x.newID())
	}
	x.mu.Lock()
	c := x.leader
	x.mu.Unlock()
	if c == nil {
		return x.placeAlone(ctx, pr, x.newID(), x.noLeaderReason())
	}
	return x.forward(ctx, c, pr)
}

// noLeaderReason says why there is no leader to forward to: none is known,
// or the one there is speaks another version.
func (x *Replica) noLeaderReason() string {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, c := range x.peers {
		if c.leading && c.version != Version {
			return reasonVersion
		}
	}
	return reasonNoLeader
}

// admitLocal places pr on this replica's ledger as the leader does, and
// tells the followers.
func (x *Replica) admitLocal(ctx context.Context, pr picker.Prepared, id string) (*picker.Reservation, error) {
	x.m.local.WithLabelValues(reasonLeader).Inc()
	r, err := x.p.AdmitPrepared(ctx, pr)
	if err != nil {
		return nil, err
	}
	e := &entry{id: id, origin: x.opts.Self, r: r, pr: pr}
	x.mu.Lock()
	x.add(e)
	if x.leading.Load() {
		x.broadcast(nil, opPlaced(e))
	} else {
		// It waited in the queue while this replica stepped down: the
		// next leader learns of it as of a pick placed alone.
		x.tell(e)
	}
	x.mu.Unlock()
	return r, nil
}

// placeHere places a pick its leader did not: as the leader, if this
// replica has taken the Lease since it forwarded it, else alone.
func (x *Replica) placeHere(ctx context.Context, pr picker.Prepared, id, reason string) (*picker.Reservation, error) {
	if x.leading.Load() {
		return x.admitLocal(ctx, pr, id)
	}
	return x.placeAlone(ctx, pr, id, reason)
}

// placeAlone places pr on this follower's own copy of the ledger (no
// leader answers), and tells the leader once one does (Adopt or Claim).
func (x *Replica) placeAlone(ctx context.Context, pr picker.Prepared, id, reason string) (*picker.Reservation, error) {
	x.m.local.WithLabelValues(reason).Inc()
	r, err := x.p.AdmitPrepared(ctx, pr)
	if err != nil {
		return nil, err
	}
	e := &entry{id: id, origin: x.opts.Self, r: r, pr: pr}
	x.mu.Lock()
	x.add(e)
	x.tell(e)
	x.mu.Unlock()
	return r, nil
}

// tell sends e, placed here while this replica does not lead, to the
// leader or, with none, to every peer. Called with mu held.
func (x *Replica) tell(e *entry) {
	adopt := &pb.FromFollower{Msg: &pb.FromFollower_Adopt{Adopt: toReservation(e)}}
	if c := x.leader; c != nil {
		// A leader is there now (a late or slow one): it adopts this
		// placement, replacing any it made of the same pick.
		e.shared = true
		c.send(adopt)
	} else {
		// No leader: the other replicas hold it in their copies, so that
		// what they place in the gap sees it (and its events follow).
		e.gossiped = true
		x.gossip(adopt)
	}
}

// forward sends pr to the leader and holds its choice here.
func (x *Replica) forward(ctx context.Context, c *peerConn, pr picker.Prepared) (*picker.Reservation, error) {
	start := time.Now()
	e := &entry{id: x.newID(), origin: x.opts.Self, pr: pr, shared: true, answer: make(chan *pb.Placed, 2), via: c}
	x.mu.Lock()
	x.byID[e.id] = e
	ok := c.send(&pb.FromFollower{Msg: &pb.FromFollower_Pick{Pick: &pb.Pick{Id: e.id, Request: toRequest(pr)}}})
	x.mu.Unlock()
	if !ok {
		x.forget(e)
		return x.placeAlone(ctx, pr, e.id, reasonNoLeader)
	}
	timer := time.NewTimer(x.opts.PickTimeout)
	defer timer.Stop()
	// The round trip is timed to the leader's first answer: queued, or
	// where the pick went (a queued pick's wait is flow control's).
	answered := false
	roundTrip := func() {
		if !answered {
			answered = true
			x.m.forwardSeconds.Observe(time.Since(start).Seconds())
		}
	}
	for {
		select {
		case a := <-e.answer:
			if a == nil || a.Refusal == pb.Refusal_REFUSAL_NOT_LEADING {
				// The stream broke, or the peer stepped down before it
				// placed the pick: it holds nothing of it.
				x.forget(e)
				return x.placeHere(ctx, pr, e.id, reasonNoLeader)
			}
			roundTrip()
			if a.Queued {
				// Flow control holds it at the leader: it waits as long
				// as its TTL, as a local wait would.
				timer.Stop()
				continue
			}
			x.m.forwarded.Inc()
			if err := refusalErr(a.Refusal); err != nil {
				x.forget(e)
				return nil, err
			}
			eps := toAddrs(a.Endpoints)
			r, _ := x.p.Hold(pr, eps, toAddr(a.Prefiller))
			x.mu.Lock()
			e.r, e.answer = r, nil
			x.byRes[r] = e
			switch {
			case x.leading.Load():
				// This replica took the Lease while the old leader
				// placed it: its followers hold it from here.
				x.broadcast(nil, opPlaced(e))
			case x.leader != nil && x.leader != c:
				// It follows another leader since, which may not have
				// heard of this placement: that leader adopts it.
				x.tell(e)
			}
			x.mu.Unlock()
			return r, nil
		case <-timer.C:
			x.forget(e)
			return x.placeHere(ctx, pr, e.id, reasonTimeout)
		case <-ctx.Done():
			// The leader may place it yet: the end follows the pick.
			x.mu.Lock()
			delete(x.byID, e.id)
			x.sendUp(&pb.Event{Id: e.id, Kind: pb.Event_KIND_END})
			x.mu.Unlock()
			return nil, ctx.Err()
		}
	}
}

// forget drops a forwarded pick that got no placement here.
func (x *Replica) forget(e *entry) {
	x.mu.Lock()
	if x.byID[e.id] == e {
		delete(x.byID, e.id)
	}
	x.mu.Unlock()
}

// FirstByte marks r's first response bytes here and at the leader.
func (x *Replica) FirstByte(r *picker.Reservation) {
	x.p.FirstByte(r)
	x.event(r, &pb.Event{Kind: pb.Event_KIND_FIRST_BYTE}, func(e *entry) { e.firstByte = true })
}

// ServedBy moves r to addr here and at the leader.
func (x *Replica) ServedBy(r *picker.Reservation, addr netip.AddrPort) {
	x.p.ServedBy(r, addr)
	x.event(r, &pb.Event{Kind: pb.Event_KIND_SERVED_BY, Addr: addr.String()}, func(e *entry) { e.servedBy = addr })
}

// End ends r here and at the leader.
func (x *Replica) End(r *picker.Reservation, o picker.Outcome) {
	x.p.End(r, o)
	x.event(r, &pb.Event{Kind: pb.Event_KIND_END, Outcome: toOutcome(o)}, func(e *entry) {
		x.remove(e)
	})
}

// event records ev of r's entry (apply, under the lock) and sends it on:
// to the leader from a follower, to every follower from the leader.
func (x *Replica) event(r *picker.Reservation, ev *pb.Event, apply func(*entry)) {
	x.mu.Lock()
	defer x.mu.Unlock()
	e := x.byRes[r]
	if e == nil {
		return
	}
	ev.Id = e.id
	apply(e)
	switch {
	case x.leading.Load():
		x.broadcast(nil, &pb.FromLeader{Msg: &pb.FromLeader_Op{Op: &pb.Op{Op: &pb.Op_Event{Event: ev}, SentUnixNano: time.Now().UnixNano()}}})
	case e.shared && x.leader != nil:
		x.sendUp(ev)
	case e.shared, e.gossiped:
		// No leader hears it: the peers' copies do.
		x.gossip(&pb.FromFollower{Msg: &pb.FromFollower_Event{Event: ev}})
	}
}

// gossip sends m to every peer that speaks this version. Called with mu
// held.
func (x *Replica) gossip(m *pb.FromFollower) {
	for _, c := range x.peers {
		if c.up && c.version == Version {
			c.send(m)
		}
	}
}

// sendUp sends ev to the leader, if there is one. Called with mu held.
func (x *Replica) sendUp(ev *pb.Event) {
	if c := x.leader; c != nil {
		c.send(&pb.FromFollower{Msg: &pb.FromFollower_Event{Event: ev}})
	}
}

// add indexes e. Called with mu held.
func (x *Replica) add(e *entry) {
	x.byID[e.id] = e
	x.byRes[e.r] = e
}

// remove drops e from the indexes. Called with mu held.
func (x *Replica) remove(e *entry) {
	delete(x.byID, e.id)
	delete(x.byRes, e.r)
}

// refusalErr is the picker's error for the leader's refusal.
func refusalErr(r pb.Refusal) error {
	switch r {
	case pb.Refusal_REFUSAL_NONE:
		return nil
	case pb.Refusal_REFUSAL_NO_ENDPOINT:
		return picker.ErrNoEndpoint
	case pb.Refusal_REFUSAL_SATURATED:
		return picker.ErrSaturated
	case pb.Refusal_REFUSAL_QUEUE_TIMEOUT:
		return picker.ErrQueueTimeout
	case pb.Refusal_REFUSAL_SHUTTING_DOWN:
		return picker.ErrShuttingDown
	case pb.Refusal_REFUSAL_SHED:
		return picker.ErrShed
	case pb.Refusal_REFUSAL_QUEUE_FULL:
		return picker.ErrQueueFull
	}
	return fmt.Errorf("the leader refused the pick (%v)", r)
}

// refusalOf is the leader's refusal for err.
func refusalOf(err error) pb.Refusal {
	for _, r := range []pb.Refusal{pb.Refusal_REFUSAL_NO_ENDPOINT, pb.Refusal_REFUSAL_SATURATED, pb.Refusal_REFUSAL_QUEUE_TIMEOUT,
		pb.Refusal_REFUSAL_SHUTTING_DOWN, pb.Refusal_REFUSAL_SHED, pb.Refusal_REFUSAL_QUEUE_FULL} {
		if errors.Is(err, refusalErr(r)) {
			return r
		}
	}
	return pb.Refusal_REFUSAL_SHUTTING_DOWN
}
