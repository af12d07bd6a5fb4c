package ngfshim

import (
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
)

// fakePicker records each stream's messages until the client half-closes,
// then sends answer's messages and ends the stream.
type fakePicker struct {
	extprocv3.UnimplementedExternalProcessorServer
	answer func(got []*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse

	mu      sync.Mutex
	streams [][]*extprocv3.ProcessingRequest
}

func (f *fakePicker) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	var got []*extprocv3.ProcessingRequest
	for {
		req, err := srv.Recv()
		if errors.Is(err, io.EOF) {
			break // the half-close
		}
		if err != nil {
			return err
		}
		got = append(got, req)
	}
	f.mu.Lock()
	f.streams = append(f.streams, got)
	f.mu.Unlock()
	for _, resp := range f.answer(got) {
		if err := srv.Send(resp); err != nil {
			return err
		}
	}
	return nil
}

func (f *fakePicker) seen() [][]*extprocv3.ProcessingRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([][]*extprocv3.ProcessingRequest(nil), f.streams...)
}

// startPicker serves f in plaintext on loopback and returns its port.
func startPicker(t *testing.T, f *fakePicker) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, f)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	return port
}

func routed(endpoint string) []*extprocv3.ProcessingResponse {
	return []*extprocv3.ProcessingResponse{
		{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				{Header: &corev3.HeaderValue{Key: DestinationHeader, RawValue: []byte(endpoint)}},
			}}},
		}}},
		{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}},
	}
}

// ask sends one request to a shim in front of the picker on port, as NJS
// does.
func ask(t *testing.T, port, method, body string, header http.Header) *httptest.ResponseRecorder {
	t.Helper()
	var r *http.Request
	if body == "" {
		r = httptest.NewRequest(method, "http://127.0.0.1:54800/", nil)
	} else {
		r = httptest.NewRequest(method, "http://127.0.0.1:54800/", strings.NewReader(body))
	}
	for k, vs := range header {
		r.Header[k] = vs
	}
	if port != "" {
		r.Header.Set(PickerHostHeader, "127.0.0.1")
		r.Header.Set(PickerPortHeader, port)
	}
	w := httptest.NewRecorder()
	(&Shim{Dial: Dialer(false)}).ServeHTTP(w, r)
	return w
}

func TestShimSendsHeadersAndBodyAsNGFDoesAndAnswersWithTheEndpoint(t *testing.T) {
	f := &fakePicker{answer: func([]*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		return routed("10.0.0.7:8000")
	}}
	port := startPicker(t, f)
	body := `{"model":"m","prompt":"hello"}`
	w := ask(t, port, http.MethodPost, body, http.Header{
		"Content-Type":       {"application/json"},
		"X-Tally-Request-Id": {"r-1"},
	})
	if w.Code != http.StatusOK || w.Header().Get(DestinationHeader) != "10.0.0.7:8000" {
		t.Fatalf("answer %d, destination %q; want 200 and 10.0.0.7:8000 (body %q)", w.Code, w.Header().Get(DestinationHeader), w.Body)
	}
	streams := f.seen()
	if len(streams) != 1 {
		t.Fatalf("%d streams, want 1", len(streams))
	}
	got := streams[0]
	if len(got) != 2 {
		t.Fatalf("%d messages before the half-close, want headers and body: %v", len(got), got)
	}
	h := got[0].GetRequestHeaders()
	if h == nil || h.GetEndOfStream() {
		t.Fatalf("first message %v: want request headers without end_of_stream", got[0])
	}
	if got[0].GetProtocolConfig() != nil {
		t.Errorf("protocol_config sent: %v", got[0].GetProtocolConfig())
	}
	seen := map[string]string{}
	for _, hv := range h.GetHeaders().GetHeaders() {
		if strings.HasPrefix(hv.GetKey(), ":") {
			t.Errorf("pseudo-header %q sent", hv.GetKey())
		}
		if hv.GetKey() != strings.ToLower(hv.GetKey()) {
			t.Errorf("header key %q is not lowercase", hv.GetKey())
		}
		if len(hv.GetRawValue()) > 0 {
			t.Errorf("header %q in raw_value; NGF uses value", hv.GetKey())
		}
		seen[hv.GetKey()] = hv.GetValue()
	}
	for k, v := range map[string]string{"content-type": "application/json", "x-tally-request-id": "r-1", "x-epp-host": "127.0.0.1", "x-epp-port": port} {
		if seen[k] != v {
			t.Errorf("header %q = %q, want %q (all: %v)", k, seen[k], v, seen)
		}
	}
	b := got[1].GetRequestBody()
	if b == nil || !b.GetEndOfStream() || !bytes.Equal(b.GetBody(), []byte(body)) {
		t.Errorf("second message %v: want the whole body with end_of_stream", got[1])
	}
}

func TestShimMarksEndOfStreamOnTheHeadersWithoutABody(t *testing.T) {
	f := &fakePicker{answer: func([]*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		return routed("10.0.0.7:8000")[:1]
	}}
	port := startPicker(t, f)
	if w := ask(t, port, http.MethodGet, "", nil); w.Code != http.StatusOK {
		t.Fatalf("answer %d %q, want 200", w.Code, w.Body)
	}
	got := f.seen()[0]
	if len(got) != 1 || !got[0].GetRequestHeaders().GetEndOfStream() {
		t.Fatalf("messages %v: want only request headers, with end_of_stream", got)
	}
}

func TestShimReturnsAnImmediateResponsesStatusAndBody(t *testing.T) {
	f := &fakePicker{answer: func([]*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{Status: &typev3.HttpStatus{Code: typev3.StatusCode_BadRequest}, Body: []byte(`{"error":"bad json"}`)},
		}}}
	}}
	port := startPicker(t, f)
	w := ask(t, port, http.MethodPost, `{"prompt": "unterminated`, nil)
	if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "bad json") || w.Header().Get(DestinationHeader) != "" {
		t.Fatalf("answer %d %q, destination %q; want 400 with the picker's body and no destination", w.Code, w.Body, w.Header().Get(DestinationHeader))
	}
}

func TestShimIgnoresADestinationInValue(t *testing.T) {
	// NGF reads raw_value only.
	f := &fakePicker{answer: func([]*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				{Header: &corev3.HeaderValue{Key: DestinationHeader, Value: "10.0.0.7:8000"}},
			}}},
		}}}}
	}}
	port := startPicker(t, f)
	if w := ask(t, port, http.MethodPost, `{}`, nil); w.Header().Get(DestinationHeader) != "" {
		t.Fatalf("destination %q from value; NGF would have none", w.Header().Get(DestinationHeader))
	}
}

func TestShimWithoutThePickerHeadersAnswers400(t *testing.T) {
	w := ask(t, "", http.MethodPost, `{}`, nil)
	if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), PickerHostHeader) {
		t.Fatalf("answer %d %q; want 400 naming %s", w.Code, w.Body, PickerHostHeader)
	}
}

func TestShimAnswers502WhenThePickerIsDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	ln.Close()
	if w := ask(t, port, http.MethodPost, `{}`, nil); w.Code != http.StatusBadGateway {
		t.Fatalf("answer %d %q; want 502", w.Code, w.Body)
	}
}
