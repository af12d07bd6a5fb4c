package picker

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/tallyepp/tally/api/v1alpha1"
)

// series gathers reg and returns the value of each series of family name,
// keyed by its labels' values joined with ",".
func series(t *testing.T, reg prometheus.Gatherer, name string) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			k := ""
			for i, l := range m.GetLabel() {
				if i > 0 {
					k += ","
				}
				k += l.GetValue()
			}
			out[k] = value(m)
		}
	}
	return out
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	}
	return -1
}

// wantSeries fails unless family name has exactly the series of want.
func wantSeries(t *testing.T, reg prometheus.Gatherer, when, name string, want map[string]float64) {
	t.Helper()
	got := series(t, reg, name)
	if len(got) != len(want) {
		t.Errorf("%s: %s = %v, want %v", when, name, got, want)
		return
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s: %s = %v, want %v", when, name, got, want)
			return
		}
	}
}

// The split decisions, the prefill legs placed on each prefill pod and
// those it holds now follow the picks, and the per-role gauges the ledger.
func TestSplitMetricsFollowThePicks(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	clock := newFakeClock()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	cfg.Disaggregation.NonCachedTokens = 16
	p := newPicker(t, 0, cfg, Options{Registerer: reg, Clock: clock})
	p.Replace(withRoles(RolePrefill, RolePrefill, RoleDecode, RoleDecode))
	a0, a1 := addr(0).String(), addr(1).String()

	wantSeries(t, reg, "before any pick", "tally_split_decisions_total",
		map[string]float64{"split": 0, "cached": 0, "short": 0, "no_prefill_pod": 0, "local_cheaper": 0, "gateway": 0})
	wantSeries(t, reg, "before any pick", "tally_prefill_legs_total", map[string]float64{})
	wantSeries(t, reg, "before any pick", "tally_role_endpoints", map[string]float64{"decode": 2, "prefill": 2})

	const n = 6
	var res []*Reservation
	legs := map[string]float64{}
	for i := range n {
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("metrics ", i), 4000), Stream: true})
		pre, ok := r.Prefiller()
		if !ok {
			t.Fatalf("pick %d, a cold 1,000-token prompt, is not split", i)
		}
		res = append(res, r)
		legs[pre.String()]++
	}
	// A short prompt is not split, and is counted as short.
	short := mustPick(t, p, Request{Model: model, Prompt: text("short", 40)})
	if _, ok := short.Prefiller(); ok {
		t.Fatal("a 10-token prompt was split")
	}
	if legs[a0] == 0 || legs[a1] == 0 {
		t.Fatalf("the scenario needs legs on both prefill pods: %v", legs)
	}
	wantSeries(t, reg, "after the picks", "tally_split_decisions_total",
		map[string]float64{"split": n, "cached": 0, "short": 1, "no_prefill_pod": 0, "local_cheaper": 0, "gateway": 0})
	wantSeries(t, reg, "after the picks", "tally_prefill_legs_total", legs)
	wantSeries(t, reg, "after the picks", "tally_endpoint_prefill_legs", legs)
	wantSeries(t, reg, "after the picks", "tally_role_queued_prefill_tokens",
		map[string]float64{"prefill": n * 1000, "decode": 10})
	wantSeries(t, reg, "after the picks", "tally_role_saturated_endpoints", map[string]float64{"decode": 0, "prefill": 0})

	// First bytes end the prefill parts: the legs held fall, those placed
	// stay counted.
	for _, r := range res {
		p.FirstByte(r)
	}
	wantSeries(t, reg, "after the first bytes", "tally_endpoint_prefill_legs", map[string]float64{a0: 0, a1: 0})
	wantSeries(t, reg, "after the first bytes", "tally_prefill_legs_total", legs)
	wantSeries(t, reg, "after the first bytes", "tally_role_queued_prefill_tokens", map[string]float64{"prefill": 0, "decode": 10})

	// A prefill pod that leaves the ledger loses its series once it has
	// been missing from two scrapes (one miss may be a pod added between
	// a scrape's snapshot and its count).
	for _, r := range append(res, short) {
		p.End(r, Outcome{})
	}
	p.Replace(withRoles(RolePrefill, RolePrefillDecode, RoleDecode, RoleDecode)[1:])
	clock.Advance(time.Duration(cfg.EndpointRetentionSeconds+1) * time.Second)
	p.sweep() // forgets the retained row of endpoint 0
	wantSeries(t, reg, "first scrape after endpoint 0 left", "tally_prefill_legs_total", map[string]float64{a1: legs[a1]})
	if got := len(p.metrics.split.legs); got != 2 {
		t.Errorf("after one scrape without endpoint 0: %d prefill pods counted, want 2 (it is forgotten at the second)", got)
	}
	wantSeries(t, reg, "second scrape", "tally_prefill_legs_total", map[string]float64{a1: legs[a1]})
	if got := len(p.metrics.split.legs); got != 1 {
		t.Errorf("after two scrapes without endpoint 0: %d prefill pods counted, want 1", got)
	}
	wantSeries(t, reg, "after the roles changed", "tally_role_endpoints", map[string]float64{"decode": 2, "prefill-decode": 1})
}

