package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker/protocol"
)

// testDeadline bounds every wait in these tests; nothing should come near it.
const testDeadline = 10 * time.Second

// pickerBehavior says how the test picker answers.
type pickerBehavior struct {
	destination        string                       // the x-gateway-destination-endpoint value
	immediate          *extprocv3.ImmediateResponse // answer this instead of deciding
	hold               bool                         // never decide: wait until the stream's context ends
	failBeforeDecision bool                         // end the stream with an error instead of deciding
	rewriteRequest     func([]byte) []byte          // the body returned is this of the body received
	rewriteResponse    func([]byte) []byte          // applied to each response chunk
	// breakOnResponse ends the stream with an error after the pick: at the
	// response headers ("headers") or after returning the first response
	// chunk ("body"), as a picker that dies while the response streams.
	breakOnResponse string
}

// streamRecord is what the test picker saw on one stream.
type streamRecord struct {
	protocol       *extprocv3.ProtocolConfiguration
	headers        map[string]string
	headersEOS     bool
	requestBody    []byte
	requestMsgs    int
	maxRequestMsg  int
	servedBy       string
	hasServedBy    bool
	responseStatus string
	responseBody   []byte
	end            error // nil when the gateway half-closed after a complete exchange
	ctxErr         error // the stream context's error when the picker returned
}

// testPicker plays the endpoint picker over real gRPC, per the endpoint picker protocol: the
// deferred header response after the whole body, the body streamed back in
// chunks of at most 62,000 bytes, and an echo of the response path.
type testPicker struct {
	extprocv3.UnimplementedExternalProcessorServer
	behave  pickerBehavior
	records chan *streamRecord
	held    chan struct{} // one send per stream held undecided
}

func newTestPicker(b pickerBehavior) *testPicker {
	return &testPicker{behave: b, records: make(chan *streamRecord, 16), held: make(chan struct{}, 16)}
}

func (p *testPicker) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	rec := &streamRecord{headers: map[string]string{}}
	err := p.process(stream, rec)
	rec.end = err
	rec.ctxErr = stream.Context().Err()
	p.records <- rec
	return err
}

