package picker

import (
	"k8s.io/utils/clock"

	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tallyepp/tally/api/v1alpha1"
)

// flowConfig turns flow control on; at the default 10,000 tokens/s and a
// 250 ms threshold an endpoint is saturated from 2,500 queued tokens.
func flowConfig() v1alpha1.PickerConfig {
	cfg := testConfig()
	cfg.FlowControl.Enabled = true
	return v1alpha1.WithDefaults(cfg)
}

// big is a request of 3,000 tokens: one saturates an endpoint.
func big(tag string) Request { return Request{Model: model, Prompt: text(tag, 12_000)} }

// saturate places one big request on each of n endpoints.
func saturate(t *testing.T, p *Picker, n int) []*Reservation {
	t.Helper()
	var rs []*Reservation
	for i := range n {
		r, tk, err := p.Enqueue(big(fmt.Sprint("fill", i)))
		if err != nil || tk != nil {
			t.Fatalf("fill %d: placed at once expected, got ticket %v, err %v", i, tk != nil, err)
		}
		rs = append(rs, r)
	}
	return rs
}

func mustWait(t *testing.T, p *Picker, req Request) *Ticket {
	t.Helper()
	r, tk, err := p.Enqueue(req)
	if err != nil || r != nil || tk == nil {
		t.Fatalf("Enqueue: want a ticket, got reservation %v, err %v", r != nil, err)
	}
	return tk
}

func placed(t *testing.T, tk *Ticket) *Reservation {
	t.Helper()
	r, done, err := tk.Result()
	if !done || err != nil {
		t.Fatalf("ticket: done %v err %v, want placed", done, err)
	}
	return r
}

func waiting(tk *Ticket) bool {
	_, done, _ := tk.Result()
	return !done
}

func TestFlowControlOffNeverWaits(t *testing.T) {
	cfg := testConfig()
	cfg.Saturation.MaxInFlightRequests = 1
	p := newPicker(t, 1, cfg, Options{})
	mustPick(t, p, big("a"))
	r, err := p.Admit(context.Background(), big("b"))
	if !errors.Is(err, ErrSaturated) || r != nil {
		t.Fatalf("Admit with flow control off over a static limit: %v, %v; want ErrSaturated", r, err)
	}
	if l := p.Snapshot(); l.Waiting != 0 {
		t.Fatalf("waiting %d, want 0", l.Waiting)
	}
}

func TestWaitsWhileEverythingIsSaturatedAndDispatchesOnRelease(t *testing.T) {
	p := newPicker(t, 2, flowConfig(), Options{})
	fill := saturate(t, p, 2)
	tk := mustWait(t, p, big("waiter"))
	if l := p.Snapshot(); l.Waiting != 1 || l.InFlight != 2 {
		t.Fatalf("ledger %d in flight, %d waiting; want 2 and 1", l.InFlight, l.Waiting)
	}
	p.End(fill[1], Outcome{})
	r := placed(t, tk)
	if got := endpointOf(r); got != fill[1].Endpoints()[0] {
		t.Errorf("placed on %v, want the freed endpoint %v", got, fill[1].Endpoints()[0])
	}
	if l := p.Snapshot(); l.Waiting != 0 || l.InFlight != 2 {
		t.Fatalf("after dispatch: %d in flight, %d waiting; want 2 and 0", l.InFlight, l.Waiting)
	}
	p.End(r, Outcome{})
	p.End(fill[0], Outcome{})
	assertLedgerEmpty(t, p)
}

