package routesim

import (
	"github.com/tallyepp/tally/internal/testtier"

	"fmt"
	"reflect"
	"testing"

	"github.com/tallyepp/tally/internal/modelsim/engine"
)

// holdChecker wraps the tally-flow policy and checks, at every call the
// simulation makes, that no request is on an engine while its ticket says
// it waits, that the picker's queue is exactly the requests held, and that
// every request ends once.
type holdChecker struct {
	*tallyFlow
	s     *sim
	t     *testing.T
	fails int
	// Calls per request.
	firstBytes, dones, admits, left []int
}

func newHoldChecker(t *testing.T, w *Workload) (*holdChecker, *sim) {
	s, err := w.newSim()
	if err != nil {
		t.Fatal(err)
	}
	pol, err := newPolicy(TallyFlow, w.cfg, &s.now, w.texts, nil)
	if err != nil {
		t.Fatal(err)
	}
	n := w.Len()
	return &holdChecker{tallyFlow: pol.(*tallyFlow), s: s, t: t,
		firstBytes: make([]int, n), dones: make([]int, n), admits: make([]int, n), left: make([]int, n)}, s
}

// check is the invariant between the picker's queue and the engines.
func (h *holdChecker) check(when string) {
	if h.fails > 5 {
		return
	}
	fail := func(format string, args ...any) {
		h.fails++
		h.t.Errorf("at %v, %s: %s", h.s.now, when, fmt.Sprintf(format, args...))
	}
	waiting := 0
	for _, w := range h.waiting {
		if _, done, _ := w.t.Result(); done {
			continue // placed or refused by a cycle; the simulation collects it next
		}
		waiting++
		if o := h.s.res.Outcomes[w.i]; o.Engine >= 0 || o.Refused != "" {
			fail("request %d is on engine %d (refused %q) while the picker says it waits", w.i, o.Engine, o.Refused)
		}
	}
	if got := h.p.Snapshot().Waiting; got != waiting {
		fail("the picker holds %d requests, the policy's tickets say %d", got, waiting)
	}
}

func (h *holdChecker) admit(i int, j *job) (admission, error) {
	h.admits[i]++
	a, err := h.tallyFlow.admit(i, j)
	h.check(fmt.Sprintf("admitting %d", i))
	return a, err
}

func (h *holdChecker) dispatched(dst []admission) ([]admission, error) {
	n := len(dst)
	dst, err := h.tallyFlow.dispatched(dst)
	for _, a := range dst[n:] {
		h.left[a.i]++
		if o := h.s.res.Outcomes[a.i]; !o.Held || o.Engine >= 0 {
			h.t.Errorf("request %d left the queue, but it was not held (%+v)", a.i, o)
		}
	}
	return dst, err
}

func (h *holdChecker) firstByte(i int) {
	h.firstBytes[i]++
	h.tallyFlow.firstByte(i)
	h.check(fmt.Sprintf("first byte of %d", i))
}

func (h *holdChecker) done(i, promptTokens, cachedTokens int) {
	h.dones[i]++
	h.tallyFlow.done(i, promptTokens, cachedTokens)
	h.check(fmt.Sprintf("release of %d", i))
}

func (h *holdChecker) observe(stats []engine.Stats) {
	h.tallyFlow.observe(stats)
	h.check("a scrape")
}

func (h *holdChecker) dispatch() {
	h.tallyFlow.dispatch()
	h.check("a dispatch cycle")
}

