package picker

import "slices"

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
//
// The request's own uncached tokens are weighted by the pool's load
// (workWeight): a token computed on a busy pool also delays the requests
// that queue behind it, so under sustained load a prefix is worth more than
// the wait it saves this request alone.
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

	weight := workWeight(cands)
	eligible, free := 0, 0
	bodiless := r.bodiless
	whole := p.uncachedTokens(nil, r.promptChars, 0) // where nothing is held
	// A held prompt's uncached tokens depend only on the blocks held and
	// the engine's cache trust, which candidates mostly share: the last
	// estimate is reused (working it out for every candidate took about 5%
	// of a pick over 128 endpoints).
	lastMatched, lastTrust, lastUncached := 0, 0.0, whole
	for i, c := range cands {
		queued := c.queued()
		foreign := c.engine.foreignCost(r.pickedNs)
		c.uncached = whole
		if m := matched[i]; m > 0 {
			if t := c.engine.cacheTrust(); m != lastMatched || t != lastTrust {
				lastMatched, lastTrust, lastUncached = m, t, p.uncachedTokens(c, r.promptChars, m)
			}
			c.uncached = lastUncached
		}
		c.cost = queued + foreign + int(float64(c.uncached)*weight) + p.cfg.DecodeWeightTokens*c.decoding
		c.saturated = !bodiless && p.overLimitLocked(c, queued)
		c.taken = c.saturated
		if !c.saturated {
			eligible++
			if !p.flowOn || bodiless || !p.flowFullLocked(c, queued+foreign) {
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

	r.nEndpoints = min(eligible, p.cfg.FallbackEndpoints)
	best := p.bestLocked(cands, max(r.nEndpoints, 1))
	for k, i := range best {
		cands[i].taken = true
		r.endpoints[k] = cands[i].ep.Address
	}
	first := best[0]

	c := cands[first]
	if p.isAdapter(c, req.Model) {
		r.adapter = req.Model
		r.adapterLoad, r.adapterWait = c.adapterLoadFor(req.Model)
	}
	p.owners++
	r.owner = p.owners
	r.row = c
	r.prefill = c.uncached
	r.heldBefore = matched[first]
	r.cachedBlocks = matched[first]
	r.cachedTokens = p.heldTokens(matched[first])
	c.hold(r, r.pickedNs)
	c.engine.recent.add(r.pickedNs)
	p.meanPromptTokens += (float64(r.promptTokens) - p.meanPromptTokens) * meanPromptWeight
	p.picks.push(r)
	// The head of the prompt (its first 32,000 tokens or so) is recorded
	// here; a longer tail right after, in a lock hold of its own (Pick), so
	// that a huge prompt holds this critical section no longer than a
	// 32,000-token one.
	p.index.Record(c.id, r.hashes[:min(len(r.hashes), p.blocks.inLock)], r.owner)
	r.tailOn = c
	return nil
}

// maxWorkWeight bounds workWeight. On a saturated pool a prefix held by one
// endpoint then pulls at most 1.5 times the tokens it saves: a held burst of
// 128 requests of 32,000 tokens over 3 pods, sharing 30,000 tokens that one
// pod holds, leaves that pod under half of it (at weight 1 it takes 15
// requests more than the others before they take their first; at 1.5, 22).
// On a trace replay at 50% and 80% prefill load, weights up to 1.5 took
// most of what unbounded ones gained (cmd/routesim; docs/benchmarks.md).
const maxWorkWeight = 1.5

// workWeight is what one uncached prompt token costs on cands' pool,
// relative to a queued one: 1/(1-ρ), bounded by maxWorkWeight, for the
// pool's mean utilization ρ (drained first). In a queue busy a share ρ of
// the time, work added now delays the requests that arrive while it runs
// by about ρ/(1-ρ) of its length, on top of the request's own wait; an
// idle pool weighs a token as its wait alone, and so does an empty one.
func workWeight(cands []*row) float64 {
	if len(cands) == 0 {
		return 1
	}
	u := 0.0
	for _, c := range cands {
		u += c.utilization
	}
	u /= float64(len(cands))
	return 1 / max(1-u, 1/maxWorkWeight)
}

// bestLocked returns the indices of the k cheapest candidates not yet
// taken (fewer if fewer are left), cheapest first, in one pass over cands.
// Exact ties are ordered at random: list order must never decide, or idle
// pools would load their first endpoint. Each tied candidate's random key
// is drawn when a comparison first needs it, so the order is that of the
// costs and then of independent uniform keys.
func (p *Picker) bestLocked(cands []*row, k int) []int {
	best, keys := p.best[:0], p.bestKeys[:0]
	for i, c := range cands {
		if c.taken || len(best) == k && c.cost > cands[best[k-1]].cost {
			continue
		}
		var key uint64 // 0: not drawn yet
		j := len(best)
		for ; j > 0; j-- {
			o := cands[best[j-1]]
			if o.cost < c.cost {
				break
			}
			if o.cost == c.cost {
				if key == 0 {
					key = p.tieKey()
				}
				if keys[j-1] == 0 {
					keys[j-1] = p.tieKey()
				}
				if keys[j-1] < key {
					break
				}
			}
		}
		if j == k {
			continue
		}
		best, keys = slices.Insert(best, j, i), slices.Insert(keys, j, key)
		if len(best) > k {
			best, keys = best[:k], keys[:k]
		}
	}
	p.best, p.bestKeys = best, keys
	return best
}

// tieKey draws a tie's random key, never 0.
func (p *Picker) tieKey() uint64 { return p.rand.Uint64() | 1 }

// heldTokens estimates the prompt tokens of matchedBlocks leading blocks.
func (p *Picker) heldTokens(matchedBlocks int) int {
	return p.blocks.chars(matchedBlocks) / p.cfg.CharsPerToken
}

// uncachedTokens estimates the prompt tokens w, whose prefix index holds
// matchedBlocks leading blocks of the prompt, still has to prefill: the
// rest of the prompt, and of the held part what w's engine has lately not
// delivered from its cache (engineView.cacheTrust); at least one token for
// any prompt, since the last token is always computed. w is not read
// when nothing is held (it may be nil then).
func (p *Picker) uncachedTokens(w *row, promptChars, matchedBlocks int) int {
	if promptChars == 0 {
		return 0
	}
	if matchedBlocks == 0 {
		return max(p.tokens(promptChars), 1)
	}
	held := float64(p.blocks.chars(matchedBlocks)) * w.engine.cacheTrust()
	return max(p.tokens(promptChars-int(held)), 1)
}
