package picker

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker/prefix"
)

// podEndpoints are n endpoints with pod UIDs, as the controllers give them.
func podEndpoints(n int) []Endpoint {
	eps := endpoints(n)
	for i := range eps {
		eps[i].UID = "uid-" + eps[i].Pod
	}
	return eps
}

func TestAFlappingPodKeepsItsRow(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 0, testConfig(), Options{Clock: clock})
	eps := podEndpoints(3)
	p.Replace(eps)
	a := addr(0)
	prompt := text("on a", 4000)
	held := []*Reservation{mustPick(t, p, on(a, prompt)), mustPick(t, p, on(a, text("more", 400)))}
	p.FirstByte(held[1])

	p.Replace(eps[1:]) // a turns NotReady
	l := p.Snapshot()
	if len(l.Endpoints) != 2 || len(l.Retained) != 1 || l.InFlight != 2 {
		t.Fatalf("after a left: %d current, %d retained, %d in flight; want 2, 1, 2", len(l.Endpoints), len(l.Retained), l.InFlight)
	}
	for range 4 {
		if r := mustPick(t, p, Request{Model: model, Prompt: prompt}); endpointOf(r) == a {
			t.Fatal("a retained endpoint was picked")
		} else {
			p.End(r, Outcome{})
		}
	}
	if _, err := p.pick(on(a, prompt)); err == nil {
		t.Error("a subset hint naming only a retained endpoint was routed; want ErrNoEndpoint")
	}

	clock.Advance(1500 * time.Millisecond)
	p.Replace(eps) // a is Ready again: the same pod, the same row
	got := statsOf(p, a)
	// Both are decoding now: the model finished the first one's prefill
	// while a was away.
	if got.InFlight != 2 || got.Decoding != 2 {
		t.Errorf("a came back with %+v, want its 2 requests (decoding)", got)
	}
	if n := heldBlocks(p, prompt, a); n != 4000/64 {
		t.Errorf("a came back holding %d blocks of its prompt, want %d", n, 4000/64)
	}
	for _, r := range held {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}

func TestANewPodAtTheSameAddressStartsFromZero(t *testing.T) {
	p := newPicker(t, 0, testConfig(), Options{})
	eps := podEndpoints(2)
	p.Replace(eps)
	a := addr(0)
	prompt := text("old pod", 4000)
	old := mustPick(t, p, on(a, prompt))

	eps[0].UID = "uid-of-the-replacement"
	p.Replace(eps)
	if got := statsOf(p, a); got.InFlight != 0 || got.PrefillTokens != 0 {
		t.Errorf("the new pod at %s starts with %+v, want zero", a, got)
	}
	if n := heldBlocks(p, prompt, a); n != 0 {
		t.Errorf("the new pod inherits %d blocks of the old one", n)
	}
	if l := p.Snapshot(); len(l.Retained) != 1 || l.Retained[0].InFlight != 1 {
		t.Errorf("the old pod's row = %+v, want retained with its request", l.Retained)
	}
	fresh := mustPick(t, p, on(a, text("new pod", 800)))
	p.FirstByte(old)
	p.End(old, Outcome{}) // touches the old pod's row only
	if got := statsOf(p, a); got.InFlight != 1 || got.PrefillTokens != 200 {
		t.Errorf("the new pod = %+v after the old pod's request ended, want only its own (1, 200)", got)
	}
	p.End(fresh, Outcome{})
	assertLedgerEmpty(t, p)
}

func TestARetainedRowIsForgottenAfterItsWindowAndItsRequests(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.EndpointRetentionSeconds = 60
	p := newPicker(t, 0, cfg, Options{Clock: clock})
	eps := podEndpoints(2)
	p.Replace(eps)
	a := addr(0)
	prompt := text("warm", 4000)
	r := mustPick(t, p, on(a, prompt))

	p.Replace(eps[1:])
	clock.Advance(2 * time.Minute)
	p.sweep()
	if l := p.Snapshot(); len(l.Retained) != 1 {
		t.Fatalf("a row with a request in flight was forgotten after its window: retained %v", l.Retained)
	}
	p.End(r, Outcome{})
	p.sweep()
	if l := p.Snapshot(); len(l.Retained) != 0 {
		t.Errorf("retained %v after its window and its last request, want none", l.Retained)
	}
	p.Replace(eps)
	if n := heldBlocks(p, prompt, a); n != 0 {
		t.Errorf("a pod back after its retention window still holds %d blocks", n)
	}
	p.mu.Lock()
	dying := p.l.index.Untidy()
	p.mu.Unlock()
	if dying {
		t.Error("the forgotten row's prefix entries were not reclaimed")
	}
	assertLedgerEmpty(t, p)
}

