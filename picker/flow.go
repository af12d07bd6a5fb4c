package picker

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
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
// out (dispatch, TTL, cancel, shutdown) goes through finishLocked, which
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
	flow  *flow
	// Clock (ns) of its arrival and of its TTL's end.
	enqueued, deadline int64
	seq                uint64 // arrival order

	// Guarded by p.mu.
	flowLink    link[Ticket] // in its flow, oldest first
	arrivalLink link[Ticket] // in the queue's arrival list
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

type flow struct {
	id      string
	band    *band
	tickets list[Ticket, flowLinks]
	n       int
	// The band's ring of flows with waiting requests.
	prev, next *flow
}

type band struct {
	priority    int
	limit       v1alpha1.Band
	n           int
	bytes       int64
	flows       map[string]*flow
	cursor      *flow // the flow whose turn is next (round-robin)
	activeFlows int
}

// flowQueue is the picker's queue; guarded by p.mu.
type flowQueue struct {
	bands        []*band // by priority, highest first
	n            int
	bytes        int64
	arrivals     list[Ticket, arrivalLinks]
	closed       bool
	seq          uint64 // arrivals so far
	free         []*row // scratch: unsaturated candidates of a cycle
	outcomes     [numOutcomes]uint64
	timerArmedAt int64 // clock the dispatch timer is set for; 0 when not set
}

// Admit places req at once when some candidate is below its saturation
// threshold, as Pick does. With flow control on and every candidate
// saturated, it waits in the queue until a dispatch cycle places it, its TTL
// passes (ErrQueueTimeout), ctx ends (ctx's error: nothing is left behind),
// or the picker shuts down (ErrShuttingDown). With flow control off it is
// Pick.
func (p *Picker) Admit(ctx context.Context, req Request) (*Reservation, error) {
	if !p.flowOn {
		return p.Pick(req)
	}
	r, t, err := p.Enqueue(req)
	if t == nil {
		return r, err
	}
	return t.Wait(ctx)
}

// Enqueue is Admit without the wait: it returns a reservation (placed at
// once), a ticket (waiting), or an error (refused).
func (p *Picker) Enqueue(req Request) (*Reservation, *Ticket, error) {
	if !p.flowOn {
		r, err := p.Pick(req)
		return r, nil, err
	}
	start := time.Now()
	r := p.prepare(req)
	now := r.pickedNs
	q := &p.queue
	p.mu.Lock()
	if q.n == 0 || r.bodiless {
		// The common case costs what a pick costs: nothing waits, so
		// nothing can be passed over (and a bodiless request passes no
		// one: it takes no capacity they wait for).
		err := p.placeLocked(r, req)
		if !errors.Is(err, ErrSaturated) {
			untidy := p.index.Untidy()
			p.mu.Unlock()
			r, err = p.placed(r, err, untidy, start)
			return r, nil, err
		}
	}
	var t *Ticket
	var err error
	if len(p.candidatesLocked(req)) == 0 {
		err = ErrNoEndpoint // no capacity will ever free for it
	} else {
		t, err = p.enqueueLocked(r, req, now)
	}
	if err != nil {
		q.outcomes[outcomeOf(err)]++
		p.mu.Unlock()
		p.metrics.observeRefused(req, err)
		_, err = p.placed(r, err, false, start)
		return nil, nil, err
	}
	// Waiting requests may not be passed over: the newcomer joins them
	// and the cycle serves whoever comes first.
	p.dispatchLocked(now)
	if !t.done && req.Priority < 0 {
		p.finishLocked(t, ErrShed, outcomeRejectedCapacity)
	}
	p.armLocked(now)
	done := t.done
	p.mu.Unlock()
	if done {
		r, err := t.result()
		return r, nil, err
	}
	return nil, t, nil
}

// outcomeOf is the outcome of a request refused before it could wait.
func outcomeOf(err error) int {
	if errors.Is(err, ErrQueueFull) {
		return outcomeRejectedCapacity
	}
	return outcomeRejectedOther
}