// Without disaggregation no split series is sent, however the pods are
// labelled; the per-role gauges are.
func TestSplitMetricsNeedDisaggregation(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	p := newPicker(t, 0, testConfig(), Options{Registerer: reg})
	p.Replace(withRoles(RolePrefill, RoleDecode, ""))
	r := mustPick(t, p, Request{Model: model, Prompt: text("off", 4000)})
	r.splitWhy = splitYes // as if place had decided: the configuration still rules
	p.countSplit(r)
	for _, name := range []string{"tally_split_decisions_total", "tally_prefill_legs_total", "tally_endpoint_prefill_legs"} {
		wantSeries(t, reg, "disaggregation off", name, map[string]float64{})
	}
	wantSeries(t, reg, "disaggregation off", "tally_role_endpoints", map[string]float64{"decode": 1, "prefill": 1, RoleUnlabelled: 1})
	q := series(t, reg, "tally_role_queued_prefill_tokens")
	if len(q) != 3 || q["prefill"] != 0 || q["decode"]+q[RoleUnlabelled] != 1000 {
		t.Errorf("disaggregation off: tally_role_queued_prefill_tokens = %v, want the 1,000 tokens on decode or unlabelled", q)
	}
}

// Each decision counts under its own label; an unset or unknown one is not
// counted.
func TestSplitDecisionSlots(t *testing.T) {
	seen := map[int]bool{}
	for _, d := range splitDecisions {
		i := d.slot()
		if i < 0 || seen[i] {
			t.Errorf("decision %q has slot %d (taken: %v)", d, i, seen[i])
		}
		seen[i] = true
	}
	for _, d := range []splitDecision{"", "maybe"} {
		if i := d.slot(); i != -1 {
			t.Errorf("decision %q has slot %d, want -1", d, i)
		}
	}
}

// With flow control, a prefill pod over its threshold counts as saturated
// under its role, and the pool's saturation (decode pods) does not move.
func TestRoleSaturation(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	cfg := testConfig()
	cfg.PrefillTokensPerSecond = 10_000
	cfg.Disaggregation.NonCachedTokens = 16
	cfg.FlowControl.Enabled = true
	p := newPicker(t, 0, v1alpha1.WithDefaults(cfg), Options{Registerer: reg, Clock: newFakeClock(), PoolName: "pool"})
	p.Replace(withRoles(RolePrefill, RolePrefill, RoleDecode, RoleDecode))
	// 3,000 tokens each: over the 2,500 a 250 ms threshold allows at
	// 10,000 tokens/s.
	for i := range 2 {
		r := enqueueNow(t, p, Request{Model: model, Prompt: text(fmt.Sprint("fill ", i), 12_000), Stream: true})
		if _, ok := r.Prefiller(); !ok {
			t.Fatalf("fill %d on an idle pool: not split", i)
		}
	}
	wantSeries(t, reg, "prefill pods full", "tally_role_saturated_endpoints", map[string]float64{"prefill": 2, "decode": 0})
	wantSeries(t, reg, "prefill pods full", "inference_extension_flow_control_pool_saturation", map[string]float64{"pool": 0})
	for _, s := range p.Snapshot().Endpoints {
		if want := s.Endpoint.Role == RolePrefill; s.Saturated != want {
			t.Errorf("%s (%s): saturated %v, want %v", s.Endpoint.Address, s.Endpoint.Role, s.Saturated, want)
		}
	}
}

