package picker

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker/internal/ilist"
	"github.com/tallyepp/tally/picker/internal/ratemodel"
	"github.com/tallyepp/tally/picker/prefix"
)

// ledger is the picker's state: the rows of the endpoints, the reservations
// held on them, the prefix index, the drain, detach and rate models, and flow
// control's queue. It takes no lock (the Picker holds one over it) and reads
// no clock: each operation is given its time, in nanoseconds on the
// picker's clock. It changes only through its operations:
//
//   - place: score the candidates, choose, reserve, record (place.go);
//     enqueue and cancel, with flow control (flow.go);
//   - firstByte, servedBy, end: a reservation's lifecycle (this file);
//   - observe: a round of engine scrapes (engine.go);
//   - setEndpoints: the endpoint set (this file);
//   - dispatch: place what waits, as capacity frees (flow.go);
//   - sweep: the backstop for streams whose end was never seen;
//   - recordTail and the index's Tidy: a long prompt's tail, and the
//     evictions records owe, in lock holds of their own.
//
// The same operations, given the same times in the same order, leave two
// ledgers made by newLedger with the same configuration and seed equal:
// nothing in it iterates a map where the order could decide anything.
type ledger struct {
	cfg              v1alpha1.PickerConfig
	blocks           blockLayout
	retention        int64 // ns a row is kept after its endpoint leaves
	failureThreshold int   // failed scrapes in a row that exclude an endpoint
	flowOn           bool
	rand             *rand.Rand

	rows   []*row                  // current endpoints, sorted by address
	byAddr map[netip.AddrPort]*row // current endpoints
	// candidateRows are the current endpoints a pick may choose without a
	// subset hint: the rows that decode, minus those excluded for failing
	// scrapes.
	candidateRows []*row
	// prefillRows are the current rows that may prefill for another, minus
	// those excluded.
	prefillRows []*row
	byKey       map[rowKey]*row // current and retained endpoints
	all         []*row          // current and retained endpoints, oldest first
	lists       uint64          // setEndpoints calls so far
	index       *prefix.Index
	owners      uint32 // the last owner tag given to a pick's prefix records
	// meanPromptTokens is a moving mean of the prompts placed: the size of
	// a foreign request when its engine does not say (engine.go).
	meanPromptTokens float64
	// loraSeen: some engine has published its LoRA adapters; the base
	// models and adapters engines have named (adapters.go).
	loraSeen                  bool
	baseModels, knownAdapters map[string]bool

	// Reservations not yet released, oldest pick first (for the sweeper).
	picks ilist.List[Reservation, pickLinks]

	// The pool's prefill rate, learned from every endpoint's streamed first
	// bytes (ratefit.go), and the fate of those samples.
	pool        ratemodel.Pool
	rateSamples [numRateSamples]uint64
	// What loading an adapter takes, learned from the first bytes of
	// requests that waited for one (adapters.go).
	loraLoad ratemodel.DecayedMean

	// Detached reservations past their prefill, by modelled end, and the
	// pool's decode model they end by (detach.go); why they ended.
	detachedDue      dueHeap
	decodeNsPerToken float64
	meanOutputTokens float64
	detachEnds       [numDetachEnds]uint64

	// Requests waiting for capacity (flow control, flow.go).
	queue flowQueue

	// Scratch of one operation, sized on setEndpoints so that picks do not
	// grow it.
	scratch scratch
}

func newLedger(cfg v1alpha1.PickerConfig, rnd *rand.Rand, failureThreshold int) ledger {
	return ledger{
		cfg:              cfg,
		blocks:           newBlockLayout(cfg),
		retention:        int64(time.Duration(cfg.EndpointRetentionSeconds) * time.Second),
		failureThreshold: failureThreshold,
		flowOn:           cfg.FlowControl.Enabled,
		rand:             rnd,
		byAddr:           make(map[netip.AddrPort]*row),
		byKey:            make(map[rowKey]*row),
		index:            prefix.NewIndex(cfg.LRUCapacityBlocks),
		// Until picks teach it: a guess at one request's prompt.
		meanPromptTokens: defaultForeignRequestTokens,
		pool:             ratemodel.NewPool(float64(cfg.PrefillTokensPerSecond)),
		loraLoad:         ratemodel.StartedAt(float64(cfg.LoRALoadMilliseconds)/1000, loraLoadPrior),
		decodeNsPerToken: defaultDecodeNsPerToken,
		meanOutputTokens: defaultOutputTokens,
		scratch:          newScratch(),
	}
}

