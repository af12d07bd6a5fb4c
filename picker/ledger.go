package picker

import "net/netip"

// row is one endpoint's line in the ledger. Reservations point at their row,
// never at an address: once an endpoint is removed its row is no longer live
// and releases against it do nothing, so a later endpoint at the same address
// (a new row) is never decremented by requests it did not receive.
//
// A live row's counters are the sums over the unreleased reservations that
// point at it, so they never go negative.
type row struct {
	ep   Endpoint
	id   int // prefix index id while live
	live bool

	inFlight int // reserved and not released
	prefill  int // outstanding prefill tokens
	decoding int // past the first byte, not released

	// Scratch of the pick in progress (under the lock).
	mark      uint64
	uncached  int // this request's uncached prompt tokens here
	cost      int
	saturated bool
	taken     bool // chosen already, or not eligible
}

// key is the form addresses take in byAddr: an IPv4 endpoint may be named
// in IPv4-mapped IPv6 form by a gateway.
func key(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

// candidatesLocked returns the rows the request may go to: every endpoint, or
// those the subset hint names (each once). It does not allocate: p.cand has
// room for every row.
func (p *Picker) candidatesLocked(req Request) []*row {
	if !req.HasSubset {
		return p.rows
	}
	p.mark++
	c := p.cand[:0]
	for _, a := range req.Subset {
		r, ok := p.byAddr[key(a)]
		if !ok || r.mark == p.mark {
			continue
		}
		r.mark = p.mark
		c = append(c, r)
	}
	return c
}

// placeLocked is the critical section of a pick: score, choose, reserve and
// record, all against the same view of the ledger and the prefix index.
//
// The cost of an endpoint estimates the request's time to first token there,
// in prefill tokens: the prefill already queued on it, plus this request's
// prompt tokens it does not hold, plus a weight per request decoding on it.
// Because the cost includes the request's own uncached tokens, a shared
// prefix pulls only as much as the tokens it saves: once the queue on its
// holder is longer than the saving, the next request goes elsewhere (and
// records the prefix there too).
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

	sat := p.cfg.Saturation
	eligible := 0
	for i, c := range cands {
		c.uncached = p.uncachedTokens(len(req.Prompt), matched[i])
		c.cost = c.prefill + c.uncached + p.cfg.DecodeWeightTokens*c.decoding
		c.saturated = sat.MaxInFlightRequests > 0 && c.inFlight >= sat.MaxInFlightRequests ||
			sat.MaxPrefillTokens > 0 && c.prefill >= sat.MaxPrefillTokens
		c.taken = c.saturated
		if !c.saturated {
			eligible++
		}
	}
	if eligible == 0 {
		return ErrSaturated
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
	c.inFlight++
	c.prefill += c.uncached
	r.row = c
	r.prefill = c.uncached
	r.heldBefore = matched[first]
	r.cachedTokens = matched[first] * p.cfg.BlockSizeChars / p.cfg.CharsPerToken
	p.linkLocked(r)
	p.index.Record(c.id, r.hashes)
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
	return max(p.tokens(promptChars-matchedBlocks*p.cfg.BlockSizeChars), 1)
}
