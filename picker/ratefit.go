package picker

import "math"

// Learning prefill rates that cannot collapse.
//
// A streamed first byte says the request's prefill, and the prefill queued
// ahead of it, took the time since it joined its endpoint's queue (plus
// fixed costs that are not prefill). Two things make that signal mislead:
// noise (a busy machine, a short sample), and first bytes that are late for
// reasons that are not prefill (a proxy that buffers responses, an engine
// whose first chunk comes at the end). Learned per endpoint from a few
// samples each, identical engines drifted apart by 4x, and late first bytes
// dragged rates down until routing was worse than round-robin. So:
//
//   - The pool's rate is one fit, seconds = overhead + tokens/rate, by least
//     squares over every endpoint's samples (rateFit); an endpoint differs
//     from it only by a learned factor (its own samples' rate against the
//     pool's), shrunk toward 1 by how much of it is noise, and bounded to
//     1.25x either way (up to 4x with many samples). The shrinking is
//     empirical Bayes: the endpoints' factors spread by their real
//     differences plus their noise (each one's samples' variance over
//     their number), so an endpoint keeps the share of its factor that the
//     spread beyond noise explains, or more where its factor alone is many
//     times its noise. Shrunk by a fixed n/(n+8) instead, identical engines
//     learned rates over 15% apart in 9 of 200 simulated runs of 500
//     requests (and in e2e runs on a busy machine).
//   - A sample is taken when the response ends, not at the first byte: a
//     first byte that came with the whole response (its events arriving in
//     far less time than decoding them takes) is late, not prefill; one that
//     came after twice what the model says the whole request takes is an
//     outlier. Neither is learned.
//   - The fit's overhead is at most maxPrefillOverhead. A sample's tokens
//     are the drain model's queue ahead of it plus its own, and a model that
//     drains too fast sees an empty queue where the engine had one: such
//     samples take longer than their tokens say. Unbounded, the overhead
//     took that wait (seconds of it under load), the slope flattened, the
//     rate rose (routesim's picker learned 154,120 tokens/s of engines
//     that peak at 48,559), the model drained faster still and saw even
//     less queue. Bounded, a sample that waited for unmodelled work lowers
//     the rate, so the model drains slower and sees that work.
//   - Where the engine publishes its own prefill timing (vLLM's prefill time
//     histogram and prompt token counters), uncached prompt tokens over
//     prefill seconds is a floor on its rate: requests prefilled together
//     each count the shared time, so it can only understate the rate, and
//     no proxy can make it late. The floor, too, is the pool's (a mean over
//     every engine's windows), from which an engine's own timing moves it
//     as its factor moves its rate: shrunk and bounded by its evidence.
//     Floored each by its own timing, identical engines were 1.45x apart
//     after a few noisy windows, and 4x while only one had been timed; a
//     burst then drained faster on the one floored highest and herded.