func TestNonStreamedPrefillDrainsAtTheModelRate(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	p := newPicker(t, 1, cfg, Options{Clock: clock})
	a := addr(0)
	first := mustPick(t, p, Request{Model: model, Prompt: text("one", 4000)}) // 1000 tokens: 100 ms
	second := mustPick(t, p, Request{Model: model, Prompt: text("two", 4000)})

	clock.Advance(50 * time.Millisecond)
	if got := statsOf(p, a); got.PrefillTokens != 1500 || got.Decoding != 0 {
		t.Errorf("after 50 ms: %+v, want 1500 prefill, none decoding", got)
	}
	clock.Advance(100 * time.Millisecond)
	if got := statsOf(p, a); got.PrefillTokens != 500 || got.Decoding != 1 {
		t.Errorf("after 150 ms: %+v, want the first done (decoding) and 500 prefill left", got)
	}
	// The second's first byte comes early: what the model still counted goes.
	p.FirstByte(second)
	if got := statsOf(p, a); got.PrefillTokens != 0 || got.Decoding != 2 {
		t.Errorf("after the second's first byte: %+v, want 0 prefill, 2 decoding", got)
	}
	p.FirstByte(first) // non-streamed: its body at the end of generation
	if got := statsOf(p, a); got.Decoding != 2 || got.InFlight != 2 {
		t.Errorf("a late first byte changed the ledger: %+v", got)
	}
	if rate := statsOf(p, a).PrefillTokensPerSecond; rate != 10_000 {
		t.Errorf("non-streamed first bytes taught the rate: %v, want the starting 10000", rate)
	}
	p.End(first, Outcome{})
	p.End(second, Outcome{})
	assertLedgerEmpty(t, p)
}

func TestStreamedFirstBytesTeachThePrefillRate(t *testing.T) {
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	p := newPicker(t, 1, cfg, Options{Clock: clock})
	a := addr(0)
	// The engine really prefills 50,000 tokens/s: 5,000 tokens take 100 ms.
	for i := range 30 {
		r := mustPick(t, p, Request{Model: model, Prompt: text("p"+string(rune('a'+i)), 20_000), Stream: true})
		clock.Advance(100 * time.Millisecond)
		p.FirstByte(r)
		p.End(r, Outcome{})
	}
	rate := statsOf(p, a).PrefillTokensPerSecond
	if math.Abs(rate-50_000) > 5_000 {
		t.Errorf("learned rate %.0f tokens/s, want about 50000", rate)
	}
	// Now a queue of non-streamed requests drains at the learned rate.
	for i := range 4 {
		mustPick(t, p, Request{Model: model, Prompt: text("q"+string(rune('a'+i)), 20_000)})
	}
	clock.Advance(250 * time.Millisecond)
	want := 20_000 - 0.25*rate
	if got := statsOf(p, a); got.Decoding != 2 || math.Abs(float64(got.PrefillTokens)-want) > 100 {
		t.Errorf("after 250 ms of 4 x 5,000 tokens at %.0f/s: %+v, want 2 decoding and %.0f prefill", rate, got, want)
	}
}

func TestOnlyTheFirstPromptBlocksAreRecorded(t *testing.T) {
	cfg := testConfig()
	cfg.MaxPromptBlocks = 10 // 7 blocks of 64 characters, then 3 of 1,024
	p := newPicker(t, 1, cfg, Options{})
	prompt := text("huge", 100*64)
	r := mustPick(t, p, Request{Model: model, Prompt: prompt})
	if promptTokens(r) != 100*64/4 {
		t.Errorf("prompt tokens = %d, want every token counted (%d)", promptTokens(r), 100*64/4)
	}
	p.mu.Lock()
	n := p.l.index.Len(p.l.rows[0].id)
	p.mu.Unlock()
	if n != 10 {
		t.Errorf("recorded %d blocks, want the cap of 10", n)
	}
	again := mustPick(t, p, Request{Model: model, Prompt: prompt})
	if want := (7*64 + 3*1024) / 4; cachedTokens(again) != want {
		t.Errorf("a repeat matched %d cached tokens, want the %d the 10 blocks cover", cachedTokens(again), want)
	}
	// A prompt that parts in the coarse tail matches up to the block
	// where it parts.
	other := append(prompt[:7*64+1024+10:7*64+1024+10], text("elsewhere", 5000)...)
	if got, want := cachedTokens(mustPick(t, p, Request{Model: model, Prompt: other})), (7*64+1024)/4; got != want {
		t.Errorf("a prompt parting in the second coarse block matched %d tokens, want %d", got, want)
	}
}

