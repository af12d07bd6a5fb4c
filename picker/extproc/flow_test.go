package extproc_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker/objective"
)

// flowFixture is one endpoint with flow control on: at the default 10,000
// tokens/s and 250 ms, one request of 3,000 tokens saturates it, and with
// the fixture's clock standing still only a response's end frees it.
func flowFixture(t testing.TB, edit func(*v1alpha1.FlowControl), o fixtureOptions) *fixture {
	cfg := v1alpha1.Default()
	cfg.FlowControl.Enabled = true
	if edit != nil {
		edit(&cfg.FlowControl)
	}
	cfg = v1alpha1.WithDefaults(cfg)
	o.cfg = &cfg
	o.endpoints = endpoints(epA)
	if o.objectives == nil {
		objectives := &objective.Priorities{}
		objectives.ReplaceObjectives(map[string]int{"critical": 10, "batch": 0, "best-effort": -1})
		o.objectives = objectives
	}
	return newFixture(t, o)
}

// bigRequest is 3,000 tokens of prompt (12,000 characters).
func bigRequest(tag int, headers ...string) envoy.Request {
	req := completion("m", letters(uint64(tag), 12_000))
	req.Headers = append(req.Headers, headers...)
	return req
}

// pending is a request whose stream is held open by the picker.
type pending struct {
	x    *envoy.Stream
	done chan struct{}
	r    envoy.Routed
	err  error
}

func (f *fixture) send(t *testing.T, req envoy.Request) *pending {
	t.Helper()
	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	p := &pending{x: x, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		p.r, p.err = x.SendRequest(req)
	}()
	return p
}

func (p *pending) answered(within time.Duration) bool {
	select {
	case <-p.done:
		return true
	case <-time.After(within):
		return false
	}
}

func (f *fixture) waitingIs(t *testing.T, n int) {
	t.Helper()
	eventually(t, fmt.Sprintf("%d requests waiting", n), func() (bool, string) {
		l := f.picker.Snapshot()
		return l.Waiting == n, fmt.Sprintf("%d waiting, %d in flight", l.Waiting, l.InFlight)
	})
}

// respond plays the model server's response r on p's stream.
func (p *pending) respond(t *testing.T, r envoy.Response) {
	t.Helper()
	if err := p.x.Respond(r); err != nil {
		t.Fatal(err)
	}
}

func routedOK(t *testing.T, p *pending, what string) {
	t.Helper()
	if !p.answered(10 * time.Second) {
		t.Fatalf("%s: still held", what)
	}
	if p.err != nil || p.r.Immediate != nil {
		t.Fatalf("%s: err %v, immediate %v", what, p.err, p.r.Immediate)
	}
}

func TestHeldStreamsAreDispatchedInPriorityOrder(t *testing.T) {
	f := flowFixture(t, nil, fixtureOptions{})
	fill := f.send(t, bigRequest(1))
	routedOK(t, fill, "the first request")

	low := f.send(t, bigRequest(2, "x-gateway-inference-objective", "batch"))
	f.waitingIs(t, 1)
	unknown := f.send(t, bigRequest(3, "x-gateway-inference-objective", "no-such-objective"))
	f.waitingIs(t, 2)
	high := f.send(t, bigRequest(4, "x-gateway-inference-objective", "critical"))
	f.waitingIs(t, 3)
	if low.answered(50 * time.Millisecond) {
		t.Fatalf("a request was answered while every endpoint is saturated: %v %v", low.r.Immediate, low.err)
	}

	// Each response's end frees the endpoint for one more.
	fill.respond(t, okResponse)
	routedOK(t, high, "the critical request")
	f.waitingIs(t, 2)
	high.respond(t, okResponse)
	// An unknown objective has priority 0, as batch: the older goes first.
	routedOK(t, low, "the batch request")
	if unknown.answered(50 * time.Millisecond) {
		t.Fatal("two requests were dispatched for one freed slot")
	}
	low.respond(t, okResponse)
	routedOK(t, unknown, "the request with an unknown objective")
	unknown.respond(t, okResponse)
	eventually(t, "an empty ledger", func() (bool, string) { return ledgerEmpty(f.picker) })
}

