// Package flowqueue is flow control's queue as a structure: priority bands,
// highest first; in each band the flows that have elements waiting, in a
// ring whose turn moves round-robin; in each flow its elements, oldest
// first; and the counts and byte totals the limits are checked against. It
// decides nothing: which element goes next, and whether it may go now, is
// the picker's ledger's (picker/flow.go), which walks the bands and the
// ring and passes the turn.
//
// The invariant not to break: an element is in exactly one flow while it
// waits, and counted in that flow, its band and the queue; Add and Remove
// are the only ways in and out, and a flow is in its band's ring exactly
// while it holds an element.
package flowqueue

import (
	"slices"

	"github.com/tallyepp/tally/picker/internal/ilist"
)

// Limit bounds what one band holds.
type Limit struct {
	MaxRequests int
	MaxBytes    int64
}

// Queue is the whole queue; its zero value is empty. S selects the link of
// T that its flows' lists use.
type Queue[T any, S ilist.Selector[T]] struct {
	bands []*Band[T, S] // by priority, highest first
	n     int
	bytes int64
}

// Band is the elements of one priority.
type Band[T any, S ilist.Selector[T]] struct {
	priority int
	limit    Limit
	n        int
	bytes    int64
	flows    map[string]*Flow[T, S]
	turn     *Flow[T, S] // the flow whose turn is next
	active   int         // flows in the ring
}

// Flow is the elements of one fairness id in a band, oldest first.
type Flow[T any, S ilist.Selector[T]] struct {
	id      string
	band    *Band[T, S]
	waiting ilist.List[T, S]
	n       int
	// The band's ring of flows with elements waiting.
	prev, next *Flow[T, S]
}

// Len is how many elements wait; Bytes, their bytes.
func (q *Queue[T, S]) Len() int     { return q.n }
func (q *Queue[T, S]) Bytes() int64 { return q.bytes }

// Bands are the bands, highest priority first (empty ones included). The
// slice is the queue's: do not modify it.
func (q *Queue[T, S]) Bands() []*Band[T, S] { return q.bands }

// Band returns the band of priority, creating it with the limit limit
// gives it.
func (q *Queue[T, S]) Band(priority int, limit func(priority int) Limit) *Band[T, S] {
	i, ok := slices.BinarySearchFunc(q.bands, priority, func(b *Band[T, S], p int) int { return p - b.priority })
	if ok {
		return q.bands[i]
	}
	b := &Band[T, S]{priority: priority, limit: limit(priority), flows: map[string]*Flow[T, S]{}}
	q.bands = slices.Insert(q.bands, i, b)
	return b
}

// Add puts x, of bytes bytes, last in band b's flow id (made if need be;
// a flow that gets its first element goes last in the band's turn, just
// before the flow whose turn is next). It returns x's flow.
func (q *Queue[T, S]) Add(x *T, b *Band[T, S], id string, bytes int64) *Flow[T, S] {
	f := b.flows[id]
	if f == nil {
		f = &Flow[T, S]{id: id, band: b}
		b.flows[id] = f
	}
	if f.n == 0 {
		b.join(f)
	}
	f.waiting.Push(x)
	f.n++
	b.n++
	b.bytes += bytes
	q.n++
	q.bytes += bytes
	return f
}

// Remove takes x, of bytes bytes, out of its flow f; a flow left empty
// leaves its band's turn and is forgotten.
func (q *Queue[T, S]) Remove(x *T, f *Flow[T, S], bytes int64) {
	b := f.band
	f.waiting.Remove(x)
	f.n--
	if f.n == 0 {
		b.leave(f)
	}
	b.n--
	b.bytes -= bytes
	q.n--
	q.bytes -= bytes
}

// Priority is the band's priority; Len, how many of its elements wait.
func (b *Band[T, S]) Priority() int { return b.priority }
func (b *Band[T, S]) Len() int      { return b.n }

// Fits reports whether the band takes one more element of bytes bytes
// within its limit.
func (b *Band[T, S]) Fits(bytes int64) bool {
	return b.n < b.limit.MaxRequests && b.bytes+bytes <= b.limit.MaxBytes
}

// Turn is the flow whose turn is next (nil when none waits), and Flows how
// many flows are in the ring: Turn, then Next of it, Flows times, walks
// them all.
func (b *Band[T, S]) Turn() *Flow[T, S] { return b.turn }
func (b *Band[T, S]) Flows() int        { return b.active }

// Pass gives the turn to the flow after f, which must be in b's ring.
func (b *Band[T, S]) Pass(f *Flow[T, S]) { b.turn = f.next }

// join puts f last in the band's turn.
func (b *Band[T, S]) join(f *Flow[T, S]) {
	b.active++
	if b.turn == nil {
		f.prev, f.next = f, f
		b.turn = f
		return
	}
	f.next, f.prev = b.turn, b.turn.prev
	f.prev.next = f
	b.turn.prev = f
}

// leave takes f, which has no element left, out of the band's turn.
func (b *Band[T, S]) leave(f *Flow[T, S]) {
	b.active--
	if f.next == f {
		b.turn = nil
	} else {
		f.prev.next, f.next.prev = f.next, f.prev
		if b.turn == f {
			b.turn = f.next
		}
	}
	f.prev, f.next = nil, nil
	delete(b.flows, f.id)
}

// ID is the flow's fairness id; Band, its band; Next, the flow after it in
// the band's ring.
func (f *Flow[T, S]) ID() string        { return f.id }
func (f *Flow[T, S]) Band() *Band[T, S] { return f.band }
func (f *Flow[T, S]) Next() *Flow[T, S] { return f.next }
func (f *Flow[T, S]) Front() *T         { return f.waiting.Front() }
func (f *Flow[T, S]) After(x *T) *T     { return f.waiting.Next(x) }
