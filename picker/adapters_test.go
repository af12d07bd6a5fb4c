package picker

import (
	"fmt"
	"math"
	"net/netip"
	"testing"
	"time"
)

const baseModel = "base"

// observeLoRA reports each endpoint's engine as vLLM with adapters: idle,
// running the adapters given for it, max_lora maxLoRAs.
func observeLoRA(p *Picker, maxLoRAs int, running map[int][]string) {
	for i := range len(p.Snapshot().Endpoints) {
		p.ObserveEngine(addr(i), EngineStats{Model: baseModel, HasLoRA: true, MaxLoRAs: maxLoRAs,
			RunningAdapters: running[i]})
	}
}

// onAs is on for endpoint e, with model as the request's model.
func onAs(e int, model string, prompt []byte) Request {
	r := on(addr(e), prompt)
	r.Model = model
	return r
}

func placements(t *testing.T, p *Picker, n int, model string, prompt func(i int) []byte) (map[int]int, []*Reservation) {
	t.Helper()
	where := map[int]int{}
	var rs []*Reservation
	for i := range n {
		r := mustPick(t, p, Request{Model: model, Prompt: prompt(i)})
		rs = append(rs, r)
		for e := range 16 {
			if r.Endpoints()[0] == addr(e) {
				where[e]++
			}
		}
	}
	return where, rs
}

func TestBaseModelRequestsIgnoreAdapters(t *testing.T) {
	p := newPicker(t, 4, testConfig(), Options{})
	observeLoRA(p, 2, map[int][]string{0: {"a", "b"}, 1: {"c"}})
	where, _ := placements(t, p, 8, baseModel, func(i int) []byte { return text(fmt.Sprint("base", i), 4000) })
	for e := range 4 {
		if where[e] != 2 {
			t.Fatalf("base-model requests landed %v, want 2 on each of 4 endpoints", where)
		}
	}
}

func TestAnAdapterGoesWhereItIsLoaded(t *testing.T) {
	p := newPicker(t, 4, testConfig(), Options{})
	observeLoRA(p, 2, map[int][]string{2: {"sql"}})
	// 200 ms at 10,000 tokens/s: a load costs 2,000 tokens, so requests of
	// 500 tokens stay on endpoint 2 until its queue passes that.
	where, _ := placements(t, p, 4, "sql", func(i int) []byte { return text(fmt.Sprint("sql", i), 2000) })
	if where[2] != 4 {
		t.Fatalf("requests for an adapter endpoint 2 runs landed %v, want all 4 there", where)
	}
}

func TestAFullEndpointIsAvoidedUnlessAllAre(t *testing.T) {
	p := newPicker(t, 3, testConfig(), Options{})
	observeLoRA(p, 2, map[int][]string{0: {"a", "b"}, 1: {"c", "d"}})
	where, _ := placements(t, p, 6, "new", func(i int) []byte { return text(fmt.Sprint("new", i), 400) })
	if where[2] != 6 {
		t.Fatalf("requests for a new adapter landed %v, want all on endpoint 2, the only one with a free slot", where)
	}
	// Once every endpoint is full, the cost decides.
	observeLoRA(p, 2, map[int][]string{0: {"a", "b"}, 1: {"c", "d"}, 2: {"e", "f"}})
	if _, err := p.pick(Request{Model: "other", Prompt: text("x", 400)}); err != nil {
		t.Fatalf("with every endpoint full: %v, want placed", err)
	}
}

// The ledger counts adapters at pick time: a burst for an adapter no engine
// has loaded loads it on as few endpoints as keep each one's queued prefill
// within twice the even share (half the endpoints), instead of on every
// endpoint, and its prompts need share no prefix for that.
func TestABurstForANewAdapterLoadsItOnFewEndpoints(t *testing.T) {
	for _, c := range []struct{ endpoints, n, tokens int }{
		{4, 16, 400}, {4, 128, 1000}, {4, 128, 250}, {6, 128, 1000}, {8, 128, 1000}, {8, 128, 8192}, {16, 128, 1000},
	} {
		p := newPicker(t, c.endpoints, testConfig(), Options{})
		observeLoRA(p, 2, nil)
		where, rs := placements(t, p, c.n, "fresh", func(i int) []byte { return text(fmt.Sprint("fresh", i), c.tokens*4) })
		total := 0
		for _, s := range p.Snapshot().Endpoints {
			total += s.PrefillTokens
		}
		// Within twice the even share, give or take one request where
		// the endpoints cannot split the burst evenly (128 over 3).
		for _, s := range p.Snapshot().Endpoints {
			if (s.PrefillTokens-c.tokens)*c.endpoints > 2*total {
				t.Errorf("%d endpoints, %d x %d tokens: %v queues %d tokens, more than twice the even share %d (placements %v)",
					c.endpoints, c.n, c.tokens, s.Endpoint.Address, s.PrefillTokens, total/c.endpoints, where)
			}
		}
		// Half the endpoints keep each within twice the even share: one
		// more would load the adapter for nothing.
		if used := len(where); used != c.endpoints/2 {
			t.Errorf("%d endpoints, %d x %d tokens for a new adapter landed on %d endpoints, want %d: %v",
				c.endpoints, c.n, c.tokens, used, c.endpoints/2, where)
		}
		t.Logf("%d endpoints, %d x %d tokens: %v", c.endpoints, c.n, c.tokens, where)
		for _, r := range rs {
			p.End(r, Outcome{})
		}
		for _, s := range p.Snapshot().Endpoints {
			if n := len(p.l.byAddr[s.Endpoint.Address].adapterRefs); n != 0 {
				t.Errorf("%v still counts %d adapters after every release", s.Endpoint.Address, n)
			}
		}
	}
}

