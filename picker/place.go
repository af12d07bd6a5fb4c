package picker

import (
	"net/netip"
	"slices"
)

// candidate is one endpoint a pick weighs, with what the scoring steps
// work out for it and pass to each other.
type candidate struct {
	w        *row
	matched  int // leading blocks of the prompt its prefix index holds
	uncached int // this request's uncached prompt tokens there
	// queued and foreign are its drained queue and its foreign load now.
	queued, foreign int
	cost            int
	taken           bool // chosen already, or not eligible
	// loraOut says why the adapter rules take it out, if they do; adapter,
	// active and refs: whether the request's model is an adapter there,
	// active there, and its requests in flight there (adapters.go).
	loraOut         uint8
	adapter, active bool
	refs            int
	// pre is its prefill pod when the request would be split there (pair).
	pre *candidate
}

// scratch is the room one operation works in, sized on setEndpoints so that
// picks do not grow it.
type scratch struct {
	rows     []*row      // the rows a request may go to
	cands    []candidate // and what the pick works out for them
	ids      []int
	matched  []int
	seen     []uint64 // by row.pos: mark of the pick that took the row in
	mark     uint64
	best     []int // best's result and its tie keys: room for one more than the longest list
	bestKeys []uint64
	ended    []endedPrefill // the detached prefills a drain ended
	weight   float64        // the last score's workWeight
	// pre holds the prefill pods a split weighs (pair), first and second
	// the two cheapest of them.
	pre           []candidate
	first, second *candidate
}

func newScratch() scratch {
	return scratch{best: make([]int, 0, maxFallbackEndpoints+1), bestKeys: make([]uint64, 0, maxFallbackEndpoints+1)}
}

// size makes room for n rows.
func (s *scratch) size(n int) {
	if cap(s.rows) < n {
		s.rows = make([]*row, 0, n)
		s.cands = make([]candidate, 0, n)
		s.ids = make([]int, 0, n)
		s.matched = make([]int, n)
		s.seen = make([]uint64, n)
		s.pre = make([]candidate, 0, n)
	}
}

// place is the critical section of a pick: score, choose, reserve and
// record, all against the same view of the ledger and the prefix index. It
// is given its time in r.pickedNs.
func (l *ledger) place(r *Reservation, req Request) error {
	now := r.pickedNs
	cands := l.score(l.candidates(req), r, now)
	if len(cands) == 0 {
		return ErrNoEndpoint
	}
	eligible, free, decodeFree := l.saturation(cands, r)
	// Flow control's threshold decides whether the request may be placed
	// now, not where: a saturated endpoint whose prefix saves more than its
	// queue costs is still the cheapest place. A request that may be split
	// needs only a decode slot on its destination, if a prefill pod is
	// free to prefill it (stage-aware saturation).
	splitOnly := false
	if free == 0 {
		if decodeFree == 0 || !l.maySplit(r) || !l.prefillFree(now) {
			return ErrSaturated
		}
		// Only a split can be placed now: its destination is one with a
		// decode slot, whatever the prefill queued there.
		splitOnly = true
		eligible = 0
		for i := range cands {
			c := &cands[i]
			c.taken = c.taken || l.decodeFull(c.w.decoding)
			if !c.taken {
				eligible++
			}
		}
	}
	if l.loraSeen {
		eligible -= l.adapterCost(cands, req.Model, r.promptTokens)
	}
	pairs := l.maySplit(r)
	if pairs {
		eligible -= l.pair(cands, r, now, splitOnly)
	}

	r.nEndpoints = min(eligible, l.cfg.FallbackEndpoints)
	best := l.best(cands, max(r.nEndpoints, 1))
	for k, i := range best {
		cands[i].taken = true
		r.endpoints[k] = cands[i].w.ep.Address
	}
	if len(best) == 0 {
		// The adapter rules took out every decode slot left, or, with
		// only a split placeable, every endpoint that could be split to
		// is too cached to split: it waits for a pod to take it whole.
		return ErrSaturated
	}
	d := &cands[best[0]]
	r.splitWhy = l.splitWhy(d, r, pairs)
	if d.pre != nil {
		l.reserveSplit(r, d, d.pre, req.Model, now)
		return nil
	}
	l.reserve(r, d, req.Model, now)
	return nil
}

