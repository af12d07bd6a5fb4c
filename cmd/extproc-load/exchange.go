package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/internal/ngfshim"
	"github.com/tallyepp/tally/picker/protocol"
)

// maxChunkBytes is the largest body chunk Envoy's ext_proc filter sends or
// accepts in a streamed body message.
const maxChunkBytes = 62_000

// client is a gateway's connections to a picker: to one address, or to
// each replica's, streams going to each in turn as a gateway spreads them
// over the ready endpoints of the picker's Service.
type client struct {
	pickers []*pickerConn
	next    atomic.Uint64
}

// pickerConn is the connections to one picker address.
type pickerConn struct {
	*envoy.Client
	conns []*grpc.ClientConn
	// addr is the picker's address, which NGF's NJS names to its shim in
	// X-EPP-Host and X-EPP-Port.
	addr string
}

// stream is one request's stream, and the picker address it went to.
type stream struct {
	*envoy.Stream
	addr string
}

// dialAll connects to every address, each with conns connections of its own.
func dialAll(addrs []string, useTLS bool, conns int) (*client, error) {
	c := &client{}
	for _, addr := range addrs {
		pc, err := dial(addr, useTLS, conns)
		if err != nil {
			c.close()
			return nil, err
		}
		c.pickers = append(c.pickers, pc)
	}
	return c, nil
}

// Open starts a stream on the next picker in turn.
func (c *client) Open(ctx context.Context) (*stream, error) {
	pc := c.pickers[(c.next.Add(1)-1)%uint64(len(c.pickers))]
	x, err := pc.Open(ctx)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", pc.addr, err)
	}
	return &stream{Stream: x, addr: pc.addr}, nil
}

// addrs are the picker addresses, in turn order.
func (c *client) addrs() []string {
	out := make([]string, len(c.pickers))
	for i, pc := range c.pickers {
		out[i] = pc.addr
	}
	return out
}

func (c *client) close() {
	for _, pc := range c.pickers {
		pc.close()
	}
}

// dial connects to a picker's ext_proc port. With useTLS the certificate is
// not verified: pickers serve self-signed ones by default.
func dial(addr string, useTLS bool, conns int) (*pickerConn, error) {
	creds := insecure.NewCredentials()
	if useTLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // a benchmark of a self-signed picker
	}
	c := &pickerConn{addr: addr}
	var ccs []grpc.ClientConnInterface
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
		ccs = append(ccs, conn)
	}
	c.Client = envoy.NewClient(envoy.Options{}, ccs...)
	return c, nil
}

func (c *pickerConn) close() {
	for _, conn := range c.conns {
		conn.Close()
	}
}

// request is a client's HTTP request as the gateway sees it.
type request struct {
	id   string
	path string
	body []byte
}

// envoyRequest is req as Envoy passes it on in FULL_DUPLEX_STREAMED mode,
// announced in protocol_config: the body in chunks of at most 62,000 bytes.
func envoyRequest(req request) envoy.Request {
	return envoy.Request{
		Headers: []string{
			":authority", "gateway.bench",
			":path", req.path,
			":method", "POST",
			":scheme", "http",
			"content-type", "application/json",
			"user-agent", "extproc-load",
			"x-forwarded-proto", "http",
			"x-request-id", req.id,
		},
		Body:       req.body,
		ChunkBytes: maxChunkBytes,
		Mode:       filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		DropEcho:   true,
	}
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
	// via is the picker address the stream went to.
	via string
	// prefiller is the prefill pod a split request's answer names in
	// x-prefiller-host-port ("" when not split).
	prefiller string
}

// sendRequest plays the request path, without waiting for answers until
// the whole body is sent, then reads the deferred headers answer and the
// body streamed back.
func sendRequest(x *envoy.Stream, req request) (placed, error) {
	var p placed
	start := time.Now()
	r, err := x.SendRequest(envoyRequest(req))
	if err != nil {
		return p, err
	}
	p.pick = r.Decided.Sub(start)
	if r.Immediate != nil {
		p.status = int(r.Immediate.GetStatus().GetCode())
		return p, nil
	}
	dest := r.Destination
	if dest == "" {
		dest = r.Metadata
	}
	p.endpoint, _, _ = strings.Cut(dest, ",")
	if p.endpoint == "" {
		return p, errors.New("the headers answer names no destination endpoint")
	}
	// The sidecar reads the first of a comma-separated list, as pd-sidecar does.
	pre, _ := envoy.HeaderValue(r.HeadersAnswer, protocol.PrefillerHeader)
	p.prefiller, _, _ = strings.Cut(pre, ",")
	p.routed = time.Since(start)
	return p, nil
}

// ngfHeaders are req's headers as NGF's shim receives them from NJS: the
// client's own (Go's server keeps Host apart, so it is not among them) and
// the X-EPP-* pair naming the picker. No pseudo-headers: NGF has none.
func ngfHeaders(req request, picker string) http.Header {
	h := http.Header{}
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(req.body)))
	h.Set("User-Agent", "extproc-load")
	h.Set("X-Request-Id", req.id)
	if host, port, err := net.SplitHostPort(picker); err == nil {
		h.Set(ngfshim.PickerHostHeader, host)
		h.Set(ngfshim.PickerPortHeader, port)
	}
	return h
}

// sendNGF plays the request path as NGF's shim does (internal/ngfshim):
// the headers, the whole body in one message, the half-close, then the
// answers until the picker ends the stream. There is never a response
// phase, so the picker detaches the request's reservation at the
// half-close. pick and routed both run to the stream's end: only then
// does the shim answer NGINX.
func sendNGF(x *envoy.Stream, req request, picker string) (placed, error) {
	var p placed
	start := time.Now()
	withBody := len(req.body) > 0
	// As NGF's shim does, a failed send ends the exchange: an answer the
	// picker sent before it is never read.
	if err := x.Send(ngfshim.RequestHeaders(ngfHeaders(req, picker), !withBody)); err != nil {
		return p, fmt.Errorf("sending the request headers: %w", err)
	}
	if withBody {
		if err := x.Send(ngfshim.RequestBody(req.body)); err != nil {
			return p, fmt.Errorf("sending the request body: %w", err)
		}
	}
	if err := x.CloseSend(); err != nil {
		return p, fmt.Errorf("half-closing the stream: %w", err)
	}
	a, err := ngfshim.ReadAnswer(x)
	p.pick = time.Since(start)
	if err != nil {
		return p, fmt.Errorf("reading the picker's answer: %w", err)
	}
	if ir := a.Immediate; ir != nil {
		p.status = int(ir.GetStatus().GetCode())
		return p, nil
	}
	p.endpoint, p.routed = a.Endpoint, p.pick
	if p.endpoint == "" {
		return p, errors.New("the picker's answers name no destination endpoint in raw_value")
	}
	return p, nil
}

// okResponse is a short streamed completion with its usage, as vLLM sends it.
func okResponse(servedBy string, promptTokens int) envoy.Response {
	return envoy.Response{Status: 200, ContentType: "text/event-stream", ServedBy: servedBy, Chunks: [][]byte{
		[]byte(`data: {"id":"cmpl-1","object":"text_completion","model":"bench","choices":[{"index":0,"text":"Hello","finish_reason":null}]}` + "\n\n"),
		fmt.Appendf(nil, `data: {"id":"cmpl-1","object":"text_completion","model":"bench","choices":[{"index":0,"text":" world","finish_reason":"length"}],"usage":{"prompt_tokens":%d,"completion_tokens":2,"total_tokens":%d}}`+"\n\n", promptTokens, promptTokens+2),
		[]byte("data: [DONE]\n\n"),
	}}
}