func (p *testPicker) process(stream extprocv3.ExternalProcessor_ProcessServer, rec *streamRecord) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	rh := first.GetRequestHeaders()
	if rh == nil {
		return fmt.Errorf("first message is %T, want request_headers", first.GetRequest())
	}
	rec.protocol = first.GetProtocolConfig()
	for _, h := range rh.GetHeaders().GetHeaders() {
		rec.headers[h.GetKey()] = string(h.GetRawValue())
	}
	rec.headersEOS = rh.GetEndOfStream()
	if !rh.GetEndOfStream() {
		for {
			m, err := stream.Recv()
			if err != nil {
				return err
			}
			b := m.GetRequestBody()
			if b == nil {
				return fmt.Errorf("got %T, want request_body", m.GetRequest())
			}
			rec.requestBody = append(rec.requestBody, b.GetBody()...)
			rec.requestMsgs++
			rec.maxRequestMsg = max(rec.maxRequestMsg, len(b.GetBody()))
			if b.GetEndOfStream() {
				break
			}
		}
	}

	switch {
	case p.behave.hold:
		p.held <- struct{}{}
		select {
		case <-stream.Context().Done():
			return stream.Context().Err()
		case <-time.After(testDeadline):
			return errors.New("held stream was never cancelled")
		}
	case p.behave.failBeforeDecision:
		return status.Error(codes.Internal, "picker failed before deciding")
	case p.behave.immediate != nil:
		return stream.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: p.behave.immediate}})
	}

	dest := p.behave.destination
	if err := stream.Send(&extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{
				ClearRouteCache: true,
				HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
					{Header: &corev3.HeaderValue{Key: protocol.DestinationHeader, RawValue: []byte(dest)}},
				}},
			},
		}},
		DynamicMetadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			protocol.LBNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
				protocol.DestinationKey: structpb.NewStringValue(dest),
			}}),
		}},
	}); err != nil {
		return err
	}
	if !rh.GetEndOfStream() {
		body := rec.requestBody
		if p.behave.rewriteRequest != nil {
			body = p.behave.rewriteRequest(body)
		}
		const maxChunk = 62000
		for {
			n := min(len(body), maxChunk)
			last := n == len(body)
			if err := stream.Send(streamedBody(body[:n], last, false)); err != nil {
				return err
			}
			body = body[n:]
			if last {
				break
			}
		}
	}

	m, err := stream.Recv()
	if err != nil {
		return err
	}
	resp := m.GetResponseHeaders()
	if resp == nil {
		return fmt.Errorf("got %T, want response_headers", m.GetRequest())
	}
	for _, h := range resp.GetHeaders().GetHeaders() {
		if h.GetKey() == ":status" {
			rec.responseStatus = string(h.GetRawValue())
		}
	}
	if v, ok := m.GetMetadataContext().GetFilterMetadata()[protocol.LBNamespace].GetFields()[protocol.ServedKey]; ok {
		rec.servedBy, rec.hasServedBy = v.GetStringValue(), true
	}
	if p.behave.breakOnResponse == "headers" {
		return errPickerBroke
	}
	if err := stream.Send(&extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				{Header: &corev3.HeaderValue{Key: "x-picker-response", RawValue: []byte("seen")}},
			}}},
		}},
	}); err != nil {
		return err
	}
	if !resp.GetEndOfStream() {
		for {
			m, err := stream.Recv()
			if err != nil {
				return err
			}
			b := m.GetResponseBody()
			if b == nil {
				return fmt.Errorf("got %T, want response_body", m.GetRequest())
			}
			rec.responseBody = append(rec.responseBody, b.GetBody()...)
			chunk := b.GetBody()
			if p.behave.rewriteResponse != nil {
				chunk = p.behave.rewriteResponse(chunk)
			}
			if err := stream.Send(streamedBody(chunk, b.GetEndOfStream(), true)); err != nil {
				return err
			}
			if p.behave.breakOnResponse == "body" {
				return errPickerBroke
			}
			if b.GetEndOfStream() {
				break
			}
		}
	}
	// The gateway ends the stream: a half-close gives io.EOF.
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("after the exchange: want io.EOF, got %v", err)
	}
	return nil
}

// errPickerBroke is how the test picker breaks a stream after the pick.
var errPickerBroke = status.Error(codes.Unavailable, "picker went away after the pick")

func streamedBody(b []byte, eos, response bool) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b, EndOfStream: eos}},
	}}}
	if response {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
}

// record waits for the picker's record of the next stream to end.
func (p *testPicker) record(t *testing.T) *streamRecord {
	t.Helper()
	select {
	case r := <-p.records:
		return r
	case <-time.After(testDeadline):
		t.Fatal("the picker's stream did not end")
		return nil
	}
}

// startPicker serves p over plaintext gRPC on loopback and returns a client.
func startPicker(t *testing.T, p *testPicker, opts ...grpc.ServerOption) (string, *envoy.Client) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(opts...)
	extprocv3.RegisterExternalProcessorServer(srv, p)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	return ln.Addr().String(), pickerClient(t, ln.Addr().String())
}

func pickerClient(t *testing.T, addr string) *envoy.Client {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return envoy.NewClient(envoy.Options{}, conn)
}

// startGateway serves gw on loopback and returns its base URL.
func startGateway(t *testing.T, gw *Gateway) string {
	t.Helper()
	if gw.PickerTimeout == 0 {
		// Long enough that only the gateway's own logic ends a stream early.
		gw.PickerTimeout = 2 * testDeadline
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: gw}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		// As main does: handlers return before Wait.
		ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
		defer cancel()
		if srv.Shutdown(ctx) != nil {
			_ = srv.Close()
		}
		gw.Wait()
	})
	return "http://" + ln.Addr().String()
}

// closedAddr is a loopback address where nothing listens. Its IP is one no
// other test listens on: a port freed on 127.0.0.1, which every test
// process shares, could be taken by another server before the test dials
// it (a fail-open test once waited 20 s on a picker address).
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.98.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// upstream is a model server stand-in that records what it received.
type upstream struct {
	*httptest.Server
	mu       sync.Mutex
	bodies   [][]byte
	headers  []http.Header
	hosts    []string
	requests atomic.Int32
}

