package main

import (
	"context"

	"encoding/json"
	"net/http/httptest"
	"net/netip"
	"testing"

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
