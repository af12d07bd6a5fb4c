package ngfshim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
)

// startReplicas serves n fake pickers on one port at n loopback IPs, as
// the pods of a picker Deployment, each answering with an endpoint of its
// own so that the answer says who answered.
func startReplicas(t *testing.T, n int) (ips []string, port string, pickers []*fakePicker) {
	t.Helper()
	for attempt := 0; attempt < 5 && len(ips) < n; attempt++ {
		ips, pickers = nil, nil
		first, err := net.Listen("tcp", "127.0.61.1:0")
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ = net.SplitHostPort(first.Addr().String())
		lns := []net.Listener{first}
		for i := 2; i <= n; i++ {
			ln, err := net.Listen("tcp", fmt.Sprintf("127.0.61.%d:%s", i, port))
			if err != nil {
				break // the port is taken at that IP: try another
			}
			lns = append(lns, ln)
		}
		if len(lns) < n {
			for _, ln := range lns {
				ln.Close()
			}
			continue
		}
		for i, ln := range lns {
			endpoint := fmt.Sprintf("10.0.0.%d:8000", i+1)
			f := &fakePicker{answer: func([]*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse { return routed(endpoint) }}
			srv := grpc.NewServer()
			extprocv3.RegisterExternalProcessorServer(srv, f)
			go srv.Serve(ln)
			t.Cleanup(srv.Stop)
			host, _, _ := net.SplitHostPort(ln.Addr().String())
			ips = append(ips, host)
			pickers = append(pickers, f)
		}
	}
	if len(ips) < n {
		t.Fatalf("no port free at %d loopback IPs", n)
	}
	return ips, port, pickers
}

func TestShimSpreadsStreamsOverEveryAddressOfThePickerHost(t *testing.T) {
	ips, port, pickers := startReplicas(t, 3)
	const service = "epp.inference.svc.cluster.local"
	// Rotated on each lookup, as DNS servers may answer.
	var lookups int
	shim := &Shim{Dial: Dialer(false), Resolve: func(_ context.Context, host string) ([]string, error) {
		if host != service {
			return nil, fmt.Errorf("no such host %q", host)
		}
		lookups++
		k := lookups % len(ips)
		return append(append([]string{}, ips[k:]...), ips[:k]...), nil
	}}
	count := map[string]int{}
	const requests = 9
	for range requests {
		r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1:54800/", strings.NewReader(`{"model":"m"}`))
		r.Header.Set(PickerHostHeader, service)
		r.Header.Set(PickerPortHeader, port)
		w := httptest.NewRecorder()
		shim.ServeHTTP(w, r)
		if w.Code != http.StatusOK {
			t.Fatalf("answer %d %q, want 200", w.Code, w.Body)
		}
		count[w.Header().Get(DestinationHeader)]++
	}
	for i, f := range pickers {
		if got := len(f.seen()); got != requests/len(pickers) {
			t.Errorf("replica at %s got %d streams, want %d (each in turn)", ips[i], got, requests/len(pickers))
		}
	}
	if len(count) != len(pickers) {
		t.Errorf("answers came from %v, want each of the %d replicas", count, len(pickers))
	}
}

func TestShimAnswers502WhenThePickerHostDoesNotResolve(t *testing.T) {
	shim := &Shim{Dial: Dialer(false), Resolve: func(context.Context, string) ([]string, error) {
		return nil, errors.New("no such host")
	}}
	r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1:54800/", strings.NewReader(`{}`))
	r.Header.Set(PickerHostHeader, "epp.missing")
	r.Header.Set(PickerPortHeader, "9002")
	w := httptest.NewRecorder()
	shim.ServeHTTP(w, r)
	if w.Code != http.StatusBadGateway || !strings.Contains(w.Body.String(), "epp.missing") {
		t.Fatalf("answer %d %q; want 502 naming the host", w.Code, w.Body)
	}
}

// startReplicasOnPorts serves n fake pickers at one IP on n ports, as the
// local stack runs a picker's replicas, each answering with an endpoint
// of its own.
func startReplicasOnPorts(t *testing.T, n int) (addrs []string, pickers []*fakePicker) {
	t.Helper()
	for i := range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		endpoint := fmt.Sprintf("10.0.0.%d:8000", i+1)
		f := &fakePicker{answer: func([]*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse { return routed(endpoint) }}
		srv := grpc.NewServer()
		extprocv3.RegisterExternalProcessorServer(srv, f)
		go srv.Serve(ln)
		t.Cleanup(srv.Stop)
		addrs = append(addrs, ln.Addr().String())
		pickers = append(pickers, f)
	}
	return addrs, pickers
}

func TestShimDialsTheResolvedPortInPlaceOfTheHeadersPort(t *testing.T) {
	addrs, pickers := startReplicasOnPorts(t, 3)
	const service = "tally-epp.e2e.svc.cluster.local"
	shim := &Shim{Dial: Dialer(false), Resolve: func(_ context.Context, host string) ([]string, error) {
		if host != service {
			return nil, fmt.Errorf("no such host %q", host)
		}
		return addrs, nil
	}}
	count := map[string]int{}
	const requests = 9
	for range requests {
		r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1:54800/", strings.NewReader(`{"model":"m"}`))
		r.Header.Set(PickerHostHeader, service)
		// No picker listens here: a shim that dialled X-EPP-Port would fail.
		r.Header.Set(PickerPortHeader, "1")
		w := httptest.NewRecorder()
		shim.ServeHTTP(w, r)
		if w.Code != http.StatusOK {
			t.Fatalf("answer %d %q, want 200", w.Code, w.Body)
		}
		count[w.Header().Get(DestinationHeader)]++
	}
	for i, f := range pickers {
		if got := len(f.seen()); got != requests/len(pickers) {
			t.Errorf("replica at %s got %d streams, want %d (each in turn)", addrs[i], got, requests/len(pickers))
		}
	}
	if len(count) != len(pickers) {
		t.Errorf("answers came from %v, want each of the %d replicas", count, len(pickers))
	}
}

func TestShimAnswers502NamingAResolvedAddressThatIsNoIP(t *testing.T) {
	shim := &Shim{Dial: Dialer(false), Resolve: func(context.Context, string) ([]string, error) {
		return []string{"epp-0:9002"}, nil
	}}
	r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1:54800/", strings.NewReader(`{}`))
	r.Header.Set(PickerHostHeader, "epp.svc")
	r.Header.Set(PickerPortHeader, "9002")
	w := httptest.NewRecorder()
	shim.ServeHTTP(w, r)
	if w.Code != http.StatusBadGateway || !strings.Contains(w.Body.String(), "epp-0:9002") {
		t.Fatalf("answer %d %q; want 502 naming the address", w.Code, w.Body)
	}
}