// setCounts says what an endpoint set changed.
type setCounts struct{ added, returned, left, dropped, total int }

// setEndpoints makes eps the whole endpoint set (Picker.Replace).
func (l *ledger) setEndpoints(eps []Endpoint, now int64) (c setCounts) {
	l.lists++
	mark := l.lists
	for _, ep := range eps {
		if !ep.Address.IsValid() {
			continue
		}
		if w, ok := l.byAddr[key(ep.Address)]; ok && w.listed == mark {
			continue // the address is listed twice: the first wins
		}
		k := identity(ep)
		w, ok := l.byKey[k]
		switch {
		case !ok:
			w = &row{key: k, id: l.index.Add(), at: now}
			w.rate = l.rateOf(w)
			l.byKey[k] = w
			l.all = append(l.all, w)
			c.added++
		case !w.current:
			c.returned++
		}
		w.ep, w.current, w.listed = ep, true, mark
		w.decodes, w.prefills = ep.decodes(), ep.prefills()
		l.byAddr[key(ep.Address)] = w
	}
	for _, w := range l.rows {
		if w.listed != mark {
			w.current, w.leftAt = false, now
			c.left++
		}
	}
	clear(l.byAddr)
	l.rows = l.rows[:0]
	for _, w := range l.all {
		if w.current {
			l.rows = append(l.rows, w)
			l.byAddr[key(w.ep.Address)] = w
		}
	}
	clear(l.rows[len(l.rows):cap(l.rows)]) // let dropped rows be collected
	slices.SortFunc(l.rows, func(a, b *row) int { return a.ep.Address.Compare(b.ep.Address) })
	for i, w := range l.rows {
		w.pos = i
	}
	l.refreshCandidates()
	l.scratch.size(len(l.rows))
	c.dropped = l.expire(now)
	c.total = len(l.rows)
	l.freed(now) // new endpoints take waiting requests
	return c
}

// expire drops the retained rows whose requests have all ended and whose
// retention window is over. It does not walk their prefix entries.
func (l *ledger) expire(now int64) (dropped int) {
	kept := l.all[:0]
	for _, w := range l.all {
		if !w.current && w.inFlight == 0 && now-w.leftAt >= l.retention {
			l.index.Remove(w.id)
			w.id, w.dropped = -1, true
			delete(l.byKey, w.key)
			dropped++
			continue
		}
		kept = append(kept, w)
	}
	clear(l.all[len(kept):])
	l.all = kept
	return dropped
}

// sweep releases every reservation picked more than lifetime (ns) before
// now, drains every row, ends the detached reservations the model says are
// done, and forgets retained rows past their window.
func (l *ledger) sweep(now, lifetime int64) (released, dropped int) {
	cutoff := now - lifetime
	// The list is in lock order, and pick times are read just before the
	// lock, so a reservation may sit behind one a few microseconds younger:
	// it is then swept on the next run.
	for r := l.picks.Front(); r != nil && r.pickedNs < cutoff; r = l.picks.Front() {
		if r.detached {
			l.detachEnds[detachEndSwept]++
		}
		l.release(r, now)
		released++
	}
	for _, w := range l.all {
		l.drain(w, now)
	}
	l.expireDetached(now)
	dropped = l.expire(now)
	l.freed(now)
	return released, dropped
}

// untidy reports whether the prefix index owes evictions (records took an
// endpoint over its capacity, or dropped rows' entries wait to be freed).
func (l *ledger) untidy() bool { return l.index.Untidy() }

