package nginx

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/internal/ngfshim"
	"github.com/tallyepp/tally/internal/testtier"
)

// These tests run the rendered configuration in a real NGINX, with the shim
// in process, a fake picker and a fake pod, to check the NGINX side alone:
// what reaches the pod, the failure modes, and unbuffered streams.

// picker is a fake endpoint picker: it routes every request to endpoint,
// except that it answers 400 to a body containing "unterminated".
type picker struct {
	extprocv3.UnimplementedExternalProcessorServer
	endpoint string

	mu      sync.Mutex
	headers [][]*corev3.HeaderValue
}

func (p *picker) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	var body []byte
	for {
		req, err := srv.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if h := req.GetRequestHeaders(); h != nil {
			p.mu.Lock()
			p.headers = append(p.headers, h.GetHeaders().GetHeaders())
			p.mu.Unlock()
		}
		body = append(body, req.GetRequestBody().GetBody()...)
	}
	if strings.Contains(string(body), "unterminated") {
		return srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{Status: &typev3.HttpStatus{Code: typev3.StatusCode_BadRequest}, Body: []byte(`{"error":"malformed JSON"}`)},
		}})
	}
	return srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
		Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
			{Header: &corev3.HeaderValue{Key: ngfshim.DestinationHeader, RawValue: []byte(p.endpoint)}},
		}}},
	}}})
}

// pod is a fake model server. A request to /sse gets one event, then the
// rest once release is closed.
type pod struct {
	release chan struct{}

	mu       sync.Mutex
	requests []podRequest
}

type podRequest struct {
	uri, body string
	header    http.Header
}

