// Package ratemodel is the picker's model of its endpoints' prefill rates:
// the arithmetic that learns them from samples, without the ledger's rows,
// reservations or clock. The ledger decides which samples to offer and
// when (picker/ratefit.go); this package says what they teach.
//
// Rates that cannot collapse: a streamed first byte says the request's
// prefill, and the prefill queued ahead of it, took the time since it
// joined its endpoint's queue; noise and late first bytes make that signal
// mislead. So the pool's rate is one least-squares fit, seconds = overhead
// + tokens/rate, over every endpoint's samples (Fit), with the overhead
// bounded (maxPrefillOverhead); an endpoint differs from it only by a
// factor shrunk toward 1 by its noise and bounded by its evidence
// (empirical Bayes over the endpoints' spread); and an engine's own
// prefill timing floors the pool's rate, and an endpoint's as its factor
// moves it. What each choice measured, and what the alternatives cost, is
// in docs/design.md ("Learned prefill rates").
//
// The invariant not to break: an endpoint's rate is the pool's moved by a
// factor its own evidence bounds (Pool.RateOf), never a rate learned from
// its samples alone, and every rate is within [MinRate, MaxRate]. The
// arithmetic is deterministic: the same samples in the same order give the
// same rates, bit for bit (the ledger's replay test relies on it).
package ratemodel

import "math"

// Bounds and weights of the learning.
const (
	// MinRate and MaxRate bound every rate, in tokens per second. MaxRate
	// is more than any engine prefills (a large batch on the fastest
	// accelerators is some tens of thousands of tokens a second). First
	// bytes that imply more did not wait for a prefill: a cache the prefix
	// index did not predict, a server that answers at once. Learned from
	// those, rates of millions drained a 32,000-token prompt in the model
	// within milliseconds, and a burst was placed on those milliseconds
	// instead of its queues.
	MinRate = 1.0
	MaxRate = 1e6
	// poolRateDecay weighs an endpoint's earlier samples by this much at
	// each new one of its own: a memory of about 20 samples. The pool's
	// fit remembers as many of each endpoint's: its decay at each sample
	// is 1-(1-poolRateDecay)/n with n endpoints. (With a memory of 20
	// samples in all, identical endpoints, each taking the pool's rate,
	// learned it 26% off in 2 of 20 runs.)
	poolRateDecay = 0.95
	// The configured starting rate enters the pool's fit as one sample of
	// ratePriorTokens tokens, which later samples outweigh; the origin is a
	// fixed weak sample (no work, no time), so a workload whose prompts are
	// all one size still gives a rate.
	ratePriorTokens  = 4096
	rateOriginWeight = 0.5
	// An endpoint's factor, its own tokens over seconds against the pool's
	// rate, is bounded by a factor growing from minDriftFactor to
	// maxDriftFactor as its decayed sample count n reaches
	// driftEvidenceSamples (its most: 20). The engine timing's floor is
	// also shrunk toward the pool's by n/(n+ratioShrinkSamples); the first
	// bytes' factor by its noise: each sample's log rate varies by
	// samplePriorVar until samplePriorN samples say otherwise, endpoints
	// with fewer than minSpreadSamples do not count in the spread, and a
	// factor strongEvidence times its noise's deviation is mostly kept.
	ratioShrinkSamples   = 8
	samplePriorVar       = 0.09
	samplePriorN         = 2
	minSpreadSamples     = 2
	strongEvidence       = 4
	minDriftFactor       = 1.25
	maxDriftFactor       = 4.0
	driftEvidenceSamples = 20
	// minFitSeconds is the least prefill time an endpoint's sample counts
	// once the pool's overhead is taken off it.
	minFitSeconds = 1e-3
	// maxPrefillOverhead bounds the fit's overhead, in seconds: what a
	// first byte pays on an idle engine beside prefill (the gateway, the
	// network, a scheduling step), not time spent queued.
	maxPrefillOverhead = 0.03
	// minSizeSpread: below this coefficient of variation of the samples'
	// tokens, the fit does not separate an overhead.
	minSizeSpread    = 0.2
	engineRateWeight = 0.3
	// The engine's counters are compared over windows of at least this
	// much prefill time and these many uncached tokens: vLLM counts a
	// request's prompt tokens at its first token and its prefill time when
	// it finishes, so short windows do not line up.
	minEngineWindowSeconds = 1.0
	minEngineWindowTokens  = 4096
	// rateReapply: a learned sample re-rates every endpoint (a walk of the
	// whole set under the picker's lock) only once the pool's rate has
	// moved this share since they were last re-rated, or as many samples
	// have been learned as there are endpoints (for the spread of their
	// factors: O(1) a sample, amortised); otherwise only the sample's
	// endpoint.
	rateReapply = 0.01
)