func TestFirstByteAndDrainFreeCapacity(t *testing.T) {
	clock := newFakeClock()
	p := newPicker(t, 1, flowConfig(), Options{Clock: clock})
	fill := saturate(t, p, 1)
	tk := mustWait(t, p, big("w1"))
	p.FirstByte(fill[0])
	r := placed(t, tk)

	// The drain model frees capacity with no event: NextDispatch says when.
	tk2 := mustWait(t, p, big("w2"))
	due, ok := clock.nextTimer()
	if !ok {
		t.Fatal("NextDispatch: nothing due while a request waits")
	}
	if d := due.Sub(clock.Now()); d <= 0 || d > maxDispatchInterval {
		t.Fatalf("next dispatch in %v, want within (0, %v]", d, maxDispatchInterval)
	}
	if p.dispatchNow() != 0 || !waiting(tk2) {
		t.Fatal("dispatched before the queue drained")
	}
	clock.Advance(100 * time.Millisecond) // 3,000 queued drain to 2,000: below 2,500
	if n := p.dispatchNow(); n != 1 {
		t.Fatalf("Dispatch placed %d, want 1", n)
	}
	p.End(placed(t, tk2), Outcome{})
	p.End(r, Outcome{})
	p.End(fill[0], Outcome{})
	assertLedgerEmpty(t, p)
}

func TestHigherPriorityDispatchedFirst(t *testing.T) {
	p := newPicker(t, 1, flowConfig(), Options{})
	fill := saturate(t, p, 1)
	low := mustWait(t, p, Request{Model: model, Prompt: text("low", 400)})
	high := mustWait(t, p, Request{Model: model, Prompt: text("high", 12_000), Priority: 10})
	p.End(fill[0], Outcome{})
	placed(t, high)
	if !waiting(low) {
		t.Fatal("the low-priority request was dispatched before the high one, or beside it")
	}
	p.End(placed(t, high), Outcome{})
	p.End(placed(t, low), Outcome{})
	assertLedgerEmpty(t, p)
}

func TestFlowsOfABandTakeTurns(t *testing.T) {
	for _, fairness := range []string{v1alpha1.FairnessRoundRobin, v1alpha1.FairnessGlobalStrict} {
		t.Run(fairness, func(t *testing.T) {
			cfg := flowConfig()
			cfg.FlowControl.Fairness = fairness
			cfg.FlowControl.Ordering = v1alpha1.OrderingFCFS
			p := newPicker(t, 1, cfg, Options{})
			fill := saturate(t, p, 1)
			// The heavy tenant sends ten times as much, and first.
			var tickets []*Ticket
			tenant := map[*Ticket]string{}
			for i := range 40 {
				id := "heavy"
				if i%11 == 10 {
					id = "light"
				}
				tk := mustWait(t, p, Request{Model: model, Prompt: text(fmt.Sprint(id, i), 12_000), FairnessID: id})
				tickets = append(tickets, tk)
				tenant[tk] = id
			}
			for i := range 10 {
				tk := mustWait(t, p, Request{Model: model, Prompt: text(fmt.Sprint("light-late", i), 12_000), FairnessID: "light"})
				tickets = append(tickets, tk)
				tenant[tk] = "light"
			}
			// Each release frees the endpoint for one request.
			holder := fill[0]
			counts := map[string]int{}
			for range 20 {
				p.End(holder, Outcome{})
				var next *Ticket
				for _, tk := range tickets {
					if r, done, err := tk.Result(); done && err == nil && r != nil && counts[fmt.Sprintf("%p", tk)] == 0 {
						next = tk
					}
				}
				if next == nil {
					t.Fatal("a release dispatched nothing")
				}
				counts[fmt.Sprintf("%p", next)] = 1
				counts[tenant[next]]++
				holder = placed(t, next)
			}
			p.End(holder, Outcome{})
			switch fairness {
			case v1alpha1.FairnessRoundRobin:
				if counts["light"] < 9 || counts["heavy"] < 9 {
					t.Errorf("of 20 dispatches: heavy %d, light %d; want each at least 45%%", counts["heavy"], counts["light"])
				}
			case v1alpha1.FairnessGlobalStrict:
				// Oldest first across flows: the first 20 arrivals.
				if counts["light"] != 1 {
					t.Errorf("global-strict gave light %d of the first 20 dispatches, want 1 (its one early request)", counts["light"])
				}
			}
			for _, tk := range tickets {
				tk.Cancel()
			}
			assertLedgerEmpty(t, p)
			if l := p.Snapshot(); l.Waiting != 0 {
				t.Fatalf("%d still waiting after every ticket was cancelled", l.Waiting)
			}
		})
	}
}

