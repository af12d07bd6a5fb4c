package picker

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker/internal/flowqueue"
	"github.com/tallyepp/tally/picker/internal/ilist"
)

// Flow control is late binding: with cfg.FlowControl on, a request that
// arrives while every candidate endpoint is saturated waits here, unplaced,
// instead of joining one engine's queue. Whenever the ledger frees capacity
// (a first byte, a release, the drain model, a scrape, new endpoints) the
// dispatch cycle places waiting requests in the same critical section as a
// pick: highest priority band first, the flows of a band in turn, and inside
// a flow the request that costs least on the freed endpoint (or the oldest).
// The wait itself holds no lock: a waiter blocks on its own channel, which
// the cycle closes (closing never blocks).
//
// Invariant: a waiting request is in exactly one flow's list and in the
// queue's arrival list, and is counted in its band and the queue; every way
// out (dispatch, TTL, cancel, shutdown) goes through finish, which
// takes it out of all of them at once.

var (
	// ErrQueueFull means the request's priority band, or the whole queue,
	// holds as many requests or bytes as its limit.
	ErrQueueFull = errors.New("the flow control queue is full")
	// ErrQueueTimeout means the request waited its whole TTL.
	ErrQueueTimeout = errors.New("the request waited in the flow control queue for its whole TTL")
	// ErrShed means every candidate is saturated and the request is
	// sheddable (priority below 0): it is refused rather than queued.
	ErrShed = errors.New("every eligible endpoint is saturated and the request is sheddable")
	// ErrShuttingDown means the picker is shutting down and waits no more.
	ErrShuttingDown = errors.New("the picker is shutting down")
)

// DefaultFairnessID is the flow of a request that names none, as upstream.
const DefaultFairnessID = "default-flow"

// The ordering looks at this many requests from the front of a flow: the
// cheapest of them goes first. It bounds the lock hold of a cycle.
const cheapestWindow = 8

// Dispatch cycles run when the ledger frees capacity; the drain model frees
// it with no event, so while requests wait a timer runs a cycle when the
// first saturated endpoint's queue should fall below the threshold, at
// least this often and at most this often.
const (
	minDispatchInterval = time.Millisecond
	maxDispatchInterval = 20 * time.Millisecond
)

// Outcomes of a request that met flow control (the upstream picker's names).
const (
	outcomeDispatched = iota
	outcomeRejectedCapacity
	outcomeRejectedOther
	outcomeEvictedTTL
	outcomeEvictedCancelled
	outcomeEvictedOther
	numOutcomes
)

var outcomeNames = [numOutcomes]string{"Dispatched", "RejectedCapacity", "RejectedOther", "EvictedTTL",
	"EvictedContextCancelled", "EvictedOther"}

// Ticket is a request waiting in the flow control queue. Wait blocks until it
// is placed or refused; Result reads the outcome without blocking (for
// callers that run in virtual time).
type Ticket struct {
	p     *Picker
	r     *Reservation
	req   Request // Prompt dropped: the hashes in r are all a dispatch needs
	bytes int64
	flow  *flowqueue.Flow[Ticket, flowLinks]
	// Clock (ns) of its arrival and of its TTL's end.
	enqueued, deadline int64
	seq                uint64 // arrival order

	// Guarded by the picker's lock.
	flowLink    ilist.Link[Ticket] // in its flow, oldest first
	arrivalLink ilist.Link[Ticket] // in the queue's arrival list
	done        bool
	err         error
	outcome     int
	// ready is closed once done is set.
	ready chan struct{}

	// What the waiter gets, settled once (result).
	once   sync.Once
	res    *Reservation
	resErr error
}

// flowQueue is the ledger's queue.
type flowQueue struct {
	waiting  flowqueue.Queue[Ticket, flowLinks] // by band and flow
	arrivals ilist.List[Ticket, arrivalLinks]
	closed   bool
	seq      uint64 // arrivals so far
	free     []*row // scratch: unsaturated candidates of a cycle
	// scratch: the candidates of a cycle with a decode slot free while a
	// prefill pod is free (a split request's choice), empty otherwise
	decodeFree []*row
	outcomes   [numOutcomes]uint64
}

// Enqueue is Admit without the wait, for callers that cannot block (a
// simulation in virtual time, whose clock fires the dispatch timer): it
// returns a reservation (placed at once), a ticket (waiting), or an error
// (refused).
func (p *Picker) Enqueue(req Request) (*Reservation, *Ticket, error) {
	start := time.Now()
	return p.enqueue(p.prepare(req), req, start)
}