func startUpstream(t *testing.T, respond func(w http.ResponseWriter, r *http.Request)) *upstream {
	t.Helper()
	u := &upstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("upstream reading the body: %v", err)
		}
		u.mu.Lock()
		u.bodies = append(u.bodies, body)
		u.headers = append(u.headers, r.Header.Clone())
		u.hosts = append(u.hosts, r.Host)
		u.mu.Unlock()
		u.requests.Add(1)
		respond(w, r)
	}))
	t.Cleanup(u.Close)
	return u
}

func (u *upstream) addr() string { return u.Listener.Addr().String() }

func (u *upstream) only(t *testing.T) ([]byte, http.Header, string) {
	t.Helper()
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.bodies) != 1 {
		t.Fatalf("upstream got %d requests, want 1", len(u.bodies))
	}
	return u.bodies[0], u.headers[0], u.hosts[0]
}

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func newClient(t *testing.T) *http.Client {
	t.Helper()
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: testDeadline}
}

func TestForwardsABodyByteForByteThroughThePicker(t *testing.T) {
	reqBody := randomBytes(t, 1<<20)
	respBody := randomBytes(t, 300<<10)
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = w.Write(respBody)
	})
	picker := newTestPicker(pickerBehavior{destination: up.addr()})
	_, client := startPicker(t, picker)
	base := startGateway(t, &Gateway{Picker: client})

	req, _ := http.NewRequest(http.MethodPost, base+"/v1/completions?x=1", bytes.NewReader(reqBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Custom", "kept")
	req.Header.Set(protocol.DestinationHeader, "10.9.9.9:1") // a client must not choose the pod
	resp, err := newClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}

	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d, want 200", resp.StatusCode)
	}
	if !bytes.Equal(got, respBody) {
		t.Errorf("client got %d response bytes that differ from the upstream's %d", len(got), len(respBody))
	}
	if resp.Header.Get("X-Picker-Response") != "seen" {
		t.Errorf("the picker's response header mutation was not applied: %v", resp.Header)
	}
	upBody, upHeader, upHost := up.only(t)
	if !bytes.Equal(upBody, reqBody) {
		t.Errorf("upstream got %d body bytes that differ from the %d sent", len(upBody), len(reqBody))
	}
	if upHeader.Get(protocol.DestinationHeader) != up.addr() || upHeader.Get("X-Custom") != "kept" {
		t.Errorf("upstream headers: %v", upHeader)
	}
	if want := strings.TrimPrefix(base, "http://"); upHost != want {
		t.Errorf("upstream Host %q, want the client's %q", upHost, want)
	}

	rec := picker.record(t)
	if rec.end != nil || rec.ctxErr != nil {
		t.Errorf("stream did not end with a half-close: end %v, context %v", rec.end, rec.ctxErr)
	}
	if rec.protocol.GetRequestBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED ||
		rec.protocol.GetResponseBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		t.Errorf("protocol_config %v, want both body modes FULL_DUPLEX_STREAMED", rec.protocol)
	}
	wantHeaders := map[string]string{
		":method": "POST", ":path": "/v1/completions?x=1", ":authority": strings.TrimPrefix(base, "http://"),
		"content-type": "application/json", "x-custom": "kept",
	}
	for k, v := range wantHeaders {
		if rec.headers[k] != v {
			t.Errorf("picker got header %s=%q, want %q", k, rec.headers[k], v)
		}
	}
	if _, ok := rec.headers[protocol.DestinationHeader]; ok {
		t.Errorf("the client's %s reached the picker", protocol.DestinationHeader)
	}
	if rec.headersEOS {
		t.Error("request headers carried end_of_stream although a body follows")
	}
	if !bytes.Equal(rec.requestBody, reqBody) {
		t.Errorf("picker got %d body bytes that differ from the %d sent", len(rec.requestBody), len(reqBody))
	}
	if rec.maxRequestMsg > defaultBodyChunkBytes || rec.requestMsgs < (1<<20)/defaultBodyChunkBytes {
		t.Errorf("request body came in %d messages of at most %d bytes, want 16 KiB chunks", rec.requestMsgs, rec.maxRequestMsg)
	}
	if rec.servedBy != up.addr() || rec.responseStatus != "200" {
		t.Errorf("response headers: served-by %q status %q, want %q and 200", rec.servedBy, rec.responseStatus, up.addr())
	}
	if !bytes.Equal(rec.responseBody, respBody) {
		t.Errorf("picker got %d response bytes that differ from the upstream's %d", len(rec.responseBody), len(respBody))
	}
}

