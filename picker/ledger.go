package picker

import (
	"math"
	"net/netip"
	"slices"
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
// at it, so they never go negative: hold and drop are the only places that
// change them, besides endPrefill, which moves a reservation from prefill to
// decoding.
type row struct {
	ep      Endpoint
	key     rowKey
	id      int // prefix index id until dropped
	current bool
	dropped bool
	leftAt  int64 // clock (ns) when it left the set, while retained

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
	// How this endpoint's prefill differs from the pool's, learned from
	// its streamed first bytes, and the floor its engine's own prefill
	// timing sets (ratefit.go).
	rates endpointRate
	// Reservations still in prefill, in the order they joined the queue.
	qHead, qTail *Reservation
	// Detached reservations (detach.go), in the order they were detached.
	detached     int
	dHead, dTail *Reservation

	// What the engine's metrics say (see engine.go).
	engine engineView
	// adapterRefs counts the requests in flight here by LoRA adapter, and
	// recentAdapters are the last max_lora adapters used here, most recent
	// first (adapters.go).
	adapterRefs    map[string]int
	recentAdapters []string

	// Scratch of the pick in progress (under the lock).
	mark      uint64
	uncached  int // this request's uncached prompt tokens here
	cost      int
	saturated bool
	loraFull  bool // runs max_lora other adapters
	taken     bool // chosen already, or not eligible
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

// advance moves the drain model to now: the queue has drained at rate since
// the last update, never past what was queued.
func (w *row) advance(now int64) {
	if now <= w.at {
		return
	}
	w.posOut = min(w.posIn, w.posOut+w.rate*float64(now-w.at)/1e9)
	w.at = now
}

// drain advances the model and moves every reservation whose modelled
// prefill is done to decoding: amortised O(1), since each reservation leaves
// the queue once.
func (w *row) drain(now int64) {
	fromAt, fromOut := w.at, w.posOut
	w.advance(now)
	for r := w.qHead; r != nil && (r.endPos <= w.posOut || w.posOut >= w.posIn); r = w.qHead {
		// When the model's position passed its end: its decoding started
		// then, not at this (lazy) drain.
		end := fromAt + int64(max(r.endPos-fromOut, 0)/w.rate*1e9)
		w.endPrefill(r, now)
		if r.detached {
			r.p.scheduleDetachedLocked(r, min(max(end, r.enqueuedAt), now))
		}
	}
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
	w.advance(now)
	ahead := w.queued()
	w.prefill += r.prefill
	w.posIn += float64(r.prefill)
	r.endPos = w.posIn
	r.work = ahead + r.prefill
	r.enqueuedAt = now
	r.qPrev, r.qNext = w.qTail, nil
	if w.qTail != nil {
		w.qTail.qNext = r
	} else {
		w.qHead = r
	}
	w.qTail = r
}

// drop takes r off the row, whatever it holds there.
func (w *row) drop(r *Reservation, now int64) {
	w.inFlight--
	w.dropAdapter(r)
	w.engine.trough = min(w.engine.trough, w.inFlight)
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
	if r == w.qHead {
		w.posOut += rem
	} else {
		w.posIn -= rem
	}
	if r.qPrev != nil {
		r.qPrev.qNext = r.qNext
	} else {
		w.qHead = r.qNext
	}
	if r.qNext != nil {
		r.qNext.qPrev = r.qPrev
	} else {
		w.qTail = r.qPrev
	}
	r.qPrev, r.qNext = nil, nil
	w.prefill -= r.prefill
	if w.qHead == nil { // nothing in prefill: the model has nothing queued
		w.posIn, w.posOut = 0, 0
	}
}

// candidatesLocked returns the rows the request may go to: every current
// endpoint, or those the subset hint names (each once). An entry names the
// endpoint at its address; one without a port (port 0), or whose port no
// endpoint at that IP has, names every endpoint at its IP, as the upstream
// picker matches hints by IP (it ignores the port altogether). It does not
// allocate: p.cand has room for every row.
func (p *Picker) candidatesLocked(req Request) []*row {
	if !req.HasSubset {
		return p.candidates
	}
	c := p.subsetLocked(req, false)
	if len(c) == 0 {
		// The hint names only endpoints failing their scrapes: they are
		// still better than none (scrapes correct the ledger, they do not
		// decide who may serve).
		c = p.subsetLocked(req, true)
	}
	return c
}

// subsetLocked returns the rows the subset hint names, each once, those
// excluded for failing scrapes only if withExcluded.
func (p *Picker) subsetLocked(req Request, withExcluded bool) []*row {
	p.mark++
	c := p.cand[:0]
	for _, a := range req.Subset {
		a = key(a)
		if r, ok := p.byAddr[a]; ok && a.Port() != 0 {
			c = p.addCandidateLocked(c, r, withExcluded)
			continue
		}
		ip := a.Addr()
		c = p.addIPLocked(c, ip, withExcluded)
		// A row may hold the IPv4-mapped form; IPv6 addresses sort after
		// IPv4 ones, so only a pool with some can.
		if n := len(p.rows); ip.Is4() && n > 0 && p.rows[n-1].ep.Address.Addr().Is6() {
			c = p.addIPLocked(c, netip.AddrFrom16(ip.As16()), withExcluded)
		}
	}
	return c
}

// addIPLocked appends the rows at ip. Rows are sorted by address, IP first,
// so they are contiguous: a binary search finds them.
func (p *Picker) addIPLocked(c []*row, ip netip.Addr, withExcluded bool) []*row {
	i, _ := slices.BinarySearchFunc(p.rows, ip, func(w *row, ip netip.Addr) int { return w.ep.Address.Addr().Compare(ip) })
	for ; i < len(p.rows) && p.rows[i].ep.Address.Addr() == ip; i++ {
		c = p.addCandidateLocked(c, p.rows[i], withExcluded)
	}
	return c
}

// addCandidateLocked appends r unless this pick has it already, or it is
// excluded for failing scrapes and withExcluded is false.
func (p *Picker) addCandidateLocked(c []*row, r *row, withExcluded bool) []*row {
	if r.mark == p.mark || r.engine.excluded && !withExcluded {
		return c
	}
	r.mark = p.mark
	return append(c, r)
}

// placeLocked is the critical section of a pick: score, choose, reserve and
// record, all against the same view of the ledger and the prefix index.
//
// The cost of an endpoint estimates the request's time to first token there,
// in prefill tokens: the prefill the model says is still queued on it, plus
// the load its engine reports beyond the ledger (foreign load, engine.go),
// plus this request's prompt tokens it does not hold, plus a weight per
// request decoding on it. Because the cost includes the request's own uncached
// tokens, a shared prefix pulls only as much as the tokens it saves: once the
// queue on its holder is longer than the saving, the next request goes
// elsewhere (and records the prefix there too).
func (p *Picker) placeLocked(r *Reservation, req Request) error {
	cands := p.candidatesLocked(req)
	if len(cands) == 0 {
		return ErrNoEndpoint
	}
	ids, matched := p.candIDs[:len(cands)], p.matched[:len(cands)]
	for i, c := range cands {
		ids[i] = c.id
	}
	p.index.Match(r.hashes, ids, matched)

	for _, c := range cands {
		c.drain(r.pickedNs)
	}
	if len(p.detachedDue) > 0 {
		p.expireDetachedLocked(r.pickedNs)
	}

	eligible, free := 0, 0
	for i, c := range cands {
		queued := c.queued()
		foreign := c.engine.foreignCost(r.pickedNs)
		c.uncached = p.uncachedTokens(r.promptChars, matched[i])
		c.cost = queued + foreign + c.uncached + p.cfg.DecodeWeightTokens*c.decoding
		c.saturated = p.overLimitLocked(c, queued)
		c.taken = c.saturated
		if !c.saturated {
			eligible++
			if !p.flowOn || !p.flowFullLocked(c, queued+foreign) {
				free++
			}
		}
	}
	// Flow control's threshold decides whether the request may be placed
	// now, not where: a saturated endpoint whose prefix saves more than its
	// queue costs is still the cheapest place. (Placing only where capacity
	// freed cost a trace replay at 80% load half its prefix hits, and its
	// TTFT p50 went from 395 to 671 times the bound: cmd/routesim.)
	if free == 0 {
		return ErrSaturated
	}
	if p.loraSeen {
		eligible -= p.adapterCostLocked(cands, req.Model, r.promptTokens)
	}

	first := p.bestLocked(cands)
	cands[first].taken = true
	r.endpoints[0] = cands[first].ep.Address
	r.nEndpoints = min(eligible, p.cfg.FallbackEndpoints)
	for k := 1; k < r.nEndpoints; k++ {
		next := cands[p.bestLocked(cands)]
		next.taken = true
		r.endpoints[k] = next.ep.Address
	}

	c := cands[first]
	if p.isAdapter(c, req.Model) {
		r.adapter = req.Model
	}
	p.owners++
	r.owner = p.owners
	r.row = c
	r.prefill = c.uncached
	r.heldBefore = matched[first]
	r.cachedBlocks = matched[first]
	r.cachedTokens = p.blocks.chars(matched[first]) / p.cfg.CharsPerToken
	c.hold(r, r.pickedNs)
	p.meanPromptTokens += (float64(r.promptTokens) - p.meanPromptTokens) * meanPromptWeight
	p.linkLocked(r)
	// The head of the prompt (its first 32,000 tokens or so) is recorded
	// here; a longer tail right after, in a lock hold of its own (Pick), so
	// that a huge prompt holds this critical section no longer than a
	// 32,000-token one.
	p.index.Record(c.id, r.hashes[:min(len(r.hashes), p.blocks.inLock)], r.owner)
	r.tailOn = c
	return nil
}

// bestLocked returns the index of the cheapest candidate not yet taken,
// choosing uniformly at random among exact ties: list order must never
// decide, or idle pools would load their first endpoint.
func (p *Picker) bestLocked(cands []*row) int {
	best, ties := -1, 0
	for i, c := range cands {
		switch {
		case c.taken:
		case best < 0 || c.cost < cands[best].cost:
			best, ties = i, 1
		case c.cost == cands[best].cost:
			ties++
			if p.rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// uncachedTokens estimates the prompt tokens an endpoint holding
// matchedBlocks leading blocks still has to prefill: at least one for any
// prompt, since the last token is always computed.
func (p *Picker) uncachedTokens(promptChars, matchedBlocks int) int {
	if promptChars == 0 {
		return 0
	}
	return max(p.tokens(promptChars-p.blocks.chars(matchedBlocks)), 1)
}