// enqueue is Enqueue of r, prepared from req.
func (p *Picker) enqueue(r *Reservation, req Request, start time.Time) (*Reservation, *Ticket, error) {
	if !p.cfg.FlowControl.Enabled {
		r, err := p.placeNow(r, req, start)
		return r, nil, err
	}
	now := r.pickedNs
	p.mu.Lock()
	t, placed, err := p.l.admit(r, req)
	untidy := placed && p.l.untidy()
	done := t != nil && t.done
	if t != nil {
		t.p = p
	}
	p.rearm(now)
	p.mu.Unlock()
	if t == nil {
		if !placed {
			p.metrics.observeRefused(req, err)
		}
		r, err = p.placed(r, err, untidy, start)
		return r, nil, err
	}
	if done {
		r, err := t.result()
		return r, nil, err
	}
	return nil, t, nil
}

// admit places r at once, unless requests wait or every candidate is
// saturated: then it waits in the queue (a ticket), or is refused. placed
// says it went through place (err is place's).
func (l *ledger) admit(r *Reservation, req Request) (t *Ticket, placed bool, err error) {
	now := r.pickedNs
	q := &l.queue
	if q.waiting.Len() == 0 || r.bodiless {
		// The common case costs what a pick costs: nothing waits, so
		// nothing can be passed over (and a bodiless request passes no
		// one: it takes no capacity they wait for).
		err := l.place(r, req)
		if !errors.Is(err, ErrSaturated) {
			return nil, true, err
		}
	}
	if len(l.candidates(req)) == 0 {
		err = ErrNoEndpoint // no capacity will ever free for it
	} else {
		t, err = l.enqueue(r, req, now)
	}
	if err != nil {
		q.outcomes[outcomeOf(err)]++
		return nil, false, err
	}
	// Waiting requests may not be passed over: the newcomer joins them
	// and the cycle serves whoever comes first.
	l.dispatch(now)
	if !t.done && req.Priority < 0 {
		l.finish(t, ErrShed, outcomeRejectedCapacity)
	}
	return t, false, nil
}

// outcomeOf is the outcome of a request refused before it could wait.
func outcomeOf(err error) int {
	if errors.Is(err, ErrQueueFull) {
		return outcomeRejectedCapacity
	}
	return outcomeRejectedOther
}

// enqueue adds r to its band and flow, or says why it may not wait.
func (l *ledger) enqueue(r *Reservation, req Request, now int64) (*Ticket, error) {
	q := &l.queue
	fc := l.cfg.FlowControl
	bytes := max(req.Bytes, int64(r.promptChars))
	switch {
	case q.closed:
		return nil, ErrShuttingDown
	case fc.MaxRequests > 0 && q.waiting.Len() >= fc.MaxRequests, fc.MaxBytes > 0 && q.waiting.Bytes()+bytes > fc.MaxBytes:
		return nil, ErrQueueFull
	}
	b := q.waiting.Band(req.Priority, l.bandLimit)
	if !b.Fits(bytes) {
		return nil, ErrQueueFull
	}
	id := req.FairnessID
	if id == "" {
		id = DefaultFairnessID
	}
	req.Prompt = nil
	t := &Ticket{r: r, req: req, bytes: bytes, enqueued: now,
		deadline: now + int64(time.Duration(fc.RequestTTLSeconds)*time.Second),
		ready:    make(chan struct{})}
	q.seq++
	t.seq = q.seq
	t.flow = q.waiting.Add(t, b, id, bytes)
	q.arrivals.Push(t)
	return t, nil
}

// bandLimit is the limit of priority's band.
func (l *ledger) bandLimit(priority int) flowqueue.Limit {
	b := l.cfg.FlowControl.BandFor(priority)
	return flowqueue.Limit{MaxRequests: b.MaxRequests, MaxBytes: b.MaxBytes}
}

// finish takes t out of the queue with its outcome and wakes its
// waiter: placed (err nil, t.r holds the reservation) or refused.
func (l *ledger) finish(t *Ticket, err error, outcome int) {
	q := &l.queue
	q.waiting.Remove(t, t.flow, t.bytes)
	q.arrivals.Remove(t)
	q.outcomes[outcome]++
	t.done, t.err, t.outcome = true, err, outcome
	close(t.ready)
}