// With flow control on, under load: a request reaches an engine only once
// the picker placed it, at the instant it placed it; every request ends
// exactly once, placed (one first byte, one release) or refused (neither);
// and the run is the same twice.
func TestFlowControlHoldsRequestsOffTheEngines(t *testing.T) {
	w, err := Prepare(loadSample(t, 160), Config{Engines: 3, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 8, NonStreaming: 0.2, Bypass: 0.1, Seed: 3,
		Priorities: []PriorityShare{{10, 0.2}, {-1, 0.3}}, FlowWeights: []float64{3, 1}})
	if err != nil {
		t.Fatal(err)
	}
	h, s := newHoldChecker(t, w)
	res, err := s.runWith(h)
	if err != nil {
		t.Fatal(err)
	}
	bounds := w.Bounds()
	var held, refused, placed int
	for i, o := range res.Outcomes {
		j := &w.jobs[i]
		switch {
		case o.Bypass:
			if h.admits[i] != 0 || o.Engine < 0 {
				t.Errorf("request %d bypasses the policy but was admitted %d times, engine %d", i, h.admits[i], o.Engine)
			}
			continue
		case h.admits[i] != 1:
			t.Errorf("request %d admitted %d times", i, h.admits[i])
		}
		if o.Held {
			held++
			if h.left[i] != 1 {
				t.Errorf("held request %d left the queue %d times", i, h.left[i])
			}
		}
		if o.Refused != "" {
			refused++
			if o.Engine >= 0 || h.firstBytes[i] != 0 || h.dones[i] != 0 || o.E2E != 0 {
				t.Errorf("refused request %d (%s) reached engine %d: %d first bytes, %d releases", i, o.Refused, o.Engine, h.firstBytes[i], h.dones[i])
			}
			if o.Refused == RefusedShed && o.Priority >= 0 {
				t.Errorf("request %d of priority %d was shed", i, o.Priority)
			}
			continue
		}
		placed++
		if o.Engine < 0 || h.firstBytes[i] != 1 || h.dones[i] != 1 {
			t.Errorf("placed request %d: engine %d, %d first bytes, %d releases; want one each", i, o.Engine, h.firstBytes[i], h.dones[i])
		}
		if o.Start != j.arrival+o.Wait || o.Wait < 0 || o.Held != (o.Wait > 0 || h.left[i] > 0) {
			t.Errorf("request %d arrived %v, started %v after waiting %v (held %v)", i, j.arrival, o.Start, o.Wait, o.Held)
		}
		// Not its bound past the wait: a request held while later ones
		// went first may find the prefix they computed.
		if o.TTFT <= o.Wait || o.TTFT < bounds[i].TTFT || o.E2E < o.TTFT {
			t.Errorf("request %d: TTFT %v, E2E %v; its wait %v, its bound %v", i, o.TTFT, o.E2E, o.Wait, bounds[i].TTFT)
		}
	}
	if held == 0 || refused == 0 || placed == 0 {
		t.Fatalf("held %d, refused %d, placed %d: the load should make each happen", held, refused, placed)
	}
	if l := h.p.Snapshot(); l.InFlight != 0 || l.Waiting != 0 {
		t.Errorf("after the run the picker holds %d requests and %d wait", l.InFlight, l.Waiting)
	}
	s2 := Summarize(res)
	if s2.Refused.Total() != refused || s2.Held != held {
		t.Errorf("summary: %d refused, %d held; the outcomes say %d, %d", s2.Refused.Total(), s2.Held, refused, held)
	}
	again, err := w.Run(TallyFlow)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(res.Outcomes, again.Outcomes) {
		t.Error("two runs of one workload with flow control differ")
	}
}

// Overloaded, with two priorities that both wait: the critical band waits
// less than the standard one, and fairness shares the dispatches between
// two backlogged flows, one sending ten times the other.
func TestFlowControlServesPriorityThenFlowsInTurn(t *testing.T) {
	testtier.SkipIfShort(t, "a simulated trace with priorities and flows (about 4 s with -race)")
	reqs := loadSample(t, 200)
	w, err := Prepare(reqs, Config{Engines: 4, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 10, Seed: 1,
		Priorities: []PriorityShare{{10, 0.2}}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := w.Run(TallyFlow)
	if err != nil {
		t.Fatal(err)
	}
	s := Summarize(res)
	if len(s.Bands) != 2 || s.Bands[0].Priority != 10 || s.Bands[1].Priority != 0 {
		t.Fatalf("bands %+v, want 10 then 0", s.Bands)
	}
	crit, std := s.Bands[0], s.Bands[1]
	if crit.Held == 0 || std.Held == 0 || crit.Wait.Mean >= std.Wait.Mean {
		t.Errorf("critical: %d held, mean wait %v; standard: %d held, mean wait %v; want both held, the critical band less long",
			crit.Held, crit.Wait.Mean, std.Held, std.Wait.Mean)
	}

	w, err = Prepare(reqs, Config{Engines: 4, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 60, Seed: 1, FlowWeights: []float64{10, 1}})
	if err != nil {
		t.Fatal(err)
	}
	if res, err = w.Run(TallyFlow); err != nil {
		t.Fatal(err)
	}
	flows := Summarize(res).Flows
	if len(flows) != 2 || flows[0].Requests < 5*flows[1].Requests {
		t.Fatalf("flows %+v: want two, the first sending far more", flows)
	}
	for _, f := range flows {
		if f.Contended < 5 || f.Share < 0.4 {
			t.Errorf("%s: %d of the dispatches while both flows waited (%.0f%%), want at least 40%%", f.ID, f.Contended, 100*f.Share)
		}
	}
}