// pair scores each decode candidate of a request that may be split
// (disaggregation) as the cheaper of its two ways to a first token: its
// own prefill there, or a split, when at least nonCachedTokens of the
// prompt are not cached there (llm-d's prefix-based-pd-decider). A split's
// cost is the request's time to first token through the pair: the
// cheapest free prefill pod other than the candidate (its queue and the
// request's uncached tokens there) and the transfer of what the candidate
// lacks, or the candidate's own queue if that drains later (the two run
// at once), plus the candidate's decoding; a candidate that would prefill
// itself costs its whole cost. Each side adds the stall its
// prefill puts on the requests decoding there, which wait out its tokens
// (vLLM runs a step's prefill beside its decodes): what keeping prefill
// off decode pods is for. A candidate splits unless prefilling there is
// cheaper than the split before its transfer: the transfer is the price
// the pods' roles ask (on an idle pool the decode pod would otherwise
// prefill the first request of every burst), so an exact tie splits too.
// The candidates that split get c.pre, their prefill pod. With force (only
// a split may be placed now: place's splitOnly) a candidate that cannot
// split is taken out; pair returns how many it took out.
func (l *ledger) pair(cands []candidate, r *Reservation, now int64, force bool) (out int) {
	s := &l.scratch
	first, second := l.prefillers(r, now)
	s.first, s.second = first, second
	need := l.cfg.Disaggregation.NonCachedTokens
	for i := range cands {
		c := &cands[i]
		if c.taken {
			continue
		}
		p := first
		if p != nil && p.w == c.w {
			p = second
		}
		if p == nil || c.uncached < need {
			if force {
				c.taken = true
				out++
				continue
			}
			c.cost += c.uncached * c.w.decoding
			continue
		}
		local := c.cost + c.uncached*c.w.decoding
		// The prefill leg and the drain of c's own queue run at once: the
		// decode leg reaches c when the leg and the transfer are done,
		// and then waits for what c still has queued.
		wait := c.queued + c.foreign
		rest := c.cost - int(float64(c.uncached)*s.weight) - wait // decoding, adapter loads
		transfer := l.transferCost(c)
		if force || max(p.cost, wait)+rest <= local {
			c.cost, c.pre = max(p.cost+transfer, wait)+rest, p
		} else {
			c.cost = local
		}
	}
	return out
}

// prefillers returns the two cheapest prefill pods free to prefill r (nil
// where there are fewer): each one's cost is
// its queue and the request's uncached tokens there, plus the stall they
// put on what decodes there. Exact ties are ordered at random. A
// saturated prefill pod (flow control, or a static limit) is none.
func (l *ledger) prefillers(r *Reservation, now int64) (first, second *candidate) {
	s := &l.scratch
	rows := l.prefillRows
	ids, matched := s.ids[:len(rows)], s.matched[:len(rows)]
	for i, w := range rows {
		ids[i] = w.id
	}
	l.index.Match(r.hashes, ids, matched)
	pre := s.pre[:0]
	for i, w := range rows {
		l.drain(w, now)
		if !w.prefillsNow(now) {
			continue
		}
		c := candidate{w: w, matched: matched[i], uncached: l.uncachedTokens(w, r.promptChars, matched[i])}
		c.queued, c.foreign = w.queued(), w.engine.foreignCost(now)
		if l.prefillSaturated(w, c.queued, c.foreign) {
			continue
		}
		c.cost = l.cost(c.queued, c.foreign, c.uncached, w.decoding, s.weight) + c.uncached*w.decoding
		pre = append(pre, c)
	}
	s.pre = pre
	best := l.best(pre, 2)
	if len(best) > 0 {
		first = &pre[best[0]]
	}
	if len(best) > 1 {
		second = &pre[best[1]]
	}
	return first, second
}

// transferCost is what moving the KV of c's uncached tokens to c (a split
// request's decode pod) costs, in c's prefill tokens: the transfer at
// disaggregation.transferTokensPerSecond, at c's prefill rate.
func (l *ledger) transferCost(c *candidate) int {
	return int(float64(c.uncached) * c.w.rate / float64(l.cfg.Disaggregation.TransferTokensPerSecond))
}

// splitWhy says why r, placed on d, was split or not (disaggregation
// only; "" when it is off).
func (l *ledger) splitWhy(d *candidate, r *Reservation, pairs bool) splitDecision {
	dis := &l.cfg.Disaggregation
	switch {
	case !dis.Enabled() || r.bodiless:
		return ""
	case d.pre != nil:
		return splitYes
	case len(l.prefillRows) == 0:
		return splitNoPrefillPod
	case r.whole:
		return splitGateway
	case !pairs:
		return splitShort
	}
	if p := l.scratch.first; p == nil || p.w == d.w && l.scratch.second == nil {
		return splitNoPrefillPod
	}
	if d.uncached < dis.NonCachedTokens {
		return splitCached
	}
	return splitLocalCheaper
}