func TestFullQueueShedAndTTLAre429WithRetryAfter(t *testing.T) {
	f := flowFixture(t, func(fc *v1alpha1.FlowControl) {
		fc.DefaultBand.MaxRequests = 1
		fc.RequestTTLSeconds = 1
	}, fixtureOptions{now: time.Now})
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go f.picker.Run(ctx) // the TTL's timer
	// A steady clock drains the model at 10,000 tokens/s: a request of
	// 100,000 tokens keeps the endpoint saturated past the TTL.
	huge := f.send(t, completion("m", letters(9, 400_000)))
	routedOK(t, huge, "the huge request")

	waiter := f.send(t, bigRequest(2))
	f.waitingIs(t, 1)
	for _, c := range []struct {
		what string
		req  envoy.Request
	}{
		{"a request past its band's limit", bigRequest(3)},
		{"a sheddable request", bigRequest(4, "x-gateway-inference-objective", "best-effort")},
	} {
		p := f.send(t, c.req)
		if !p.answered(5 * time.Second) {
			t.Fatalf("%s was held", c.what)
		}
		assert429(t, c.what, p)
	}
	if !waiter.answered(5 * time.Second) {
		t.Fatal("a request was held past its TTL of 1 s")
	}
	assert429(t, "a request past its TTL", waiter)
	if l := f.picker.Snapshot(); l.Waiting != 0 || l.InFlight != 1 {
		t.Fatalf("%d waiting, %d in flight; want 0 and 1 (the huge request)", l.Waiting, l.InFlight)
	}
	huge.respond(t, okResponse)
	eventually(t, "an empty ledger", func() (bool, string) { return ledgerEmpty(f.picker) })
}

func assert429(t *testing.T, what string, p *pending) {
	t.Helper()
	im := p.r.Immediate
	if p.err != nil || im == nil || im.GetStatus().GetCode() != 429 {
		t.Fatalf("%s: err %v, immediate %v; want a 429", what, p.err, im)
	}
	for _, h := range im.GetHeaders().GetSetHeaders() {
		if h.GetHeader().GetKey() == "retry-after" && string(h.GetHeader().GetRawValue()) != "" {
			return
		}
	}
	t.Errorf("%s: the 429 has no retry-after header: %v", what, im.GetHeaders())
}

// saturatedFlow is a flowFixture whose endpoint serves one request (fill)
// and holds another (held) behind it.
func saturatedFlow(t *testing.T) (f *fixture, fill, held *pending) {
	t.Helper()
	f = flowFixture(t, nil, fixtureOptions{})
	fill = f.send(t, bigRequest(1))
	routedOK(t, fill, "the first request")
	held = f.send(t, bigRequest(2))
	f.waitingIs(t, 1)
	return f, fill, held
}

func TestDisconnectWhileWaitingLeavesNothingBehind(t *testing.T) {
	f, fill, gone := saturatedFlow(t)
	gone.x.Cancel() // the client went away: Envoy resets the stream
	f.waitingIs(t, 0)
	if l := f.picker.Snapshot(); l.InFlight != 1 {
		t.Fatalf("%d in flight after the waiter left, want 1", l.InFlight)
	}
	next := f.send(t, bigRequest(3))
	f.waitingIs(t, 1)
	fill.respond(t, okResponse)
	routedOK(t, next, "the request after the one that left")
	next.respond(t, okResponse)
	eventually(t, "an empty ledger", func() (bool, string) { return ledgerEmpty(f.picker) })
}

func TestShutdownAnswersWaitingRequests503(t *testing.T) {
	f, fill, w := saturatedFlow(t)
	if n := f.picker.CloseQueue(); n != 1 {
		t.Fatalf("CloseQueue answered %d, want 1", n)
	}
	if !w.answered(5 * time.Second) {
		t.Fatal("the waiting request was not answered at shutdown")
	}
	if im := w.r.Immediate; w.err != nil || im == nil || im.GetStatus().GetCode() != 503 {
		t.Fatalf("at shutdown: err %v, immediate %v; want 503", w.err, im)
	}
	fill.respond(t, okResponse)
	eventually(t, "an empty ledger", func() (bool, string) { return ledgerEmpty(f.picker) })
}

// A request without a body (a GET of /v1/models, a probe through the
// gateway) is routed at once while every endpoint is saturated and others
// wait, as the upstream picker routes it, past admission; the waiting
// request keeps its place.
func TestABodilessRequestIsNotHeld(t *testing.T) {
	f, fill, held := saturatedFlow(t)
	models := f.send(t, envoy.Request{Headers: gatewayHeaders("GET", "/v1/models")})
	routedOK(t, models, "GET /v1/models")
	models.respond(t, response(200, `{"data":[]}`))
	if held.answered(50 * time.Millisecond) {
		t.Fatalf("the waiting request was answered by a bodiless request's end: %v %v", held.r.Immediate, held.err)
	}
	fill.respond(t, okResponse)
	routedOK(t, held, "the waiting request")
	held.respond(t, okResponse)
	eventually(t, "an empty ledger", func() (bool, string) { return ledgerEmpty(f.picker) })
}
