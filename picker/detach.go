package picker

import (
	"container/heap"
	"math"
	"time"
)

// Detached reservations. Some gateways ask the picker only where a request
// goes and never show it the response: NGINX Gateway Fabric's shim sends the
// request, half-closes its stream and proxies the request itself; an Envoy
// that skips the response phases does the same. The request is then still
// running on the model server when its stream ends, and releasing its
// reservation there would make the ledger forget it at once: a burst would
// herd as with pickers that learn load from scrapes. A detached reservation
// instead stays in the ledger and ends when the model says the request is
// done: its prefill drains like any other's, then it decodes for its
// expected output (max_tokens when the request gives one, else the mean
// output the pool's responses have shown) at the pool's observed decode
// speed (both also learned from the engines' counters where they publish
// them: observeOutputCounts). Engine scrapes shorten it when two in
// a row report fewer requests than the ledger holds there (the request
// finished early), and a request the model ended while the engine still
// runs it shows as foreign load: the correction works both ways.

const (
	// Until responses teach them: the expected output of a request that
	// gives no max_tokens, and the time one output token takes.
	defaultOutputTokens       = 256
	defaultDecodeNsPerToken   = float64(20 * time.Millisecond)
	minDecodeNsPerToken       = float64(100 * time.Microsecond)
	maxDecodeNsPerToken       = float64(time.Second)
	decodeLearnWeight         = 0.05
	outputLearnWeight         = 0.02
	maxExpectedOutputTokens   = 1 << 20
	decodeSampleSpreadAllowed = 4.0 // a sample counts within 1/4x..4x of the estimate
	// detachArrival: an engine scrape may end a detached request only once
	// a scrape at least this long after its pick found the engine busy: by
	// then the request has reached the engine, so an engine that counts
	// fewer requests than the ledger has finished some. One the gateway is
	// still forwarding, or one a pod holds before its engine sees it, is
	// not taken for finished.
	detachArrival = 100 * time.Millisecond
)

// detach ends the stream's hold on r without releasing it (Outcome.Detached):
// the gateway will show no response. r ends on its own when the model says
// the request is done, when an engine scrape says so, or by the sweeper. It
// reports whether r was detached now.
func (l *ledger) detach(r *Reservation, now int64) bool {
	if r.released || r.detached {
		return false
	}
	r.detached = true
	w := r.row
	w.detached++
	w.detachedList.Push(r)
	if r.decoding && r.pre == nil {
		// A split request still prefilling elsewhere is scheduled when
		// its prefiller's model ends the prefill (row.drain).
		l.scheduleDetached(r, now)
	}
	return true
}

// expectedOutputTokens is how many tokens r is expected to generate.
func (l *ledger) expectedOutputTokens(r *Reservation) float64 {
	if r.maxTokens > 0 {
		return float64(min(r.maxTokens, maxExpectedOutputTokens))
	}
	return l.meanOutputTokens
}

// scheduleDetached gives a detached reservation whose prefill ended at
// end its modelled end. On an engine the last scrape found behind the
// model, its prefill counts in behind: the engine has not begun it either.
func (l *ledger) scheduleDetached(r *Reservation, end int64) {
	if e := &r.row.engine; e.lagging && !r.sawFirstByte && !r.split() {
		e.behind += max(r.promptTokens-r.cachedTokens, 1)
	}
	r.doneAt = end + int64(l.expectedOutputTokens(r)*l.decodeNsPerToken)
	if r.heapIdx >= 0 {
		heap.Fix(&l.detachedDue, r.heapIdx)
		return
	}
	heap.Push(&l.detachedDue, r)
}

// unlinkDetached takes a detached reservation off its row's list and
// the schedule; release calls it.
func (l *ledger) unlinkDetached(r *Reservation) {
	w := r.row
	w.detached--
	w.detachedList.Remove(r)
	if r.heapIdx >= 0 {
		heap.Remove(&l.detachedDue, r.heapIdx)
	}
}

// expireDetached releases the detached reservations the model says
// are done by now (rows drained first, so that every prefill the model has
// ended is scheduled). It returns how many it released.
func (l *ledger) expireDetached(now int64) (n int) {
	for len(l.detachedDue) > 0 && l.detachedDue[0].doneAt <= now {
		l.release(l.detachedDue[0], now)
		n++
	}
	l.detachEnds[detachEndModel] += uint64(n)
	return n
}

// shortenDetached releases up to excess detached reservations of w,
// oldest first, that had reached the engine by seen (picked detachArrival
// before it): the engine reports fewer requests than the ledger holds.
func (l *ledger) shortenDetached(w *row, excess int, now, seen int64) {
	for r := w.detachedList.Front(); r != nil && excess > 0; {
		next := w.detachedList.Next(r)
		if r.pickedNs+int64(detachArrival) > seen {
			break // the list is in detach order, close to pick order
		}
		if r.pre != nil {
			// Still prefilling on its prefiller: this engine has not
			// begun it, so it is not among those that ended.
			r = next
			continue
		}
		l.release(r, now)
		l.detachEnds[detachEndEngine]++
		excess--
		r = next
	}
}