// enqueueLocked adds r to its band and flow, or says why it may not wait.
func (p *Picker) enqueueLocked(r *Reservation, req Request, now int64) (*Ticket, error) {
	q := &p.queue
	fc := p.cfg.FlowControl
	bytes := max(req.Bytes, int64(r.promptChars))
	switch {
	case q.closed:
		return nil, ErrShuttingDown
	case fc.MaxRequests > 0 && q.n >= fc.MaxRequests, fc.MaxBytes > 0 && q.bytes+bytes > fc.MaxBytes:
		return nil, ErrQueueFull
	}
	b := p.bandLocked(req.Priority)
	if b.n >= b.limit.MaxRequests || b.bytes+bytes > b.limit.MaxBytes {
		return nil, ErrQueueFull
	}
	id := req.FairnessID
	if id == "" {
		id = DefaultFairnessID
	}
	f := b.flows[id]
	if f == nil {
		f = &flow{id: id, band: b}
		b.flows[id] = f
	}
	req.Prompt = nil
	t := &Ticket{p: p, r: r, req: req, bytes: bytes, flow: f, enqueued: now,
		deadline: now + int64(time.Duration(fc.RequestTTLSeconds)*time.Second),
		ready:    make(chan struct{})}
	q.seq++
	t.seq = q.seq
	if f.n == 0 {
		b.joinRing(f)
	}
	f.tickets.push(t)
	f.n++
	b.n++
	b.bytes += bytes
	q.arrivals.push(t)
	q.n++
	q.bytes += bytes
	return t, nil
}

// bandLocked returns the band of priority, creating it.
func (p *Picker) bandLocked(priority int) *band {
	q := &p.queue
	i, ok := slices.BinarySearchFunc(q.bands, priority, func(b *band, prio int) int { return prio - b.priority })
	if ok {
		return q.bands[i]
	}
	b := &band{priority: priority, limit: p.cfg.FlowControl.BandFor(priority), flows: map[string]*flow{}}
	q.bands = slices.Insert(q.bands, i, b)
	return b
}

// joinRing puts f, which just got its first request, last in the band's
// turn: just before the cursor.
func (b *band) joinRing(f *flow) {
	b.activeFlows++
	if b.cursor == nil {
		f.prev, f.next = f, f
		b.cursor = f
		return
	}
	f.next, f.prev = b.cursor, b.cursor.prev
	f.prev.next = f
	b.cursor.prev = f
}

// leaveRing takes f, which has no request left, out of the band's turn.
func (b *band) leaveRing(f *flow) {
	b.activeFlows--
	if f.next == f {
		b.cursor = nil
	} else {
		f.prev.next, f.next.prev = f.next, f.prev
		if b.cursor == f {
			b.cursor = f.next
		}
	}
	f.prev, f.next = nil, nil
	delete(b.flows, f.id)
}

// finishLocked takes t out of the queue with its outcome and wakes its
// waiter: placed (err nil, t.r holds the reservation) or refused.
func (p *Picker) finishLocked(t *Ticket, err error, outcome int) {
	q := &p.queue
	f := t.flow
	b := f.band
	f.tickets.remove(t)
	f.n--
	if f.n == 0 {
		b.leaveRing(f)
	}
	b.n--
	b.bytes -= t.bytes
	q.arrivals.remove(t)
	q.n--
	q.bytes -= t.bytes
	q.outcomes[outcome]++
	t.done, t.err, t.outcome = true, err, outcome
	close(t.ready)
}

// Dispatch runs a dispatch cycle now: it places what it can of the waiting
// requests and expires those past their TTL. The picker runs cycles itself
// (on every event that frees capacity, and on a timer while Run runs);
// callers in virtual time run them at NextDispatch. It returns how many
// requests it placed.
func (p *Picker) Dispatch() int {
	now := p.clock()
	p.mu.Lock()
	n := p.dispatchLocked(now)
	p.armLocked(now)
	p.mu.Unlock()
	return n
}

// NextDispatch is when a dispatch cycle may next place a waiting request
// that no event frees (the drain model, a TTL); false when none waits.
func (p *Picker) NextDispatch() (time.Time, bool) {
	now := p.clock()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.queue.n == 0 {
		return time.Time{}, false
	}
	return p.epoch.Add(time.Duration(p.nextDueLocked(now))), true
}