// tidy evicts or frees up to batch of the prefix entries owed, and reports
// whether more are owed.
func (l *ledger) tidy(batch int) bool { return l.index.Tidy(batch) }

// waiting reports whether requests wait in flow control's queue.
func (l *ledger) waiting() bool { return l.queue.waiting.Len() > 0 }

// drain drains w to now and schedules the end of the detached
// reservations whose prefill it ended.
func (l *ledger) drain(w *row, now int64) {
	s := &l.scratch
	s.ended = w.drain(now, s.ended[:0])
	for _, e := range s.ended {
		l.scheduleDetached(e.r, e.at)
	}
	clear(s.ended)
}

// newReservation is req's reservation, picked at now, with its prompt's
// block hashes (kept, not copied).
func (l *ledger) newReservation(req Request, hashes []uint64, now int64) *Reservation {
	chars := len(req.Prompt)
	if chars == 0 {
		chars = max(req.PromptChars, 0)
	}
	r := &Reservation{
		pickedNs:     now,
		promptChars:  chars,
		promptTokens: l.tokens(chars),
		stream:       req.Stream,
		bodiless:     req.bodiless(),
		whole:        req.DestinationOnly,
		maxTokens:    max(req.MaxTokens, 0),
		heapIdx:      -1,
		nHashes:      len(hashes),
	}
	if len(hashes) > 0 {
		r.hashes = hashes
	}
	return r
}

// recordTail records the blocks of a long prompt past what its critical
// section recorded, unless the request has ended or moved since (servedBy
// records all of them itself). It reports whether evictions are owed.
func (l *ledger) recordTail(r *Reservation) bool {
	if !r.released && r.row.id >= 0 && r.tailOn == r.row {
		// Recording the whole prompt walks the head it recorded a moment
		// ago (still at the front of the list) and puts the tail behind
		// it, where eviction takes a prompt's tail before its head.
		l.index.Record(r.row.id, r.hashes, r.owner)
		// A split request's prefiller cached the whole prompt too.
		if w := r.pre; w != nil && w.id >= 0 {
			l.index.Record(w.id, r.hashes, r.owner)
		}
	}
	return l.index.Untidy()
}

// tokens estimates the tokens of chars characters of prompt: rounded up, so
// any text costs at least one token.
func (l *ledger) tokens(chars int) int {
	return (chars + l.cfg.CharsPerToken - 1) / l.cfg.CharsPerToken
}

// firstByte ends r's prefill at its first response bytes. A streamed first
// byte teaches the prefill rate when the response ends (release): only
// then can a late one be told apart.
func (l *ledger) firstByte(r *Reservation, now int64) {
	if r.released || r.sawFirstByte {
		return
	}
	r.sawFirstByte = true
	r.firstByteNs = now
	if !r.decoding {
		r.row.endPrefill(r, now)
	}
	// A split request's first bytes come from its destination once the
	// prefill leg has answered and the KV cache moved.
	l.releasePrefill(r, now)
	if w := r.prefilledOn; w != nil {
		w.engine.legFailures, w.engine.legsOffUntil = 0, 0 // its leg worked
	}
	l.freed(now)
}

// Outcome is how a request's stream ended, as far as its response said.
type Outcome struct {
	// PromptTokens and CachedTokens are the engine's usage: of its
	// PromptTokens prompt tokens, CachedTokens came from its prefix cache.
	// PromptTokens 0: the response did not say.
	PromptTokens, CachedTokens int
	// CompletionTokens are the response's output tokens, 0 when unknown.
	CompletionTokens int
	// Detached: the stream ended at the pick, and the request runs on
	// without the picker seeing its response (a gateway that asks only
	// where a request goes): it stays in the ledger until the model says
	// it is done (detach.go).
	Detached bool
	// ServerError: the response was a model server's error (a status of
	// 500 or more). Its bytes are no first token: the stream reports no
	// first byte for it. A split request's error that came before any
	// first byte is its prefill leg's (llm-d's sidecar answers with that
	// leg's error): its prefill pod is fed back (legFailed).
	ServerError bool
}