// dispatch is the dispatch cycle.
func (l *ledger) dispatch(now int64) (placed int) {
	q := &l.queue
	if q.waiting.Len() == 0 {
		return 0
	}
	for t := q.arrivals.Front(); t != nil && t.deadline <= now; t = q.arrivals.Front() {
		l.finish(t, ErrQueueTimeout, outcomeEvictedTTL)
	}
	for q.waiting.Len() > 0 && len(l.candidateRows) > 0 {
		free, decodeFree := l.freeRows(now)
		if len(free) == 0 && len(decodeFree) == 0 {
			break
		}
		t := l.nextTicket(free, decodeFree, now)
		if t == nil {
			break
		}
		t.r.pickedNs = now
		err := l.place(t.r, t.req)
		if errors.Is(err, ErrSaturated) {
			// Its candidates filled since the check: it waits on. Cannot
			// happen without a subset hint, which freeRows checks, or a
			// request freed by a split (decodeFree) whose prompt is cached
			// where it would decode: it is not split, and waits for a pod
			// to take it whole.
			break
		}
		if err != nil {
			l.finish(t, err, outcomeRejectedOther)
			continue
		}
		l.finish(t, nil, outcomeDispatched)
		placed++
	}
	return placed
}

// freeRows returns the current candidates below their saturation
// threshold, drained to now, and, when some prefill pod is free
// (prefillFree), those with a decode slot free: a request that may be
// split may go there (place's rule).
func (l *ledger) freeRows(now int64) (free, decodeFree []*row) {
	q := &l.queue
	q.free, q.decodeFree = q.free[:0], q.decodeFree[:0]
	split := l.cfg.Disaggregation.Enabled() && l.prefillFree(now)
	for _, c := range l.candidateRows {
		l.drain(c, now)
		queued := c.queued()
		if !l.saturated(c, queued, c.decoding, now) {
			q.free = append(q.free, c)
		}
		if split && !l.overLimit(c, queued) && !l.decodeFull(c.decoding) {
			q.decodeFree = append(q.decodeFree, c)
		}
	}
	return q.free, q.decodeFree
}

// nextTicket chooses the next request to place on one of free: from
// the highest band with one that may go there, the flow whose turn it is,
// and in it the cheapest of the first few (or the oldest).
func (l *ledger) nextTicket(free, decodeFree []*row, now int64) *Ticket {
	strict := l.cfg.FlowControl.Fairness == v1alpha1.FairnessGlobalStrict
	for _, b := range l.queue.waiting.Bands() {
		if b.Len() == 0 {
			continue
		}
		if strict {
			// The flow whose oldest request is oldest; the others only if
			// none of its may go on the free endpoints (a subset hint).
			oldest := b.Turn()
			for f, k := oldest.Next(), 1; k < b.Flows(); f, k = f.Next(), k+1 {
				if f.Front().seq < oldest.Front().seq {
					oldest = f
				}
			}
			if t := l.chooseInFlow(oldest, free, decodeFree, now); t != nil {
				return t
			}
		}
		f := b.Turn()
		for range b.Flows() {
			if t := l.chooseInFlow(f, free, decodeFree, now); t != nil {
				b.Pass(f) // the next flow's turn, even if t empties f
				return t
			}
			f = f.Next()
		}
	}
	return nil
}

// chooseInFlow returns the request of f to place next, or nil when
// none of its first few may go on any of free (or of decodeFree, for one
// that may be split).
func (l *ledger) chooseInFlow(f *flowqueue.Flow[Ticket, flowLinks], free, decodeFree []*row, now int64) *Ticket {
	fc := &l.cfg.FlowControl
	fcfs := fc.Ordering == v1alpha1.OrderingFCFS ||
		now-f.Front().enqueued >= int64(time.Duration(fc.MaxReorderMilliseconds)*time.Millisecond)
	var best *Ticket
	bestCost := 0
	k := 0
	for t := f.Front(); t != nil && k < cheapestWindow; t = f.After(t) {
		k++
		rows := free
		if len(decodeFree) > 0 && l.maySplit(t.r) {
			rows = decodeFree // free's rows are among them
		}
		cost, ok := l.costOnFree(t, rows, now)
		if !ok {
			continue
		}
		if fcfs {
			return t
		}
		if best == nil || cost < bestCost {
			best, bestCost = t, cost
		}
	}
	return best
}

// costOnFree is t's least cost over the free rows it may go to: the
// prefill queued there plus its uncached prompt tokens there. ok is false
// when it may go on none of them (a subset hint).
func (l *ledger) costOnFree(t *Ticket, free []*row, now int64) (cost int, ok bool) {
	rows, weight := free, workWeight(l.candidateRows)
	if t.req.HasSubset {
		cands := l.candidates(t.req)
		weight = workWeight(cands)
		n := 0
		for _, c := range cands {
			if slices.Contains(free, c) {
				cands[n] = c
				n++
			}
		}
		rows = cands[:n]
	}
	if len(rows) == 0 {
		return 0, false
	}
	ids, matched := l.scratch.ids[:len(rows)], l.scratch.matched[:len(rows)]
	for i, c := range rows {
		ids[i] = c.id
	}
	l.index.Match(t.r.hashes, ids, matched)
	for i, c := range rows {
		x := l.cost(c.queued(), c.engine.foreignCost(now), l.uncachedTokens(c, t.r.promptChars, matched[i]), c.decoding, weight)
		if i == 0 || x < cost {
			cost = x
		}
	}
	return cost, true
}