// vLLM publishes lora_requests_info only once it has run requests: an idle
// engine that has said nothing is judged by what the pool's others said.
func TestAnEngineThatHasNotSaidIsJudgedByThePool(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	p.ObserveEngine(addr(0), EngineStats{Running: 1, Model: baseModel, HasLoRA: true, MaxLoRAs: 1, RunningAdapters: []string{"sql"}})
	p.ObserveEngine(addr(1), EngineStats{Model: baseModel})
	where, _ := placements(t, p, 3, "sql", func(i int) []byte { return text(fmt.Sprint("q", i), 400) })
	if where[0] != 3 {
		t.Fatalf("requests for the adapter endpoint 0 runs landed %v, want all on it: endpoint 1 has not loaded it", where)
	}
	where, _ = placements(t, p, 4, baseModel, func(i int) []byte { return text(fmt.Sprint("b", i), 400) })
	if where[1] < 2 {
		t.Fatalf("base-model requests landed %v, want endpoint 1 used", where)
	}
}

// vLLM admits other adapters' waiting requests past one whose adapter has
// no slot: on an engine whose max_lora slots are held by running adapters,
// a waiting adapter starves while their requests keep coming. So while one
// starves there, requests for the running adapters go where another engine
// can take them, and the starving adapter's own requests count it as not
// loaded there (at 70% of a trace's load, p99 TTFT was 14 s against 3.3 s
// at p90: cmd/routesim, seed 8).
func TestAnAdapterStarvingForASlotIsNotFedAgainst(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	p.ObserveEngine(addr(0), EngineStats{Running: 2, Waiting: 1, Model: baseModel, HasLoRA: true, MaxLoRAs: 2,
		RunningAdapters: []string{"a", "b"}, WaitingAdapters: []string{"c"}})
	p.ObserveEngine(addr(1), EngineStats{Running: 1, Model: baseModel, HasLoRA: true, MaxLoRAs: 2, RunningAdapters: []string{"d"}})
	for _, model := range []string{"a", "c"} {
		where, rs := placements(t, p, 2, model, func(i int) []byte { return text(fmt.Sprint(model, i), 400) })
		if where[1] != 2 {
			t.Errorf("requests for %s landed %v, want both on endpoint 1 while c waits for a slot on endpoint 0", model, where)
		}
		for _, r := range rs {
			p.End(r, Outcome{})
		}
	}
	// Once nothing waits there, its running adapters draw their requests again.
	p.ObserveEngine(addr(0), EngineStats{Running: 2, Model: baseModel, HasLoRA: true, MaxLoRAs: 2, RunningAdapters: []string{"a", "b"}})
	if where, _ := placements(t, p, 2, "b", func(i int) []byte { return text(fmt.Sprint("again", i), 400) }); where[0] != 2 {
		t.Errorf("requests for b landed %v, want both on endpoint 0, which runs it", where)
	}
}