// Bounds and weights of the learning.
const (
	minPrefillRate = 1.0
	// maxPrefillRate is more than any engine prefills (a large batch on
	// the fastest accelerators is some tens of thousands of tokens a
	// second). First bytes that imply more did not wait for a prefill: a
	// cache the prefix index did not predict, a server that answers at
	// once. Learned from those, rates of millions drained a 32,000-token
	// prompt in the model within milliseconds, and a burst was placed on
	// those milliseconds instead of its queues.
	maxPrefillRate = 1e6
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
	// minLearnTokens: a first byte teaches the rate only if at least this
	// much prefill came before it; shorter ones say little but noise.
	minLearnTokens = 256
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
	// A first byte is late when the response's output arrived within
	// lateSpreadShare of the time decoding it takes; an outlier when it
	// came after outlierFactor times the modelled whole request, once the
	// pool has outlierEvidence samples.
	lateSpreadShare = 0.25
	lateMinOutput   = 4
	outlierFactor   = 2.0
	outlierEvidence = 16
	minFitSeconds   = 1e-3
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
	// rateReapply: a learned sample re-rates every row (a walk of the
	// whole set under the lock) only once the pool's rate has moved this
	// share since they were last re-rated, or as many samples have been
	// learned as there are rows (for the spread of their factors: O(1) a
	// sample, amortised); otherwise only the sample's row.
	rateReapply = 0.01
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

// decayedMean is a mean in which each value added weighs the earlier ones
// by a decay, so that it follows what the latest values say. Its zero value
// holds nothing; startedAt holds prior samples of a starting value.
type decayedMean struct{ sum, weight float64 }

func startedAt(value, prior float64) decayedMean {
	return decayedMean{sum: value * prior, weight: prior}
}

func (m *decayedMean) add(x, decay float64) {
	m.sum = m.sum*decay + x
	m.weight = m.weight*decay + 1
}

// mean is the mean (0 while the mean holds nothing).
func (m decayedMean) mean() float64 {
	if m.weight == 0 {
		return 0
	}
	return m.sum / m.weight
}

// rateFit fits seconds = overhead + tokens/rate by least squares over
// exponentially decayed sums: the time to a first byte includes fixed
// costs (the gateway, the network, the engine's scheduling step) that are
// not prefill, and the intercept takes them, so short prompts do not drag
// the rate down.
type rateFit struct{ n, t, s, tt, ts float64 }

func (f *rateFit) add(tokens, seconds, weight float64) {
	f.n += weight
	f.t += weight * tokens
	f.s += weight * seconds
	f.tt += weight * tokens * tokens
	f.ts += weight * tokens * seconds
}

func (f *rateFit) decay(d float64) {
	f.n, f.t, f.s, f.tt, f.ts = f.n*d, f.t*d, f.s*d, f.tt*d, f.ts*d
}

// fit returns the fitted rate and overhead; ok is false when the samples
// cannot tell them. Samples of nearly one size cannot tell an overhead from
// a slower rate: they give the rate through the origin, their tokens over
// their seconds, and no overhead.
func (f *rateFit) fit() (rate, overhead float64, ok bool) {
	if f.n <= 0 || f.s <= 0 {
		return 0, 0, false
	}
	if mean := f.t / f.n; f.tt/f.n-mean*mean < minSizeSpread*minSizeSpread*mean*mean {
		return min(max(f.t/f.s, minPrefillRate), maxPrefillRate), 0, true
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
		return maxPrefillRate, overhead, true // the time does not grow with the work
	}
	return min(max(1/slope, minPrefillRate), maxPrefillRate), overhead, true
}

// poolRate is the pool's prefill model.
type poolRate struct {
	fit      rateFit
	rate     float64 // tokens per second
	overhead float64 // seconds every first byte pays
	samples  float64 // learned samples, decayed as the fit's
	// applied is the rate every row's drain model last took: rows are
	// all given a new one only when the pool's moves past rateReapply.
	applied float64
	// spread is how far the endpoints' log factors vary beyond their
	// noise (a variance), as of the last walk, and unwalked the samples
	// learned since.
	spread   float64
	unwalked int
	// The engines' timing: the mean of every window's log rate, decayed
	// by poolRateDecay at each, its floor (0 before any window), and the
	// floor the rows last took.
	floorLog            decayedMean
	floor, floorApplied float64
}

func newPoolRate(rate float64) poolRate {
	p := poolRate{rate: rate, applied: rate}
	p.fit.add(ratePriorTokens, ratePriorTokens/rate, 1)
	return p
}

// endpointRate is how one endpoint's prefill differs from the pool's.
type endpointRate struct {
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

// rateOf is w's prefill rate: the pool's times its bounded factor, and at
// least the pool's engine floor times the bounded factor of its own timing.
func (l *ledger) rateOf(w *row) float64 {
	e := &w.rates
	var logRatio float64
	if e.samples > 0 && e.seconds > 0 {
		logRatio = math.Log(e.tokens / e.seconds / l.pool.rate)
		logRatio *= kept(logRatio, e.noise(), l.pool.spread)
	}
	rate := l.pool.rate * math.Exp(bounded(logRatio, e.samples))
	var floor float64
	if l.pool.floor > 0 {
		var own float64
		if e.engineFloor > 0 {
			own = math.Log(e.engineFloor / l.pool.floor)
		}
		floor = l.pool.floor * math.Exp(drift(own, e.floorWindows))
	}
	return min(max(rate, floor, minPrefillRate), maxPrefillRate)
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
func (e *endpointRate) noise() float64 {
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

// factorSpread is the variance of the endpoints' log factors beyond their
// noise: the variance of their measured factors less their mean noise.
func (l *ledger) factorSpread() float64 {
	var k, sum, squares, noise float64
	for _, w := range l.all {
		e := &w.rates
		if e.samples < minSpreadSamples || e.seconds <= 0 {
			continue
		}
		x := math.Log(e.tokens / e.seconds)
		k, sum, squares, noise = k+1, sum+x, squares+x*x, noise+e.noise()
	}
	if k < 2 {
		return 0
	}
	return max((squares-sum*sum/k)/(k-1)-noise/k, 0)
}

// setRates moves every row's drain model to now at its old rate, then
// gives it its current one.
func (l *ledger) setRates(now int64) {
	l.pool.spread, l.pool.unwalked = l.factorSpread(), 0
	for _, w := range l.all {
		w.advance(now)
		w.rate = l.rateOf(w)
	}
}

// learnPrefill takes r's streamed first byte as a prefill sample, as
// its response ends at now (see above).
func (l *ledger) learnPrefill(r *Reservation, now int64) {
	seconds := float64(r.firstByteNs-r.enqueuedAt) / 1e9
	if seconds <= 0 || r.work < minLearnTokens {
		l.rateSamples[rateSampleShort]++
		return
	}
	w := r.row
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
		load := seconds - l.pool.overhead - float64(r.work)/w.rate
		l.loraLoad.add(min(max(load, 0), maxLoRALoadSeconds), loraLoadDecay)
		return
	}
	if l.pool.samples >= outlierEvidence {
		whole := l.pool.overhead + float64(r.work)/w.rate + l.expectedOutputTokens(r)*l.decodeNsPerToken/1e9
		if seconds > outlierFactor*whole {
			l.rateSamples[rateSampleOutlier]++
			return
		}
	}
	l.rateSamples[rateSampleLearned]++

	pool := &l.pool
	decay := 1 - (1-poolRateDecay)/float64(max(len(l.byKey), 1))
	pool.fit.decay(decay)
	pool.fit.add(float64(r.work), seconds, 1)
	pool.samples = pool.samples*decay + 1
	if rate, overhead, ok := pool.fit.fit(); ok {
		pool.rate, pool.overhead = rate, overhead
	}
	e := &w.rates
	prefill := max(seconds-pool.overhead, minFitSeconds)
	logRate := math.Log(float64(r.work) / prefill)
	e.tokens = e.tokens*poolRateDecay + float64(r.work)
	e.seconds = e.seconds*poolRateDecay + prefill
	e.logSum = e.logSum*poolRateDecay + logRate
	e.logSquares = e.logSquares*poolRateDecay + logRate*logRate
	e.samples = e.samples*poolRateDecay + 1
	pool.unwalked++
	if math.Abs(pool.rate/pool.applied-1) > rateReapply || pool.unwalked >= len(l.byKey) {
		pool.applied = pool.rate
		l.setRates(now)
		return
	}
	w.advance(now)
	w.rate = l.rateOf(w)
}

// observePrefillTiming updates w's engine floor from a scrape's
// prefill counters.
func (l *ledger) observePrefillTiming(w *row, s EngineStats, now int64) {
	e := &w.rates
	if !s.HasPrefillTiming {
		return
	}
	dSec := s.PrefillSecondsTotal - e.baseSeconds
	dTok := (s.PromptTokensTotal - e.basePrompt) - (s.CachedTokensTotal - e.baseCached)
	if e.engineBase && dSec >= 0 && dSec < minEngineWindowSeconds {
		return // the window is still short
	}
	if e.engineBase && dSec >= minEngineWindowSeconds && dTok >= minEngineWindowTokens {
		sample := dTok / dSec
		if e.engineFloor == 0 {
			e.engineFloor = sample
		} else {
			e.engineFloor *= math.Exp((math.Log(sample) - math.Log(e.engineFloor)) * engineRateWeight)
		}
		e.floorWindows = e.floorWindows*poolRateDecay + 1
		pool := &l.pool
		pool.floorLog.add(math.Log(sample), poolRateDecay)
		pool.floor = math.Exp(pool.floorLog.mean())
		if pool.floorApplied == 0 || math.Abs(pool.floor/pool.floorApplied-1) > rateReapply {
			pool.floorApplied = pool.floor
			l.setRates(now)
		} else {
			w.advance(now)
			w.rate = l.rateOf(w)
		}
	}
	// A new window (also after an engine restart reset its counters).
	e.engineBase = true
	e.baseSeconds, e.basePrompt, e.baseCached = s.PrefillSecondsTotal, s.PromptTokensTotal, s.CachedTokensTotal
}