func TestSendsWhatThePickerReturnsNotTheOriginal(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "the answer")
	})
	picker := newTestPicker(pickerBehavior{
		destination:     up.addr(),
		rewriteRequest:  func([]byte) []byte { return []byte(`{"model":"rewritten"}`) },
		rewriteResponse: bytes.ToUpper,
	})
	_, client := startPicker(t, picker)
	base := startGateway(t, &Gateway{Picker: client})

	resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"original","prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	upBody, _, _ := up.only(t)
	if string(upBody) != `{"model":"rewritten"}` {
		t.Errorf("upstream got %q, want the picker's body", upBody)
	}
	if string(got) != "THE ANSWER" {
		t.Errorf("client got %q, want the picker's returned chunks", got)
	}
	picker.record(t)
}

func TestBodilessRequestEndsOnTheHeaders(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, `{"data":[]}`)
	})
	picker := newTestPicker(pickerBehavior{destination: up.addr()})
	_, client := startPicker(t, picker)
	base := startGateway(t, &Gateway{Picker: client})

	resp, err := newClient(t).Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(got) != `{"data":[]}` {
		t.Errorf("got %d %q", resp.StatusCode, got)
	}
	rec := picker.record(t)
	if !rec.headersEOS || rec.requestMsgs != 0 {
		t.Errorf("headers end_of_stream %v with %d body messages, want end_of_stream and none", rec.headersEOS, rec.requestMsgs)
	}
	if body, _, _ := up.only(t); len(body) != 0 {
		t.Errorf("upstream got a body of %d bytes", len(body))
	}
}

func TestFallsBackToTheNextEndpointWhenTheConnectionIsRefused(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "served")
	})
	refused := closedAddr(t)
	picker := newTestPicker(pickerBehavior{destination: refused + "," + up.addr()})
	_, client := startPicker(t, picker)
	base := startGateway(t, &Gateway{Picker: client})

	body := `{"model":"m","prompt":"hello"}`
	resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(got) != "served" {
		t.Fatalf("got %d %q, want 200 from the second endpoint", resp.StatusCode, got)
	}
	if upBody, _, _ := up.only(t); string(upBody) != body {
		t.Errorf("the fallback endpoint got %q, want the whole body %q", upBody, body)
	}
	rec := picker.record(t)
	if rec.servedBy != up.addr() {
		t.Errorf("served-by %q, want the endpoint that served, %q (not the refused %q)", rec.servedBy, up.addr(), refused)
	}
}

func TestEveryEndpointRefusedGoesThroughTheResponsePathAs503(t *testing.T) {
	picker := newTestPicker(pickerBehavior{destination: closedAddr(t) + "," + closedAddr(t)})
	_, client := startPicker(t, picker)
	base := startGateway(t, &Gateway{Picker: client})

	resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("status %d, want 503", resp.StatusCode)
	}
	rec := picker.record(t)
	if rec.responseStatus != "503" || rec.hasServedBy {
		t.Errorf("picker saw status %q served-by %q (present %v), want 503 and no served-by", rec.responseStatus, rec.servedBy, rec.hasServedBy)
	}
}

func TestServerSentEventsStayStreaming(t *testing.T) {
	clientGotFirst := make(chan struct{})
	var secondWrittenEarly atomic.Bool
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: one\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-clientGotFirst:
		case <-time.After(testDeadline / 2):
			secondWrittenEarly.Store(true) // the client never saw event one on its own
		}
		_, _ = io.WriteString(w, "data: two\n\ndata: [DONE]\n\n")
	})
	picker := newTestPicker(pickerBehavior{destination: up.addr()})
	_, client := startPicker(t, picker)
	base := startGateway(t, &Gateway{Picker: client})

	resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	first, err := br.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	close(clientGotFirst)
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatal(err)
	}
	if secondWrittenEarly.Load() {
		t.Fatal("event one reached the client only after event two was written: the gateway buffers")
	}
	if first != "data: one\n" || string(rest) != "\ndata: two\n\ndata: [DONE]\n\n" {
		t.Errorf("got %q then %q", first, rest)
	}
	picker.record(t)
}

