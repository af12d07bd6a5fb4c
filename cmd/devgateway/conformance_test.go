package main

import (
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/go-logr/logr/testr"
	"google.golang.org/grpc"
	"sigs.k8s.io/gateway-api-inference-extension/conformance/utils/headers"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
)

// conformancePool is what the conformance suite deploys, played on loopback:
// model servers on their own IPs (one serving two data-parallel ranks), the
// real picker with its conformance hooks, and the dev gateway in front.
type conformancePool struct {
	gateway string
	// servers maps each endpoint "ip:port" to its model server.
	servers map[string]*modelServer
}

// modelServer serves on an endpoint's own address, as a pod serves on its
// IP, and says which endpoint it is.
type modelServer struct{ requests atomic.Int32 }

func startConformancePool(t *testing.T, hooks bool, endpoints ...string) *conformancePool {
	t.Helper()
	pool := &conformancePool{servers: map[string]*modelServer{}}
	var eps []picker.Endpoint
	for _, ep := range endpoints {
		ln, err := net.Listen("tcp", ep)
		if err != nil {
			t.Skipf("cannot listen on %s (loopback addresses beyond 127.0.0.1 are needed): %v", ep, err)
		}
		u := &modelServer{}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			u.requests.Add(1)
			_, _ = io.WriteString(w, "served by "+ep)
		})}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { _ = srv.Close() })
		pool.servers[ep] = u
		addr := netip.MustParseAddrPort(ep)
		eps = append(eps, picker.Endpoint{Pod: "pod-" + addr.Addr().String(), Address: addr})
	}

	pick := picker.New(v1alpha1.Default(), picker.Options{Log: testr.New(t)})
	pick.Replace(eps)
	srv := grpc.NewServer()
	extproc.NewServer(pick, extproc.Options{Log: testr.New(t), ConformanceTestHooks: hooks}).Register(srv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	pool.gateway = startGateway(t, &Gateway{Picker: pickerClient(t, ln.Addr().String())})
	return pool
}

// post sends the suite's request through the gateway, with the selection
// header when selection is not empty, and returns the response.
func (c *conformancePool) post(t *testing.T, selection string) (body, served string) {
	t.Helper()
	// The suite's own request: a route that is no OpenAI path, a
	// completions body.
	req, err := http.NewRequest(http.MethodPost, c.gateway+"/primary-gateway-test",
		strings.NewReader(`{"model": "conformance-fake-model", "prompt": "Write as if you were a critic: San Francisco"}`))
	if err != nil {
		t.Fatal(err)
	}
	if selection != "" {
		req.Header.Set(headers.HeaderTestEppEndPointSelectionKey, selection)
	}
	resp, err := newClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	return string(got), resp.Header.Get(headers.ConformanceTestResultHeader)
}

// TestConformanceHooks plays the suite's GatewayFollowingEPPRouting,
// GatewayFollowingEPPRoutingWithDataParallelism and
// GatewayDestinationEndpointServed expectations against the real picker,
// with the suite's own header names.
func TestConformanceHooks(t *testing.T) {
	// The names the picker answers to are the suite's.
	if headers.HeaderTestEppEndPointSelectionKey != "test-epp-endpoint-selection" ||
		headers.ConformanceTestResultHeader != "x-conformance-test-served-endpoint" {
		t.Fatalf("the conformance suite renamed its headers: %q, %q", headers.HeaderTestEppEndPointSelectionKey, headers.ConformanceTestResultHeader)
	}
	const (
		pod0  = "127.0.0.71:3000"
		pod1a = "127.0.0.72:3000"
		pod1b = "127.0.0.72:3002" // a second data-parallel rank of the same pod
		pod2  = "127.0.0.73:3000"
	)
	c := startConformancePool(t, true, pod0, pod1a, pod1b, pod2)
	for _, tc := range []struct {
		name      string
		selection string
		want      []string // the endpoints that may serve
	}{
		{"a single pod by IP", "127.0.0.73", []string{pod2}},
		{"two pods by IP", "127.0.0.71,127.0.0.73", []string{pod0, pod2}},
		{"every rank of a pod by IP", "127.0.0.72", []string{pod1a, pod1b}},
		{"one rank by ip:port", "127.0.0.72:3002", []string{pod1b}},
		{"a pod by IP and a fixed rank", "127.0.0.71, 127.0.0.72:3000", []string{pod0, pod1a}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reached := map[string]bool{}
			for range 12 {
				body, served := c.post(t, tc.selection)
				if !slices.Contains(tc.want, served) {
					t.Fatalf("%s = %q, want one of %v", headers.ConformanceTestResultHeader, served, tc.want)
				}
				if body != "served by "+served {
					t.Fatalf("the response %q does not come from %s, the endpoint the header names", body, served)
				}
				reached[served] = true
			}
			if len(tc.want) > 1 && len(reached) < 2 {
				t.Logf("only %v reached of %v: the picker balances by load, nothing forces a spread", reached, tc.want)
			}
		})
	}

	// Without the header the pool is routed as usual, and the served
	// endpoint is still reported.
	if _, served := c.post(t, ""); c.servers[served] == nil {
		t.Errorf("without a selection: served %q, not an endpoint of the pool", served)
	}
}

func TestConformanceHooksAreOffByDefault(t *testing.T) {
	const pod0, pod1 = "127.0.0.74:3000", "127.0.0.75:3000"
	c := startConformancePool(t, false, pod0, pod1)
	// Each request finds the pool idle, so the picker chooses between the
	// two at random: none of 40 requests goes to pod0 once in 2^40 runs
	// (of 8, once in 256: a clean-clone CI run failed so).
	for range 40 {
		if _, served := c.post(t, "127.0.0.75"); served != "" {
			t.Fatalf("hooks off: %s = %q, want no such header", headers.ConformanceTestResultHeader, served)
		}
	}
	// The header chose nothing: both endpoints take traffic.
	if c.servers[pod0].requests.Load() == 0 {
		t.Errorf("hooks off: the selection header steered every request to %s", pod1)
	}
}