// dispatchLocked is the dispatch cycle.
func (p *Picker) dispatchLocked(now int64) (placed int) {
	q := &p.queue
	if q.n == 0 {
		return 0
	}
	for t := q.arrivals.head; t != nil && t.deadline <= now; t = q.arrivals.head {
		p.finishLocked(t, ErrQueueTimeout, outcomeEvictedTTL)
	}
	for q.n > 0 && len(p.candidates) > 0 {
		free := p.freeRowsLocked(now)
		if len(free) == 0 {
			break
		}
		t := p.nextTicketLocked(free, now)
		if t == nil {
			break
		}
		t.r.pickedNs = now
		t.r.pickedAt = p.epoch.Add(time.Duration(now))
		err := p.placeLocked(t.r, t.req)
		if errors.Is(err, ErrSaturated) {
			// Its candidates filled since the check: it waits on. Cannot
			// happen without a subset hint, which freeRowsLocked checks.
			break
		}
		if err != nil {
			p.finishLocked(t, err, outcomeRejectedOther)
			continue
		}
		p.finishLocked(t, nil, outcomeDispatched)
		placed++
	}
	return placed
}

// freeRowsLocked returns the current candidates below their saturation
// threshold, drained to now.
func (p *Picker) freeRowsLocked(now int64) []*row {
	q := &p.queue
	q.free = q.free[:0]
	for _, c := range p.candidates {
		c.drain(now)
		if !p.saturatedLocked(c, c.queued(), now) {
			q.free = append(q.free, c)
		}
	}
	return q.free
}

// saturatedLocked reports whether c may take no request now: over a static
// limit (overLimitLocked) or, with flow control, over its threshold.
func (p *Picker) saturatedLocked(c *row, queued int, now int64) bool {
	return p.overLimitLocked(c, queued) || p.flowOn && p.flowFullLocked(c, queued+c.engine.foreignCost(now))
}

// overLimitLocked reports whether c is over a static saturation limit
// (cfg.Saturation): it is then no candidate at all.
func (p *Picker) overLimitLocked(c *row, queued int) bool {
	sat := &p.cfg.Saturation
	return sat.MaxInFlightRequests > 0 && c.inFlight >= sat.MaxInFlightRequests ||
		sat.MaxPrefillTokens > 0 && queued >= sat.MaxPrefillTokens
}

// flowFullLocked reports whether c is over flow control's threshold: its
// queued prefill (the ledger's drain model, plus the load its engine
// reports beyond the ledger) would take holdPrefillMilliseconds at its
// rate, or its decoding slots are full. (Trusting an engine's waiting
// count beyond the ledger's prefill held every request a scrape interval,
// 250 ms, under extproc-load's steady load: the count is read before the
// requests it counts have started.)
func (p *Picker) flowFullLocked(c *row, work int) bool {
	fc := &p.cfg.FlowControl
	if fc.MaxDecodingRequests > 0 && c.decoding >= fc.MaxDecodingRequests {
		return true
	}
	return work > 0 && float64(work)*1000 >= float64(fc.HoldPrefillMilliseconds)*c.rate
}

// nextTicketLocked chooses the next request to place on one of free: from
// the highest band with one that may go there, the flow whose turn it is,
// and in it the cheapest of the first few (or the oldest).
func (p *Picker) nextTicketLocked(free []*row, now int64) *Ticket {
	strict := p.cfg.FlowControl.Fairness == v1alpha1.FairnessGlobalStrict
	for _, b := range p.queue.bands {
		if b.n == 0 {
			continue
		}
		if strict {
			// The flow whose oldest request is oldest; the others only if
			// none of its may go on the free endpoints (a subset hint).
			oldest := b.cursor
			for f, k := b.cursor.next, 1; k < b.activeFlows; f, k = f.next, k+1 {
				if f.tickets.head.seq < oldest.tickets.head.seq {
					oldest = f
				}
			}
			if t := p.chooseInFlowLocked(oldest, free, now); t != nil {
				return t
			}
		}
		f := b.cursor
		for range b.activeFlows {
			if t := p.chooseInFlowLocked(f, free, now); t != nil {
				b.cursor = f.next // the next flow's turn, even if t empties f
				return t
			}
			f = f.next
		}
	}
	return nil
}

