package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tallyepp/tally/picker/extproc"
)

// maxChunkBytes is the largest body chunk Envoy's ext_proc filter sends or
// accepts in a streamed body message.
const maxChunkBytes = 62_000

// destinationHeader is the header (and envoy.lb metadata key) a picker sets.
const destinationHeader = extproc.DestinationHeader

// client is a gateway's connections to one picker. Envoy multiplexes the
// streams of each worker thread over one HTTP/2 connection; the client
// spreads its streams over a few connections the same way.
type client struct {
	conns []*grpc.ClientConn
	procs []extprocv3.ExternalProcessorClient
	next  atomic.Uint64
}

// dial connects to a picker's ext_proc port. With useTLS the certificate is
// not verified: pickers serve self-signed ones by default.
func dial(addr string, useTLS bool, conns int) (*client, error) {
	creds := insecure.NewCredentials()
	if useTLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // a benchmark of a self-signed picker
	}
	c := &client{}
	for range max(conns, 1) {
		// Large windows, as Envoy's defaults are: a 128 KiB prompt should
		// not wait on flow control.
		conn, err := grpc.NewClient("passthrough:///"+addr,
			grpc.WithTransportCredentials(creds),
			grpc.WithInitialWindowSize(1<<24), grpc.WithInitialConnWindowSize(1<<24),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
		if err != nil {
			c.close()
			return nil, fmt.Errorf("connecting to the picker at %s: %w", addr, err)
		}
		c.conns = append(c.conns, conn)
		c.procs = append(c.procs, extprocv3.NewExternalProcessorClient(conn))
	}
	return c, nil
}

func (c *client) close() {
	for _, conn := range c.conns {
		conn.Close()
	}
}

// exchange is one HTTP request going through the gateway: one ext_proc stream.
type exchange struct {
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
}

func (c *client) open(ctx context.Context) (*exchange, error) {
	i := (c.next.Add(1) - 1) % uint64(len(c.procs))
	ctx, cancel := context.WithCancel(ctx)
	s, err := c.procs[i].Process(ctx)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("opening an ext_proc stream: %w", err)
	}
	return &exchange{stream: s, cancel: cancel}, nil
}

// request is a client's HTTP request as the gateway sees it.
type request struct {
	id   string
	path string
	body []byte
}

// placed is what the gateway learnt from the request path.
type placed struct {
	// endpoint is the first of the picker's destinations ("" if refused).
	endpoint string
	// status is the HTTP status of an ImmediateResponse (0 if routed).
	status int
	// pick runs from the first request message sent to the headers answer
	// (the routing decision) received; routed on to the last chunk of the
	// request body streamed back, when the gateway can finish the upstream
	// request.
	pick, routed time.Duration
}

// sendRequest plays Envoy's request path in FULL_DUPLEX_STREAMED mode:
// the headers (protocol_config on the first message), the body in chunks of
// at most 62,000 bytes, the last with end_of_stream, without waiting for
// answers; then it reads the deferred headers answer and the body streamed
// back.
func (x *exchange) sendRequest(req request) (placed, error) {
	var p placed
	start := time.Now()
	if err := x.send(requestHeaders(req)); err != nil {
		return p, err
	}
	for off := 0; ; off += maxChunkBytes {
		end := min(off+maxChunkBytes, len(req.body))
		err := x.send(bodyChunk(req.body[off:end], end == len(req.body)))
		if errors.Is(err, io.EOF) {
			break // the picker answered early and closed: read its answer
		}
		if err != nil {
			return p, err
		}
		if end == len(req.body) {
			break
		}
	}
	resp, err := x.stream.Recv()
	if err != nil {
		return p, fmt.Errorf("waiting for the headers answer: %w", err)
	}
	p.pick = time.Since(start)
	if ir := resp.GetImmediateResponse(); ir != nil {
		p.status = int(ir.GetStatus().GetCode())
		return p, nil
	}
	h := resp.GetRequestHeaders()
	if h == nil {
		return p, fmt.Errorf("answer to the request headers is %T, want a headers answer", resp.GetResponse())
	}
	dest := headerValue(h.GetResponse().GetHeaderMutation(), destinationHeader)
	if dest == "" {
		dest = resp.GetDynamicMetadata().GetFields()["envoy.lb"].GetStructValue().GetFields()[destinationHeader].GetStringValue()
	}
	p.endpoint, _, _ = strings.Cut(dest, ",")
	if p.endpoint == "" {
		return p, errors.New("the headers answer names no destination endpoint")
	}
	var echoed int
	for {
		resp, err := x.stream.Recv()
		if err != nil {
			return p, fmt.Errorf("waiting for the request body (%d of %d bytes back): %w", echoed, len(req.body), err)
		}
		common := resp.GetRequestBody().GetResponse()
		if common == nil {
			return p, fmt.Errorf("got %T while the request body streams back", resp.GetResponse())
		}
		sb := common.GetBodyMutation().GetStreamedResponse()
		if sb == nil {
			return p, errors.New("a request body answer carries no streamed body")
		}
		echoed += len(sb.GetBody())
		if sb.GetEndOfStream() {
			break
		}
	}
	p.routed = time.Since(start)
	return p, nil
}

