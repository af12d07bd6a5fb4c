package picker

import "time"

// A prefill pod whose prefill legs fail legFailureThreshold times in a
// row prefills for no other pod for legBackoff, doubled at each further
// failure up to maxLegBackoff: its split requests prefill on their decode
// pods meanwhile. A leg that works (a split request's first byte) ends it.
// A decode pod that fails its split requests can make their prefill pods
// take the blame: the cost is a while of prefilling on the decode pods,
// never a failed request more.
const (
	legFailureThreshold = 3
	legBackoff          = 5 * time.Second
	maxLegBackoff       = 80 * time.Second
)

// legFailed feeds back the failed prefill leg of r, a split request whose
// response was an error before any first byte (Outcome.ServerError).
func (l *ledger) legFailed(r *Reservation, now int64) {
	w := r.prefilledOn
	if w == nil || w.dropped {
		return
	}
	e := &w.engine
	e.legFailures++
	e.legFailuresTotal++
	if n := e.legFailures - legFailureThreshold; n >= 0 {
		e.legsOffUntil = now + int64(min(legBackoff<<min(n, 4), maxLegBackoff))
	}
}

// prefillsNow reports whether w's prefill legs may be chosen at now (not
// backed off by legFailed).
func (w *row) prefillsNow(now int64) bool { return w.engine.legsOffUntil <= now }