// behindTokens is the prefill of the n detached reservations of w
// detached last among those past their modelled prefill (fewer if it has
// fewer): those an engine working in arrival order reaches last. Each is
// its uncached prompt tokens at the pick.
func (w *row) behindTokens(n int) (tokens int) {
	skip := -n
	for r := w.detachedList.Front(); r != nil; r = w.detachedList.Next(r) {
		if r.decoding {
			skip++
		}
	}
	for r := w.detachedList.Front(); r != nil; r = w.detachedList.Next(r) {
		if !r.decoding {
			continue
		}
		if skip > 0 {
			skip--
			continue
		}
		tokens += max(r.promptTokens-r.cachedTokens, 1)
	}
	return tokens
}

// Why detached reservations ended, indexing Picker.detachEnds.
const (
	detachEndModel = iota
	detachEndEngine
	detachEndSwept
	numDetachEnds
)

var detachEndNames = [numDetachEnds]string{"model", "engine", "swept"}

// learnResponse learns the pool's decode speed and output length from
// a response that ended at now after completionTokens tokens (0: unknown).
func (l *ledger) learnResponse(r *Reservation, completionTokens int, now int64) {
	if completionTokens <= 0 {
		return
	}
	l.meanOutputTokens += (float64(completionTokens) - l.meanOutputTokens) * outputLearnWeight
	if !r.stream || !r.sawFirstByte || completionTokens < 2 || r.firstByteNs <= 0 {
		return
	}
	sample := float64(now-r.firstByteNs) / float64(completionTokens-1)
	if sample < l.decodeNsPerToken/(2*decodeSampleSpreadAllowed) {
		// The response arrived at once (a buffering proxy, a late first
		// byte): it says nothing of the decode speed.
		return
	}
	// One odd response moves the estimate a little, not a lot.
	sample = min(max(sample, l.decodeNsPerToken/decodeSampleSpreadAllowed), l.decodeNsPerToken*decodeSampleSpreadAllowed)
	l.decodeNsPerToken += (sample - l.decodeNsPerToken) * decodeLearnWeight
	l.decodeNsPerToken = min(max(l.decodeNsPerToken, minDecodeNsPerToken), maxDecodeNsPerToken)
}

// observeOutputCounts learns the pool's expected output, and its
// decode speed where the engine times its decoding, from w's engine's
// counters: the requests finished since the last scrape weigh as many
// responses would (learnResponse), so a pool whose gateway shows no
// responses learns them too. Counters that went back (an engine restart)
// start a new window.
func (l *ledger) observeOutputCounts(w *row, s EngineStats) {
	e := &w.engine
	if !s.HasOutputCounts {
		e.outputBase = false
		return
	}
	dReq := s.FinishedRequestsTotal - e.baseFinished
	dTok := s.GenerationTokensTotal - e.baseGenerated
	timed := s.HasDecodeTiming && e.decodeBase
	dSec := s.DecodeSecondsTotal - e.baseDecode
	if e.outputBase && dReq >= 0 && dTok >= 0 && (dSec >= 0 || !timed) {
		if dReq < 1 {
			return // nothing finished yet: the window goes on
		}
		mean := min(max(dTok/dReq, 1), maxExpectedOutputTokens) // a request generates a token at least
		l.meanOutputTokens += (mean - l.meanOutputTokens) * (1 - math.Pow(1-outputLearnWeight, dReq))
		// A request's decode time runs from its first token to its last:
		// it spans its tokens after the first.
		if intervals := dTok - dReq; timed && intervals >= 1 {
			sample := min(max(dSec*1e9/intervals, minDecodeNsPerToken), maxDecodeNsPerToken)
			l.decodeNsPerToken += (sample - l.decodeNsPerToken) * (1 - math.Pow(1-decodeLearnWeight, dReq))
		}
	}
	e.outputBase, e.decodeBase = true, s.HasDecodeTiming
	e.baseFinished, e.baseGenerated, e.baseDecode = s.FinishedRequestsTotal, s.GenerationTokensTotal, s.DecodeSecondsTotal
}

// dueHeap orders detached reservations by their modelled end.
type dueHeap []*Reservation

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].doneAt < h[j].doneAt }
func (h dueHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIdx, h[j].heapIdx = i, j
}
func (h *dueHeap) Push(x any) {
	r := x.(*Reservation)
	r.heapIdx = len(*h)
	*h = append(*h, r)
}
func (h *dueHeap) Pop() any {
	old := *h
	r := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	r.heapIdx = -1
	return r
}
