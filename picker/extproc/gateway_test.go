package extproc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
)

// This file plays the gateway: it drives the real ext_proc server over a real
// gRPC connection on loopback, sending the messages Envoy's ext_proc filter
// sends, in the order it sends them.

// Endpoints of the simulated pool. Only their addresses matter: nothing
// connects to them.
var (
	epA = netip.MustParseAddrPort("127.0.0.11:8000")
	epB = netip.MustParseAddrPort("127.0.0.12:8000")
	epC = netip.MustParseAddrPort("127.0.0.13:8000")
)

func endpoints(addrs ...netip.AddrPort) []picker.Endpoint {
	eps := make([]picker.Endpoint, len(addrs))
	for i, a := range addrs {
		// The pod name follows the address: the same endpoint listed again
		// is the same pod, with its cache.
		eps[i] = picker.Endpoint{Pod: "vllm-" + a.Addr().String(), Address: a}
	}
	return eps
}

type fixtureOptions struct {
	cfg             *v1alpha1.PickerConfig // nil: defaults
	endpoints       []picker.Endpoint      // nil: A, B, C
	maxRequestBytes int64                  // 0: cfg.MaxRequestBytes
	// maxBufferedRequestBytes is the server's buffer budget; 0: none.
	maxBufferedRequestBytes int64
	wrap                    func(extproc.Picker) extproc.Picker
	quiet                   bool         // log nothing (load tests)
	log                     *logr.Logger // nil: the test's log (or none if quiet)
	// conformanceTestHooks turns on extproc.Options.ConformanceTestHooks.
	conformanceTestHooks bool
	// objectives gives requests their priority (flow control); nil: none.
	objectives extproc.Objectives
	// rewrites rewrites requests' models; nil: none.
	rewrites extproc.Rewrites
	// now is the picker's clock; nil: one that stands still.
	now func() time.Time
}

type fixture struct {
	picker *picker.Picker
	reg    *prometheus.Registry
	gw     *gateway
}

// newFixture starts a picker, the ext_proc server on 127.0.0.1:0 and a client
// connection to it; all are stopped when the test ends.
func newFixture(t testing.TB, o fixtureOptions) *fixture {
	t.Helper()
	cfg := v1alpha1.Default()
	if o.cfg != nil {
		cfg = *o.cfg
	}
	if o.endpoints == nil {
		o.endpoints = endpoints(epA, epB, epC)
	}
	if o.maxRequestBytes == 0 {
		o.maxRequestBytes = cfg.MaxRequestBytes
	}
	log := logr.Discard()
	switch {
	case o.log != nil:
		log = *o.log
	case !o.quiet:
		log = testr.New(t.(*testing.T))
	}
	reg := prometheus.NewRegistry()
	// A clock that stands still: the picker's drain model then releases no
	// prefill behind the tests' backs, so they can assert exact ledgers.
	frozen := time.Now()
	now := o.now
	if now == nil {
		now = func() time.Time { return frozen }
	}
	p := picker.New(cfg, picker.Options{Rand: rand.New(rand.NewPCG(1, 2)), Log: log, Registerer: reg, Now: now})
	p.Replace(o.endpoints)
	var routed extproc.Picker = p
	if o.wrap != nil {
		routed = o.wrap(p)
	}
	srv := extproc.NewServer(routed, extproc.Options{
		MaxRequestBytes:         o.maxRequestBytes,
		MaxBufferedRequestBytes: o.maxBufferedRequestBytes,
		Log:                     log,
		Registerer:              reg,
		ConformanceTestHooks:    o.conformanceTestHooks,
		Objectives:              o.objectives,
		Rewrites:                o.rewrites,
	})
	// WaitForHandlers: Stop returns only once every stream has ended, so no
	// stream logs after its test is over.
	g := grpc.NewServer(append(extproc.GRPCServerOptions(o.maxRequestBytes), grpc.WaitForHandlers(true))...)
	srv.Register(g)
	return &fixture{picker: p, reg: reg, gw: serve(t, g, grpc.WithTransportCredentials(insecure.NewCredentials()))}
}

// serve runs g on a loopback port and returns a gateway connected to it.
func serve(t testing.TB, g *grpc.Server, creds grpc.DialOption) *gateway {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- g.Serve(lis) }()
	t.Cleanup(func() {
		g.Stop()
		if err := <-served; err != nil {
			t.Errorf("grpc server: %v", err)
		}
	})
	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), creds)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &gateway{client: extprocv3.NewExternalProcessorClient(conn), conn: conn}
}

