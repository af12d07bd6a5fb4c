package replica

import (
	"context"
	"errors"
	"sync"
	"time"
)

// A peer stream's messages are mostly changes that no pick waits for: the
// leader's copies of each placement, first byte and end for every
// follower, and a follower's first bytes and ends for the leader. Sent one
// by one at 400 requests a second, each is a write on one side and a read
// and a thread's wake-up on the other, most of the CPU the replicas spend
// on one another. An outbox holds such a change up to peerCoalesce for
// those that follow it, and gRPC writes what it is handed at once in one
// system call. What a pick waits for (a follower's pick, the leader's
// answer) is sent by the goroutine that has it, at once, with what waits
// before it, in order: a Claim queued before a pick must reach the leader
// first, or the leader would end the pick's placement as one the follower
// no longer claims. Handing a pick to another goroutine to send would cost
// it a wake-up, on a busy machine the largest part of its round trip.
const (
	peerCoalesce = 2 * time.Millisecond
	// peerSendStall is the longest a pick waits to be sent: with 1 MiB of
	// flow control window, seconds of picks, a send that waits this long
	// is to a leader that stopped reading (hung, not gone: its keepalive
	// answers), and its stream is cut.
	peerSendStall = time.Second
	// maxBatch is the most messages that wait for the window: a full
	// batch goes at once.
	maxBatch = 256
)

// errOutboxFull cuts a stream whose peer is too far behind (it resyncs
// when it reconnects); errStreamDone ends an outbox whose stream ended.
var (
	errOutboxFull = errors.New("peer stream: outbox full, the peer reads too slowly")
	errStreamDone = errors.New("peer stream ended")
)

// outbox holds one peer stream's messages until they are sent, in order.
// send is the stream's: it is called by one goroutine at a time.
type outbox[M any] struct {
	send func(M) error
	cut  func() // ends the stream, at the first failed send or a full outbox

	sending sync.Mutex // held while sending
	spare   []M        // under sending: the queue's next backing array

	mu     sync.Mutex
	queue  []M
	err    error         // once set, nothing more is taken or sent
	window chan struct{} // a held message began a window
	full   chan struct{} // the held messages make a batch
}

func newOutbox[M any](send func(M) error, cut func()) *outbox[M] {
	return &outbox[M]{send: send, cut: cut, window: make(chan struct{}, 1), full: make(chan struct{}, 1)}
}

// hold queues m to be sent within the window. It reports whether m was
// taken: not when the stream ended or the outbox is full, which cuts it.
func (o *outbox[M]) hold(m M) bool {
	n, ok := o.put(m)
	switch {
	case !ok:
	case n == 1:
		signal(o.window)
	case n == maxBatch:
		signal(o.full)
	}
	return ok
}

// add queues m for the caller, which calls flush once it has let go of
// its locks. It reports whether m was taken, as hold does.
func (o *outbox[M]) add(m M) bool {
	_, ok := o.put(m)
	return ok
}

// put appends m to the queue, and says how long the queue is then.
func (o *outbox[M]) put(m M) (int, bool) {
	o.mu.Lock()
	if o.err == nil && len(o.queue) >= outboxSize {
		o.err = errOutboxFull
		o.mu.Unlock()
		o.cut()
		return 0, false
	}
	defer o.mu.Unlock()
	if o.err != nil {
		return 0, false
	}
	o.queue = append(o.queue, m)
	return len(o.queue), true
}

// flush sends what is queued, in order, from the calling goroutine.
func (o *outbox[M]) flush() error {
	o.sending.Lock()
	defer o.sending.Unlock()
	o.mu.Lock()
	batch, err := o.queue, o.err
	o.queue = o.spare
	o.mu.Unlock()
	if err != nil {
		return err
	}
	for _, m := range batch {
		if err := o.sendOrCut(m); err != nil {
			return err
		}
	}
	clear(batch)
	o.spare = batch[:0]
	return nil
}

// flushWithin is flush for a goroutine that cannot wait long: a send
// that gRPC holds back for want of flow control window, which a peer that
// stopped reading leaves shut, cuts the stream after d, ending the send.
func (o *outbox[M]) flushWithin(d time.Duration) error {
	guard := time.AfterFunc(d, o.cut)
	defer guard.Stop()
	return o.flush()
}

// now sends m from the calling goroutine, ahead of what is queued: an
// answer that the peer matches by id, which waits on nothing before it.
func (o *outbox[M]) now(m M) error {
	o.sending.Lock()
	defer o.sending.Unlock()
	o.mu.Lock()
	err := o.err
	o.mu.Unlock()
	if err != nil {
		return err
	}
	return o.sendOrCut(m)
}

// sendOrCut sends m; a failed send ends the outbox and cuts the stream.
// Called with sending held.
func (o *outbox[M]) sendOrCut(m M) error {
	err := o.send(m)
	if err != nil {
		o.mu.Lock()
		o.err = err
		o.mu.Unlock()
		o.cut()
	}
	return err
}

// close ends the outbox: what is queued is dropped and nothing more is
// sent. It waits for a send under way.
func (o *outbox[M]) close() {
	o.sending.Lock()
	o.mu.Lock()
	if o.err == nil {
		o.err = errStreamDone
	}
	o.queue = nil
	o.mu.Unlock()
	o.sending.Unlock()
}

// run sends each held message within window of its coming, with what
// came before it and since, until ctx ends (nil) or a send fails (its
// error).
func (o *outbox[M]) run(ctx context.Context, window time.Duration) error {
	t := time.NewTimer(time.Hour)
	t.Stop()
	for {
		select {
		case <-o.window:
		case <-o.full:
		case <-ctx.Done():
			return nil
		}
		if !o.isFull() {
			t.Reset(window)
			select {
			case <-t.C:
			case <-o.full:
				t.Stop()
			case <-ctx.Done():
				return nil
			}
		}
		if err := o.flush(); err != nil {
			return err
		}
	}
}

// isFull says whether the held messages make a batch.
func (o *outbox[M]) isFull() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.queue) >= maxBatch
}

// signal sends on c unless a signal already waits there.
func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}