// reserveSplit holds a split request: as decoding on its destination d
// from the pick, its prefill queued on the prefiller p alone.
func (l *ledger) reserveSplit(r *Reservation, d, p *candidate, model string, now int64) {
	r.decoding = true
	l.reserve(r, d, model, now)
	l.reservePrefill(r, p, now)
}

// reservePrefill holds a split request's prefill on its prefiller, and
// records its prompt's head there: the prefiller's engine computes, and
// caches, the prompt (the KV it hands over lands on the destination, where
// reserve recorded it).
func (l *ledger) reservePrefill(r *Reservation, p *candidate, now int64) {
	w := p.w
	r.prefiller = w.ep.Address
	r.pre, r.prefilledOn = w, w
	r.prefill = p.uncached
	if r.adapter != "" {
		// Its first byte waits for the adapter on either pod: the prefill
		// leg runs with it, then the decode leg.
		load, wait := w.adapterLoadFor(r.adapter)
		r.adapterLoad, r.adapterWait = r.adapterLoad || load, r.adapterWait || wait
	}
	w.holdPrefill(r, now)
	w.engine.recent.add(now)
	l.index.Record(w.id, r.hashes[:min(len(r.hashes), l.blocks.inLock)], r.owner)
}

// score drains rows to now and works out each one's cost for r: the
// candidates, in the scratch.
func (l *ledger) score(rows []*row, r *Reservation, now int64) []candidate {
	s := &l.scratch
	cands := s.cands[:len(rows)]
	if len(rows) == 0 {
		return cands
	}
	ids, matched := s.ids[:len(rows)], s.matched[:len(rows)]
	for i, w := range rows {
		ids[i] = w.id
	}
	l.index.Match(r.hashes, ids, matched)
	for _, w := range rows {
		l.drain(w, now)
	}
	if len(l.detachedDue) > 0 {
		l.expireDetached(now)
	}

	weight := workWeight(rows)
	s.weight = weight
	whole := l.uncachedTokens(nil, r.promptChars, 0) // where nothing is held
	// A held prompt's uncached tokens depend only on the blocks held and
	// the engine's cache trust, which candidates mostly share: the last
	// estimate is reused.
	lastMatched, lastTrust, lastUncached := 0, 0.0, whole
	for i, w := range rows {
		c := candidate{w: w, matched: matched[i], uncached: whole}
		if m := c.matched; m > 0 {
			if t := w.engine.cacheTrust(); m != lastMatched || t != lastTrust {
				lastMatched, lastTrust, lastUncached = m, t, l.uncachedTokens(w, r.promptChars, m)
			}
			c.uncached = lastUncached
		}
		c.queued, c.foreign = w.queued(), w.engine.foreignCost(now)
		c.cost = l.cost(c.queued, c.foreign, c.uncached, w.decoding, weight)
		cands[i] = c
	}
	return cands
}

// cost estimates a request's time to first token on an endpoint, in
// prefill tokens: the prefill the model says is still queued there, plus
// the load its engine reports beyond the ledger (foreign load, engine.go),
// plus the request's uncached prompt tokens there weighted by the pool's
// load, plus a weight per request decoding there. Because it includes the request's
// own uncached tokens, a shared prefix pulls only as much as the tokens it
// saves: once the queue on its holder is longer than the saving, the next
// request goes elsewhere (and records the prefix there too). The queue is
// read after a drain to now.
//
// The uncached tokens are weighted by the pool's load (workWeight): a
// token computed on a busy pool also delays the requests that queue behind
// it, so under sustained load a prefix is worth more than the wait it
// saves this request alone.
func (l *ledger) cost(queued, foreign, uncached, decoding int, weight float64) int {
	return queued + foreign + int(float64(uncached)*weight) + l.cfg.DecodeWeightTokens*decoding
}

// saturation takes out the candidates over a static saturation limit, and
// counts those left (eligible), those of them below flow control's
// threshold (free), and those with a decode slot free (decodeFree: where a
// split request may go while its prefill runs elsewhere).
func (l *ledger) saturation(cands []candidate, r *Reservation) (eligible, free, decodeFree int) {
	for i := range cands {
		c := &cands[i]
		c.taken = !r.bodiless && l.overLimit(c.w, c.queued)
		if c.taken {
			continue
		}
		eligible++
		if !l.flowOn || r.bodiless {
			free++
			decodeFree++
			continue
		}
		if !l.decodeFull(c.w.decoding) {
			decodeFree++
			if !l.prefillFull(c.w, c.queued+c.foreign) {
				free++
			}
		}
	}
	return eligible, free, decodeFree
}