type gateway struct {
	client extprocv3.ExternalProcessorClient
	conn   *grpc.ClientConn
}

// exchange is one HTTP request going through the gateway: one ext_proc stream.
type exchange struct {
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
	// responseMode is the response body mode the stream announced.
	responseMode filterv3.ProcessingMode_BodySendMode
}

func (g *gateway) open(ctx context.Context) (*exchange, error) {
	ctx, cancel := context.WithCancel(ctx)
	s, err := g.client.Process(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	return &exchange{stream: s, cancel: cancel, responseMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}, nil
}

// httpRequest is a client request as the gateway sees it.
type httpRequest struct {
	path, method string
	headers      map[string]string
	body         []byte // nil: a bodiless request (end_of_stream on the headers)
	chunkBytes   int    // size of the body chunks the gateway sends; 0: 16 KiB
	hint         *structpb.Value
	// mode, when set, is announced in protocol_config for both bodies; unset,
	// no protocol_config is sent (the gateway's FULL_DUPLEX_STREAMED).
	mode filterv3.ProcessingMode_BodySendMode
	// chunked leaves content-length out, as for a chunked HTTP/1.1 body.
	chunked bool
	// dropEcho checks the streamed-back body's chunks without keeping
	// them (routed.body stays nil): a benchmark's gateway, in the picker's
	// process, then does not run its garbage collector for it.
	dropEcho bool
}

func completion(model, prompt string) httpRequest {
	return httpRequest{path: "/v1/completions", method: "POST", body: completionBody(model, prompt)}
}

func completionBody(model, prompt string) []byte {
	var b bytes.Buffer
	b.WriteString(`{"model":"`)
	b.WriteString(model)
	b.WriteString(`","prompt":"`)
	b.WriteString(prompt) // test prompts need no JSON escaping
	b.WriteString(`","max_tokens":16}`)
	return b.Bytes()
}

// routed is what the gateway learnt from the request path.
type routed struct {
	headersAnswer *extprocv3.CommonResponse // the answer to the request headers
	bodyAnswer    *extprocv3.CommonResponse // the answer to a BUFFERED, STREAMED or BUFFERED_PARTIAL body
	destination   string                    // the header mutation's value
	metadata      string                    // the dynamic metadata's value
	body          []byte                    // the body passed on upstream
	bodyChunks    []int                     // sizes of the chunks it came back in
	immediate     *extprocv3.ImmediateResponse
}

func (r routed) first() string {
	first, _, _ := strings.Cut(r.destination, ",")
	return first
}

// sendRequest plays the request path: headers, body chunks, and the answers
// the server gives, until the request is routed or refused.
func (x *exchange) sendRequest(req httpRequest) (routed, error) {
	headers := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":path", RawValue: []byte(req.path)},
		{Key: ":method", RawValue: []byte(req.method)},
		{Key: ":authority", RawValue: []byte("gateway.example")},
	}}
	if req.body != nil && !req.chunked {
		headers.Headers = append(headers.Headers, &corev3.HeaderValue{Key: "content-length", RawValue: fmt.Appendf(nil, "%d", len(req.body))})
	}
	for k, v := range req.headers {
		headers.Headers = append(headers.Headers, &corev3.HeaderValue{Key: k, RawValue: []byte(v)})
	}
	first := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: headers, EndOfStream: req.body == nil},
	}}
	if req.hint != nil {
		first.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			"envoy.lb.subset_hint": {Fields: map[string]*structpb.Value{"x-gateway-destination-endpoint-subset": req.hint}},
		}}
	}
	duplex := req.mode == 0 || req.mode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	if req.mode != 0 {
		first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: req.mode, ResponseBodyMode: req.mode}
		x.responseMode = req.mode
	}
	if err := x.send(first); err != nil {
		return routed{}, err
	}

	var r routed
	if req.body == nil {
		return r, x.recvHeadersAnswer(&r)
	}
	if !duplex {
		// Envoy holds the body back until the headers are answered, then
		// sends it as one message (the modes this helper plays are
		// BUFFERED, BUFFERED_PARTIAL and a one-chunk STREAMED).
		if err := x.recvHeadersAnswer(&r); err != nil || r.immediate != nil {
			return r, err
		}
		if err := x.send(bodyMessage(req.body, true)); err != nil {
			return r, err
		}
		resp, err := x.stream.Recv()
		if err != nil {
			return r, fmt.Errorf("waiting for the body answer: %w", err)
		}
		if r.immediate = resp.GetImmediateResponse(); r.immediate != nil {
			return r, nil
		}
		common := resp.GetRequestBody().GetResponse()
		if common == nil {
			return r, fmt.Errorf("answer to the body is %T, want a request body answer", resp.GetResponse())
		}
		r.bodyAnswer = common
		if r.destination == "" { // only BUFFERED routes in the body answer
			r.destination = destination(common)
			r.metadata = metadataDestination(resp)
		}
		r.body = req.body // the body passes on unless mutated
		if bm, ok := common.GetBodyMutation().GetMutation().(*extprocv3.BodyMutation_Body); ok {
			r.body = bm.Body
		}
		return r, nil
	}

	chunk := req.chunkBytes
	if chunk == 0 {
		chunk = 16 << 10
	}
	for off := 0; ; off += chunk {
		end := min(off+chunk, len(req.body))
		if err := x.send(bodyMessage(req.body[off:end], end == len(req.body))); err != nil {
			if errors.Is(err, io.EOF) {
				break // the server answered early and closed: read its answer
			}
			return r, err
		}
		if end == len(req.body) {
			break
		}
	}
	if err := x.recvHeadersAnswer(&r); err != nil || r.immediate != nil {
		return r, err
	}
	for {
		resp, err := x.stream.Recv()
		if err != nil {
			return r, fmt.Errorf("waiting for the request body: %w", err)
		}
		sb := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sb == nil {
			return r, fmt.Errorf("got %T while the request body streams back, want streamed request body chunks", resp.GetResponse())
		}
		if !req.dropEcho {
			r.body = append(r.body, sb.GetBody()...)
		}
		r.bodyChunks = append(r.bodyChunks, len(sb.GetBody()))
		if sb.GetEndOfStream() {
			return r, nil
		}
	}
}