func TestServedByKeepsBlocksAnotherRequestRecorded(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	a, b := addr(0), addr(1)
	prompt := text("shared by two", 4000)
	first := mustPick(t, p, on(a, prompt))
	second := mustPick(t, p, on(a, prompt)) // is served by a, from the blocks first put there
	p.ServedBy(first, b)
	if n := heldBlocks(p, prompt, a); n != 4000/64 {
		t.Errorf("a holds %d blocks after the first request moved to b, want %d: the second still computes them there", n, 4000/64)
	}
	p.End(second, Outcome{})
	p.End(first, Outcome{})
	assertLedgerEmpty(t, p)
}

// After a fallback, the prediction booked against the engine's usage is
// the serving endpoint's, not the first choice's.
func TestServedByBooksTheServingEndpointsPrediction(t *testing.T) {
	p := newPicker(t, 2, testConfig(), Options{})
	a, b := addr(0), addr(1)
	prompt := text("held by b", 64*100) // 100 blocks, 1,600 tokens
	p.End(mustPick(t, p, on(b, prompt)), Outcome{})
	r := mustPick(t, p, on(a, prompt)) // a holds none of it
	if cachedTokens(r) != 0 {
		t.Fatalf("predicted %d cached tokens on a, want 0", cachedTokens(r))
	}
	p.ServedBy(r, b)
	if cachedTokens(r) != 1600 {
		t.Errorf("after ServedBy(b), CachedTokens() = %d, want b's 1600", cachedTokens(r))
	}
	p.End(r, Outcome{PromptTokens: 1600, CachedTokens: 1600})
	p.End(r, Outcome{})
	if s := statsOf(p, b); s.DeliveredCachedTokens != 1600 || s.PredictedCachedTokens != 1600 {
		t.Errorf("b's delivered/predicted = %d/%d, want 1600/1600", s.DeliveredCachedTokens, s.PredictedCachedTokens)
	}
	if s := statsOf(p, a); s.DeliveredCachedTokens != 0 || s.PredictedCachedTokens != 0 {
		t.Errorf("a's delivered/predicted = %d/%d, want 0/0: it did not serve", s.DeliveredCachedTokens, s.PredictedCachedTokens)
	}
}

func TestShortPromptsDoNotTeachTheRate(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 1, testConfig(), Options{Clock: clock})
	for i := range 20 {
		// 100 tokens whose first byte takes 20 ms: overhead, not prefill.
		r := mustPick(t, p, Request{Model: model, Prompt: text("short"+string(rune('a'+i)), 400), Stream: true})
		clock.Advance(20 * time.Millisecond)
		p.FirstByte(r)
		p.End(r, Outcome{})
	}
	if rate := statsOf(p, addr(0)).PrefillTokensPerSecond; rate != float64(testConfig().PrefillTokensPerSecond) {
		t.Errorf("short prompts taught a rate of %.0f tokens/s, want the starting %d kept", rate, testConfig().PrefillTokensPerSecond)
	}
}

func TestTheRateFitSeparatesFixedOverhead(t *testing.T) {
	// The engine prefills 50,000 tokens/s; every first byte also pays a
	// fixed cost, whatever the prompt. Up to maxPrefillOverhead the fit
	// takes it as overhead; beyond it, the rest is taken as slower prefill
	// (a rate learned low, never high).
	for _, c := range []struct {
		fixed  time.Duration
		lo, hi float64
	}{
		{25 * time.Millisecond, 45_000, 55_000},
		{80 * time.Millisecond, 30_000, 50_000},
	} {
		clock := newFakeClock()
		p := newPicker(t, 1, testConfig(), Options{Clock: clock})
		for i := range 40 {
			tokens := 1000 + (i%5)*2000
			r := mustPick(t, p, Request{Model: model, Prompt: text("o"+string(rune('a'+i)), tokens*4), Stream: true})
			clock.Advance(c.fixed + time.Duration(tokens)*time.Second/50_000)
			p.FirstByte(r)
			p.End(r, Outcome{})
		}
		if rate := statsOf(p, addr(0)).PrefillTokensPerSecond; rate < c.lo || rate > c.hi {
			t.Errorf("%v fixed: learned %.0f tokens/s, want %.0f to %.0f", c.fixed, rate, c.lo, c.hi)
		}
	}
}