// saturated reports whether w may take no request now: over a static
// limit (overLimit) or, with flow control, over its threshold.
func (l *ledger) saturated(w *row, queued, decoding int, now int64) bool {
	return l.overLimit(w, queued) || l.flowOn && l.flowFull(w, queued+w.engine.foreignCost(now), decoding)
}

// prefillSaturated reports whether w, queued and foreign its drained queue
// and foreign load, may not prefill a split request now: saturated's
// rules.
func (l *ledger) prefillSaturated(w *row, queued, foreign int) bool {
	return l.overLimit(w, queued) || l.flowOn && l.flowFull(w, queued+foreign, w.decoding)
}

// maySplit reports whether r is long enough to be split, were enough of it
// uncached on its destination (prefiller has the whole rule).
func (l *ledger) maySplit(r *Reservation) bool {
	dis := &l.cfg.Disaggregation
	return dis.Enabled() && !r.bodiless && !r.whole && len(l.prefillRows) > 0 &&
		r.promptTokens >= dis.PromptTokens && r.promptTokens >= dis.NonCachedTokens
}

// prefillFree reports whether some prefill pod may prefill a split request
// now (prefillSaturated), drained to now.
func (l *ledger) prefillFree(now int64) bool {
	for _, w := range l.prefillRows {
		l.drain(w, now)
		if w.prefillsNow(now) && !l.prefillSaturated(w, w.queued(), w.engine.foreignCost(now)) {
			return true
		}
	}
	return false
}

// overLimit reports whether w is over a static saturation limit
// (cfg.Saturation): it is then no candidate at all.
func (l *ledger) overLimit(w *row, queued int) bool {
	sat := &l.cfg.Saturation
	return sat.MaxInFlightRequests > 0 && w.inFlight >= sat.MaxInFlightRequests ||
		sat.MaxPrefillTokens > 0 && queued >= sat.MaxPrefillTokens
}

// flowFull reports whether w is over flow control's threshold: its
// queued prefill (the ledger's drain model, plus the load its engine
// reports beyond the ledger) would take holdPrefillMilliseconds at its
// rate (prefillFull), or its decoding slots are full (decodeFull). An
// engine's waiting count is not trusted here: it is read before the
// requests it counts have started (docs/design.md, "Flow control").
func (l *ledger) flowFull(w *row, work, decoding int) bool {
	return l.decodeFull(decoding) || l.prefillFull(w, work)
}

// decodeFull reports whether an endpoint with decoding requests decoding
// has no decoding slot free (flowControl.maxDecodingRequests).
func (l *ledger) decodeFull(decoding int) bool {
	m := l.cfg.FlowControl.MaxDecodingRequests
	return m > 0 && decoding >= m
}

// prefillFull reports whether work tokens of prefill would take w
// holdPrefillMilliseconds or more at its rate.
func (l *ledger) prefillFull(w *row, work int) bool {
	return work > 0 && float64(work)*1000 >= float64(l.cfg.FlowControl.HoldPrefillMilliseconds)*w.rate
}

// reserve holds r on c's row and records its prompt's head there.
func (l *ledger) reserve(r *Reservation, c *candidate, model string, now int64) {
	w := c.w
	if l.isAdapter(w, model) {
		r.adapter = model
		r.adapterLoad, r.adapterWait = w.adapterLoadFor(model)
	}
	l.owners++
	r.owner = l.owners
	r.row = w
	r.prefill = c.uncached
	r.heldBefore = c.matched
	r.cachedBlocks = c.matched
	r.cachedTokens = l.heldTokens(c.matched)
	w.hold(r, now)
	w.engine.recent.add(now)
	l.meanPromptTokens += (float64(r.promptTokens) - l.meanPromptTokens) * meanPromptWeight
	l.picks.Push(r)
	// The head of the prompt (its first 32,000 tokens or so) is recorded
	// here; a longer tail right after, in a lock hold of its own
	// (recordTail), so that a huge prompt holds this critical section no
	// longer than a 32,000-token one.
	l.index.Record(w.id, r.hashes[:min(len(r.hashes), l.blocks.inLock)], r.owner)
	r.tailOn = w
}

