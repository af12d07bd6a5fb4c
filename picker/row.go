package picker

import (
	"math"
	"net/netip"
	"time"

	"github.com/tallyepp/tally/picker/internal/ilist"
	"github.com/tallyepp/tally/picker/internal/ratemodel"
)

// row is one endpoint's line in the ledger. Reservations point at their row,
// never at an address, and a row is identified by its pod's UID (rowKey), so
// a readiness flap hands the same row back and another pod at the same
// address never inherits it.
//
// A row is current while its endpoint is in the set (a candidate), retained
// after it leaves while it still holds reservations or for the retention
// window, and dropped after that; a dropped row holds no reservations.
//
// A row's counters are the sums over the unreleased reservations that point
// at it, so they never go negative: hold and drop change inFlight, prefill,
// decoding and adapterRefs; endPrefill moves a reservation from prefill to
// decoding; the ledger's detach and unlinkDetached change detached and its
// list.
type row struct {
	// The fields every pick reads for every candidate come first, to share
	// as few cache lines as they can: a pick over 128 endpoints reads
	// every row.
	id       int // prefix index id until dropped
	inFlight int // reserved and not released
	prefill  int // prefill tokens of its reservations still in prefill
	decoding int // past their first byte, or past their modelled prefill

	// The prefill drain model (see the package doc). posIn counts the
	// prefill tokens ever queued here and posOut those the model says are
	// computed, as of at; both are positions in one FIFO, so a
	// reservation's prefill is done when posOut reaches its endPos.
	rate          float64 // tokens per second
	posIn, posOut float64
	at            int64
	// utilization is the share of recent time (a decayed mean over
	// utilizationWindow) during which the model had prefill queued here.
	utilization float64
	// Reservations still in prefill, in the order they joined the queue.
	inPrefill ilist.List[Reservation, prefillLinks]

	// What the engine's metrics say (see engine.go).
	engine engineView

	ep Endpoint
	// decodes and prefills: its endpoint's role allows it to be a
	// destination, and to prefill for another (Endpoint.Role).
	decodes, prefills bool
	key               rowKey
	current           bool
	dropped           bool
	leftAt            int64 // ledger time when it left the set, while retained
	// pos is its place in the ledger's rows while current; listed, the
	// last setEndpoints that listed it.
	pos    int
	listed uint64

	// How this endpoint's prefill differs from the pool's, learned from
	// its streamed first bytes, and the floor its engine's own prefill
	// timing sets (ratefit.go).
	rates ratemodel.Endpoint
	// Detached reservations (detach.go), in the order they were detached.
	detached     int
	detachedList ilist.List[Reservation, detachLinks]

	// adapterRefs counts the requests in flight here by LoRA adapter, and
	// recentAdapters are the last max_lora adapters used here, most recent
	// first (adapters.go).
	adapterRefs    map[string]int
	recentAdapters []string
}

// rowKey identifies an endpoint across endpoint sets: its pod UID and
// address, or, for callers that give no UID, its pod name and address.
type rowKey struct {
	uid, pod string
	addr     netip.AddrPort
}

func identity(ep Endpoint) rowKey {
	if ep.UID != "" {
		return rowKey{uid: ep.UID, addr: key(ep.Address)}
	}
	return rowKey{pod: ep.Pod, addr: key(ep.Address)}
}

