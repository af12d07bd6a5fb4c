package main

import (
	"context"

	"encoding/json"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/debugledger"
)

func TestDebugLedgerIsOneSnapshotWithRetainedRows(t *testing.T) {
	p := picker.New(v1alpha1.Default(), picker.Options{})
	a := picker.Endpoint{Pod: "a", UID: "uid-a", Address: netip.MustParseAddrPort("10.0.0.1:8000")}
	b := picker.Endpoint{Pod: "b", UID: "uid-b", Address: netip.MustParseAddrPort("10.0.0.2:8000")}
	p.Replace([]picker.Endpoint{a, b})
	for _, ep := range []picker.Endpoint{a, b} {
		if _, err := p.Admit(context.Background(), picker.Request{Model: "m", Prompt: make([]byte, 4000), Subset: []netip.AddrPort{ep.Address}, HasSubset: true}); err != nil {
			t.Fatal(err)
		}
	}
	p.Replace([]picker.Endpoint{b}) // a turns NotReady with its request in flight

	rec := httptest.NewRecorder()
	ledgerHandler(p, nil).ServeHTTP(rec, httptest.NewRequest("GET", "/debug/ledger", nil))
	var got debugledger.Ledger
	if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
		t.Fatalf("decoding %s: %v", rec.Body, err)
	}
	if len(got.Endpoints) != 1 || got.Endpoints[0].UID != "uid-b" || len(got.Retained) != 1 || got.Retained[0].Pod != "a" {
		t.Fatalf("ledger = %+v, want b current and a retained", got)
	}
	sum := got.Endpoints[0].InFlight + got.Retained[0].InFlight
	if got.InFlight != 2 || sum != got.InFlight {
		t.Errorf("totals %d in flight, rows sum to %d; want both 2", got.InFlight, sum)
	}
}

// Over a prefill/decode pool the document shows each endpoint's role, the
// roles' sums, and each reservation's prefill pod while it holds the
// prefill part, and after it no longer does.
func TestDebugLedgerShowsPrefillDecodeSplits(t *testing.T) {
	cfg := v1alpha1.Default()
	cfg.Disaggregation.NonCachedTokens = 16
	// A clock that stands still: the drain model computes nothing
	// between the pick and the reads.
	p := picker.New(cfg, picker.Options{Clock: clocktesting.NewFakeClock(time.Unix(0, 0))})
	pods := []picker.Endpoint{
		{Pod: "prefill-0", Role: picker.RolePrefill, Address: netip.MustParseAddrPort("10.0.0.1:8000")},
		{Pod: "decode-0", Role: picker.RoleDecode, Address: netip.MustParseAddrPort("10.0.0.2:8000")},
		{Pod: "plain-0", Address: netip.MustParseAddrPort("10.0.0.3:8000")},
	}
	p.Replace(pods)
	prompt := make([]byte, 8000) // 2,000 tokens, none cached
	for i := range prompt {
		prompt[i] = byte('a' + i%26)
	}
	split, err := p.Admit(context.Background(), picker.Request{Model: "m", Prompt: prompt, Stream: true,
		Subset: []netip.AddrPort{pods[1].Address}, HasSubset: true})
	if err != nil {
		t.Fatal(err)
	}
	if pre, ok := split.Prefiller(); !ok || pre != pods[0].Address {
		t.Fatalf("a cold 2,000-token prompt on the decode pod: prefiller %v, %v; want the prefill pod", pre, ok)
	}
	get := func() debugledger.Ledger {
		t.Helper()
		rec := httptest.NewRecorder()
		ledgerHandler(p, nil).ServeHTTP(rec, httptest.NewRequest("GET", "/debug/ledger", nil))
		var got debugledger.Ledger
		if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
			t.Fatalf("decoding %s: %v", rec.Body, err)
		}
		return got
	}

	got := get()
	roles := map[string]string{}
	for _, e := range got.Endpoints {
		roles[e.Pod] = e.Role
	}
	if roles["prefill-0"] != "prefill" || roles["decode-0"] != "decode" || roles["plain-0"] != "" || len(roles) != 3 {
		t.Errorf("roles %v, want prefill-0 prefill, decode-0 decode, plain-0 unlabelled", roles)
	}
	if r, ok := got.RoleOf("prefill"); !ok || r.Endpoints != 1 || r.PrefillLegs != 1 || r.InFlight != 1 || r.PrefillTokens != 2000 {
		t.Errorf("the prefill role = %+v, %v; want its one pod holding the one prefill leg of 2,000 tokens", r, ok)
	}
	if r, ok := got.RoleOf("decode"); !ok || r.Endpoints != 1 || r.Decoding != 1 || r.PrefillTokens != 0 {
		t.Errorf("the decode role = %+v, %v; want its pod decoding the split request", r, ok)
	}
	if r, ok := got.RoleOf("unlabelled"); !ok || r.Endpoints != 1 || r.InFlight != 0 {
		t.Errorf("the unlabelled role = %+v, %v", r, ok)
	}
	if len(got.Reservations) != 1 {
		t.Fatalf("reservations %+v, want the split one", got.Reservations)
	}
	r := got.Reservations[0]
	if r.Endpoint != "10.0.0.2:8000" || r.Pod != "decode-0" || r.Prefiller != "10.0.0.1:8000" || r.PrefillerPod != "prefill-0" ||
		!r.PrefillHeld || r.PrefillTokens != 2000 || !r.Decoding {
		t.Errorf("the split reservation = %+v, want on decode-0, prefilled by prefill-0, its part held", r)
	}
	if got.PrefillsHeldOn(pods[0].Address) != 1 {
		t.Errorf("prefill parts held on prefill-0: %d, want 1", got.PrefillsHeldOn(pods[0].Address))
	}

	p.FirstByte(split) // the decode pod's first byte ends the prefill part
	got = get()
	if r := got.Reservations[0]; r.PrefillHeld || r.PrefillTokens != 0 || r.Prefiller != "10.0.0.1:8000" {
		t.Errorf("after the first byte: %+v, want its prefiller named and its part released", r)
	}
	if r, _ := got.RoleOf("prefill"); r.PrefillLegs != 0 || r.InFlight != 0 {
		t.Errorf("after the first byte, the prefill role = %+v, want nothing held", r)
	}
	p.End(split, picker.Outcome{})
	if got := get(); len(got.Reservations) != 0 || !got.Idle() {
		t.Errorf("after the end: %+v, want idle with no reservation", got)
	}
}