// maxWorkWeight bounds workWeight: on a saturated pool a prefix held by one
// endpoint pulls at most 1.5 times the tokens it saves (docs/design.md).
const maxWorkWeight = 1.5

// workWeight is what one uncached prompt token costs on rows' pool,
// relative to a queued one: 1/(1-ρ), bounded by maxWorkWeight, for the
// pool's mean utilization ρ (drained first). In a queue busy a share ρ of
// the time, work added now delays the requests that arrive while it runs
// by about ρ/(1-ρ) of its length, on top of the request's own wait; an
// idle pool weighs a token as its wait alone, and so does an empty one.
func workWeight(rows []*row) float64 {
	if len(rows) == 0 {
		return 1
	}
	u := 0.0
	for _, w := range rows {
		u += w.utilization
	}
	return weightAt(u / float64(len(rows)))
}

// weightAt is workWeight at the pool's mean utilization u.
func weightAt(u float64) float64 { return 1 / max(1-u, 1/maxWorkWeight) }

// best returns the indices of the k cheapest candidates not yet taken
// (fewer if fewer are left), cheapest first, in one pass over cands. Exact
// ties are ordered at random: list order must never decide, or idle pools
// would load their first endpoint. Each tied candidate's random key is
// drawn when a comparison first needs it, so the order is that of the
// costs and then of independent uniform keys.
func (l *ledger) best(cands []candidate, k int) []int {
	s := &l.scratch
	best, keys := s.best[:0], s.bestKeys[:0]
	for i := range cands {
		c := &cands[i]
		if c.taken || len(best) == k && c.cost > cands[best[k-1]].cost {
			continue
		}
		var key uint64 // 0: not drawn yet
		j := len(best)
		for ; j > 0; j-- {
			o := &cands[best[j-1]]
			if o.cost < c.cost {
				break
			}
			if o.cost == c.cost {
				if key == 0 {
					key = l.tieKey()
				}
				if keys[j-1] == 0 {
					keys[j-1] = l.tieKey()
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
	s.best, s.bestKeys = best, keys
	return best
}

// tieKey draws a tie's random key, never 0.
func (l *ledger) tieKey() uint64 { return l.rand.Uint64() | 1 }

// heldTokens estimates the prompt tokens of matchedBlocks leading blocks.
func (l *ledger) heldTokens(matchedBlocks int) int {
	return l.blocks.chars(matchedBlocks) / l.cfg.CharsPerToken
}

// uncachedTokens estimates the prompt tokens w, whose prefix index holds
// matchedBlocks leading blocks of the prompt, still has to prefill: the
// rest of the prompt, and of the held part what w's engine has lately not
// delivered from its cache (engineView.cacheTrust); at least one token for
// any prompt, since the last token is always computed. w is not read
// when nothing is held (it may be nil then).
func (l *ledger) uncachedTokens(w *row, promptChars, matchedBlocks int) int {
	if promptChars == 0 {
		return 0
	}
	if matchedBlocks == 0 {
		return max(l.tokens(promptChars), 1)
	}
	held := float64(l.blocks.chars(matchedBlocks)) * w.engine.cacheTrust()
	return max(l.tokens(promptChars-int(held)), 1)
}

// hold is place for a choice made elsewhere (Picker.Hold): r is reserved on
// endpoints[0], with endpoints as its fallbacks, at the cost place would
// give it there; a split request's prefill (prefiller valid) is held on the
// prefiller, as place holds it. It reports false, and changes nothing, when
// endpoints[0] is not a current endpoint. A prefiller this ledger does not
// know is still named (r.Prefiller), its prefill then held on the
// destination.
func (l *ledger) hold(r *Reservation, req Request, endpoints []netip.AddrPort, prefiller netip.AddrPort) bool {
	if len(endpoints) == 0 {
		return false
	}
	w, ok := l.byAddr[key(endpoints[0])]
	if !ok {
		return false
	}
	now := r.pickedNs
	d := l.score(append(l.scratch.rows[:0], w), r, now)[0]
	r.nEndpoints = copy(r.endpoints[:min(len(endpoints), maxFallbackEndpoints)], endpoints)
	if !prefiller.IsValid() {
		l.reserve(r, &d, req.Model, now)
		return true
	}
	r.prefiller = prefiller
	pw, known := l.byAddr[key(prefiller)]
	if !known || pw == w {
		l.reserve(r, &d, req.Model, now)
		return true
	}
	pc := l.score(append(l.scratch.rows[:0], pw), r, now)[0]
	l.reserveSplit(r, &d, &pc, req.Model, now)
	return true
}