func (x *exchange) recvHeadersAnswer(r *routed) error {
	resp, err := x.stream.Recv()
	if err != nil {
		return fmt.Errorf("waiting for the headers answer: %w", err)
	}
	if r.immediate = resp.GetImmediateResponse(); r.immediate != nil {
		return nil
	}
	h := resp.GetRequestHeaders()
	if h == nil {
		return fmt.Errorf("answer to the headers is %T, want a request headers answer", resp.GetResponse())
	}
	r.headersAnswer = h.GetResponse()
	r.destination = destination(h.GetResponse())
	r.metadata = metadataDestination(resp)
	return nil
}

func destination(c *extprocv3.CommonResponse) string {
	for _, h := range c.GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
			return string(h.GetHeader().GetRawValue()) + h.GetHeader().GetValue()
		}
	}
	return ""
}

func metadataDestination(resp *extprocv3.ProcessingResponse) string {
	return resp.GetDynamicMetadata().GetFields()["envoy.lb"].GetStructValue().GetFields()["x-gateway-destination-endpoint"].GetStringValue()
}

func bodyMessage(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos},
	}}
}

// httpResponse is a model server's response as the gateway sees it.
type httpResponse struct {
	status   int
	servedBy string   // "": no served-by metadata
	chunks   []string // body chunks; none: end_of_stream on the headers
}

// sendResponseHeaders plays the response headers and reads their answer.
func (x *exchange) sendResponseHeaders(resp httpResponse) error {
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":status", RawValue: fmt.Appendf(nil, "%d", resp.status)},
				{Key: "content-type", RawValue: []byte("text/event-stream")},
			}},
			EndOfStream: len(resp.chunks) == 0,
		},
	}}
	if resp.servedBy != "" {
		msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			"envoy.lb": {Fields: map[string]*structpb.Value{"x-gateway-destination-endpoint-served": structpb.NewStringValue(resp.servedBy)}},
		}}
	}
	if err := x.send(msg); err != nil {
		return err
	}
	got, err := x.stream.Recv()
	if err != nil {
		return fmt.Errorf("waiting for the response headers answer: %w", err)
	}
	if got.GetResponseHeaders() == nil {
		return fmt.Errorf("answer to the response headers is %T", got.GetResponse())
	}
	return nil
}

