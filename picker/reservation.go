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
	pickedNs     int64 // pickedAt on the picker's clock
	promptChars  int
	promptTokens int
	cachedBlocks int // of the hashed blocks, those the chosen endpoint held
	nHashes      int // the prompt's hashed blocks
	stream       bool
	bodiless     bool   // Request.bodiless: nothing runs on the engine for it
	maxTokens    int    // the request's max_tokens; 0 when it gives none
	adapter      string // its LoRA adapter on its row's engine; "" for the base model
	// adapterLoad: its adapter was not resident on its row when it took
	// it, so its first byte waits for the load (adapters.go); adapterWait:
	// the row's engine ran max_lora other adapters then, so it waits first
	// for one of them to drain.
	adapterLoad, adapterWait bool
	endpoints                [maxFallbackEndpoints]netip.AddrPort
	nEndpoints               int

	// Guarded by p.mu.
	row          *row // current holder; its counters include this reservation until released
	prefill      int  // prefill tokens still held (0 once decoding)
	decoding     bool // past the first byte, or past the modelled prefill
	sawFirstByte bool
	released     bool
	delivered    bool
	heldBefore   int      // leading blocks the holder had before this request recorded there
	cachedTokens int      // of the prompt's tokens, those heldBefore holds
	owner        uint32   // tag of this request's records in the prefix index
	tailOn       *row     // where its pick left a long prompt's tail to record
	hashes       []uint64 // the prompt's blocks, kept for ServedBy
	hashBuf      *[]uint64
	firstByteNs  int64 // clock of its first response bytes
	outputTokens int   // its response's output tokens, when Completed said

	// Detached (detach.go): its row's list of detached reservations, and
	// its modelled end and place in the picker's schedule once its prefill
	// is done (heapIdx -1 while not scheduled).
	detached   bool
	detachLink link[Reservation]
	doneAt     int64
	heapIdx    int

	// The drain model of its row, while in prefill: where its prefill ends
	// in the row's queue, the work (tokens) from joining the queue to its
	// end, when it joined, and its neighbours in the queue.
	endPos      float64
	work        int
	enqueuedAt  int64
	prefillLink link[Reservation]

	// The sweeper's list, in pick order; guarded by p.mu.
	pickLink link[Reservation]
}

// Endpoints lists the chosen endpoint, then the next best by cost (exact ties
// in random order), at most FallbackEndpoints in all; saturated endpoints are
// not listed. The slice is shared: do not modify it.
func (r *Reservation) Endpoints() []netip.AddrPort { return r.endpoints[:r.nEndpoints] }

// FirstByte marks the first response bytes: the endpoint has computed the
// prompt, so what is left of the prefill is released and the request is
// decoding. For a streamed request it also teaches the endpoint's prefill
// rate. Later calls do nothing.
func (r *Reservation) FirstByte() {
	p := r.p
	now := p.clock()
	p.mu.Lock()
	defer p.mu.Unlock()
	if r.released || r.sawFirstByte {
		return
	}
	r.sawFirstByte = true
	r.firstByteNs = now
	w := r.row
	// A streamed first byte teaches the prefill rate when the response
	// ends (releaseLocked): only then can a late one be told apart.
	if !r.decoding {
		w.endPrefill(r, now)
	}
	p.freedLocked(now)
}

// Release releases everything the reservation still holds. Later calls,
// and calls after the sweeper released it, do nothing.
func (r *Reservation) Release() {
	p := r.p
	now := p.clock()
	p.mu.Lock()
	buf := p.releaseLocked(r, now)
	p.freedLocked(now)
	p.mu.Unlock()
	if buf != nil {
		*buf = (*buf)[:0]
		p.hashBufs.Put(buf)
	}
}

// Delivered reports the engine's usage for the request: of promptTokens
// prompt tokens (the engine's count), cachedTokens came from its prefix
// cache. It books them, and the picker's prediction, in the endpoint's drift
// counters. It forgets nothing from the prefix index, even when the engine
// held fewer of the request's blocks than the index said: the usage comes
// once the engine has computed the whole prompt, so the blocks it lacked are
// in its cache again. Call it before Release; later calls do nothing.
func (r *Reservation) Delivered(promptTokens, cachedTokens int) {
	p := r.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if r.released || r.delivered || promptTokens <= 0 {
		return
	}
	r.delivered = true
	e := &r.row.engine
	delivered := min(max(cachedTokens, 0), promptTokens)
	e.delivered += int64(delivered)
	e.predic += int64(r.cachedTokens)
	e.learnCacheTrust(delivered, r.cachedTokens)
}

// releaseLocked releases r if it is still held and returns its hash buffer
// for reuse (outside the lock).
func (p *Picker) releaseLocked(r *Reservation, now int64) *[]uint64 {
	if r.released {
		return nil
	}
	if r.detached {
		p.unlinkDetachedLocked(r)
	}
	if r.stream && r.sawFirstByte {
		p.learnPrefillLocked(r, now)
	}
	r.row.drop(r, now)
	r.prefill = 0
	r.released = true
	p.picks.remove(r)
	buf := r.hashBuf
	r.hashes, r.hashBuf = nil, nil
	return buf
}

// ServedBy moves what the reservation still holds to addr, the endpoint
// that actually served the request (the gateway may have used a fallback),
// and records the prompt's blocks there. The blocks this request added to
// the previous holder are forgotten there, unless another request recorded
// them since: this one never computed them. Nothing happens if addr is not
// a current endpoint, already the holder, or the reservation has been
// released.
func (r *Reservation) ServedBy(addr netip.AddrPort) {
	p := r.p
	now := p.clock()
	p.mu.Lock()
	untidy := r.moveLocked(addr, now)
	p.mu.Unlock()
	if untidy {
		p.tidy()
	}
}

// moveLocked is ServedBy under the lock; it reports whether the index owes
// evictions.
func (r *Reservation) moveLocked(addr netip.AddrPort, now int64) bool {
	p := r.p
	to, ok := p.byAddr[key(addr)]
	if r.released || r.detached || !ok || to == r.row {
		return false
	}
	from := r.row
	from.drop(r, now)
	p.index.ForgetOwn(from.id, r.hashes[r.heldBefore:], r.owner)

	ids, matched := p.candIDs[:1], p.matched[:1]
	ids[0] = to.id
	p.index.Match(r.hashes, ids, matched)
	r.heldBefore = matched[0]
	r.cachedTokens = p.heldTokens(matched[0])
	if !r.decoding {
		r.prefill = p.uncachedTokens(to, r.promptChars, matched[0])
	}
	r.row = to
	r.tailOn = nil // recorded whole just below
	r.adapterLoad, r.adapterWait = to.adapterLoadFor(r.adapter)
	to.hold(r, now)
	p.index.Record(to.id, r.hashes, r.owner)
	return p.index.Untidy()
}