// DecayedMean is a mean in which each value added weighs the earlier ones
// by a decay, so that it follows what the latest values say. Its zero value
// holds nothing; StartedAt holds prior samples of a starting value.
type DecayedMean struct{ sum, weight float64 }

// StartedAt is a mean of value that weighs as much as prior samples.
func StartedAt(value, prior float64) DecayedMean {
	return DecayedMean{sum: value * prior, weight: prior}
}

// Add adds x, weighing the earlier values by decay.
func (m *DecayedMean) Add(x, decay float64) {
	m.sum = m.sum*decay + x
	m.weight = m.weight*decay + 1
}

// Mean is the mean (0 while the mean holds nothing).
func (m DecayedMean) Mean() float64 {
	if m.weight == 0 {
		return 0
	}
	return m.sum / m.weight
}

// Weight is how many samples the mean holds, decayed (0: none).
func (m DecayedMean) Weight() float64 { return m.weight }

// Fit fits seconds = overhead + tokens/rate by least squares over
// exponentially decayed sums: the time to a first byte includes fixed
// costs (the gateway, the network, the engine's scheduling step) that are
// not prefill, and the intercept takes them, so short prompts do not drag
// the rate down. The zero Fit holds no sample.
type Fit struct{ n, t, s, tt, ts float64 }

// Add adds a sample of tokens that took seconds, of the given weight.
func (f *Fit) Add(tokens, seconds, weight float64) {
	f.n += weight
	f.t += weight * tokens
	f.s += weight * seconds
	f.tt += weight * tokens * tokens
	f.ts += weight * tokens * seconds
}

// Decay weighs every sample so far by d.
func (f *Fit) Decay(d float64) {
	f.n, f.t, f.s, f.tt, f.ts = f.n*d, f.t*d, f.s*d, f.tt*d, f.ts*d
}

// Fit returns the fitted rate and overhead; ok is false when the samples
// cannot tell them. Samples of nearly one size cannot tell an overhead from
// a slower rate: they give the rate through the origin, their tokens over
// their seconds, and no overhead.
func (f *Fit) Fit() (rate, overhead float64, ok bool) {
	if f.n <= 0 || f.s <= 0 {
		return 0, 0, false
	}
	if mean := f.t / f.n; f.tt/f.n-mean*mean < minSizeSpread*minSizeSpread*mean*mean {
		return min(max(f.t/f.s, MinRate), MaxRate), 0, true
	}
	// The origin sample, added here so that it never decays.
	n, t, tt := f.n+rateOriginWeight, f.t, f.tt
	den := n*tt - t*t
	if den <= 1e-9*n*tt {
		return 0, 0, false
	}
	slope := (n*f.ts - t*f.s) / den
	overhead = max((f.s-slope*t)/n, 0)
	if overhead > maxPrefillOverhead {
		// The slope of the fit whose intercept is the bound (the origin
		// sample, with no tokens, does not move it).
		overhead = maxPrefillOverhead
		slope = (f.ts - overhead*f.t) / f.tt
	}
	if slope <= 0 {
		return MaxRate, overhead, true // the time does not grow with the work
	}
	return min(max(1/slope, MinRate), MaxRate), overhead, true
}