// vLLM keeps an idle adapter in its slot until another needs one, and
// publishes only running and waiting adapters: the last max_lora used on an
// endpoint still count as loaded there.
func TestAnIdleAdapterInItsSlotStillCountsAsLoaded(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	p.ObserveEngine(addr(0), EngineStats{Running: 1, Model: baseModel, HasLoRA: true, MaxLoRAs: 2, RunningAdapters: []string{"sql"}})
	p.ObserveEngine(addr(1), EngineStats{Model: baseModel, HasLoRA: true, MaxLoRAs: 2})
	p.ObserveEngine(addr(0), EngineStats{Model: baseModel, HasLoRA: true, MaxLoRAs: 2}) // sql done, idle in its slot
	where, rs := placements(t, p, 3, "sql", func(i int) []byte { return text(fmt.Sprint("q", i), 400) })
	if where[0] != 3 {
		t.Fatalf("requests for the adapter idle on endpoint 0 landed %v, want all there", where)
	}
	for _, r := range rs {
		p.End(r, Outcome{})
	}
	// Two other adapters used there since: sql's slot went to one of them.
	for _, a := range []string{"chat", "tools"} {
		p.ObserveEngine(addr(0), EngineStats{Model: baseModel, HasLoRA: true, MaxLoRAs: 2, RunningAdapters: []string{a}})
	}
	p.mu.Lock()
	resident := p.l.byAddr[key(addr(0))].adapterResident("sql")
	p.mu.Unlock()
	if resident {
		t.Error("after two other adapters took endpoint 0's two slots, sql still counts as loaded there")
	}
}

// A streamed request that waited for its adapter to load teaches the load
// time, not the prefill rate: with a load of 1.5 s where 200 ms is
// configured, the charge for a load becomes about 1.5 s, and the rate stays
// what base-model requests show. Left in the rate fit, each such first byte
// counted the load as prefill.
func TestTheAdapterLoadTimeIsLearnedApartFromTheRate(t *testing.T) {
	const (
		rate    = 50_000.0
		load    = 1500 * time.Millisecond
		outputs = 16
	)
	clock := newFakeClock()
	p := newPicker(t, 3, testConfig(), Options{Clock: clock})
	observeLoRA(p, 64, nil)
	for i := range 60 {
		model, tokens, wait := baseModel, 8000, time.Duration(0)
		if i%2 == 1 {
			model, tokens, wait = fmt.Sprint("adapter-", i), 4000, load // never loaded before
		}
		serveStreamed(t, p, clock, Request{Model: model, Prompt: text(fmt.Sprint("load", i), tokens*4), Stream: true},
			wait+10*time.Millisecond+time.Duration(float64(tokens)/rate*float64(time.Second)), outputs)
	}
	l := p.Snapshot()
	if got := l.LoRALoadSeconds; math.Abs(got-load.Seconds()) > 0.15*load.Seconds() {
		t.Errorf("learned a load time of %.3f s, want about %.1f", got, load.Seconds())
	}
	for _, s := range l.Endpoints {
		if math.Abs(s.PrefillTokensPerSecond-rate) > 0.25*rate {
			t.Errorf("%v: prefill rate %.0f tokens/s, want about %.0f: loads are not prefill", s.Endpoint.Address, s.PrefillTokensPerSecond, rate)
		}
	}
	if n := l.RateSamples[rateSampleAdapterLoad]; n != 30 {
		t.Errorf("%d samples taken as adapter loads, want 30", n)
	}
}

// serveStreamed picks req on p and serves it on clock: its first byte after
// firstByte, then outputs tokens 8 ms apart; then it ends.
func serveStreamed(t *testing.T, p *Picker, clock *fakeClock, req Request, firstByte time.Duration, outputs int) {
	t.Helper()
	r := mustPick(t, p, req)
	clock.Advance(firstByte)
	p.FirstByte(r)
	clock.Advance(time.Duration(outputs-1) * 8 * time.Millisecond)
	p.End(r, Outcome{CompletionTokens: outputs})
	p.End(r, Outcome{})
}

// A burst for an adapter stays on the endpoints where it is active, but an
// endpoint that holds more of the request's prompt than any of them (a
// prefix cached for the same adapter there earlier) is still a candidate:
// its cache saves more than the adapter's load costs.
func TestAnEndpointHoldingThePromptIsNotPassedOver(t *testing.T) {
	p := newPicker(t, 3, testConfig(), Options{})
	observeLoRA(p, 2, map[int][]string{0: {"sql"}})
	shared := text("report", 32_000) // 8,000 tokens
	p.End(mustPick(t, p, onAs(1, "sql", shared)), Outcome{})
	// Endpoint 1 then runs two other adapters, which push sql out of its
	// slots, and goes idle: sql is neither active nor resident there.
	observeLoRA(p, 2, map[int][]string{0: {"sql"}, 1: {"x", "y"}})
	observeLoRA(p, 2, map[int][]string{0: {"sql"}})
	// 10,000 tokens queued everywhere, so endpoint 0, where sql runs, can
	// take the request within twice the even share.
	for e := range 3 {
		mustPick(t, p, onAs(e, baseModel, text(fmt.Sprint("base", e), 40_000)))
	}
	r := mustPick(t, p, Request{Model: "sql", Prompt: append(append([]byte(nil), shared...), text("question", 400)...)})
	if got := r.Endpoints()[0]; got != addr(1) {
		t.Fatalf("a request whose 8,000-token prefix endpoint 1 holds went to %v, want %v: its cache saves more than a load costs", got, addr(1))
	}
}