func TestCheapestFirstWithinAnAgeBound(t *testing.T) {
	clock := newFakeClock()
	cfg := flowConfig()
	cfg.FlowControl.MaxReorderMilliseconds = 500
	cfg.FlowControl.MaxDecodingRequests = 1
	p := newPicker(t, 1, cfg, Options{Clock: clock})
	// One decoding request fills the endpoint's one slot; its release
	// frees room for one request of 3,000 tokens (past the threshold).
	hold := func(tag string) *Reservation {
		r, tk, err := p.Enqueue(Request{Model: model, Prompt: text(tag, 400)})
		if err != nil || tk != nil {
			t.Fatalf("holder: ticket %v, err %v", tk != nil, err)
		}
		p.FirstByte(r)
		return r
	}
	r := hold("h1")
	large := mustWait(t, p, Request{Model: model, Prompt: text("large", 40_000)})
	small := mustWait(t, p, Request{Model: model, Prompt: text("small", 12_000)})
	p.End(r, Outcome{})
	placed(t, small)
	if !waiting(large) {
		t.Fatal("the large request went before the small one, or beside it")
	}
	p.End(placed(t, small), Outcome{})
	p.End(placed(t, large), Outcome{})
	assertLedgerEmpty(t, p)

	// Past the age bound the oldest goes first, however large.
	r = hold("h2")
	large = mustWait(t, p, Request{Model: model, Prompt: text("large2", 40_000)})
	clock.Advance(600 * time.Millisecond)
	small = mustWait(t, p, Request{Model: model, Prompt: text("small2", 12_000)})
	p.End(r, Outcome{})
	placed(t, large)
	if !waiting(small) {
		t.Fatal("the small request passed one older than the age bound")
	}
	p.End(placed(t, large), Outcome{})
	p.End(placed(t, small), Outcome{})
	assertLedgerEmpty(t, p)
}

func TestQueueLimitsTTLAndShedding(t *testing.T) {
	clock := newFakeClock()
	cfg := flowConfig()
	cfg.FlowControl.HoldPrefillMilliseconds = 100_000
	cfg.FlowControl.MaxDecodingRequests = 1
	cfg.FlowControl.Bands = []v1alpha1.Band{{Priority: 0, MaxRequests: 2}, {Priority: 5, MaxBytes: 1000}}
	p := newPicker(t, 1, cfg, Options{Clock: clock})
	r, _, _ := p.Enqueue(Request{Model: model, Prompt: text("x", 400)})
	p.FirstByte(r)

	a := mustWait(t, p, Request{Model: model, Prompt: text("a", 400)})
	mustWait(t, p, Request{Model: model, Prompt: text("b", 400)})
	if _, _, err := p.Enqueue(Request{Model: model, Prompt: text("c", 400)}); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("third request in a band of 2: %v, want ErrQueueFull", err)
	}
	if _, _, err := p.Enqueue(Request{Model: model, Prompt: text("d", 400), Priority: 5, Bytes: 1001}); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("1,001 bytes in a band of 1,000: %v, want ErrQueueFull", err)
	}
	if _, _, err := p.Enqueue(Request{Model: model, Prompt: text("e", 400), Priority: -1}); !errors.Is(err, ErrShed) {
		t.Fatalf("sheddable request while saturated: %v, want ErrShed", err)
	}
	if l := p.Snapshot(); l.Waiting != 2 {
		t.Fatalf("waiting %d, want 2: refused requests must not stay queued", l.Waiting)
	}

	clock.Advance(time.Duration(cfg.FlowControl.RequestTTLSeconds)*time.Second + time.Millisecond)
	p.dispatchNow()
	if _, done, err := a.Result(); !done || !errors.Is(err, ErrQueueTimeout) {
		t.Fatalf("after the TTL: done %v, err %v; want ErrQueueTimeout", done, err)
	}
	if l := p.Snapshot(); l.Waiting != 0 || l.InFlight != 1 {
		t.Fatalf("after the TTL: %d waiting, %d in flight; want 0 and 1", l.Waiting, l.InFlight)
	}
	p.End(r, Outcome{})
	assertLedgerEmpty(t, p)
}