func (p *pod) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	p.mu.Lock()
	p.requests = append(p.requests, podRequest{uri: r.RequestURI, body: string(body), header: r.Header.Clone()})
	p.mu.Unlock()
	if r.URL.Path != "/sse" {
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"served":true}`))
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Write([]byte("data: first\n\n"))
	w.(http.Flusher).Flush()
	select {
	case <-p.release:
	case <-r.Context().Done():
		return
	}
	w.Write([]byte("data: [DONE]\n\n"))
}

func (p *picker) seen() [][]*corev3.HeaderValue {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([][]*corev3.HeaderValue(nil), p.headers...)
}

func (p *pod) received() []podRequest {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]podRequest(nil), p.requests...)
}

type rig struct {
	url    string
	dir    string
	picker *picker
	pod    *pod
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

func addrOf(ln net.Listener) netip.AddrPort {
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// startRig starts the fake pod, the fake picker, the shim and NGINX with
// the given failure mode. The picker is down when pickerDown is set.
func startRig(t *testing.T, mode infv1.EndpointPickerFailureMode, pickerDown bool) *rig {
	t.Helper()
	return startRigNamingThePicker(t, mode, pickerDown, "")
}

// startRigNamingThePicker is startRig with NGINX naming the picker by
// pickerHost (when set), which the shim resolves to the fake picker.
func startRigNamingThePicker(t *testing.T, mode infv1.EndpointPickerFailureMode, pickerDown bool, pickerHost string) *rig {
	t.Helper()
	testtier.SkipIfShort(t, "NGINX with its NJS module")
	bin, jsModule, err := Find()
	if err != nil {
		if Optional() {
			t.Skipf("NGINX is not installed, and $%s=1 allows skipping: %v", OptionalEnv, err)
		}
		t.Fatalf("these tests need NGINX with its NJS module (set $%s=1 to skip them without it): %v", OptionalEnv, err)
	}

	podLn := listen(t)
	p := &pod{release: make(chan struct{})}
	podSrv := &http.Server{Handler: p}
	go podSrv.Serve(podLn)
	t.Cleanup(func() { podSrv.Close() })

	pickerLn := listen(t)
	pk := &picker{endpoint: addrOf(podLn).String()}
	pickerAddr := addrOf(pickerLn)
	if pickerDown {
		pickerLn.Close()
	} else {
		g := grpc.NewServer()
		extprocv3.RegisterExternalProcessorServer(g, pk)
		go g.Serve(pickerLn)
		t.Cleanup(g.Stop)
	}

	shim := httptest.NewServer(&ngfshim.Shim{Dial: ngfshim.Dialer(false), Resolve: func(_ context.Context, host string) ([]string, error) {
		if host != pickerHost {
			return nil, fmt.Errorf("no such host %q", host)
		}
		return []string{pickerAddr.String()}, nil
	}})
	t.Cleanup(shim.Close)

	nginxLn := listen(t)
	nginxAddr := addrOf(nginxLn)
	nginxLn.Close() // NGINX binds it

	dir := t.TempDir()
	conf, err := Render(Config{
		Dir:           dir,
		JSModule:      jsModule,
		Listen:        nginxAddr,
		Shim:          addrOf(shim.Listener),
		Picker:        pickerAddr,
		PickerHost:    pickerHost,
		PoolEndpoints: []netip.AddrPort{addrOf(podLn)},
		FailureMode:   mode,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ConfigName), conf, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ScriptName), Script, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, Args(dir)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("tcp", nginxAddr.String())
		if err == nil {
			c.Close()
			break
		}
		select {
		case <-exited:
			t.Fatalf("nginx exited: %s", out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("nginx does not accept connections on %s: %s", nginxAddr, out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return &rig{url: "http://" + nginxAddr.String(), dir: dir, picker: pk, pod: p}
}

func (r *rig) post(t *testing.T, path, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, r.url+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Tally-Request-Id", "req-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

func (r *rig) errorLog(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(r.dir, "error.log"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestNGINXProxiesTheRequestWholeToThePickedEndpoint(t *testing.T) {
	r := startRig(t, infv1.EndpointPickerFailClose, false)
	body := `{"model":"m","prompt":"` + strings.Repeat("abcdefgh", 40_000) + `"}`
	status, got := r.post(t, "/v1/completions?api-version=2", body)
	if status != http.StatusOK || got != `{"served":true}` {
		t.Fatalf("status %d, body %q; want 200 and the pod's body", status, got)
	}
	reqs := r.pod.received()
	if len(reqs) != 1 {
		t.Fatalf("the pod received %d requests, want 1", len(reqs))
	}
	if reqs[0].uri != "/v1/completions?api-version=2" {
		t.Errorf("the pod received %q, want the client's path and query", reqs[0].uri)
	}
	if reqs[0].body != body {
		t.Errorf("the pod received a body of %d bytes, want the client's %d", len(reqs[0].body), len(body))
	}
	if id := reqs[0].header.Get("X-Tally-Request-Id"); id != "req-1" {
		t.Errorf("the pod received X-Tally-Request-Id %q, want the client's", id)
	}

	// What the picker saw: the client's headers, as NGF's shim sends them.
	streams := r.picker.seen()
	if len(streams) != 1 {
		t.Fatalf("the picker saw %d streams, want 1", len(streams))
	}
	seen := map[string]string{}
	for _, h := range streams[0] {
		if strings.HasPrefix(h.GetKey(), ":") {
			t.Errorf("the picker received pseudo-header %q", h.GetKey())
		}
		seen[h.GetKey()] = h.GetValue()
	}
	for _, k := range []string{"content-type", "x-tally-request-id", "x-epp-host", "x-epp-port"} {
		if seen[k] == "" {
			t.Errorf("the picker did not receive %q: %v", k, seen)
		}
	}
}

func TestNGINXNamesThePickerByPickerHostForTheShimToResolve(t *testing.T) {
	const service = "tally-epp.e2e.svc.cluster.local"
	r := startRigNamingThePicker(t, infv1.EndpointPickerFailClose, false, service)
	if status, got := r.post(t, "/v1/completions", `{"prompt":"hi"}`); status != http.StatusOK || got != `{"served":true}` {
		t.Fatalf("status %d, body %q; want the picked pod's answer\n%s", status, got, r.errorLog(t))
	}
	streams := r.picker.seen()
	if len(streams) != 1 {
		t.Fatalf("the picker saw %d streams, want 1", len(streams))
	}
	for _, h := range streams[0] {
		if h.GetKey() == "x-epp-host" && h.GetValue() != service {
			t.Errorf("x-epp-host %q, want the Service's name %q", h.GetValue(), service)
		}
	}
}

func TestNGINXPassesAStreamAsThePodWritesIt(t *testing.T) {
	r := startRig(t, infv1.EndpointPickerFailClose, false)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.url+"/sse", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	// The pod writes the rest only after this first event arrived: an
	// NGINX that passed the response on only once it ended, or once a
	// buffer filled, would hold it until the deadline.
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || line != "data: first\n" {
		t.Fatalf("first line %q, %v; want the pod's first event while the pod holds the rest", line, err)
	}
	close(r.pod.release)
}

func TestNGINXFailCloseAnswers500WhenThePickerRefusesAndTheShimStatusIsLogged(t *testing.T) {
	r := startRig(t, infv1.EndpointPickerFailClose, false)
	status, _ := r.post(t, "/v1/completions", `{"prompt": "unterminated`)
	if status != http.StatusInternalServerError {
		t.Errorf("status %d, want NGF's FailClose 500", status)
	}
	if n := len(r.pod.received()); n != 0 {
		t.Errorf("the pod received %d requests, want none", n)
	}
	if log := r.errorLog(t); !strings.Contains(log, "shim status: 400") || !strings.Contains(log, "malformed JSON") {
		t.Errorf("the error log does not record the shim's 400 and the picker's body:\n%s", log)
	}
}

