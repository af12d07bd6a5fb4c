package debugledger

import (
	"encoding/json"
	"net/netip"
	"slices"
	"testing"
)

// A document as a picker over a prefill/decode pool serves it: two prefill
// pods and a decode pod, one split request whose prefill part is still
// held, one whose part was released, and one prefilled on its destination.
const pdDocument = `{
  "inFlight": 4, "prefillTokens": 1000, "loraLoadSeconds": 0.2, "workWeight": 1,
  "endpoints": [
    {"pod": "prefill-0", "endpoint": "10.0.0.1:8000", "role": "prefill", "inFlight": 1, "prefillTokens": 1000, "decoding": 0, "prefillLegs": 1, "saturated": true},
    {"pod": "prefill-1", "endpoint": "10.0.0.2:8000", "role": "prefill", "inFlight": 0, "prefillTokens": 0, "decoding": 0, "prefillLegs": 0, "saturated": false},
    {"pod": "decode-0", "endpoint": "10.0.0.3:8000", "role": "decode", "inFlight": 3, "prefillTokens": 10, "decoding": 2, "prefillLegs": 0, "saturated": false}
  ],
  "retained": [],
  "roles": [
    {"role": "decode", "endpoints": 1, "saturated": 0, "inFlight": 3, "decoding": 2, "prefillTokens": 10, "prefillLegs": 0},
    {"role": "prefill", "endpoints": 2, "saturated": 1, "inFlight": 1, "decoding": 0, "prefillTokens": 1000, "prefillLegs": 1}
  ],
  "reservations": [
    {"endpoint": "10.0.0.3:8000", "pod": "decode-0", "prefiller": "10.0.0.1:8000", "prefillerPod": "prefill-0", "prefillHeld": true, "prefillTokens": 1000, "decoding": true, "detached": false, "promptTokens": 1000, "cachedTokens": 0, "ageSeconds": 0.01},
    {"endpoint": "10.0.0.3:8000", "pod": "decode-0", "prefiller": "10.0.0.2:8000", "prefillerPod": "prefill-1", "prefillHeld": false, "prefillTokens": 0, "decoding": true, "detached": false, "promptTokens": 1000, "cachedTokens": 0, "ageSeconds": 0.5},
    {"endpoint": "10.0.0.3:8000", "pod": "decode-0", "prefillHeld": false, "prefillTokens": 10, "decoding": false, "detached": false, "promptTokens": 10, "cachedTokens": 0, "ageSeconds": 0.001}
  ]
}`

// The names operators and scripts read stay what they are: a document
// written with them decodes into these types, and these types write them.
func TestDisaggregationFieldsKeepTheirNames(t *testing.T) {
	var l Ledger
	if err := json.Unmarshal([]byte(pdDocument), &l); err != nil {
		t.Fatal(err)
	}
	if e := l.Endpoints[0]; e.Role != "prefill" || e.PrefillLegs != 1 || !e.Saturated {
		t.Errorf("endpoint 0 = %+v, want role prefill, 1 prefill leg, saturated", e)
	}
	r := l.Reservations[0]
	if r.Prefiller != "10.0.0.1:8000" || r.PrefillerPod != "prefill-0" || !r.PrefillHeld || r.PrefillTokens != 1000 || !r.Decoding || r.AgeSeconds != 0.01 {
		t.Errorf("reservation 0 = %+v", r)
	}
	if r := l.Reservations[2]; r.Prefiller != "" || r.PrefillHeld {
		t.Errorf("an unsplit reservation = %+v, want no prefiller", r)
	}

	// Written back, the same keys come out, and the prefiller's keys are
	// left out of an unsplit reservation.
	out, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	var raw struct {
		Roles        []map[string]any `json:"roles"`
		Reservations []map[string]any `json:"reservations"`
		Endpoints    []map[string]any `json:"endpoints"`
	}
	if err := json.Unmarshal(out, &raw); err != nil {
		t.Fatal(err)
	}
	keys := func(m map[string]any) []string {
		var k []string
		for key := range m {
			k = append(k, key)
		}
		slices.Sort(k)
		return k
	}
	want := map[string][]string{
		"role":                {"decoding", "endpoints", "inFlight", "prefillLegs", "prefillTokens", "role", "saturated"},
		"split reservation":   {"ageSeconds", "cachedTokens", "decoding", "detached", "endpoint", "pod", "prefillHeld", "prefillTokens", "prefiller", "prefillerPod", "promptTokens"},
		"local reservation":   {"ageSeconds", "cachedTokens", "decoding", "detached", "endpoint", "pod", "prefillHeld", "prefillTokens", "promptTokens"},
		"endpoint (P/D part)": {"prefillLegs", "role", "saturated"},
	}
	for what, got := range map[string][]string{
		"role": keys(raw.Roles[0]), "split reservation": keys(raw.Reservations[0]), "local reservation": keys(raw.Reservations[2]),
	} {
		if !slices.Equal(got, want[what]) {
			t.Errorf("%s keys %v, want %v", what, got, want[what])
		}
	}
	for _, k := range want["endpoint (P/D part)"] {
		if _, ok := raw.Endpoints[1][k]; !ok {
			t.Errorf("an endpoint is written without %q (even at its zero value): %v", k, keys(raw.Endpoints[1]))
		}
	}
}

func TestRoleOfAndPrefillsHeldOn(t *testing.T) {
	var l Ledger
	if err := json.Unmarshal([]byte(pdDocument), &l); err != nil {
		t.Fatal(err)
	}
	if r, ok := l.RoleOf("prefill"); !ok || r.Endpoints != 2 || r.Saturated != 1 || r.PrefillLegs != 1 {
		t.Errorf("RoleOf(prefill) = %+v, %v", r, ok)
	}
	if r, ok := l.RoleOf("prefill-decode"); ok {
		t.Errorf("RoleOf(prefill-decode) = %+v in a pool without one", r)
	}
	for addr, want := range map[string]int{"10.0.0.1:8000": 1, "10.0.0.2:8000": 0, "10.0.0.3:8000": 0} {
		if got := l.PrefillsHeldOn(netip.MustParseAddrPort(addr)); got != want {
			t.Errorf("PrefillsHeldOn(%s) = %d, want %d", addr, got, want)
		}
	}
	// An older picker's document, without the fields, decodes to none.
	var old Ledger
	if err := json.Unmarshal([]byte(`{"inFlight": 0, "endpoints": [{"pod": "a", "endpoint": "10.0.0.1:8000"}]}`), &old); err != nil {
		t.Fatal(err)
	}
	if _, ok := old.RoleOf("unlabelled"); ok || old.PrefillsHeldOn(netip.MustParseAddrPort("10.0.0.1:8000")) != 0 {
		t.Errorf("an older document: roles %v, reservations %v", old.Roles, old.Reservations)
	}
}