func TestCloseQueueRefusesWaitersAndNewcomers(t *testing.T) {
	p := newPicker(t, 1, flowConfig(), Options{})
	fill := saturate(t, p, 1)
	tk := mustWait(t, p, big("w"))
	done := make(chan error, 1)
	go func() {
		_, err := tk.Wait(context.Background())
		done <- err
	}()
	if n := p.CloseQueue(); n != 1 {
		t.Fatalf("CloseQueue refused %d, want 1", n)
	}
	if err := <-done; !errors.Is(err, ErrShuttingDown) {
		t.Fatalf("waiter: %v, want ErrShuttingDown", err)
	}
	if _, _, err := p.Enqueue(big("late")); !errors.Is(err, ErrShuttingDown) {
		t.Fatalf("a request that would wait after CloseQueue: %v, want ErrShuttingDown", err)
	}
	p.End(fill[0], Outcome{})
	if r, _, err := p.Enqueue(big("free")); err != nil {
		t.Fatalf("a request with room after CloseQueue: %v, want placed", err)
	} else {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}

// Many clients wait, give up and are dispatched at once, under the race
// detector: every outcome leaves the ledger and the queue empty.
func TestWaitCancelAndDispatchRaceLeaveNothingBehind(t *testing.T) {
	p := newPicker(t, 3, flowConfig(), Options{Clock: clock.RealClock{}})
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go p.Run(ctx)
	var wg sync.WaitGroup
	var mu sync.Mutex
	outcomes := map[string]int{}
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 7))
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.IntN(30))*time.Millisecond)
			defer cancel()
			r, err := p.Admit(ctx, Request{Model: model, Prompt: text(fmt.Sprint(i%17), 4000+rng.IntN(20_000)),
				Priority: rng.IntN(3), FairnessID: fmt.Sprint(rng.IntN(4))})
			mu.Lock()
			outcomes[fmt.Sprint(err)]++
			mu.Unlock()
			if err != nil {
				return
			}
			time.Sleep(time.Duration(rng.IntN(5)) * time.Millisecond)
			if rng.IntN(2) == 0 {
				p.FirstByte(r)
			}
			p.End(r, Outcome{})
		}()
	}
	wg.Wait()
	if outcomes["<nil>"] == 0 || outcomes[context.DeadlineExceeded.Error()] == 0 {
		t.Fatalf("outcomes %v: want some placed and some given up", outcomes)
	}
	assertLedgerEmpty(t, p)
	if l := p.Snapshot(); l.Waiting != 0 {
		t.Fatalf("%d still waiting", l.Waiting)
	}
}