// A snapshot works out a split request's prefill part ended by the
// prefiller's drain model without a drain: gone from the prefiller, as the
// next drain leaves it, not counted decoding there.
func TestSnapshotProjectsAnEndedPrefillLeg(t *testing.T) {
	clock := newFakeClock()
	p := pdPicker(t, clock)
	r, dest, pre := splitPick(t, p, "projected")
	if s := statsOf(p, pre); s.PrefillLegs != 1 {
		t.Errorf("at the pick: the prefiller holds %d legs, want 1", s.PrefillLegs)
	}
	// 1,000 tokens at 10,000 tokens/s: done in 100 ms by the model.
	clock.Advance(101 * time.Millisecond)
	wantRow(t, p, "past the modelled prefill, before a drain", pre, 0, 0, 0)
	wantRow(t, p, "past the modelled prefill, before a drain", dest, 1, 0, 1)
	if s := statsOf(p, pre); s.PrefillLegs != 0 {
		t.Errorf("past the modelled prefill: the prefiller holds %d legs, want 0", s.PrefillLegs)
	}
	if l := p.Snapshot(); l.InFlight != 1 {
		t.Errorf("past the modelled prefill: %d in flight in all, want 1 (the destination's)", l.InFlight)
	}
	p.sweep() // drains: the same as projected
	wantRow(t, p, "after a drain", pre, 0, 0, 0)
	p.End(r, Outcome{})
	assertLedgerEmpty(t, p)
}

// podAt names the pod of test endpoint a (endpoints).
func podAt(a netip.AddrPort) string { return fmt.Sprint("pod-", int(a.Addr().As4()[3])-2) }

// SnapshotWithReservations lists each reservation with where it is held,
// its prefill pod when split and whether that pod still holds its prefill.
func TestSnapshotListsReservations(t *testing.T) {
	clock := newFakeClock()
	p := pdPicker(t, clock)
	split, dest, pre := splitPick(t, p, "listed")
	clock.Advance(10 * time.Millisecond)
	local := mustPick(t, p, Request{Model: model, Prompt: text("local", 40)})

	find := func(l Ledger, at netip.AddrPort, prefiller netip.AddrPort) ReservationStats {
		t.Helper()
		for _, s := range l.Reservations {
			if s.Endpoint == at && s.Prefiller == prefiller {
				return s
			}
		}
		t.Fatalf("no reservation on %s prefilled by %v in %+v", at, prefiller, l.Reservations)
		return ReservationStats{}
	}
	l := p.SnapshotWithReservations()
	if len(l.Reservations) != 2 || l.ReservationsOmitted != 0 {
		t.Fatalf("%d reservations listed, %d omitted, want 2 and 0", len(l.Reservations), l.ReservationsOmitted)
	}
	if l.Reservations[0].Prefiller != pre {
		t.Errorf("the oldest pick is listed second: %+v", l.Reservations)
	}
	s := find(l, dest, pre)
	if !s.PrefillHeld || s.PrefillTokens != 1000 || !s.Decoding || s.PrefillerPod != podAt(pre) || s.Pod != podAt(dest) {
		t.Errorf("the split request, held: %+v", s)
	}
	if s.Age != 10*time.Millisecond {
		t.Errorf("the split request's age %v, want 10ms", s.Age)
	}
	lo := find(l, endpointOf(local), netip.AddrPort{})
	if lo.PrefillHeld || lo.Decoding || lo.PrefillTokens != 10 {
		t.Errorf("the request prefilled on its destination: %+v", lo)
	}
	if p.Snapshot().Reservations != nil {
		t.Error("Snapshot lists the reservations; only SnapshotWithReservations should")
	}

	// The prefill part ends by the model (no drain needed to show it),
	// then the local one's prefill too.
	clock.Advance(100 * time.Millisecond)
	l = p.SnapshotWithReservations()
	if s := find(l, dest, pre); s.PrefillHeld || s.PrefillTokens != 0 {
		t.Errorf("past the prefiller's modelled prefill: %+v, want the prefill part released", s)
	}
	if lo := find(l, endpointOf(local), netip.AddrPort{}); !lo.Decoding || lo.PrefillTokens != 0 {
		t.Errorf("past its modelled prefill: %+v, want decoding", lo)
	}

	// At most the limit is listed, and the rest counted.
	p.mu.Lock()
	list, omitted := p.l.reservations(p.now(), 1)
	p.mu.Unlock()
	if len(list) != 1 || omitted != 1 || list[0].Prefiller != pre {
		t.Errorf("limit 1: listed %+v, omitted %d; want the oldest and 1 omitted", list, omitted)
	}
	p.End(split, Outcome{})
	p.End(local, Outcome{})
	if l := p.SnapshotWithReservations(); len(l.Reservations) != 0 {
		t.Errorf("after the ends: %+v listed", l.Reservations)
	}
}