// key is the form addresses take in byAddr: an IPv4 endpoint may be named
// in IPv4-mapped IPv6 form by a gateway.
func key(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

// utilizationWindow is the memory of a row's utilization: a burst on an
// idle pool is placed from none (docs/design.md).
const utilizationWindow = 20 * time.Second

// advance moves the drain model to now: the queue has drained at rate since
// the last update, never past what was queued; utilization takes in the
// share of the interval the queue was not empty. Every candidate of every
// pick takes it, so it divides only when the queue empties within the
// interval.
func (w *row) advance(now int64) {
	if now <= w.at {
		return
	}
	dt := float64(now - w.at)
	// The interval's weight, 1 - exp(-x): between picks x is tiny, and its
	// series to x² is exact to x³/6 (under 2e-10 below 1e-3), where
	// math.Exp on every row took a pick over 128 endpoints 14% of its CPU.
	x := dt * (1 / float64(utilizationWindow))
	fresh := x - x*x/2
	if x >= 1e-3 {
		fresh = -math.Expm1(-x)
	}
	drained := w.rate * dt * 1e-9
	busy := 0.0 // the share of the interval the queue was not empty
	if q := float64(w.queued()); q >= drained {
		busy = 1
	} else if q > 0 {
		busy = q / drained
	}
	w.utilization += (busy - w.utilization) * fresh
	w.posOut = min(w.posIn, w.posOut+drained)
	w.at = now
}

// endedPrefill is a detached reservation whose modelled prefill a drain
// ended, and when.
type endedPrefill struct {
	r  *Reservation
	at int64
}

// drain advances the model and moves every reservation whose modelled
// prefill is done to decoding: amortised O(1), since each reservation leaves
// the queue once. It appends the detached ones to ended, with the time
// their prefill ended, for the ledger to schedule their end.
func (w *row) drain(now int64, ended []endedPrefill) []endedPrefill {
	fromAt, fromOut := w.at, w.posOut
	w.advance(now)
	for r := w.inPrefill.Front(); r != nil && (r.endPos <= w.posOut || w.posOut >= w.posIn); r = w.inPrefill.Front() {
		// When the model's position passed its end: its decoding started
		// then, not at this (lazy) drain.
		end := fromAt + int64(max(r.endPos-fromOut, 0)/w.rate*1e9)
		if r.pre == w {
			// A split request's prefill leg is one token long: done
			// with its prefill, it is gone from its prefiller.
			w.dropPrefill(r, now)
			r.pre, r.prefill = nil, 0
		} else {
			w.endPrefill(r, now)
		}
		if r.detached {
			ended = append(ended, endedPrefill{r, min(max(end, r.enqueuedAt), now)})
		}
	}
	return ended
}

// queued is the modelled prefill still to compute here, in tokens (call
// drain first).
func (w *row) queued() int {
	return min(w.prefill, max(int(math.Ceil(w.posIn-w.posOut)), 0))
}

// hold adds r to the row: its request, and its prefill at the back of the
// queue (or its decoding).
func (w *row) hold(r *Reservation, now int64) {
	w.inFlight++
	w.holdAdapter(r)
	w.engine.peak = max(w.engine.peak, w.inFlight)
	if r.decoding {
		w.decoding++
		return
	}
	w.enqueue(r, now)
}

// holdPrefill adds the prefill part of a split request r to w, its
// prefiller: the request, its adapter (the prefill leg runs with it), and
// its prefill at the back of the queue.
func (w *row) holdPrefill(r *Reservation, now int64) {
	w.inFlight++
	w.holdAdapter(r)
	w.engine.peak = max(w.engine.peak, w.inFlight)
	w.enqueue(r, now)
}

// dropPrefill takes the prefill part of a split request r off w, its
// prefiller.
func (w *row) dropPrefill(r *Reservation, now int64) {
	w.inFlight--
	w.dropAdapter(r)
	w.leaveQueue(r, now)
}

// enqueue puts r's prefill at the back of w's queue.
func (w *row) enqueue(r *Reservation, now int64) {
	w.advance(now)
	ahead := w.queued()
	w.prefill += r.prefill
	w.posIn += float64(r.prefill)
	r.endPos = w.posIn
	r.work = ahead + r.prefill
	r.enqueuedAt = now
	w.inPrefill.Push(r)
}

// drop takes r off the row, whatever it holds there.
func (w *row) drop(r *Reservation, now int64) {
	w.inFlight--
	w.dropAdapter(r)
	if r.decoding {
		w.decoding--
		return
	}
	w.leaveQueue(r, now)
}

// endPrefill moves r from prefill to decoding: its first byte came, or the
// model says its prefill is done.
func (w *row) endPrefill(r *Reservation, now int64) {
	w.leaveQueue(r, now)
	r.prefill = 0
	r.decoding = true
	w.decoding++
}

// leaveQueue takes r's prefill out of the queue before the model finished
// it. What the model still counted for r leaves the queue with it: at the
// head by moving posOut (everything behind moves up, exactly), elsewhere by
// moving posIn (later reservations keep their positions and finish a little
// late, until the queue empties).
func (w *row) leaveQueue(r *Reservation, now int64) {
	w.advance(now)
	rem := min(float64(r.prefill), max(r.endPos-w.posOut, 0))
	if r == w.inPrefill.Front() {
		w.posOut += rem
	} else {
		w.posIn -= rem
	}
	w.inPrefill.Remove(r)
	w.prefill -= r.prefill
	if w.inPrefill.Front() == nil { // nothing in prefill: the model has nothing queued
		w.posIn, w.posOut = 0, 0
	}
}