func TestFlowControlMetrics(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	p := newPicker(t, 1, flowConfig(), Options{Registerer: reg, PoolName: "pool"})
	fill := saturate(t, p, 1)
	tk := mustWait(t, p, Request{Model: model, Prompt: text("w", 400), FairnessID: "tenant-a", Priority: 2})
	want := `
# HELP inference_extension_flow_control_queue_size Requests waiting in the flow control queue now.
# TYPE inference_extension_flow_control_queue_size gauge
inference_extension_flow_control_queue_size{fairness_id="tenant-a",inference_pool="pool",model_name="test-model",priority="2",target_model_name="test-model"} 1
# HELP inference_extension_flow_control_pool_saturation Share of the pool's candidate endpoints (decode-capable, not failing scrapes) over their saturation threshold. At 1 a new request waits, unless it can be split onto a free prefill pod and a decode pod with a decoding slot free; prefill pods are counted in tally_role_saturated_endpoints.
# TYPE inference_extension_flow_control_pool_saturation gauge
inference_extension_flow_control_pool_saturation{inference_pool="pool"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"inference_extension_flow_control_queue_size", "inference_extension_flow_control_pool_saturation"); err != nil {
		t.Fatal(err)
	}
	p.End(fill[0], Outcome{})
	p.End(placed(t, tk), Outcome{})
	if got := testutil.CollectAndCount(p, "inference_extension_flow_control_queue_size"); got != 0 {
		t.Errorf("queue size series after the dispatch: %d, want none", got)
	}
	n, err := testutil.GatherAndCount(reg, "inference_extension_flow_control_request_queue_duration_seconds")
	if err != nil || n != 1 {
		t.Errorf("queue duration series: %d (%v), want 1 (Dispatched)", n, err)
	}
}

func TestARequestNoEndpointCanTakeIsNotQueued(t *testing.T) {
	p := newPicker(t, 1, flowConfig(), Options{})
	fill := saturate(t, p, 1)
	tk := mustWait(t, p, big("w"))
	req := big("nowhere")
	req.Subset, req.HasSubset = []netip.AddrPort{addr(7)}, true
	if _, _, err := p.Enqueue(req); !errors.Is(err, ErrNoEndpoint) {
		t.Fatalf("a subset hint naming no endpoint while requests wait: %v, want ErrNoEndpoint", err)
	}
	if l := p.Snapshot(); l.Waiting != 1 {
		t.Fatalf("waiting %d, want 1", l.Waiting)
	}
	tk.Cancel()
	p.End(fill[0], Outcome{})
	assertLedgerEmpty(t, p)
}

// A request without a body (a GET of /v1/models, a health check) is placed
// at once, past a static limit and past flow control's queue, as the
// upstream picker routes it without admission; a request with a body is
// still refused or held.
func TestABodilessRequestIsPlacedAtOnceWhateverTheLoad(t *testing.T) {
	cfg := testConfig()
	cfg.Saturation.MaxInFlightRequests = 1
	p := newPicker(t, 1, cfg, Options{})
	fill := mustPick(t, p, big("a"))
	if _, err := p.Admit(context.Background(), Request{Model: model, Bytes: 40}); !errors.Is(err, ErrSaturated) {
		t.Fatalf("a small request with a body over the static limit: %v, want ErrSaturated", err)
	}
	r, err := p.Admit(context.Background(), Request{})
	if err != nil {
		t.Fatalf("a bodiless request over the static limit: %v, want placed", err)
	}
	p.End(r, Outcome{})
	p.End(fill, Outcome{})
	assertLedgerEmpty(t, p)

	p = newPicker(t, 2, flowConfig(), Options{})
	fills := saturate(t, p, 2)
	tk := mustWait(t, p, big("waiter"))
	r, tk2, err := p.Enqueue(Request{})
	if err != nil || tk2 != nil || r == nil {
		t.Fatalf("a bodiless request with every endpoint saturated and one waiting: ticket %v, err %v; want placed", tk2 != nil, err)
	}
	if !waiting(tk) {
		t.Fatalf("the waiting request was dispatched by a bodiless one")
	}
	p.End(r, Outcome{})
	if !waiting(tk) {
		t.Fatalf("the bodiless request's release dispatched the waiting request: it freed no capacity")
	}
	mustWait(t, p, Request{Model: model, Bytes: 40}).Cancel()
	for _, f := range fills {
		p.End(f, Outcome{})
	}
	p.End(placed(t, tk), Outcome{})
	assertLedgerEmpty(t, p)
}