// sendResponseChunk plays one response body chunk and checks its answer:
// in FULL_DUPLEX_STREAMED mode the chunk must come back unchanged.
func (x *exchange) sendResponseChunk(chunk string, eos bool) error {
	if err := x.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte(chunk), EndOfStream: eos},
	}}); err != nil {
		return err
	}
	got, err := x.stream.Recv()
	if err != nil {
		return fmt.Errorf("waiting for the response body answer: %w", err)
	}
	common := got.GetResponseBody().GetResponse()
	if common == nil {
		return fmt.Errorf("answer to a response body chunk is %T", got.GetResponse())
	}
	if x.responseMode != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		if common.GetBodyMutation() != nil {
			return fmt.Errorf("response chunk answered with a body mutation in mode %v: %v", x.responseMode, common)
		}
		return nil
	}
	sb := common.GetBodyMutation().GetStreamedResponse()
	if string(sb.GetBody()) != chunk || sb.GetEndOfStream() != eos {
		return fmt.Errorf("response chunk came back as %q (end %v), want %q (end %v)", sb.GetBody(), sb.GetEndOfStream(), chunk, eos)
	}
	return nil
}

// respond plays a whole response and the end of the stream; it returns once
// the server has ended the stream (and so has released the request).
func (x *exchange) respond(resp httpResponse) error {
	if err := x.sendResponseHeaders(resp); err != nil {
		return err
	}
	for i, c := range resp.chunks {
		if err := x.sendResponseChunk(c, i == len(resp.chunks)-1); err != nil {
			return err
		}
	}
	return x.finish()
}

// finish half-closes the stream as Envoy does and waits for the server to end it.
func (x *exchange) finish() error {
	defer x.cancel()
	if err := x.stream.CloseSend(); err != nil {
		return err
	}
	if _, err := x.stream.Recv(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("stream end: got %v, want io.EOF", err)
	}
	return nil
}

func (x *exchange) send(m *extprocv3.ProcessingRequest) error {
	if err := x.stream.Send(m); err != nil {
		if errors.Is(err, io.EOF) {
			return err
		}
		return fmt.Errorf("sending %T: %w", m.GetRequest(), err)
	}
	return nil
}

var okResponse = httpResponse{status: 200, chunks: []string{`data: {"choices":[{"text":"hi"}]}` + "\n\n", "data: [DONE]\n\n"}}

// roundTrip plays a whole request and its 200 response.
func (g *gateway) roundTrip(ctx context.Context, req httpRequest) (routed, error) {
	x, err := g.open(ctx)
	if err != nil {
		return routed{}, err
	}
	defer x.cancel()
	r, err := x.sendRequest(req)
	if err != nil || r.immediate != nil {
		return r, err
	}
	return r, x.respond(okResponse)
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t testing.TB, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still not true after 10s: %s", what, state)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ledgerEmpty reports whether the picker holds no reservation at all.
func ledgerEmpty(p *picker.Picker) (bool, string) {
	l := p.Snapshot()
	inFlight, prefill := l.InFlight, l.PrefillTokens
	ok := inFlight == 0 && prefill == 0
	var b strings.Builder
	fmt.Fprintf(&b, "totals in-flight=%d prefill=%d;", inFlight, prefill)
	for _, s := range p.Stats() {
		fmt.Fprintf(&b, " %s;", statsString(s))
		ok = ok && s.InFlight == 0 && s.PrefillTokens == 0 && s.Decoding == 0
	}
	return ok, b.String()
}

func statsOf(p *picker.Picker, addr netip.AddrPort) picker.EndpointStats {
	for _, s := range p.Stats() {
		if s.Endpoint.Address == addr {
			return s
		}
	}
	return picker.EndpointStats{}
}

func hintList(addrs ...string) *structpb.Value {
	vals := make([]*structpb.Value, len(addrs))
	for i, a := range addrs {
		vals[i] = structpb.NewStringValue(a)
	}
	return structpb.NewListValue(&structpb.ListValue{Values: vals})
}

// gauge reads an unlabelled gauge from the fixture's registry; unlike
// counter it may be called from any goroutine (0 if it cannot be read).
func (f *fixture) gauge(name string) float64 {
	families, _ := f.reg.Gather()
	for _, fam := range families {
		if fam.GetName() == name && len(fam.GetMetric()) > 0 {
			return fam.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return 0
}

// counter reads a counter (or counter vec member) from the fixture's registry.
func (f *fixture) counter(t testing.TB, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := f.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, fam := range families {
		if fam.GetName() != name {
			continue
		}
	metrics:
		for _, m := range fam.GetMetric() {
			for _, lp := range m.GetLabel() {
				if labels[lp.GetName()] != lp.GetValue() {
					continue metrics
				}
			}
			return m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return 0
}