func TestImmediateResponseReachesTheClientAsIs(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {})
	picker := newTestPicker(pickerBehavior{immediate: &extprocv3.ImmediateResponse{
		Status: &typev3.HttpStatus{Code: typev3.StatusCode_TooManyRequests},
		Body:   []byte("every endpoint is saturated"),
		Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
			{Header: &corev3.HeaderValue{Key: "retry-after", RawValue: []byte("1")}},
		}},
	}})
	_, client := startPicker(t, picker)
	base := startGateway(t, &Gateway{Picker: client})

	resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || string(got) != "every endpoint is saturated" || resp.Header.Get("Retry-After") != "1" {
		t.Errorf("got %d %q Retry-After %q, want 429, the picker's body and header", resp.StatusCode, got, resp.Header.Get("Retry-After"))
	}
	if n := up.requests.Load(); n != 0 {
		t.Errorf("upstream got %d requests, want none", n)
	}
	picker.record(t)
}

func TestFailureModeWhenThePickerCannotDecide(t *testing.T) {
	for _, tc := range []struct {
		name        string
		unreachable bool
		mode        infv1.EndpointPickerFailureMode
		wantStatus  int
	}{
		{"unreachable, FailOpen", true, infv1.EndpointPickerFailOpen, http.StatusOK},
		{"unreachable, FailClose", true, infv1.EndpointPickerFailClose, http.StatusServiceUnavailable},
		{"stream fails before the decision, FailOpen", false, infv1.EndpointPickerFailOpen, http.StatusOK},
		{"stream fails before the decision, FailClose", false, infv1.EndpointPickerFailClose, http.StatusServiceUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
				_, _ = io.WriteString(w, "served without the picker")
			})
			var client *envoy.Client
			if tc.unreachable {
				client = pickerClient(t, closedAddr(t))
			} else {
				_, client = startPicker(t, newTestPicker(pickerBehavior{failBeforeDecision: true}))
			}
			// The first endpoint chosen refuses; the gateway moves on to the next.
			endpoints := []string{closedAddr(t), up.addr()}
			base := startGateway(t, &Gateway{
				Picker: client,
				Pool:   func() PoolView { return PoolView{FailureMode: tc.mode, Endpoints: endpoints} },
				Choose: func(n int) int { return 0 },
			})
			body := strings.Repeat("x", 100<<10)
			resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			got, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.wantStatus {
				t.Fatalf("status %d (%q), want %d", resp.StatusCode, got, tc.wantStatus)
			}
			if tc.mode == infv1.EndpointPickerFailOpen {
				if upBody, _, _ := up.only(t); string(upBody) != body {
					t.Errorf("upstream got %d bytes, want the original %d", len(upBody), len(body))
				}
			} else if n := up.requests.Load(); n != 0 {
				t.Errorf("FailClose sent %d requests upstream", n)
			}
		})
	}
}

func TestFailOpenPicksAmongThePoolsEndpoints(t *testing.T) {
	ups := []*upstream{}
	var endpoints []string
	for range 3 {
		u := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {})
		ups = append(ups, u)
		endpoints = append(endpoints, u.addr())
	}
	var asked atomic.Int32
	base := startGateway(t, &Gateway{
		Picker: pickerClient(t, closedAddr(t)),
		Pool:   func() PoolView { return PoolView{FailureMode: infv1.EndpointPickerFailOpen, Endpoints: endpoints} },
		Choose: func(n int) int {
			asked.Add(1)
			return 2 % n
		},
	})
	resp, err := newClient(t).Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if asked.Load() != 1 || ups[2].requests.Load() != 1 || ups[0].requests.Load()+ups[1].requests.Load() != 0 {
		t.Errorf("choice asked %d times; requests per endpoint %d %d %d, want only the chosen third",
			asked.Load(), ups[0].requests.Load(), ups[1].requests.Load(), ups[2].requests.Load())
	}
}

