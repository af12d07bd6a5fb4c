package picker

import (
	"github.com/tallyepp/tally/internal/testtier"

	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tallyepp/tally/picker/internal/ratemodel"
)

// engineSim plays streamed requests against picker endpoints whose engines
// prefill at the given rates (tokens/s), one at a time, with a fixed
// overhead and noise; late says which responses come whole at the end.
type engineSim struct {
	t       *testing.T
	p       *Picker
	clock   *fakeClock
	rng     *rand.Rand
	rates   []float64
	late    func(i int) bool
	decode  time.Duration // per output token
	outputs int
}

func (s *engineSim) run(n int) {
	for i := range n {
		ep := i % len(s.rates)
		tokens := 500 + s.rng.IntN(8000)
		req := on(addr(ep), text(fmt.Sprint("sim", i), tokens*4))
		req.Stream = true
		r := mustPick(s.t, s.p, req)
		noise := math.Exp(s.rng.NormFloat64() * 0.3)
		prefill := time.Duration(float64(tokens)/s.rates[ep]*noise*float64(time.Second)) + 20*time.Millisecond
		decode := time.Duration(s.outputs-1) * s.decode
		if s.late != nil && s.late(i) {
			s.clock.Advance(prefill + decode)
			s.p.FirstByte(r)
		} else {
			s.clock.Advance(prefill)
			s.p.FirstByte(r)
			s.clock.Advance(decode)
		}
		s.p.End(r, Outcome{CompletionTokens: s.outputs})
		s.p.End(r, Outcome{})
	}
}

func rates(p *Picker) []float64 {
	var out []float64
	for _, s := range p.Snapshot().Endpoints {
		out = append(out, s.PrefillTokensPerSecond)
	}
	return out
}

func spread(rs []float64) float64 {
	lo, hi := rs[0], rs[0]
	for _, r := range rs {
		lo, hi = min(lo, r), max(hi, r)
	}
	return hi / lo
}

func newSim(t *testing.T, engineRates []float64, seed uint64) *engineSim {
	clock := newFakeClock()
	p := newPicker(t, len(engineRates), testConfig(), Options{Clock: clock})
	return &engineSim{t: t, p: p, clock: clock, rng: rand.New(rand.NewPCG(seed, 1)), rates: engineRates,
		decode: 8 * time.Millisecond, outputs: 64}
}

// Identical engines measured with noise agree: each is shrunk toward the
// pool by how much of its factor the noise explains. (Shrunk by a fixed
// n/(n+8), 9 of 200 seeds spread over 15%.)
func TestIdenticalEnginesLearnRatesThatAgree(t *testing.T) {
	testtier.SkipIfShort(t, "200 simulated runs of the rate model (about 9 s of CPU with -race)")
	for seed := range uint64(20) {
		s := newSim(t, []float64{50_000, 50_000, 50_000, 50_000}, seed)
		s.run(500)
		rs := rates(s.p)
		if sp := spread(rs); sp > 1.15 {
			t.Errorf("seed %d: rates %.0f spread %.2fx, want within 15%%", seed, rs, sp)
		}
		for _, r := range rs {
			if math.Abs(r-50_000) > 0.25*50_000 {
				t.Errorf("seed %d: rate %.0f, want about 50000", seed, r)
			}
		}
	}
}

// First bytes that come with the whole response are not prefill: half of
// them late leaves the rate where all-streaming puts it.
func TestLateFirstBytesDoNotTeachTheRate(t *testing.T) {
	s := newSim(t, []float64{50_000, 50_000, 50_000}, 7)
	s.late = func(i int) bool { return i%2 == 0 }
	s.run(600)
	for _, r := range rates(s.p) {
		if math.Abs(r-50_000) > 0.2*50_000 {
			t.Errorf("rates %.0f with half the first bytes late, want about 50000", rates(s.p))
			break
		}
	}
	l := s.p.Snapshot()
	if got := l.RateSamples[rateSampleLate]; got < 250 {
		t.Errorf("%d samples taken as late of 300, want nearly all", got)
	}
}

// An engine that really is slower is learned as slower, once the evidence
// is there: the endpoints' factors spread beyond their noise, so each keeps
// most of its own. (Shrunk by a fixed n/(n+8), it was learned 1.5 to 1.7
// times slower.)
func TestASlowerEngineIsLearnedWithEvidence(t *testing.T) {
	testtier.SkipIfShort(t, "simulated runs of the rate model (about 3 s with -race)")
	for seed := range uint64(5) {
		s := newSim(t, []float64{50_000, 50_000, 25_000}, seed)
		s.run(600)
		rs := rates(s.p)
		if ratio := rs[0] / rs[2]; ratio < 1.8 || ratio > 2.3 {
			t.Errorf("seed %d: rates %.0f: the half-speed engine is learned %.2fx slower, want about 2x", seed, rs, ratio)
		}
	}
}

// One slower engine among many barely spreads the pool's factors, yet its
// own factor is many times its noise: it is learned as slower too.
func TestOneSlowerEngineAmongManyIsLearned(t *testing.T) {
	testtier.SkipIfShort(t, "simulated runs over many engines (about 3 s with -race)")
	engines := []float64{25_000}
	for range 9 {
		engines = append(engines, 50_000)
	}
	s := newSim(t, engines, 1)
	s.run(2000)
	rs := rates(s.p)
	for i, r := range rs[1:] {
		if ratio := r / rs[0]; ratio < 1.5 {
			t.Errorf("rates %.0f: engine %d is learned only %.2fx faster than the half-speed one, want at least 1.5x", rs, i+1, ratio)
		}
	}
}