// Pool is the pool's prefill model: the fit over every endpoint's samples,
// the spread of the endpoints' factors, and the floor of the engines'
// timing.
type Pool struct {
	fit      Fit
	rate     float64 // tokens per second
	overhead float64 // seconds every first byte pays
	samples  float64 // learned samples, decayed as the fit's
	// applied is the rate every endpoint last took: they are all given a
	// new one only when the pool's moves past rateReapply.
	applied float64
	// spread is how far the endpoints' log factors vary beyond their
	// noise (a variance), as of the last walk, and unwalked the samples
	// learned since.
	spread   float64
	unwalked int
	// The engines' timing: the mean of every window's log rate, decayed
	// by poolRateDecay at each, its floor (0 before any window), and the
	// floor the endpoints last took.
	floorLog            DecayedMean
	floor, floorApplied float64
}

// NewPool is a pool that starts at rate (tokens per second), weighed as
// one sample.
func NewPool(rate float64) Pool {
	p := Pool{rate: rate, applied: rate}
	p.fit.Add(ratePriorTokens, ratePriorTokens/rate, 1)
	return p
}

// Rate is the pool's fitted rate, in tokens per second.
func (p *Pool) Rate() float64 { return p.rate }

// Overhead is what every first byte pays beside prefill, in seconds.
func (p *Pool) Overhead() float64 { return p.overhead }

// Samples is how many samples the pool has learned, decayed.
func (p *Pool) Samples() float64 { return p.samples }

// Endpoint is how one endpoint's prefill differs from the pool's. The zero
// Endpoint has no evidence: it takes the pool's rate.
type Endpoint struct {
	// Its samples' tokens and seconds (less the pool's overhead), the sums
	// of their log rates and of the squares of those, and how many, each
	// decayed by poolRateDecay at each new one.
	tokens, seconds, logSum, logSquares, samples float64
	// The engine's own timing: the floor it sets, its windows (decayed as
	// the samples), and the counters at the start of the current window
	// (engineBase false: no window yet).
	engineFloor, floorWindows           float64
	engineBase                          bool
	baseSeconds, basePrompt, baseCached float64
}

// Learn takes a sample of e, one of endpoints: tokens of prefill whose
// first byte came seconds after they joined its queue. It reports whether
// every endpoint must now be re-rated (then, first, Walked); otherwise only
// e's rate has changed.
func (p *Pool) Learn(e *Endpoint, tokens, seconds float64, endpoints int) (reapplyAll bool) {
	decay := 1 - (1-poolRateDecay)/float64(max(endpoints, 1))
	p.fit.Decay(decay)
	p.fit.Add(tokens, seconds, 1)
	p.samples = p.samples*decay + 1
	if rate, overhead, ok := p.fit.Fit(); ok {
		p.rate, p.overhead = rate, overhead
	}
	prefill := max(seconds-p.overhead, minFitSeconds)
	logRate := math.Log(tokens / prefill)
	e.tokens = e.tokens*poolRateDecay + tokens
	e.seconds = e.seconds*poolRateDecay + prefill
	e.logSum = e.logSum*poolRateDecay + logRate
	e.logSquares = e.logSquares*poolRateDecay + logRate*logRate
	e.samples = e.samples*poolRateDecay + 1
	p.unwalked++
	if math.Abs(p.rate/p.applied-1) > rateReapply || p.unwalked >= endpoints {
		p.applied = p.rate
		return true
	}
	return false
}

// ObserveTiming takes e's engine's prefill counters, as scraped: its
// prefill seconds, prompt tokens and cached prompt tokens, each a total
// since the engine started. A window of them long enough teaches the floor:
// learned says e's rate may have changed, reapplyAll that every endpoint
// must be re-rated (then, first, Walked). A window still short is left to
// grow; one whose counters went back (an engine restart) starts anew.
func (p *Pool) ObserveTiming(e *Endpoint, prefillSeconds, promptTokens, cachedTokens float64) (learned, reapplyAll bool) {
	dSec := prefillSeconds - e.baseSeconds
	dTok := (promptTokens - e.basePrompt) - (cachedTokens - e.baseCached)
	if e.engineBase && dSec >= 0 && dSec < minEngineWindowSeconds {
		return false, false // the window is still short
	}
	if e.engineBase && dSec >= minEngineWindowSeconds && dTok >= minEngineWindowTokens {
		sample := dTok / dSec
		if e.engineFloor == 0 {
			e.engineFloor = sample
		} else {
			e.engineFloor *= math.Exp((math.Log(sample) - math.Log(e.engineFloor)) * engineRateWeight)
		}
		e.floorWindows = e.floorWindows*poolRateDecay + 1
		p.floorLog.Add(math.Log(sample), poolRateDecay)
		p.floor = math.Exp(p.floorLog.Mean())
		learned = true
		if p.floorApplied == 0 || math.Abs(p.floor/p.floorApplied-1) > rateReapply {
			p.floorApplied = p.floor
			reapplyAll = true
		}
	}
	// A new window (also after an engine restart reset its counters).
	e.engineBase = true
	e.baseSeconds, e.basePrompt, e.baseCached = prefillSeconds, promptTokens, cachedTokens
	return learned, reapplyAll
}