func TestNGINXFailCloseAnswers500WhenThePickerIsDown(t *testing.T) {
	r := startRig(t, infv1.EndpointPickerFailClose, true)
	if status, _ := r.post(t, "/v1/completions", `{"prompt":"hi"}`); status != http.StatusInternalServerError {
		t.Errorf("status %d, want NGF's FailClose 500", status)
	}
	if n := len(r.pod.received()); n != 0 {
		t.Errorf("the pod received %d requests, want none", n)
	}
}

func TestNGINXFailOpenSendsToThePoolWhenThePickerNamesNoEndpoint(t *testing.T) {
	r := startRig(t, infv1.EndpointPickerFailOpen, true)
	if status, got := r.post(t, "/v1/completions", `{"prompt":"hi"}`); status != http.StatusOK || got != `{"served":true}` {
		t.Errorf("status %d, body %q; want the pool's pod to serve it", status, got)
	}
}

func TestRenderNamesTheFieldAtFault(t *testing.T) {
	ok := Config{
		Dir:    "/tmp/x",
		Listen: netip.MustParseAddrPort("127.0.0.1:1"),
		Shim:   netip.MustParseAddrPort("127.0.0.1:2"),
		Picker: netip.MustParseAddrPort("127.0.0.1:3"),
	}
	if _, err := Render(ok); err != nil {
		t.Fatal(err)
	}
	for field, c := range map[string]Config{
		"Dir":         func() Config { c := ok; c.Dir = "relative"; return c }(),
		"Listen":      func() Config { c := ok; c.Listen = netip.AddrPort{}; return c }(),
		"FailureMode": func() Config { c := ok; c.FailureMode = "FailSometimes"; return c }(),
		"JSModule":    func() Config { c := ok; c.JSModule = "/a b.so"; return c }(),
		"PickerHost":  func() Config { c := ok; c.PickerHost = "epp;evil"; return c }(),
	} {
		if _, err := Render(c); err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("Render with a bad %s: %v, want an error naming it", field, err)
		}
	}
}

func TestRenderPassesPickerHostInPlaceOfPickersIP(t *testing.T) {
	c := Config{
		Dir:        "/tmp/x",
		Listen:     netip.MustParseAddrPort("127.0.0.1:1"),
		Shim:       netip.MustParseAddrPort("127.0.0.1:2"),
		Picker:     netip.MustParseAddrPort("127.0.0.1:9002"),
		PickerHost: "tally-epp.e2e.svc.cluster.local",
	}
	conf, err := Render(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"set $epp_host tally-epp.e2e.svc.cluster.local;", "set $epp_port 9002;"} {
		if !strings.Contains(string(conf), want) {
			t.Errorf("nginx.conf lacks %q:\n%s", want, conf)
		}
	}
	for _, bad := range []string{"a b", "-epp", "epp-", "epp..svc", "epp.svc.", "epp_0", strings.Repeat("a", 64)} {
		c.PickerHost = bad
		if _, err := Render(c); err == nil || !strings.Contains(err.Error(), "PickerHost") {
			t.Errorf("Render with PickerHost %q: %v, want an error naming PickerHost", bad, err)
		}
	}
}
