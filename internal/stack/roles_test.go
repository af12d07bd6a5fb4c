package stack

import (
	"context"
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"

	"github.com/tallyepp/tally/internal/pdsidecar"
)

// startRolePod starts a pod of role on a random loopback IP, as
// newTestPod does.
func startRolePod(t *testing.T, s *Stack, name, role string) *Pod {
	t.Helper()
	p := &Pod{Name: name, Role: role, stack: s}
	var err error
	for range 5 { // another test may hold the same address
		p.Addr = netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 202, byte(rand.IntN(256)), byte(1 + rand.IntN(254))}), 8000)
		if err = p.startSimulator(); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.pods = append(s.pods, p)
	s.mu.Unlock()
	return p
}

func TestDecodePodRunsTheSidecarInFrontOfItsSimulator(t *testing.T) {
	s := &Stack{
		opts:     Options{Model: DefaultModel, TimeScale: 10, DecoderPort: DefaultDecoderPort},
		servedBy: map[string]string{},
		http:     NewHTTPClient(),
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Error(err)
		}
	})
	pre := startRolePod(t, s, "sim-p", RolePrefill)
	dec := startRolePod(t, s, "sim-d", RoleDecode)

	req := Completion(DefaultModel, strings.Repeat("abcd", 800), 3, true) // 50 blocks
	req.Headers = map[string]string{pdsidecar.PrefillerHeader: pre.Addr.String()}
	if r := Send(context.Background(), s.HTTPClient(), dec.URL(), "pd-1", req); r.Err != nil {
		t.Fatalf("request through the decode pod's sidecar: %v", r.Err)
	}
	if got, pf := s.ServedBy("pd-1"), s.PrefilledBy("pd-1"); got != dec.Name || pf != pre.Name {
		t.Fatalf("served by %q, prefilled by %q; want %s and %s", got, pf, dec.Name, pre.Name)
	}
	ds, _ := dec.Stats()
	ps, _ := pre.Stats()
	if ds.PrefillTokens != 1 || ds.KVBlocksPulled != 50 || ps.PrefillTokens != 800 || ps.LeasesReleased != 1 {
		t.Fatalf("decode pod: %d prefill tokens, %d pulled; prefill pod: %d prefill tokens, %d released; want 1, 50, 800, 1",
			ds.PrefillTokens, ds.KVBlocksPulled, ps.PrefillTokens, ps.LeasesReleased)
	}

	// The decode leg's pull of the KV blocks is no request to the prefill
	// pod: it received the prefill leg alone.
	if n := pre.Served(); n != 1 {
		t.Fatalf("the prefill pod counts %d requests, want 1 (its prefill leg)", n)
	}

	// Without the header the sidecar passes the request through.
	plain := Completion(DefaultModel, "hello there", 2, false)
	if r := Send(context.Background(), s.HTTPClient(), dec.URL(), "pd-2", plain); r.Err != nil {
		t.Fatalf("plain request: %v", r.Err)
	}
	if ds, _ := dec.Stats(); ds.FinishedRequests != 2 {
		t.Fatalf("decode pod finished %d requests, want 2", ds.FinishedRequests)
	}
	// A reset simulator is still reached through the sidecar.
	if err := dec.ResetEngine(); err != nil {
		t.Fatal(err)
	}
	if r := Send(context.Background(), s.HTTPClient(), dec.URL(), "pd-3", plain); r.Err != nil {
		t.Fatalf("after ResetEngine: %v", r.Err)
	}
}

func TestRolesLabelPodsAndAreChecked(t *testing.T) {
	if l := podLabels(RoleDecode); l[RoleLabel] != RoleDecode || l["app"] != "sim" {
		t.Fatalf("labels of a decode pod: %v", l)
	}
	if l := podLabels(""); len(l) != len(podSelectorLabel) {
		t.Fatalf("labels of a pod without a role: %v; want the selector's alone", l)
	}
	o := Options{BinDir: "x", Pods: 2, Roles: []string{RolePrefill, "both"}}
	if err := o.setDefaults(); err == nil || !strings.Contains(err.Error(), "Roles[1]") {
		t.Fatalf("a role of \"both\": %v; want an error naming Roles[1]", err)
	}
	o = Options{BinDir: "x", Pods: 1, Roles: []string{RolePrefill, RoleDecode}}
	if err := o.setDefaults(); err == nil || !strings.Contains(err.Error(), "Roles") {
		t.Fatalf("more roles than pods: %v; want an error naming Roles", err)
	}
}

func TestClusterNamesAnInvalidRole(t *testing.T) {
	_, err := StartCluster(context.Background(), ClusterOptions{Pods: 2, Roles: []string{RoleDecode, "prefiller"}})
	if err == nil || !strings.Contains(err.Error(), "Roles[1]") || !strings.Contains(err.Error(), `"prefiller"`) {
		t.Fatalf("StartCluster with role %q: %v, want an error naming Roles[1] and the value", "prefiller", err)
	}
}
