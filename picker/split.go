package picker

import (
	"net/netip"
	"sync"
	"sync/atomic"
)

// splitDecision says why a pick split a request (prefill/decode
// disaggregation) or did not: the label of tally_split_decisions_total. It
// is set by place, under the lock, and counted after the pick, outside it.
type splitDecision string

// The decisions, as llm-d's prefix-based-pd-decider and Tally's cost
// decide them (place.go, pair and splitWhy).
const (
	// splitYes: the request's prefill runs on a prefill pod.
	splitYes splitDecision = "split"
	// splitCached: the decode pod holds too much of the prompt, fewer than
	// disaggregation.nonCachedTokens are uncached there.
	splitCached splitDecision = "cached"
	// splitShort: the prompt is shorter than disaggregation.promptTokens
	// (or than nonCachedTokens).
	splitShort splitDecision = "short"
	// splitNoPrefillPod: no ready prefill pod under its saturation
	// threshold.
	splitNoPrefillPod splitDecision = "no_prefill_pod"
	// splitLocalCheaper: prefilling on the decode pod gives an earlier
	// first token than the split through the cheapest prefill pod (before
	// its transfer).
	splitLocalCheaper splitDecision = "local_cheaper"
	// splitGateway: the gateway takes only the destination from the
	// answer (Request.DestinationOnly): the prefill pod would never be
	// named to the decode pod's sidecar.
	splitGateway splitDecision = "gateway"
)

// splitDecisions lists the decisions in the order of splitCounts' slots.
var splitDecisions = [...]splitDecision{splitYes, splitCached, splitShort, splitNoPrefillPod, splitLocalCheaper, splitGateway}

// slot is d's index in splitDecisions; -1 for "" (not decided: no
// disaggregation, or a bodiless request) or an unknown value.
func (d splitDecision) slot() int {
	for i, s := range splitDecisions {
		if s == d {
			return i
		}
	}
	return -1
}

// splitCounts are the disaggregation counters, kept as plain numbers and
// sent at scrape time (Collect), so that counting a pick allocates
// nothing: the decisions by reason, and the prefill legs by prefill pod.
// The legs of an endpoint that is no longer in the ledger (current or
// retained) are forgotten at the next scrape, so that pod churn does not
// grow the series without bound; its counter then starts again from 0,
// which rate() reads as a reset.
type splitCounts struct {
	decisions [len(splitDecisions)]atomic.Uint64

	mu   sync.Mutex
	legs map[netip.AddrPort]*legCounter // by key(address) of the prefiller
}

// legCounter is one prefill pod's legs. missed: the last scrape did not
// find its endpoint in the ledger; it is forgotten when the next one does
// not either (one miss alone may be a pod added between the scrape's
// snapshot and its count).
type legCounter struct {
	n      atomic.Uint64
	missed bool
}

// countSplit counts a placed pick's split decision and, when it split, its
// prefill leg; only with disaggregation on. It runs outside the lock, after
// place: r is not returned yet, so nothing else reads or writes it.
func (p *Picker) countSplit(r *Reservation) {
	if !p.cfg.Disaggregation.Enabled() {
		return
	}
	s := &p.metrics.split
	if i := r.splitWhy.slot(); i >= 0 {
		s.decisions[i].Add(1)
	}
	if !r.prefiller.IsValid() {
		return
	}
	a := key(r.prefiller)
	s.mu.Lock()
	c := s.legs[a]
	if c == nil {
		if s.legs == nil {
			s.legs = map[netip.AddrPort]*legCounter{}
		}
		c = new(legCounter)
		s.legs[a] = c
	}
	s.mu.Unlock()
	c.n.Add(1)
}

// legCount is one endpoint's prefill legs so far.
type legCount struct {
	addr netip.AddrPort
	n    uint64
}

// legsOf returns the prefill legs counted for the endpoints of l (current
// and retained), in their order, and forgets those missing from it twice
// in a row.
func (s *splitCounts) legsOf(l *Ledger) []legCount {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.legs) == 0 {
		return nil
	}
	out := make([]legCount, 0, len(s.legs))
	known := make(map[netip.AddrPort]bool, len(l.Endpoints)+len(l.Retained))
	for _, eps := range [2][]EndpointStats{l.Endpoints, l.Retained} {
		for _, e := range eps {
			a := key(e.Endpoint.Address)
			known[a] = true
			if c := s.legs[a]; c != nil {
				c.missed = false
				out = append(out, legCount{e.Endpoint.Address, c.n.Load()})
			}
		}
	}
	for a, c := range s.legs {
		if !known[a] {
			if c.missed {
				delete(s.legs, a)
			}
			c.missed = true
		}
	}
	return out
}
