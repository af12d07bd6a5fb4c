package picker

import (
	"fmt"
	"net/netip"
	"testing"
)

// withRoles returns test endpoints whose roles are roles, in order.
func withRoles(roles ...string) []Endpoint {
	eps := endpoints(len(roles))
	for i, r := range roles {
		eps[i].Role = r
	}
	return eps
}

// A prefill-only pod is never a request's destination: not from the whole
// pool, however idle it is, nor when a subset hint names it among others.
func TestPrefillOnlyPodsAreNeverDestinations(t *testing.T) {
	p := newPicker(t, 0, testConfig(), Options{})
	roles := withRoles(RolePrefill, RoleDecode, RolePrefill, RolePrefillDecode, "", "encode")
	p.Replace(roles)
	got := map[netip.AddrPort]int{}
	var res []*Reservation
	for i := range 60 {
		r := mustPick(t, p, Request{Model: model, Prompt: text(fmt.Sprint("roles ", i), 4000)})
		got[endpointOf(r)]++
		res = append(res, r)
	}
	for _, i := range []int{0, 2, 5} {
		if got[addr(i)] != 0 {
			t.Errorf("endpoint %d (role %q) is the destination of %d requests, want none", i, roles[i].Role, got[addr(i)])
		}
	}
	for _, i := range []int{1, 3, 4} {
		if got[addr(i)] == 0 {
			t.Errorf("decode-capable endpoint %d took no request of 60: %v", i, got)
		}
	}
	r, err := p.pick(Request{Model: model, Prompt: text("hint", 400), HasSubset: true, Subset: []netip.AddrPort{addr(0), addr(1)}})
	if err != nil {
		t.Fatalf("a hint naming a prefill pod and a decode pod: %v", err)
	}
	if endpointOf(r) != addr(1) {
		t.Errorf("a hint naming a prefill pod and a decode pod gives %s, want the decode pod %s", endpointOf(r), addr(1))
	}
	if only, err := p.pick(Request{Model: model, Prompt: text("hint", 400), HasSubset: true, Subset: []netip.AddrPort{addr(0)}}); err != ErrNoEndpoint {
		t.Errorf("a hint naming only a prefill pod gives %v, want ErrNoEndpoint", err)
		if only != nil {
			res = append(res, only)
		}
	}
	for _, r := range append(res, r) {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
}
