package ratemodel

import (
	"math"
	"math/rand/v2"
	"testing"
)

func near(got, want, share float64) bool { return math.Abs(got-want) <= share*math.Abs(want) }

func TestDecayedMeanFollowsTheLatestValues(t *testing.T) {
	var m DecayedMean
	if m.Mean() != 0 || m.Weight() != 0 {
		t.Fatalf("zero value: mean %v weight %v, want 0, 0", m.Mean(), m.Weight())
	}
	// Without decay it is the plain mean.
	for _, x := range []float64{1, 2, 3, 6} {
		m.Add(x, 1)
	}
	if m.Mean() != 3 || m.Weight() != 4 {
		t.Errorf("undecayed mean of 1, 2, 3, 6: %v (weight %v), want 3 (4)", m.Mean(), m.Weight())
	}
	// A prior is outweighed as values that differ from it come.
	m = StartedAt(10, 5)
	if m.Mean() != 10 {
		t.Fatalf("StartedAt(10, 5) has mean %v, want 10", m.Mean())
	}
	for range 200 {
		m.Add(2, 0.95)
	}
	if !near(m.Mean(), 2, 0.001) {
		t.Errorf("after 200 values of 2 at decay 0.95 the mean is %v, want 2", m.Mean())
	}
}

// fitOf fits samples of sizes spread over [500, 8500] tokens that take
// overhead + tokens/rate seconds each.
func fitOf(rate, overhead float64) Fit {
	var f Fit
	for tokens := 500.0; tokens <= 8500; tokens += 500 {
		f.Add(tokens, overhead+tokens/rate, 1)
	}
	return f
}

func TestFitSeparatesAnOverheadWithinItsBound(t *testing.T) {
	// The weak origin sample (no work, no time) pulls a little toward
	// the origin: a few percent with 17 samples.
	f := fitOf(40_000, 0.02)
	rate, overhead, ok := f.Fit()
	if !ok || !near(rate, 40_000, 0.03) || math.Abs(overhead-0.02) > 0.003 {
		t.Errorf("fit of 40000 tokens/s plus 20 ms: %.0f tokens/s, %.4f s, %v; want about 40000, 0.02, true", rate, overhead, ok)
	}
	// A fixed cost beyond the bound is not all overhead: the rest is taken
	// as slower prefill, never as faster.
	f = fitOf(40_000, 0.2)
	rate, overhead, ok = f.Fit()
	if !ok || overhead != maxPrefillOverhead || rate >= 40_000 {
		t.Errorf("fit of 40000 tokens/s plus 200 ms: %.0f tokens/s, %.4f s, %v; want below 40000, %v, true", rate, overhead, ok, maxPrefillOverhead)
	}
}

func TestFitOfOneSizeGoesThroughTheOrigin(t *testing.T) {
	var f Fit
	for range 10 {
		f.Add(4000, 0.1, 1)
	}
	rate, overhead, ok := f.Fit()
	if !ok || !near(rate, 40_000, 1e-9) || overhead != 0 {
		t.Errorf("samples of one size: %v tokens/s, %v s, %v; want their 40000 tokens/s, no overhead", rate, overhead, ok)
	}
}

func TestFitBoundsItsRateAndSaysWhenItCannotTell(t *testing.T) {
	var f Fit
	if _, _, ok := f.Fit(); ok {
		t.Error("an empty fit gave a rate")
	}
	// First bytes that come at once, whatever the work, say nothing of a
	// rate but that it is high: the bound.
	for tokens := 500.0; tokens <= 8500; tokens += 500 {
		f.Add(tokens, 0.001, 1)
	}
	if rate, _, ok := f.Fit(); !ok || rate != MaxRate {
		t.Errorf("instant first bytes: %v tokens/s, %v; want the bound %v", rate, ok, float64(MaxRate))
	}
	// Decayed, the samples keep their fit: only their weight changes.
	g := fitOf(40_000, 0.01)
	want, _, _ := g.Fit()
	g.Decay(0.5)
	if got, _, _ := g.Fit(); !near(got, want, 0.01) {
		t.Errorf("decayed fit %.0f tokens/s, want about the undecayed %.0f", got, want)
	}
}

func TestBoundedAndDriftGrowWithEvidence(t *testing.T) {
	for _, c := range []struct{ n, bound float64 }{{0, minDriftFactor}, {driftEvidenceSamples, maxDriftFactor}, {1000, maxDriftFactor}} {
		if got := bounded(10, c.n); !near(got, math.Log(c.bound), 1e-12) {
			t.Errorf("bounded(10, %v) = %v, want log %v", c.n, got, c.bound)
		}
		if got := bounded(-10, c.n); !near(got, -math.Log(c.bound), 1e-12) {
			t.Errorf("bounded(-10, %v) = %v, want -log %v", c.n, got, c.bound)
		}
	}
	if got := bounded(0.1, 0); got != 0.1 {
		t.Errorf("bounded(0.1, 0) = %v, want 0.1 (within the bound)", got)
	}
	x := math.Log(1.2)
	prev := 0.0
	for _, n := range []float64{0, 1, 4, 16, 64} {
		d := drift(x, n)
		if d < prev || d > x {
			t.Errorf("drift(%v, %v) = %v, want between the drift of fewer samples (%v) and %v", x, n, d, prev, x)
		}
		prev = d
	}
	if drift(x, 0) != 0 {
		t.Errorf("drift with no samples = %v, want 0", drift(x, 0))
	}
}