// The full endpoints are kept out only while an endpoint with room can take
// the request within three even shares of the pool's queued prefill: a
// slot frees when the adapters holding it finish, sooner than a queue
// several times the others' drains.
func TestAFullEndpointGivesWayOnlyToALongQueue(t *testing.T) {
	for _, c := range []struct {
		name       string
		fullQueued int // base-model tokens queued on each full endpoint
		openQueued int // and on the endpoint with a free slot
		wantFull   bool
		why        string
	}{
		{"open queue within three shares", 10_000, 40_000, false, "the open endpoint's 40,000 tokens are within three even shares (70,400 / 4)"},
		{"open queue past three shares", 0, 40_000, true, "the open endpoint holds the pool's whole queue, past three even shares"},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPicker(t, 4, testConfig(), Options{})
			observeLoRA(p, 2, map[int][]string{0: {"a", "b"}, 1: {"c", "d"}, 2: {"e", "f"}})
			for e := range 3 {
				if c.fullQueued > 0 {
					mustPick(t, p, onAs(e, baseModel, text(fmt.Sprint("full", e), 4*c.fullQueued)))
				}
			}
			mustPick(t, p, onAs(3, baseModel, text("open", 4*c.openQueued)))
			r := mustPick(t, p, Request{Model: "new", Prompt: text("new", 1600)})
			if got := r.Endpoints()[0]; (got != addr(3)) != c.wantFull {
				t.Fatalf("a request for a new adapter went to %v (endpoint 3 has the free slot); want full endpoint %v: %s", got, c.wantFull, c.why)
			}
		})
	}
}

// Loading an adapter stalls the engine's whole batch, so a load costs once
// for the request and once for each request in flight where it happens: a
// new adapter goes to the endpoint with a longer queue of fewer requests
// rather than stall many short ones.
func TestALoadCostsEveryRequestInFlightThere(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	observeLoRA(p, 4, nil)
	// A load costs 2,000 tokens (200 ms at 10,000 tokens/s). Endpoint 0:
	// 4 requests of 100 tokens; endpoint 1: one of 3,000.
	for i := range 4 {
		mustPick(t, p, onAs(0, baseModel, text(fmt.Sprint("short", i), 400)))
	}
	mustPick(t, p, onAs(1, baseModel, text("long", 12_000)))
	// Counted once, the load left endpoint 0 at 400 + 2,000 against
	// 3,000 + 2,000; counted for the batch, 400 + 5 × 2,000 against
	// 3,000 + 2 × 2,000.
	r := mustPick(t, p, Request{Model: "fresh", Prompt: text("fresh", 1600)})
	if got := r.Endpoints()[0]; got != addr(1) {
		t.Fatalf("a request for a new adapter went to %v, where 4 requests would wait for its load, want %v, where 1 would", got, addr(1))
	}
}

// The load is charged for at most maxLoadCharges requests in flight: a
// request does not wait behind 5 s of queue to spare 40 decoding requests
// one step of 200 ms.
func TestALoadIsChargedForABoundedBatch(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	observeLoRA(p, 4, nil)
	for i := range 40 {
		p.FirstByte(mustPick(t, p, onAs(0, baseModel, text(fmt.Sprint("decoding", i), 400))))
	}
	mustPick(t, p, onAs(1, baseModel, text("queued", 200_000))) // 50,000 tokens, 5 s
	r := mustPick(t, p, Request{Model: "fresh", Prompt: text("fresh", 1600)})
	if got := r.Endpoints()[0]; got != addr(0) {
		t.Fatalf("a request for a new adapter went to %v, behind 50,000 queued tokens, want %v, where 40 requests decode", got, addr(0))
	}
}