// chooseInFlowLocked returns the request of f to place next, or nil when
// none of its first few may go on any of free.
func (p *Picker) chooseInFlowLocked(f *flow, free []*row, now int64) *Ticket {
	fc := &p.cfg.FlowControl
	fcfs := fc.Ordering == v1alpha1.OrderingFCFS ||
		now-f.tickets.head.enqueued >= int64(time.Duration(fc.MaxReorderMilliseconds)*time.Millisecond)
	var best *Ticket
	bestCost := 0
	k := 0
	for t := f.tickets.head; t != nil && k < cheapestWindow; t = t.flowLink.next {
		k++
		cost, ok := p.costOnFreeLocked(t, free, now)
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

// costOnFreeLocked is t's least cost over the free rows it may go to: the
// prefill queued there plus its uncached prompt tokens there. ok is false
// when it may go on none of them (a subset hint).
func (p *Picker) costOnFreeLocked(t *Ticket, free []*row, now int64) (cost int, ok bool) {
	rows := free
	if t.req.HasSubset {
		cands := p.candidatesLocked(t.req)
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
	ids, matched := p.candIDs[:len(rows)], p.matched[:len(rows)]
	for i, c := range rows {
		ids[i] = c.id
	}
	p.index.Match(t.r.hashes, ids, matched)
	for i, c := range rows {
		// The cost placeLocked will weigh.
		x := c.queued() + c.engine.foreignCost(now) + p.uncachedTokens(c, t.r.promptChars, matched[i]) +
			p.cfg.DecodeWeightTokens*c.decoding
		if i == 0 || x < cost {
			cost = x
		}
	}
	return cost, true
}

// nextDueLocked is the clock at which a cycle should next run: when the
// first saturated endpoint's modelled queue falls below its threshold, or
// the oldest request's TTL ends, within the dispatch interval bounds.
func (p *Picker) nextDueLocked(now int64) int64 {
	fc := &p.cfg.FlowControl
	due := int64(maxDispatchInterval)
	for _, c := range p.candidates {
		c.drain(now)
		over := float64(c.queued()) - float64(fc.HoldPrefillMilliseconds)*c.rate/1000
		if over > 0 && c.rate > 0 {
			due = min(due, int64(over/c.rate*1e9))
		}
	}
	due = max(due, int64(minDispatchInterval))
	if t := p.queue.arrivals.head; t != nil {
		due = min(due, max(t.deadline-now, 0))
	}
	return now + due
}

// armLocked sets the dispatch timer (while Run runs) for the next cycle no
// event will trigger. Resetting a timer made by AfterFunc never blocks.
func (p *Picker) armLocked(now int64) {
	q := &p.queue
	if p.dispatchTimer == nil || q.n == 0 {
		return
	}
	due := p.nextDueLocked(now)
	if q.timerArmedAt != 0 && q.timerArmedAt <= due && q.timerArmedAt > now {
		return // it fires sooner already
	}
	q.timerArmedAt = due
	p.dispatchTimer.Reset(time.Duration(due - now))
}

// dispatchOnTimer is the timer's cycle.
func (p *Picker) dispatchOnTimer() {
	now := p.clock()
	p.mu.Lock()
	p.queue.timerArmedAt = 0
	p.dispatchLocked(now)
	p.armLocked(now)
	p.mu.Unlock()
}

// freedLocked runs a cycle after an event that may have freed capacity.
func (p *Picker) freedLocked(now int64) {
	if p.queue.n > 0 {
		p.dispatchLocked(now)
		p.armLocked(now)
	}
}

// CloseQueue refuses every waiting request with ErrShuttingDown, and every
// later one that would wait. A shutting-down picker calls it once its
// gateway has stopped sending it new streams.
func (p *Picker) CloseQueue() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	q := &p.queue
	q.closed = true
	n := q.n
	for q.arrivals.head != nil {
		p.finishLocked(q.arrivals.head, ErrShuttingDown, outcomeEvictedOther)
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
func (t *Ticket) Result() (r *Reservation, err error, done bool) {
	select {
	case <-t.ready:
		r, err = t.result()
		return r, err, true
	default:
		return nil, nil, false
	}
}

// Cancel withdraws t if it still waits, and releases its reservation if it
// was placed: nothing of it is left behind.
func (t *Ticket) Cancel() {
	p := t.p
	p.mu.Lock()
	if !t.done {
		p.finishLocked(t, context.Canceled, outcomeEvictedCancelled)
	}
	p.mu.Unlock()
	if r, _ := t.result(); r != nil {
		r.Release()
	}
}

// result settles a done ticket, once: a placement's long prompt tail and
// evictions outside the lock, and the metrics.
func (t *Ticket) result() (*Reservation, error) {
	t.once.Do(func() {
		p := t.p
		p.metrics.observeQueue(t, time.Duration(p.clock()-t.enqueued))
		// The pick's duration is its own, not its wait (observed above).
		t.res, t.resErr = p.placed(t.r, t.err, t.err == nil, time.Now())
	})
	return t.res, t.resErr
}