func TestKeptWeighsAFactorAgainstItsNoise(t *testing.T) {
	if got := kept(0.5, math.Inf(1), 0.1); got != 0 {
		t.Errorf("a factor of infinite noise keeps %v, want 0", got)
	}
	if got := kept(0.5, 0.01, 0.01); got != 0.5 {
		t.Errorf("noise as large as the spread keeps %v, want half", got)
	}
	// A factor many times its noise's deviation is mostly kept, however
	// little the endpoints spread.
	if got := kept(1, 0.0001, 0); got < 0.99 {
		t.Errorf("a factor 100 deviations out keeps %v, want nearly all", got)
	}
}

// learnFrom plays n samples on endpoints of the given rates (tokens/s),
// each off by a log-normal factor of deviation 0.3, as the ledger offers
// them, re-rating every endpoint when the pool says so.
func learnFrom(p *Pool, es []Endpoint, rates []float64, n int, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	for i := range n {
		k := i % len(rates)
		tokens := float64(500 + rng.IntN(8000))
		seconds := tokens/rates[k]*math.Exp(rng.NormFloat64()*0.3) + 0.02
		if p.Learn(&es[k], tokens, seconds, len(es)) {
			var s Spread
			for j := range es {
				s.Add(&es[j])
			}
			p.Walked(s.Variance())
		}
	}
}

func TestIdenticalEndpointsLearnOneRate(t *testing.T) {
	for seed := range uint64(10) {
		p := NewPool(10_000)
		es := make([]Endpoint, 4)
		learnFrom(&p, es, []float64{50_000, 50_000, 50_000, 50_000}, 500, seed)
		lo, hi := math.Inf(1), 0.0
		for i := range es {
			r := p.RateOf(&es[i])
			lo, hi = min(lo, r), max(hi, r)
		}
		if hi/lo > 1.15 || !near(lo, 50_000, 0.25) {
			t.Errorf("seed %d: rates %.0f to %.0f, want about 50000 and within 15%%", seed, lo, hi)
		}
	}
}

func TestASlowerEndpointIsLearnedSlower(t *testing.T) {
	p := NewPool(10_000)
	es := make([]Endpoint, 3)
	learnFrom(&p, es, []float64{50_000, 50_000, 25_000}, 600, 1)
	if ratio := p.RateOf(&es[0]) / p.RateOf(&es[2]); ratio < 1.8 || ratio > 2.3 {
		t.Errorf("the half-speed endpoint is learned %.2fx slower, want about 2x", ratio)
	}
	// An endpoint with no samples takes the pool's rate.
	var fresh Endpoint
	if got := p.RateOf(&fresh); got != p.Rate() {
		t.Errorf("an endpoint without samples: %v tokens/s, want the pool's %v", got, p.Rate())
	}
}

func TestLearnSaysWhenEveryEndpointIsReRated(t *testing.T) {
	p := NewPool(40_000)
	es := make([]Endpoint, 3)
	// A sample at the starting rate hardly moves the pool: only the
	// third, as many as there are endpoints, re-rates them all.
	for i, want := range []bool{false, false, true} {
		if got := p.Learn(&es[i], 4096, 4096.0/40_000, len(es)); got != want {
			t.Errorf("sample %d at the pool's rate: re-rate all %v, want %v", i, got, want)
		}
		if i == 2 {
			p.Walked(0)
		}
	}
	// One that moves the pool's rate does at once.
	if !p.Learn(&es[0], 8000, 1, len(es)) {
		t.Error("a sample that moved the pool's rate did not re-rate every endpoint")
	}
}

func TestEngineTimingFloorsTheRate(t *testing.T) {
	p := NewPool(1_000) // badly wrong
	var e Endpoint
	var sec, prompt, cached float64
	for i := range 5 {
		// 60,000 prompt tokens, 20,000 of them cached, in 1 s of prefill.
		sec, prompt, cached = sec+1, prompt+60_000, cached+20_000
		learned, all := p.ObserveTiming(&e, sec, prompt, cached)
		if learned != (i > 0) || all != (i == 1) {
			t.Errorf("window %d: learned %v, re-rate all %v; want %v, %v", i, learned, all, i > 0, i == 1)
		}
	}
	if rate := p.RateOf(&e); !near(rate, 40_000, 0.025) {
		t.Errorf("rate %.0f, want the engine's 40000 uncached tokens per prefill second", rate)
	}
	// A window shorter than a second is left to grow.
	if learned, _ := p.ObserveTiming(&e, sec+0.5, prompt+1e6, cached); learned {
		t.Error("a window of half a second was learned")
	}
	// An engine restart resets its counters: a new window, no wild sample.
	if learned, _ := p.ObserveTiming(&e, 0.1, 10, 0); learned {
		t.Error("counters that went back (an engine restart) were learned as a window")
	}
	if rate := p.RateOf(&e); !near(rate, 40_000, 0.025) {
		t.Errorf("rate %.0f after an engine restart, want still 40000", rate)
	}
	// An endpoint whose engine was never timed takes the pool's floor.
	var untimed Endpoint
	if rate := p.RateOf(&untimed); !near(rate, 40_000, 0.025) {
		t.Errorf("an untimed endpoint: %.0f tokens/s, want the pool's floor near 40000", rate)
	}
}

func TestSpreadCountsEndpointsWithSamples(t *testing.T) {
	var s Spread
	s.Add(&Endpoint{})
	s.Add(&Endpoint{tokens: 40_000, seconds: 1, samples: 10})
	if v := s.Variance(); v != 0 {
		t.Errorf("one endpoint with samples: spread %v, want 0", v)
	}
	// Two endpoints 4x apart, with little noise, spread.
	s.Add(&Endpoint{tokens: 10_000, seconds: 1, samples: 10})
	if v := s.Variance(); v <= 0 {
		t.Errorf("endpoints 4x apart: spread %v, want above 0", v)
	}
}