func TestAHugePromptsTailIsRecordedOutsideTheCriticalSection(t *testing.T) {
	cfg := testConfig() // 64-character blocks: 32,000 tokens are 2,000 of them
	p := newPicker(t, 1, cfg, Options{})
	prompt := text("long context", 200_000) // 50,000 tokens: 2,000 fine blocks in the lock, more after
	all := len(prefix.HashTiered(nil, model, "", prompt, cfg.BlockSizeChars, p.blocks.fine, p.blocks.coarseChars, cfg.MaxPromptBlocks))
	var inSection int
	_, err := pickPausing(p, Request{Model: model, Prompt: prompt}, func() { // right after the critical section, before the tail
		p.mu.Lock()
		inSection = p.l.index.Len(p.l.rows[0].id)
		p.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	after := p.l.index.Len(p.l.rows[0].id)
	p.mu.Unlock()
	if inSection != p.blocks.inLock || after != all || all <= p.blocks.inLock {
		t.Errorf("blocks recorded: %d in the critical section (want %d), %d after the pick (want all %d)", inSection, p.blocks.inLock, after, all)
	}
}

// The ledger as a state machine: the same operations, given the same times
// in the same order, leave two ledgers equal; reading one changes nothing.

// ledgerOp is one of the ledger's operations, as recorded from a replay.
type ledgerOp struct {
	kind    string // place, firstByte, servedBy, end, observe, set, dispatch, sweep
	at      int64
	req     Request        // place
	ref     int            // firstByte, servedBy, end: the place op's index
	addr    netip.AddrPort // servedBy
	outcome Outcome        // end
	round   []Scrape       // observe
	eps     []Endpoint     // set
}

// replayer applies recorded operations to one ledger, as the Picker does:
// the hashing before the lock, the long prompt's tail and the index's
// evictions after each operation.
type replayer struct {
	cfg    v1alpha1.PickerConfig
	l      ledger
	blocks blockLayout
	res    map[int]*Reservation // by place op
	ticket map[int]*Ticket
}

func newReplayer(cfg v1alpha1.PickerConfig, seed uint64) *replayer {
	cfg = v1alpha1.WithDefaults(cfg)
	return &replayer{cfg: cfg, l: newLedger(cfg, rand.New(rand.NewPCG(seed, 7)), DefaultScrapeFailureThreshold),
		blocks: newBlockLayout(cfg), res: map[int]*Reservation{}, ticket: map[int]*Ticket{}}
}

// reservation is the reservation of place op i, once it is placed.
func (h *replayer) reservation(i int) *Reservation {
	if r := h.res[i]; r != nil {
		return r
	}
	if t := h.ticket[i]; t != nil && t.done && t.err == nil {
		h.res[i] = t.r
		return t.r
	}
	return nil
}

func (h *replayer) apply(i int, op ledgerOp) {
	l := &h.l
	switch op.kind {
	case "place":
		hashes := prefix.HashTiered(nil, op.req.Model, op.req.CacheSalt, op.req.Prompt,
			h.cfg.BlockSizeChars, h.blocks.fine, h.blocks.coarseChars, h.cfg.MaxPromptBlocks)
		r := l.newReservation(op.req, hashes, op.at)
		t, placed, err := l.admit(r, op.req)
		switch {
		case t != nil:
			h.ticket[i] = t
		case placed && err == nil:
			h.res[i] = r
			l.recordTail(r)
		}
	case "firstByte":
		if r := h.reservation(op.ref); r != nil {
			l.firstByte(r, op.at)
		}
	case "servedBy":
		if r := h.reservation(op.ref); r != nil {
			l.servedBy(r, op.addr, op.at)
		}
	case "end":
		if r := h.reservation(op.ref); r != nil {
			l.end(r, op.outcome, op.at)
		} else if t := h.ticket[op.ref]; t != nil && !t.done {
			l.finish(t, context.Canceled, outcomeEvictedCancelled)
		}
	case "observe":
		l.observe(op.round, op.at)
	case "set":
		l.setEndpoints(op.eps, op.at)
	case "dispatch":
		l.dispatch(op.at)
	case "sweep":
		l.sweep(op.at, int64(time.Minute))
	}
	for l.tidy(tidyBatchBlocks) {
	}
}

// traceOps records the operations of a replay of the Mooncake sample over
// four endpoints with flow control on: streamed and non-streamed requests,
// LoRA adapters, fallbacks the gateway used, streams that end at the pick
// (detached), scrapes that report engines' counts and timings, an endpoint
// that leaves and comes back and one that joins, and the sweeper.
func traceOps(t *testing.T) []ledgerOp {
	t.Helper()
	f, err := os.Open("../test/data/mooncake_sample.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var trace []struct {
		Timestamp    int64    `json:"timestamp"`
		InputLength  int      `json:"input_length"`
		OutputLength int      `json:"output_length"`
		HashIDs      []uint64 `json:"hash_ids"`
	}
	dec := json.NewDecoder(f)
	for dec.More() {
		var j struct {
			Timestamp    int64    `json:"timestamp"`
			InputLength  int      `json:"input_length"`
			OutputLength int      `json:"output_length"`
			HashIDs      []uint64 `json:"hash_ids"`
		}
		if err := dec.Decode(&j); err != nil {
			t.Fatal(err)
		}
		trace = append(trace, j)
	}
	eps := podEndpoints(5)
	fresh := slices.Clone(eps[:3])
	for k := range fresh {
		fresh[k].UID += "-new"
	}
	var ops []ledgerOp
	add := func(op ledgerOp) int { ops = append(ops, op); return len(ops) - 1 }
	ms := func(v int64) int64 { return v * int64(time.Millisecond) }
	origin := trace[0].Timestamp
	add(ledgerOp{kind: "set", at: 0, eps: eps[:4]})
	type pending struct {
		at  int64
		op  ledgerOp
		seq int
	}
	var later []pending
	seq := 0
	defer_ := func(at int64, op ledgerOp) {
		seq++
		later = append(later, pending{at, op, seq})
	}
	flush := func(until int64) {
		slices.SortStableFunc(later, func(a, b pending) int { return cmp.Or(cmp.Compare(a.at, b.at), cmp.Compare(a.seq, b.seq)) })
		n := 0
		for _, p := range later {
			if p.at > until {
				break
			}
			p.op.at = p.at
			add(p.op)
			n++
		}
		later = later[n:]
	}
	rng := rand.New(rand.NewPCG(3, 4))
	var running [5]int
	for i, j := range trace[:300] {
		at := ms(j.Timestamp-origin) / 4 // four times faster: queues form
		flush(at)
		switch i {
		case 100:
			add(ledgerOp{kind: "set", at: at, eps: eps[2:4]}) // two leave
		case 160:
			add(ledgerOp{kind: "set", at: at, eps: eps[1:]}) // one comes back, and one joins
		case 220:
			add(ledgerOp{kind: "set", at: at, eps: fresh}) // three new pods at the old addresses
		case 260:
			add(ledgerOp{kind: "set", at: at, eps: eps})
		}
		var prompt []byte
		for _, h := range j.HashIDs {
			prompt = append(prompt, text(fmt.Sprint("block", h), 512)...)
		}
		prompt = prompt[:min(len(prompt), j.InputLength*4)]
		req := Request{Model: model, Prompt: prompt, Stream: i%3 != 0, MaxTokens: j.OutputLength + 8,
			Priority: i%5 - 1, FairnessID: fmt.Sprint("flow-", i%3)}
		if i%4 == 1 {
			req.Model = fmt.Sprint("adapter-", i%6)
		}
		ref := add(ledgerOp{kind: "place", at: at, req: req})
		prefill := ms(int64(20 + j.InputLength/50))
		decode := ms(int64(5 + j.OutputLength*20))
		ep := i % 5
		running[ep]++
		switch {
		case i%7 == 3: // the stream ends at the pick
			add(ledgerOp{kind: "end", at: at, ref: ref, outcome: Outcome{Detached: true}})
		default:
			if i%11 == 5 {
				defer_(at+ms(1), ledgerOp{kind: "servedBy", ref: ref, addr: eps[(i+1)%5].Address})
			}
			defer_(at+prefill, ledgerOp{kind: "firstByte", ref: ref})
			defer_(at+prefill+decode, ledgerOp{kind: "end", ref: ref, outcome: Outcome{PromptTokens: j.InputLength,
				CachedTokens: rng.IntN(j.InputLength + 1), CompletionTokens: j.OutputLength}})
		}
		if i%9 == 0 {
			round := make([]Scrape, 0, 5)
			for k, e := range eps {
				s := EngineStats{Running: rng.IntN(4), Waiting: rng.IntN(3), CacheTokens: 200_000,
					HasPrefillTiming: true, PrefillSecondsTotal: float64(i) * 0.05, PromptTokensTotal: float64(i) * 9000,
					CachedTokensTotal: float64(i) * 3000, HasOutputCounts: true, FinishedRequestsTotal: float64(i),
					GenerationTokensTotal: float64(i) * 40, HasDecodeTiming: true, DecodeSecondsTotal: float64(i) * 0.8,
					Model: model, HasLoRA: true, MaxLoRAs: 2, RunningAdapters: []string{fmt.Sprint("adapter-", (i+k)%6)}}
				round = append(round, Scrape{Address: e.Address, Stats: s, Failed: k == 4 && i%2 == 0, Age: time.Duration(k) * time.Millisecond})
			}
			add(ledgerOp{kind: "observe", at: at, round: round})
		}
		add(ledgerOp{kind: "dispatch", at: at + ms(2)})
		if i%50 == 49 {
			add(ledgerOp{kind: "sweep", at: at})
		}
	}
	flush(math.MaxInt64)
	return ops
}

// ledgerConfig is the replay's configuration: flow control on, with a
// threshold the trace crosses.
func ledgerConfig() v1alpha1.PickerConfig {
	cfg := testConfig()
	cfg.FlowControl.Enabled = true
	cfg.FlowControl.HoldPrefillMilliseconds = 300
	cfg.EndpointRetentionSeconds = 1
	return cfg
}

func TestTheSameOperationsLeaveTwoLedgersEqual(t *testing.T) {
	ops := traceOps(t)
	a, b := newReplayer(ledgerConfig(), 1), newReplayer(ledgerConfig(), 1)
	// a is read between operations (as metrics and /debug/ledger read it),
	// b never: reading must change nothing. b runs after a, so an operation
	// that read a clock would give b other times.
	var snaps []Ledger
	for i, op := range ops {
		a.apply(i, op)
		snaps = append(snaps, a.l.snapshot(op.at))
		a.l.snapshot(op.at + int64(time.Second))
		a.l.flowGauges(op.at)
		if a.l.queue.waiting.Len() > 0 {
			a.l.nextDue(op.at)
		}
	}
	time.Sleep(10 * time.Millisecond)
	kinds := map[string]int{}
	for i, op := range ops {
		b.apply(i, op)
		kinds[op.kind]++
		if got := b.l.snapshot(op.at); !reflect.DeepEqual(got, snaps[i]) {
			t.Fatalf("after operation %d (%s at %v) the snapshots differ:\n a %+v\n b %+v", i, op.kind, time.Duration(op.at), snaps[i], got)
		}
	}
	if a.l.queue.waiting.Len() != 0 {
		t.Fatalf("%d requests still wait at the end of the replay", a.l.queue.waiting.Len())
	}
	if !reflect.DeepEqual(a.l, b.l) {
		t.Fatal("the ledgers differ at the end of the replay, though their snapshots agree")
	}
	// The replay went through every operation, and flow control held some.
	last := snaps[len(snaps)-1]
	held := a.l.queue.outcomes[outcomeDispatched] + a.l.queue.outcomes[outcomeRejectedCapacity]
	t.Logf("operations %v; flow control: %v; detached ends %v; rate samples %v", kinds, a.l.queue.outcomes, last.DetachEnds, last.RateSamples)
	if held == 0 || last.DetachEnds == [numDetachEnds]uint64{} || last.RateSamples[rateSampleLearned] == 0 {
		t.Fatal("the replay missed flow control, detached ends or rate learning")
	}
}
