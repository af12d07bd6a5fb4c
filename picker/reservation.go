package picker

import (
	"net/netip"
	"time"
)

// Reservation is one placed request's hold on the ledger. Its methods are
// safe to call concurrently and in any order; each of FirstByte and Release
// takes effect at most once, whoever calls it first (the stream, or the
// sweeper through Release).
type Reservation struct {
	p *Picker

	// Fixed at pick time.
	pickedAt     time.Time
	promptTokens int
	cachedTokens int
	endpoints    [maxFallbackEndpoints]netip.AddrPort
	nEndpoints   int

	// Guarded by p.mu.
	row        *row // current holder; its counters include this reservation while live
	prefill    int  // prefill tokens still held (0 once decoding)
	decoding   bool
	released   bool
	heldBefore int      // leading blocks the holder had before this request recorded there
	hashes     []uint64 // the prompt's blocks, kept for ServedBy
	hashBuf    *[]uint64

	// The sweeper's list, in pick order; guarded by p.mu.
	older, newer *Reservation
}

// Endpoints lists the chosen endpoint, then the next best by cost (exact ties
// in random order), at most FallbackEndpoints in all; saturated endpoints are
// not listed. The slice is shared: do not modify it.
func (r *Reservation) Endpoints() []netip.AddrPort { return r.endpoints[:r.nEndpoints] }

// Endpoint returns the endpoint currently holding the reservation: the
// chosen one, or the one named by ServedBy.
func (r *Reservation) Endpoint() netip.AddrPort {
	r.p.mu.Lock()
	defer r.p.mu.Unlock()
	return r.row.ep.Address
}

// PromptTokens is the estimated number of prompt tokens.
func (r *Reservation) PromptTokens() int { return r.promptTokens }

// CachedTokens is the estimated number of prompt tokens the chosen endpoint
// held in its prefix index at pick time.
func (r *Reservation) CachedTokens() int { return r.cachedTokens }

// FirstByte releases the prefill tokens: the endpoint has computed the
// prompt and the request is now decoding. Later calls do nothing.
func (r *Reservation) FirstByte() {
	p := r.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if r.released || r.decoding {
		return
	}
	if h := r.row; h.live {
		h.prefill -= r.prefill
		h.decoding++
	}
	r.prefill = 0
	r.decoding = true
	p.firstBytes++
}

// Release releases everything the reservation still holds. Later calls,
// and calls after the sweeper released it, do nothing.
func (r *Reservation) Release() {
	p := r.p
	p.mu.Lock()
	buf := p.releaseLocked(r)
	p.mu.Unlock()
	if buf != nil {
		*buf = (*buf)[:0]
		p.hashBufs.Put(buf)
	}
}

// releaseLocked releases r if it is still held and returns its hash buffer
// for reuse (outside the lock).
func (p *Picker) releaseLocked(r *Reservation) *[]uint64 {
	if r.released {
		return nil
	}
	if h := r.row; h.live {
		h.inFlight--
		h.prefill -= r.prefill
		if r.decoding {
			h.decoding--
		}
	}
	r.prefill = 0
	r.released = true
	p.unlinkLocked(r)
	p.releases++
	buf := r.hashBuf
	r.hashes, r.hashBuf = nil, nil
	return buf
}

// ServedBy moves what the reservation still holds to addr, the endpoint
// that actually served the request (the gateway may have used a fallback),
// and records the prompt's blocks there. The blocks this request added to
// the previous holder are forgotten there: it never computed them. Nothing
// happens if addr is unknown, already the holder, or the reservation has
// been released.
func (r *Reservation) ServedBy(addr netip.AddrPort) {
	p := r.p
	p.mu.Lock()
	defer p.mu.Unlock()
	to, ok := p.byAddr[key(addr)]
	if r.released || !ok || to == r.row {
		return
	}
	if from := r.row; from.live {
		from.inFlight--
		from.prefill -= r.prefill
		if r.decoding {
			from.decoding--
		}
		p.index.Forget(from.id, r.hashes[r.heldBefore:])
	}
	to.inFlight++
	to.prefill += r.prefill
	if r.decoding {
		to.decoding++
	}
	r.row = to
	ids, matched := p.candIDs[:1], p.matched[:1]
	ids[0] = to.id
	p.index.Match(r.hashes, ids, matched)
	r.heldBefore = matched[0]
	p.index.Record(to.id, r.hashes)
}

// linkLocked appends r to the sweeper's list: no allocation, the links live
// in the reservation.
func (p *Picker) linkLocked(r *Reservation) {
	r.older, r.newer = p.newest, nil
	if p.newest != nil {
		p.newest.newer = r
	} else {
		p.oldest = r
	}
	p.newest = r
}

func (p *Picker) unlinkLocked(r *Reservation) {
	if r.older != nil {
		r.older.newer = r.newer
	} else {
		p.oldest = r.newer
	}
	if r.newer != nil {
		r.newer.older = r.older
	} else {
		p.newest = r.older
	}
	r.older, r.newer = nil, nil
}