// An adapter short of endpoints, whose one active endpoint is past the
// affinity, takes a full endpoint when no endpoint with a free slot can
// take it within three even shares: a hot adapter otherwise queued on the
// one endpoint it ran on while the full ones drained. With an endpoint
// with a free slot, the full ones stay out.
func TestAnAdapterShortOfEndpointsTakesAFullOneOnlyWithoutRoomElsewhere(t *testing.T) {
	for _, c := range []struct {
		name    string
		running map[int][]string
		want    func(at netip.AddrPort) bool
		why     string
	}{
		{"every other endpoint full", map[int][]string{0: {"hot"}, 1: {"a", "b"}, 2: {"c", "d"}, 3: {"e", "f"}},
			func(at netip.AddrPort) bool { return at != addr(0) }, "a full endpoint with 10,000 tokens queued, not endpoint 0 with 50,000"},
		{"a free slot on endpoint 3", map[int][]string{0: {"hot"}, 1: {"a", "b"}, 2: {"c", "d"}, 3: {"e"}},
			func(at netip.AddrPort) bool { return at == addr(3) }, "endpoint 3, which has a free slot, not a full one"},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPicker(t, 4, testConfig(), Options{})
			observeLoRA(p, 2, c.running)
			// 50,000 tokens for hot on endpoint 0 (past two even shares,
			// within three), 10,000 base-model tokens on each other one.
			for i := range 5 {
				mustPick(t, p, onAs(0, "hot", text(fmt.Sprint("hot", i), 4*10_000)))
			}
			for e := 1; e < 4; e++ {
				mustPick(t, p, onAs(e, baseModel, text(fmt.Sprint("base", e), 4*10_000)))
			}
			r := mustPick(t, p, Request{Model: "hot", Prompt: text("next", 400)})
			if got := endpointOf(r); !c.want(got) {
				t.Fatalf("the hot adapter's request went to %v, want %s", got, c.why)
			}
		})
	}
}

// A request placed where its engine runs max_lora other adapters waits for
// one of them to drain before its own loads: its first byte says how long
// their requests ran, not what a load takes. Such first bytes teach
// neither the load time nor the rate; loads on engines with a free slot
// still teach the load time, and base-model requests the rate.
func TestAWaitForAnAdapterSlotIsNotLearnedAsALoad(t *testing.T) {
	const (
		rate    = 50_000.0
		load    = 300 * time.Millisecond
		slot    = 4 * time.Second
		outputs = 16
	)
	clock := newFakeClock()
	p := newPicker(t, 2, testConfig(), Options{Clock: clock})
	for i := range 60 {
		model, running, wait := baseModel, map[int][]string{}, time.Duration(0)
		switch i % 3 {
		case 1: // a free slot everywhere
			model, wait = fmt.Sprint("adapter-", i), load
		case 2: // every engine runs its one slot's adapter: the pick waits for it
			model, wait = fmt.Sprint("adapter-", i), slot+load
			running = map[int][]string{0: {"busy-0"}, 1: {"busy-1"}}
		}
		observeLoRA(p, 1, running)
		serveStreamed(t, p, clock, Request{Model: model, Prompt: text(fmt.Sprint("slot", i), 16_000), Stream: true},
			wait+10*time.Millisecond+time.Duration(4000/rate*float64(time.Second)), outputs)
	}
	l := p.Snapshot()
	if got := l.LoRALoadSeconds; math.Abs(got-load.Seconds()) > 0.25*load.Seconds() {
		t.Errorf("learned a load time of %.3f s, want about %.1f: a wait for a slot is not a load", got, load.Seconds())
	}
	if n := l.RateSamples[rateSampleAdapterWait]; n != 20 {
		t.Errorf("%d samples taken as waits for a slot, want 20", n)
	}
	if n := l.RateSamples[rateSampleAdapterLoad]; n != 20 {
		t.Errorf("%d samples taken as adapter loads, want 20", n)
	}
	for _, s := range l.Endpoints {
		if math.Abs(s.PrefillTokensPerSecond-rate) > 0.25*rate {
			t.Errorf("%v: prefill rate %.0f tokens/s, want about %.0f: a wait for a slot is not prefill", s.Endpoint.Address, s.PrefillTokensPerSecond, rate)
		}
	}
}

// vLLM keys its KV cache by adapter (a LoRA adapter is a model name): a
// prefix cached for one model never serves another.
func TestPrefixesNeverMatchAcrossModels(t *testing.T) {
	p := newPicker(t, 1, testConfig(), Options{})
	prompt := text("shared", 8000)
	p.End(mustPick(t, p, Request{Model: "base", Prompt: prompt}), Outcome{})
	if r := mustPick(t, p, Request{Model: "adapter-a", Prompt: prompt}); cachedTokens(r) != 0 {
		t.Errorf("adapter-a found %d cached tokens of base's prompt, want 0", cachedTokens(r))
	}
	if r := mustPick(t, p, Request{Model: "base", Prompt: prompt}); cachedTokens(r) < 1900 {
		t.Errorf("base found %d cached tokens of its own prompt, want about 2,000", cachedTokens(r))
	}
}