// end ends r's stream (Picker.End). It returns the hash buffer to reuse
// (outside the lock), and whether r was detached.
func (l *ledger) end(r *Reservation, o Outcome, now int64) (buf *[]uint64, detached bool) {
	if r.released {
		return nil, false
	}
	if o.Detached && !r.bodiless {
		// A bodiless request (a GET of /v1/models) gives the engine no
		// prefill or decoding to model: it is done when it is answered.
		return nil, l.detach(r, now)
	}
	if o.ServerError && r.split() && !r.sawFirstByte {
		l.legFailed(r, now)
	}
	// A split request's usage is its destination's, whose cache the
	// prefiller's KV filled: it says nothing of the prefix index's trust.
	if o.PromptTokens > 0 && !r.delivered && !r.split() {
		r.delivered = true
		e := &r.row.engine
		delivered := min(max(o.CachedTokens, 0), o.PromptTokens)
		e.delivered += int64(delivered)
		e.predicted += int64(r.cachedTokens)
		e.learnCacheTrust(delivered, r.cachedTokens)
	}
	if o.CompletionTokens > 0 {
		r.outputTokens = o.CompletionTokens
		l.learnResponse(r, o.CompletionTokens, now)
	}
	buf = l.release(r, now)
	l.freed(now)
	return buf, false
}

// release releases r if it is still held and returns its hash buffer for
// reuse (outside the lock).
func (l *ledger) release(r *Reservation, now int64) *[]uint64 {
	if r.released {
		return nil
	}
	if r.detached {
		l.unlinkDetached(r)
	}
	if r.stream && r.sawFirstByte {
		// A split request's first byte times its prefiller's queue and
		// prefill, then the KV transfer and a decode step: a sample of
		// the prefiller's rate (the transfer is overhead, as a first
		// step's is), never of the destination's, which prefilled nothing.
		// One whose prefiller this ledger did not know teaches nothing.
		switch w := r.prefilledOn; {
		case !r.split():
			l.learnPrefill(r, r.row, now)
		case w != nil && !w.dropped:
			l.learnPrefill(r, w, now)
		}
	}
	l.releasePrefill(r, now)
	r.row.drop(r, now)
	r.prefill = 0
	r.released = true
	l.picks.Remove(r)
	buf := r.hashBuf
	r.hashes, r.hashBuf = nil, nil
	return buf
}

// releasePrefill takes a split request's prefill part off its prefiller,
// if it still holds it.
func (l *ledger) releasePrefill(r *Reservation, now int64) {
	if r.pre == nil {
		return
	}
	r.pre.dropPrefill(r, now)
	r.pre, r.prefill = nil, 0
}

// servedBy moves r to the endpoint at addr (Picker.ServedBy); it reports
// whether the index owes evictions.
func (l *ledger) servedBy(r *Reservation, addr netip.AddrPort, now int64) bool {
	to, ok := l.byAddr[key(addr)]
	if r.released || r.detached || !ok || to == r.row {
		return false
	}
	from := r.row
	from.drop(r, now)
	l.index.ForgetOwn(from.id, r.hashes[r.heldBefore:], r.owner)

	ids, matched := l.scratch.ids[:1], l.scratch.matched[:1]
	ids[0] = to.id
	l.index.Match(r.hashes, ids, matched)
	r.heldBefore = matched[0]
	r.cachedTokens = l.heldTokens(matched[0])
	if !r.decoding {
		r.prefill = l.uncachedTokens(to, r.promptChars, matched[0])
	}
	r.row = to
	r.tailOn = nil // recorded whole just below
	r.adapterLoad, r.adapterWait = to.adapterLoadFor(r.adapter)
	to.hold(r, now)
	l.index.Record(to.id, r.hashes, r.owner)
	return l.index.Untidy()
}