// Walked records the spread of the endpoints' factors (Spread.Variance
// over every endpoint), measured for a walk that re-rates them all.
func (p *Pool) Walked(spread float64) {
	p.spread, p.unwalked = spread, 0
}

// RateOf is e's prefill rate: the pool's times its bounded factor, and at
// least the pool's engine floor times the bounded factor of its own timing.
func (p *Pool) RateOf(e *Endpoint) float64 {
	var logRatio float64
	if e.samples > 0 && e.seconds > 0 {
		logRatio = math.Log(e.tokens / e.seconds / p.rate)
		logRatio *= kept(logRatio, e.noise(), p.spread)
	}
	rate := p.rate * math.Exp(bounded(logRatio, e.samples))
	var floor float64
	if p.floor > 0 {
		var own float64
		if e.engineFloor > 0 {
			own = math.Log(e.engineFloor / p.floor)
		}
		floor = p.floor * math.Exp(drift(own, e.floorWindows))
	}
	return min(max(rate, floor, MinRate), MaxRate)
}

// drift is how far, in log space, an endpoint with n (decayed) samples
// that differ from the pool's by logRatio is taken to differ: shrunk toward
// 0 while its samples are few, and bounded by a factor that grows with them.
func drift(logRatio, n float64) float64 {
	return bounded(logRatio*n/(n+ratioShrinkSamples), n)
}

// bounded bounds a log factor by how many samples say it.
func bounded(logRatio, n float64) float64 {
	bound := math.Log(minDriftFactor + (maxDriftFactor-minDriftFactor)*min(n/driftEvidenceSamples, 1))
	return min(max(logRatio, -bound), bound)
}

// noise is the variance of the endpoint's measured log factor: its
// samples' variance (with samplePriorN prior samples of samplePriorVar)
// over their number.
func (e *Endpoint) noise() float64 {
	n := e.samples
	if n <= 0 {
		return math.Inf(1)
	}
	dev := max(e.logSquares-e.logSum*e.logSum/n, 0)
	return (dev + samplePriorVar*samplePriorN) / (n + samplePriorN) / n
}

// kept is the share of a measured log factor x of the given noise that an
// endpoint takes, where the endpoints' factors spread by spread beyond
// their noise: spread/(spread+noise), or more where x is many times its
// noise's deviation.
func kept(x, noise, spread float64) float64 {
	share := spread / (spread + noise)
	if x != 0 {
		share = max(share, 1-strongEvidence*strongEvidence*noise/(x*x))
	}
	return max(share, 0)
}

// Spread measures the variance of the endpoints' log factors beyond their
// noise: Add every endpoint, then read Variance. The zero Spread has none.
type Spread struct{ k, sum, squares, noise float64 }

// Add counts e, if it has samples enough to say anything.
func (s *Spread) Add(e *Endpoint) {
	if e.samples < minSpreadSamples || e.seconds <= 0 {
		return
	}
	x := math.Log(e.tokens / e.seconds)
	s.k, s.sum, s.squares, s.noise = s.k+1, s.sum+x, s.squares+x*x, s.noise+e.noise()
}

// Variance is the variance of the measured factors less their mean noise
// (0 with fewer than two endpoints counted).
func (s *Spread) Variance() float64 {
	if s.k < 2 {
		return 0
	}
	return max((s.squares-s.sum*s.sum/s.k)/(s.k-1)-s.noise/s.k, 0)
}