// nextDue is the time at which a cycle should next run: when the first
// saturated endpoint's modelled queue falls below its threshold, or the
// oldest request's TTL ends, within the dispatch interval bounds. It
// changes nothing (the drain to now is worked out on the side).
func (l *ledger) nextDue(now int64) int64 {
	fc := &l.cfg.FlowControl
	due := int64(maxDispatchInterval)
	// Prefill pods count too: a split request waits on them.
	for _, rows := range [2][]*row{l.candidateRows, l.prefillRows} {
		for _, c := range rows {
			over := float64(l.projected(c, now, nil).queued) - float64(fc.HoldPrefillMilliseconds)*c.rate/1000
			if over > 0 && c.rate > 0 {
				due = min(due, int64(over/c.rate*1e9))
			}
		}
	}
	due = max(due, int64(minDispatchInterval))
	if t := l.queue.arrivals.Front(); t != nil {
		due = min(due, max(t.deadline-now, 0))
	}
	return now + due
}

// rearm sets the dispatch timer, while requests wait, for the next cycle
// no event will run. It runs under the lock, after each of the ledger's
// operations; resetting a timer made by AfterFunc never blocks.
func (p *Picker) rearm(now int64) {
	if !p.l.waiting() {
		return
	}
	due := p.l.nextDue(now)
	if p.timerDue != 0 && p.timerDue <= due && p.timerDue > now {
		return // it fires sooner already
	}
	p.timerDue = due
	if p.dispatchTimer == nil {
		p.dispatchTimer = p.clock.AfterFunc(time.Duration(due-now), p.dispatchOnTimer)
		return
	}
	p.dispatchTimer.Reset(time.Duration(due - now))
}

// dispatchOnTimer is the timer's cycle.
func (p *Picker) dispatchOnTimer() {
	now := p.now()
	p.mu.Lock()
	p.timerDue = 0
	p.l.dispatch(now)
	p.rearm(now)
	p.mu.Unlock()
}

// freed runs a cycle after an event that may have freed capacity.
func (l *ledger) freed(now int64) {
	if l.queue.waiting.Len() > 0 {
		l.dispatch(now)
	}
}

// CloseQueue refuses every waiting request with ErrShuttingDown, and every
// later one that would wait. A shutting-down picker calls it once its
// gateway has stopped sending it new streams.
func (p *Picker) CloseQueue() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.l.closeQueue()
}

// closeQueue refuses every waiting request, and every later one.
func (l *ledger) closeQueue() int {
	q := &l.queue
	q.closed = true
	n := q.waiting.Len()
	for q.arrivals.Front() != nil {
		l.finish(q.arrivals.Front(), ErrShuttingDown, outcomeEvictedOther)
	}
	return n
}

// Wait blocks until t is placed or refused, or ctx ends; see Admit.
func (t *Ticket) Wait(ctx context.Context) (*Reservation, error) {
	select {
	case <-t.ready:
		return t.result()
	case <-ctx.Done():
		t.Cancel()
		return nil, ctx.Err()
	}
}

// Result returns t's outcome without waiting; done is false while it waits.
func (t *Ticket) Result() (r *Reservation, done bool, err error) {
	select {
	case <-t.ready:
		r, err = t.result()
		return r, true, err
	default:
		return nil, false, nil
	}
}

// Cancel withdraws t if it still waits, and ends its reservation if it
// was placed: nothing of it is left behind.
func (t *Ticket) Cancel() {
	p := t.p
	p.mu.Lock()
	if !t.done {
		p.l.finish(t, context.Canceled, outcomeEvictedCancelled)
	}
	p.mu.Unlock()
	if r, _ := t.result(); r != nil {
		p.End(r, Outcome{})
	}
}

// result settles a done ticket, once: a placement's long prompt tail and
// evictions outside the lock, and the metrics.
func (t *Ticket) result() (*Reservation, error) {
	t.once.Do(func() {
		p := t.p
		p.metrics.observeQueue(t, time.Duration(p.now()-t.enqueued))
		// The pick's duration is its own, not its wait (observed above).
		t.res, t.resErr = p.placed(t.r, t.err, t.err == nil, time.Now())
	})
	return t.res, t.resErr
}