// The engine's own prefill timing is a floor no late first byte goes under.
func TestEnginePrefillTimingFloorsTheRate(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 1_000 // badly wrong
	p := newPicker(t, 1, cfg, Options{Clock: clock})
	a := addr(0)
	var sec, prompt, cached float64
	for range 5 {
		clock.Advance(time.Second)
		// 60,000 prompt tokens, 20,000 of them cached, in 1 s of prefill.
		sec, prompt, cached = sec+1, prompt+60_000, cached+20_000
		p.ObserveEngine(a, EngineStats{PrefillSecondsTotal: sec, PromptTokensTotal: prompt, CachedTokensTotal: cached, HasPrefillTiming: true})
	}
	if rate := statsOf(p, a).PrefillTokensPerSecond; math.Abs(rate-40_000) > 1_000 {
		t.Errorf("rate %.0f, want the engine's 40000 uncached tokens per prefill second", rate)
	}
	// An engine restart resets its counters: a new window, no wild sample.
	p.ObserveEngine(a, EngineStats{PrefillSecondsTotal: 0.1, PromptTokensTotal: 10, HasPrefillTiming: true})
	if rate := statsOf(p, a).PrefillTokensPerSecond; math.Abs(rate-40_000) > 1_000 {
		t.Errorf("rate %.0f after an engine restart, want still 40000", rate)
	}
}

// engineTimer reports windows of the engines' prefill timing: each window
// 1 s of prefill computing rate uncached tokens.
type engineTimer struct {
	p     *Picker
	clock *fakeClock
	sec   []float64
	tok   []float64
}

// newEngineTimer starts a picker of n endpoints whose configured rate,
// 10,000 tokens/s, only the engines' timing corrects.
func newEngineTimer(t *testing.T, n int) *engineTimer {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	p := newPicker(t, n, cfg, Options{Clock: clock})
	return &engineTimer{p: p, clock: clock, sec: make([]float64, n), tok: make([]float64, n)}
}

func (e *engineTimer) window(ep int, rate float64) {
	e.sec[ep]++
	e.tok[ep] += rate
	e.p.ObserveEngine(addr(ep), EngineStats{PrefillSecondsTotal: e.sec[ep], PromptTokensTotal: e.tok[ep], HasPrefillTiming: true})
}

// The engine's timing is a pool's evidence, as first bytes are: identical
// engines whose timing is read at different moments, or not at all (an
// engine without the histogram, one whose window is still short), get one
// floor, not one engine's alone. Floored apart, a burst drained faster on
// the engine timed first and herded there.
func TestOneEnginesTimingFloorsIdenticalEngines(t *testing.T) {
	e := newEngineTimer(t, 3)
	p, clock := e.p, e.clock
	for range 4 {
		clock.Advance(time.Second)
		e.window(0, 40_000)
	}
	rs := rates(p)
	if sp := spread(rs); sp > 1.1 {
		t.Errorf("rates %.0f with only the first engine's timing read: spread %.2fx, want within 10%%", rs, sp)
	}
	if rs[1] < 30_000 {
		t.Errorf("rates %.0f: the untimed engines keep the 10000 prior, want the pool's floor near 40000", rs)
	}
	// An endpoint that joins later starts from the pool's floor too.
	p.Replace(endpoints(4))
	if rs := rates(p); spread(rs) > 1.1 {
		t.Errorf("rates %.0f after a fourth endpoint joined: spread %.2fx, want within 10%%", rs, spread(rs))
	}
}

// Noisy timings of identical engines, a few windows each, give rates that
// agree: an engine's own floor moves it from the pool's only with evidence.
func TestNoisyEngineTimingsOfIdenticalEnginesAgree(t *testing.T) {
	e := newEngineTimer(t, 3)
	p, clock := e.p, e.clock
	for range 3 {
		clock.Advance(time.Second)
		for ep, r := range []float64{29_000, 36_000, 42_000} {
			e.window(ep, r)
		}
	}
	if rs := rates(p); spread(rs) > 1.15 {
		t.Errorf("rates %.0f from timings 29000/36000/42000: spread %.2fx, want within 15%%", rs, spread(rs))
	}
}

// An engine that really is faster is floored higher once its timing has
// said so for long enough.
func TestAFasterEnginesTimingIsLearnedWithEvidence(t *testing.T) {
	e := newEngineTimer(t, 2)
	p, clock := e.p, e.clock
	for range 40 {
		clock.Advance(time.Second)
		e.window(0, 40_000)
		e.window(1, 20_000)
	}
	rs := rates(p)
	if ratio := rs[0] / rs[1]; ratio < 1.6 {
		t.Errorf("rates %.0f: the engine timed twice as fast is floored only %.2fx higher, want at least 1.6x", rs, ratio)
	}
}

// First bytes that come at once (a server that answers without a prefill,
// a cache the index did not predict) teach no more than ratemodel.MaxRate.
func TestInstantFirstBytesTeachABoundedRate(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 3, testConfig(), Options{Clock: clock})
	for i := range 60 {
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("instant", i), (2000+i*100)*4), Stream: true})
		clock.Advance(time.Millisecond)
		p.FirstByte(r)
		clock.Advance(400 * time.Millisecond) // 16 tokens, decoded as they come
		p.End(r, Outcome{CompletionTokens: 16})
		p.End(r, Outcome{})
	}
	for _, r := range rates(p) {
		if r > ratemodel.MaxRate {
			t.Fatalf("learned %.0f tokens/s from first bytes 1 ms after the pick, want at most %.0f", r, float64(ratemodel.MaxRate))
		}
	}
	if r := rates(p)[0]; r < ratemodel.MaxRate/2 {
		t.Errorf("learned %.0f tokens/s from first bytes 1 ms after the pick, want near the bound", r)
	}
}
