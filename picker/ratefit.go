package picker

import "github.com/tallyepp/tally/picker/internal/ratemodel"

// Learning prefill rates: the model, and why it cannot collapse, is
// package ratemodel; here the ledger chooses which first bytes and scrapes
// it learns from, and moves its rows to the rates it learns.
//
// A sample is taken when the response ends, not at the first byte: a first
// byte that came with the whole response (its events arriving in far less
// time than decoding them takes) is late, not prefill; one that came after
// twice what the model says the whole request takes is an outlier. Neither
// is learned.

// Which first bytes are learned.
const (
	// minLearnTokens: a first byte teaches the rate only if at least this
	// much prefill came before it; shorter ones say little but noise.
	minLearnTokens = 256
	// A first byte is late when the response's output arrived within
	// lateSpreadShare of the time decoding it takes; an outlier when it
	// came after outlierFactor times the modelled whole request, once the
	// pool has outlierEvidence samples.
	lateSpreadShare = 0.25
	lateMinOutput   = 4
	outlierFactor   = 2.0
	outlierEvidence = 16
)

// What became of the streamed first bytes offered to the rate.
const (
	rateSampleLearned = iota
	rateSampleShort   // less than minLearnTokens of work
	rateSampleLate    // came with the whole response
	rateSampleOutlier // after twice the modelled whole request
	// It waited for its adapter to load: it teaches the load time, not the
	// rate (adapters.go).
	rateSampleAdapterLoad
	// It waited for an adapter slot to free, then for the load: it
	// teaches neither.
	rateSampleAdapterWait
	numRateSamples
)

var rateSampleNames = [numRateSamples]string{"learned", "short", "late", "outlier", "adapter_load", "adapter_wait"}

// rateOf is w's prefill rate: the pool's times its bounded factor, and at
// least the pool's engine floor times the bounded factor of its own timing.
func (l *ledger) rateOf(w *row) float64 {
	return l.pool.RateOf(&w.rates)
}

// factorSpread is the variance of the endpoints' log factors beyond their
// noise: the variance of their measured factors less their mean noise.
func (l *ledger) factorSpread() float64 {
	var s ratemodel.Spread
	for _, w := range l.all {
		s.Add(&w.rates)
	}
	return s.Variance()
}

// setRates moves every row's drain model to now at its old rate, then
// gives it its current one.
func (l *ledger) setRates(now int64) {
	l.pool.Walked(l.factorSpread())
	for _, w := range l.all {
		w.advance(now)
		w.rate = l.rateOf(w)
	}
}

// learnPrefill takes r's streamed first byte as a sample of w's prefill
// rate, w the row that prefilled it (its own, or its prefiller's when it
// was split), as its response ends at now (see above).
func (l *ledger) learnPrefill(r *Reservation, w *row, now int64) {
	seconds := float64(r.firstByteNs-r.enqueuedAt) / 1e9
	if seconds <= 0 || r.work < minLearnTokens {
		l.rateSamples[rateSampleShort]++
		return
	}
	if out := r.outputTokens; out >= lateMinOutput {
		spread := float64(now - r.firstByteNs)
		if spread < lateSpreadShare*float64(out-1)*l.decodeNsPerToken {
			l.rateSamples[rateSampleLate]++
			return
		}
	}
	if r.adapterWait {
		l.rateSamples[rateSampleAdapterWait]++
		return
	}
	if r.adapterLoad {
		l.rateSamples[rateSampleAdapterLoad]++
		load := seconds - l.pool.Overhead() - float64(r.work)/w.rate
		l.loraLoad.Add(min(max(load, 0), maxLoRALoadSeconds), loraLoadDecay)
		return
	}
	if l.pool.Samples() >= outlierEvidence {
		whole := l.pool.Overhead() + float64(r.work)/w.rate + l.expectedOutputTokens(r)*l.decodeNsPerToken/1e9
		if seconds > outlierFactor*whole {
			l.rateSamples[rateSampleOutlier]++
			return
		}
	}
	l.rateSamples[rateSampleLearned]++
	if l.pool.Learn(&w.rates, float64(r.work), seconds, len(l.byKey)) {
		l.setRates(now)
		return
	}
	w.advance(now)
	w.rate = l.rateOf(w)
}

// observePrefillTiming updates w's engine floor from a scrape's
// prefill counters.
func (l *ledger) observePrefillTiming(w *row, s EngineStats, now int64) {
	if !s.HasPrefillTiming {
		return
	}
	learned, all := l.pool.ObserveTiming(&w.rates, s.PrefillSecondsTotal, s.PromptTokensTotal, s.CachedTokensTotal)
	switch {
	case all:
		l.setRates(now)
	case learned:
		w.advance(now)
		w.rate = l.rateOf(w)
	}
}