// requestHeaders is the first message of a stream: the request headers,
// with the body modes announced in protocol_config as Envoy does.
func requestHeaders(req request) *extprocv3.ProcessingRequest {
	headers := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":authority", RawValue: []byte("gateway.bench")},
		{Key: ":path", RawValue: []byte(req.path)},
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":scheme", RawValue: []byte("http")},
		{Key: "content-type", RawValue: []byte("application/json")},
		{Key: "content-length", RawValue: []byte(strconv.Itoa(len(req.body)))},
		{Key: "user-agent", RawValue: []byte("extproc-load")},
		{Key: "x-forwarded-proto", RawValue: []byte("http")},
		{Key: "x-request-id", RawValue: []byte(req.id)},
	}}
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headers}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		},
	}
}

func bodyChunk(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos},
	}}
}

func headerValue(m *extprocv3.HeaderMutation, key string) string {
	for _, h := range m.GetSetHeaders() {
		if h.GetHeader().GetKey() == key {
			return string(h.GetHeader().GetRawValue()) + h.GetHeader().GetValue()
		}
	}
	return ""
}

// response is a model server's answer as the gateway relays it.
type response struct {
	status int
	// servedBy names the endpoint that served (Envoy's envoy.lb metadata).
	servedBy string
	chunks   [][]byte
}

// sendResponseHeaders plays the response headers and reads their answer.
func (x *exchange) sendResponseHeaders(r response) error {
	ct := "text/event-stream"
	if r.status != 200 {
		ct = "application/json"
	}
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":status", RawValue: []byte(strconv.Itoa(r.status))},
				{Key: "content-type", RawValue: []byte(ct)},
			}},
			EndOfStream: len(r.chunks) == 0,
		},
	}}
	if r.servedBy != "" {
		msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			"envoy.lb": {Fields: map[string]*structpb.Value{destinationHeader + "-served": structpb.NewStringValue(r.servedBy)}},
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

// sendResponseChunk plays one response body chunk. A streamed (SSE)
// response is answered chunk for chunk; any other is answered once, at its
// end, so wait says whether to read an answer now.
func (x *exchange) sendResponseChunk(chunk []byte, eos, wait bool) error {
	if err := x.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: chunk, EndOfStream: eos},
	}}); err != nil {
		return err
	}
	if !wait && !eos {
		return nil
	}
	for {
		got, err := x.stream.Recv()
		if err != nil {
			return fmt.Errorf("waiting for the response body answer: %w", err)
		}
		common := got.GetResponseBody().GetResponse()
		if common == nil {
			return fmt.Errorf("answer to a response body chunk is %T", got.GetResponse())
		}
		sb := common.GetBodyMutation().GetStreamedResponse()
		if sb == nil || !eos || sb.GetEndOfStream() {
			return nil
		}
	}
}

// respond plays a whole response and the end of the stream; it returns once
// the picker has ended the stream (and so has released the request).
func (x *exchange) respond(r response) error {
	if err := x.sendResponseHeaders(r); err != nil {
		return err
	}
	for i, c := range r.chunks {
		if err := x.sendResponseChunk(c, i == len(r.chunks)-1, r.status == 200); err != nil {
			return err
		}
	}
	return x.finish()
}

// finish half-closes the stream as Envoy does at the end of a request and
// waits for the picker to end it.
func (x *exchange) finish() error {
	defer x.cancel()
	if err := x.stream.CloseSend(); err != nil {
		return err
	}
	for {
		_, err := x.stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("waiting for the stream's end: %w", err)
		}
	}
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

// okResponse is a short streamed completion with its usage, as vLLM sends it.
func okResponse(servedBy string, promptTokens int) response {
	return response{status: 200, servedBy: servedBy, chunks: [][]byte{
		[]byte(`data: {"id":"cmpl-1","object":"text_completion","model":"bench","choices":[{"index":0,"text":"Hello","finish_reason":null}]}` + "\n\n"),
		fmt.Appendf(nil, `data: {"id":"cmpl-1","object":"text_completion","model":"bench","choices":[{"index":0,"text":" world","finish_reason":"length"}],"usage":{"prompt_tokens":%d,"completion_tokens":2,"total_tokens":%d}}`+"\n\n", promptTokens, promptTokens+2),
		[]byte("data: [DONE]\n\n"),
	}}
}