func TestPickerTimeoutAppliesTheFailureMode(t *testing.T) {
	picker := newTestPicker(pickerBehavior{hold: true})
	_, client := startPicker(t, picker)
	base := startGateway(t, &Gateway{Picker: client, PickerTimeout: 200 * time.Millisecond})

	resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("status %d, want 503 (FailClose by default)", resp.StatusCode)
	}
	if rec := picker.record(t); rec.ctxErr == nil {
		t.Error("the timed-out stream was not cancelled")
	}
}

func TestClientDisconnectCancelsThePickerStream(t *testing.T) {
	t.Run("while the picker decides", func(t *testing.T) {
		picker := newTestPicker(pickerBehavior{hold: true})
		_, client := startPicker(t, picker)
		base := startGateway(t, &Gateway{Picker: client})

		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(`{"model":"m"}`))
		errc := make(chan error, 1)
		go func() {
			resp, err := newClient(t).Do(req)
			if err == nil {
				resp.Body.Close()
			}
			errc <- err
		}()
		select {
		case <-picker.held:
		case <-time.After(testDeadline):
			t.Fatal("the request never reached the picker")
		}
		cancel()
		if err := <-errc; err == nil {
			t.Error("the cancelled request succeeded")
		}
		rec := picker.record(t)
		if rec.ctxErr == nil {
			t.Errorf("the picker's stream ended (%v) without its context ending", rec.end)
		}
	})

	t.Run("while the response streams", func(t *testing.T) {
		upstreamCancelled := make(chan struct{})
		up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: one\n\n")
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
				close(upstreamCancelled)
			case <-time.After(testDeadline):
			}
		})
		picker := newTestPicker(pickerBehavior{destination: up.addr()})
		_, client := startPicker(t, picker)
		base := startGateway(t, &Gateway{Picker: client})

		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(`{"stream":true}`))
		resp, err := newClient(t).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(resp.Body).ReadString('\n')
		if err != nil || line != "data: one\n" {
			t.Fatalf("first line %q, %v", line, err)
		}
		cancel()
		resp.Body.Close()

		rec := picker.record(t)
		if rec.ctxErr == nil {
			t.Errorf("the picker's stream ended (%v) without its context ending", rec.end)
		}
		select {
		case <-upstreamCancelled:
		case <-time.After(testDeadline):
			t.Error("the upstream request was not cancelled")
		}
	})
}

// TestAPickerStreamBreakingAfterThePickLeavesTheResponseWhole: the
// response phase is best effort. Once the model server answers, a picker
// that goes away (a replica restarting, the leader lost) must not cost the
// client its response: the gateway passes the rest on without the picker.
func TestAPickerStreamBreakingAfterThePickLeavesTheResponseWhole(t *testing.T) {
	for _, phase := range []string{"headers", "body"} {
		t.Run("at the response "+phase, func(t *testing.T) {
			// Several reads upstream, so that the body outlives the break.
			respBody := randomBytes(t, 200<<10)
			up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "application/octet-stream")
				for rest := respBody; len(rest) > 0; {
					n := min(len(rest), 10<<10)
					_, _ = w.Write(rest[:n])
					w.(http.Flusher).Flush()
					rest = rest[n:]
				}
			})
			picker := newTestPicker(pickerBehavior{destination: up.addr(), breakOnResponse: phase})
			_, client := startPicker(t, picker)
			base := startGateway(t, &Gateway{Picker: client, BodyChunkBytes: 4 << 10})

			resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatalf("reading the response: %v (after %d of %d bytes)", err, len(got), len(respBody))
			}
			if resp.StatusCode != http.StatusOK || !bytes.Equal(got, respBody) {
				t.Errorf("status %d and %d bytes (equal: %v), want 200 and the upstream's %d bytes",
					resp.StatusCode, len(got), bytes.Equal(got, respBody), len(respBody))
			}
			if n := up.requests.Load(); n != 1 {
				t.Errorf("upstream got %d requests, want 1", n)
			}
			if rec := picker.record(t); !errors.Is(rec.end, errPickerBroke) {
				t.Errorf("the picker's stream ended with %v, want its break", rec.end)
			}
		})
	}
}
