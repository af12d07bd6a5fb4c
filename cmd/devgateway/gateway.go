package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/structpb"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/picker/protocol"
)

// requestIDHeader is the header Envoy gives each request a UUID in.
const requestIDHeader = "x-request-id"

const (
	defaultBodyChunkBytes     = 16 << 10
	defaultPickerTimeout      = 10 * time.Second
	defaultStreamCloseTimeout = 5 * time.Second
	upstreamDialTimeout       = 5 * time.Second
)

// PoolView is what the gateway knows of the InferencePool, used only when the
// picker cannot decide.
type PoolView struct {
	FailureMode infv1.EndpointPickerFailureMode
	// Endpoints are "ip:port" strings, the pool's Ready endpoints.
	Endpoints []string
}

// Gateway is an http.Handler that routes each request the way Envoy does
// with the endpoint picker as its ext_proc filter: one ext_proc stream per
// request, request and response bodies in FULL_DUPLEX_STREAMED mode, the
// destination taken from the picker's header mutation.
//
// Like httputil.ReverseProxy, it is a plain struct: set Picker and Pool, and
// optionally the other fields. A Gateway must not be copied after first use.
type Gateway struct {
	// Picker is the ext_proc client of the endpoint picker. Required.
	Picker extprocv3.ExternalProcessorClient
	// Pool reports the pool's failure mode and endpoints. It is called only
	// when the picker is unreachable or its stream fails before a decision.
	// Nil means FailClose.
	Pool func() PoolView
	// Transport sends requests to model servers. Nil means a transport with a
	// dial timeout that leaves Accept-Encoding and bodies untouched.
	Transport http.RoundTripper
	// BodyChunkBytes is the largest request or response body message sent to
	// the picker. Zero means 16 KiB.
	BodyChunkBytes int
	// PickerTimeout bounds the time from the start of a request to the
	// picker's decision, and the wait for its response-headers reply. Zero
	// means 10 s.
	PickerTimeout time.Duration
	// StreamCloseTimeout bounds how long a finished stream, half-closed by the
	// gateway, waits for the picker to end it before it is cancelled. Zero
	// means 5 s.
	StreamCloseTimeout time.Duration
	// Log receives one line per request at debug level and failures at warn.
	// Nil discards.
	Log *slog.Logger
	// Choose returns a number in [0, n): the first endpoint tried under
	// FailOpen. Nil means math/rand/v2.IntN.
	Choose func(n int) int

	transportOnce    sync.Once
	defaultTransport http.RoundTripper
	closing          sync.WaitGroup
}

// Wait blocks until the requests being served have returned and the
// streams the gateway is still closing have ended (each one within
// StreamCloseTimeout). Call it after the HTTP server shut down.
func (g *Gateway) Wait() { g.closing.Wait() }

func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// Counted, so that a stream's close (closeStream) is counted while the
	// count is above zero: a Wait after the server's Close, with a handler
	// still returning, does not race with it.
	g.closing.Add(1)
	defer g.closing.Done()
	// Only the picker names the destination; a client cannot choose the pod.
	r.Header.Del(protocol.DestinationHeader)
	if r.Header.Get(requestIDHeader) == "" {
		r.Header.Set(requestIDHeader, uuid.NewString())
	}
	// The stream outlives the handler by a short, bounded close (see
	// closeStream), so it does not hang off r.Context, which ends when the
	// handler returns; a client disconnect still cancels it at once.
	streamCtx, cancelStream := context.WithCancel(context.WithoutCancel(r.Context()))
	stopDisconnectWatch := context.AfterFunc(r.Context(), cancelStream)
	ex := &exchange{
		g:            g,
		w:            w,
		r:            r,
		streamCtx:    streamCtx,
		cancelStream: cancelStream,
		log:          g.logger().With("request_id", r.Header.Get(requestIDHeader), "method", r.Method, "path", r.URL.RequestURI()),
	}
	clean := false
	defer func() {
		stopDisconnectWatch()
		if clean {
			g.closeStream(ex.stream, cancelStream)
		} else {
			cancelStream()
		}
	}()
	clean = ex.run()
}

func (g *Gateway) logger() *slog.Logger {
	if g.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return g.Log
}

func (g *Gateway) chunkBytes() int {
	if g.BodyChunkBytes > 0 {
		return g.BodyChunkBytes
	}
	return defaultBodyChunkBytes
}

func (g *Gateway) pickerTimeout() time.Duration {
	if g.PickerTimeout > 0 {
		return g.PickerTimeout
	}
	return defaultPickerTimeout
}

func (g *Gateway) transport() http.RoundTripper {
	if g.Transport != nil {
		return g.Transport
	}
	g.transportOnce.Do(func() {
		g.defaultTransport = &http.Transport{
			DialContext:         (&net.Dialer{Timeout: upstreamDialTimeout}).DialContext,
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     90 * time.Second,
			// A gateway passes Accept-Encoding and bodies through as they are.
			DisableCompression: true,
		}
	})
	return g.defaultTransport
}

func (g *Gateway) pool() PoolView {
	if g.Pool == nil {
		return PoolView{FailureMode: infv1.EndpointPickerFailClose}
	}
	return g.Pool()
}

// closeStream ends a stream whose exchange completed the way Envoy does:
// half-close, let the picker finish, cancel if it has not within
// StreamCloseTimeout.
func (g *Gateway) closeStream(stream extprocv3.ExternalProcessor_ProcessClient, cancel context.CancelFunc) {
	if stream == nil || stream.CloseSend() != nil {
		cancel()
		return
	}
	timeout := g.StreamCloseTimeout
	if timeout <= 0 {
		timeout = defaultStreamCloseTimeout
	}
	g.closing.Add(1)
	go func() {
		defer g.closing.Done()
		defer cancel()
		t := time.AfterFunc(timeout, cancel)
		defer t.Stop()
		for {
			if _, err := stream.Recv(); err != nil {
				return
			}
		}
	}()
}

// exchange is one client request and its ext_proc stream.
type exchange struct {
	g            *Gateway
	w            http.ResponseWriter
	r            *http.Request
	streamCtx    context.Context
	cancelStream context.CancelFunc
	stream       extprocv3.ExternalProcessor_ProcessClient
	log          *slog.Logger
}

// decision is the picker's answer on the request path.
type decision struct {
	immediate *extprocv3.ImmediateResponse
	headers   *extprocv3.CommonResponse
	metadata  *structpb.Struct
	body      []byte
}

// upload is the request body as read from the client and sent to the picker.
type upload struct {
	done     chan struct{}
	original []byte // everything read, kept for a FailOpen retry without the picker
	readErr  error
}

// run serves the request. It reports whether the stream ended cleanly and
// may be half-closed rather than cancelled.
func (ex *exchange) run() bool {
	bodiless := ex.r.ContentLength == 0
	var timedOut atomic.Bool
	timer := time.AfterFunc(ex.g.pickerTimeout(), func() { timedOut.Store(true); ex.cancelStream() })
	up, d, err := ex.requestPath(bodiless)
	stopped := timer.Stop()
	if up != nil && (err != nil || d.immediate != nil) {
		// The client body is still being read; it must be complete (for a
		// FailOpen retry) and no longer in use before the handler returns.
		ex.cancelStream()
		<-up.done
	}
	if up != nil && up.readErr != nil {
		ex.log.Warn("reading the request body failed", "err", up.readErr)
		ex.cancelStream()
		if ex.r.Context().Err() == nil {
			http.Error(ex.w, "reading the request body failed", http.StatusBadRequest)
		}
		return false
	}
	if err != nil {
		if ex.r.Context().Err() != nil {
			return false // the client left; nobody to answer
		}
		if !stopped && timedOut.Load() {
			err = fmt.Errorf("no decision within %s: %w", ex.g.pickerTimeout(), err)
		}
		var original []byte
		switch {
		case up != nil:
			original = up.original
		case !bodiless:
			// The stream failed before the body was sent: read it here.
			var readErr error
			if original, readErr = io.ReadAll(ex.r.Body); readErr != nil {
				ex.log.Warn("reading the request body failed", "err", readErr)
				http.Error(ex.w, "reading the request body failed", http.StatusBadRequest)
				return false
			}
		}
		ex.failOver(err, original)
		return false
	}
	if d.immediate != nil {
		ex.log.Debug("picker answered", "status", immediateStatus(d.immediate))
		writeImmediate(ex.w, d.immediate)
		return false
	}

	out, err := newUpstreamRequest(ex.r, d)
	if err != nil {
		ex.log.Warn("applying the picker's header mutation failed", "err", err)
		http.Error(ex.w, "bad header mutation from the endpoint picker", http.StatusInternalServerError)
		return false
	}
	if len(out.destinations) == 0 {
		ex.log.Warn("the picker's decision names no destination")
		http.Error(ex.w, "the endpoint picker named no destination endpoint", http.StatusServiceUnavailable)
		return false
	}
	resp, served, err := ex.g.forward(ex.r.Context(), out, ex.log)
	if err != nil {
		if ex.r.Context().Err() != nil {
			return false
		}
		resp = localReply(http.StatusServiceUnavailable, "upstream connect error: "+err.Error())
	}
	ex.log.Debug("routed", "destination", strings.Join(out.destinations, ","), "served", served, "status", resp.StatusCode)
	return ex.responsePath(resp, served)
}

// requestPath opens the stream, sends the request headers and body, and
// returns the picker's decision. The returned upload, when not nil, is still
// running if err is not nil or the decision is an immediate response.
func (ex *exchange) requestPath(bodiless bool) (*upload, *decision, error) {
	stream, err := ex.g.Picker.Process(ex.streamCtx)
	if err != nil {
		return nil, nil, fmt.Errorf("opening the ext_proc stream: %w", err)
	}
	ex.stream = stream
	first := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers:     requestHeaderMap(ex.r),
			EndOfStream: bodiless,
		}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		},
	}
	if err := stream.Send(first); err != nil {
		return nil, nil, fmt.Errorf("sending the request headers: %w", err)
	}
	var up *upload
	if !bodiless {
		up = &upload{done: make(chan struct{})}
		go ex.sendRequestBody(up)
	}
	d, err := ex.awaitDecision(bodiless)
	if err == nil && d.immediate == nil && up != nil {
		// The picker has returned the whole body, so it has read all of ours.
		<-up.done
	}
	return up, d, err
}

// sendRequestBody streams the client's body to the picker, the last chunk
// with end_of_stream. It keeps reading after a send failure so that a
// FailOpen retry has the whole body.
func (ex *exchange) sendRequestBody(up *upload) {
	defer close(up.done)
	size := ex.g.chunkBytes()
	var all bytes.Buffer
	if ex.r.ContentLength > 0 {
		all.Grow(int(ex.r.ContentLength))
	}
	br := bufio.NewReaderSize(ex.r.Body, size)
	sending := true
	for {
		chunk := make([]byte, size)
		n, err := io.ReadFull(br, chunk)
		last := false
		switch {
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			last = true
		case err != nil:
			up.readErr = err
			ex.cancelStream() // no end_of_stream will come: stop waiting for a decision
			return
		default:
			// A full chunk: it is the last one if nothing follows.
			if _, err := br.Peek(1); errors.Is(err, io.EOF) {
				last = true
			} else if err != nil {
				up.readErr = err
				ex.cancelStream()
				return
			}
		}
		all.Write(chunk[:n])
		if sending {
			msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
				RequestBody: &extprocv3.HttpBody{Body: chunk[:n], EndOfStream: last},
			}}
			if err := ex.stream.Send(msg); err != nil {
				sending = false // the receiving side sees the stream's error
			}
		}
		if last {
			up.original = all.Bytes()
			return
		}
	}
}

// awaitDecision receives until the picker has answered the request headers
// and returned the whole body, or answered with an immediate response.
func (ex *exchange) awaitDecision(bodiless bool) (*decision, error) {
	d := &decision{}
	headersDone, bodyDone := false, bodiless
	for !headersDone || !bodyDone {
		msg, err := ex.stream.Recv()
		if err != nil {
			return nil, fmt.Errorf("receiving the picker's decision: %w", err)
		}
		switch m := msg.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			d.immediate = m.ImmediateResponse
			return d, nil
		case *extprocv3.ProcessingResponse_RequestHeaders:
			if headersDone {
				return nil, errors.New("the picker answered the request headers twice")
			}
			headersDone = true
			d.headers = m.RequestHeaders.GetResponse()
			d.metadata = msg.GetDynamicMetadata()
		case *extprocv3.ProcessingResponse_RequestBody:
			if bodyDone {
				return nil, errors.New("the picker returned request body after its end_of_stream")
			}
			sb := m.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse()
			if sb == nil {
				return nil, errors.New("the picker's request body response has no streamed_response, which FULL_DUPLEX_STREAMED mode requires")
			}
			d.body = append(d.body, sb.GetBody()...)
			bodyDone = sb.GetEndOfStream()
		case *extprocv3.ProcessingResponse_RequestTrailers:
			// No request trailers are sent; nothing to apply.
		default:
			return nil, fmt.Errorf("unexpected %T on the request path", m)
		}
	}
	return d, nil
}

// upstreamRequest is the request as the picker returned it.
type upstreamRequest struct {
	method, path, host string
	header             http.Header
	body               []byte
	destinations       []string
}

func newUpstreamRequest(r *http.Request, d *decision) (*upstreamRequest, error) {
	h := r.Header.Clone()
	// Pseudo-headers ride along in the header map so that the mutation can
	// rewrite them as it can in Envoy.
	h[":path"] = []string{r.URL.RequestURI()}
	h[":authority"] = []string{r.Host}
	if err := applyHeaderMutation(h, d.headers.GetHeaderMutation()); err != nil {
		return nil, err
	}
	out := &upstreamRequest{
		method: r.Method,
		path:   h.Get(":path"),
		host:   h.Get(":authority"),
		header: h,
		body:   d.body,
	}
	for _, k := range []string{":path", ":authority", ":method", ":scheme"} {
		delete(h, k)
	}
	out.destinations = parseDestinations(h.Values(protocol.DestinationHeader))
	if len(out.destinations) == 0 {
		// The header is what Envoy's original-destination cluster reads; the
		// metadata carries the same value.
		if v := d.metadata.GetFields()[protocol.LBNamespace].GetStructValue().GetFields()[protocol.DestinationKey].GetStringValue(); v != "" {
			out.destinations = parseDestinations([]string{v})
		}
	}
	return out, nil
}

// parseDestinations splits "ip:port,ip:port" values into an ordered list.
func parseDestinations(values []string) []string {
	var out []string
	for _, v := range values {
		for _, ep := range strings.Split(v, ",") {
			if ep = strings.TrimSpace(ep); ep != "" {
				out = append(out, ep)
			}
		}
	}
	return out
}

// forward sends the request to the destinations in order, moving on only
// when a connection cannot be opened (nothing was sent, so a retry is safe).
// It returns the response and the endpoint that served it.
func (g *Gateway) forward(ctx context.Context, u *upstreamRequest, log *slog.Logger) (*http.Response, string, error) {
	var errs []error
	for _, ep := range u.destinations {
		req, err := u.build(ctx, ep)
		if err != nil {
			errs = append(errs, fmt.Errorf("endpoint %q: %w", ep, err))
			continue
		}
		resp, err := g.transport().RoundTrip(req)
		if err == nil {
			return resp, ep, nil
		}
		if ctx.Err() != nil {
			return nil, "", ctx.Err()
		}
		errs = append(errs, fmt.Errorf("endpoint %s: %w", ep, err))
		if !isDialError(err) {
			// The request may have reached the server: do not send it twice.
			break
		}
		log.Debug("endpoint refused the connection; trying the next", "endpoint", ep, "err", err)
	}
	return nil, "", errors.Join(errs...)
}

func (u *upstreamRequest) build(ctx context.Context, endpoint string) (*http.Request, error) {
	target, err := url.Parse("http://" + endpoint + u.path)
	if err != nil {
		return nil, fmt.Errorf("building the upstream URL: %w", err)
	}
	if target.Host != endpoint {
		return nil, fmt.Errorf("%q is not host:port", endpoint)
	}
	req, err := http.NewRequestWithContext(ctx, u.method, target.String(), bytes.NewReader(u.body))
	if err != nil {
		return nil, fmt.Errorf("building the upstream request: %w", err)
	}
	req.Host = u.host
	req.Header = u.header.Clone()
	removeHopByHop(req.Header)
	// The body may have been rewritten: its length is what the picker returned.
	req.Header.Del("Content-Length")
	if _, ok := req.Header["User-Agent"]; !ok {
		req.Header.Set("User-Agent", "") // keep Go's default out
	}
	return req, nil
}

func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// responsePath sends the response headers (with the endpoint that served),
// applies the picker's answer, then streams the body through the picker to
// the client chunk by chunk. It reports whether the stream ended cleanly.
func (ex *exchange) responsePath(resp *http.Response, served string) bool {
	defer resp.Body.Close()
	bodiless := resp.Body == http.NoBody || ex.r.Method == http.MethodHead
	msg := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers:     responseHeaderMap(resp),
			EndOfStream: bodiless,
		}},
	}
	if served != "" {
		msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			protocol.LBNamespace: {Fields: map[string]*structpb.Value{protocol.ServedKey: structpb.NewStringValue(served)}},
		}}
	}
	timer := time.AfterFunc(ex.g.pickerTimeout(), ex.cancelStream)
	answer, err := ex.sendResponseHeaders(msg)
	timer.Stop()
	if err != nil {
		ex.log.Warn("the picker stream failed on the response path", "err", err)
		if ex.r.Context().Err() == nil {
			// As Envoy does when an ext_proc stream fails and failure is not allowed.
			http.Error(ex.w, "endpoint picker error", http.StatusInternalServerError)
		}
		return false
	}
	if answer.immediate != nil {
		writeImmediate(ex.w, answer.immediate)
		return true
	}

	h := resp.Header.Clone()
	removeHopByHop(h)
	h[":status"] = []string{strconv.Itoa(resp.StatusCode)}
	if err := applyHeaderMutation(h, answer.headers.GetHeaderMutation()); err != nil {
		ex.log.Warn("applying the picker's response header mutation failed", "err", err)
		http.Error(ex.w, "bad header mutation from the endpoint picker", http.StatusInternalServerError)
		return false
	}
	status, err := strconv.Atoi(h.Get(":status"))
	if err != nil || status < 100 || status > 999 {
		ex.log.Warn("the picker set an invalid :status", "status", h.Get(":status"))
		http.Error(ex.w, "bad :status from the endpoint picker", http.StatusInternalServerError)
		return false
	}
	delete(h, ":status")
	if !bodiless {
		// The picker may change the body; its length is known only at the end.
		h.Del("Content-Length")
	}
	for k, v := range h {
		ex.w.Header()[k] = v
	}
	ex.w.WriteHeader(status)
	rc := http.NewResponseController(ex.w)
	_ = rc.Flush() // streaming clients see the headers now
	if bodiless {
		return true
	}

	pumpDone := make(chan error, 1)
	go func() { pumpDone <- ex.sendResponseBody(resp.Body) }()
	relayErr := ex.relayResponseBody(rc)
	if relayErr != nil {
		// Unblock the pump: it may be waiting on the upstream or the stream.
		ex.cancelStream()
		resp.Body.Close()
	}
	pumpErr := <-pumpDone
	if err := errors.Join(relayErr, pumpErr); err != nil {
		if ex.r.Context().Err() == nil {
			ex.log.Warn("streaming the response failed; cutting the connection", "err", err)
		}
		ex.cancelStream()
		// The status is sent: a truncated body must not look complete.
		panic(http.ErrAbortHandler)
	}
	return true
}

// sendResponseHeaders sends the response headers and waits for the picker's
// answer to them.
func (ex *exchange) sendResponseHeaders(msg *extprocv3.ProcessingRequest) (*decision, error) {
	if err := ex.stream.Send(msg); err != nil {
		return nil, fmt.Errorf("sending the response headers: %w", err)
	}
	for {
		resp, err := ex.stream.Recv()
		if err != nil {
			return nil, fmt.Errorf("receiving the response headers answer: %w", err)
		}
		switch m := resp.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			return &decision{immediate: m.ImmediateResponse}, nil
		case *extprocv3.ProcessingResponse_ResponseHeaders:
			return &decision{headers: m.ResponseHeaders.GetResponse()}, nil
		case *extprocv3.ProcessingResponse_RequestTrailers:
			// Not sent, so nothing to apply.
		default:
			return nil, fmt.Errorf("unexpected %T while waiting for the response headers answer", m)
		}
	}
}

// sendResponseBody sends the upstream body to the picker as it arrives,
// then an empty end_of_stream message.
func (ex *exchange) sendResponseBody(body io.Reader) error {
	size := ex.g.chunkBytes()
	for {
		chunk := make([]byte, size)
		n, err := body.Read(chunk)
		if n > 0 {
			msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
				ResponseBody: &extprocv3.HttpBody{Body: chunk[:n]},
			}}
			if serr := ex.stream.Send(msg); serr != nil {
				return fmt.Errorf("sending response body to the picker: %w", serr)
			}
		}
		if errors.Is(err, io.EOF) {
			msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
				ResponseBody: &extprocv3.HttpBody{EndOfStream: true},
			}}
			if serr := ex.stream.Send(msg); serr != nil {
				return fmt.Errorf("sending the response end_of_stream to the picker: %w", serr)
			}
			return nil
		}
		if err != nil {
			// Stop the relay too: the picker will never see end_of_stream.
			ex.cancelStream()
			return fmt.Errorf("reading the upstream response body: %w", err)
		}
	}
}

// relayResponseBody writes the picker's returned chunks to the client as
// they arrive, flushing each, until end_of_stream.
func (ex *exchange) relayResponseBody(rc *http.ResponseController) error {
	for {
		msg, err := ex.stream.Recv()
		if err != nil {
			return fmt.Errorf("receiving response body from the picker: %w", err)
		}
		switch m := msg.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ResponseBody:
			sb := m.ResponseBody.GetResponse().GetBodyMutation().GetStreamedResponse()
			if sb == nil {
				return errors.New("the picker's response body response has no streamed_response, which FULL_DUPLEX_STREAMED mode requires")
			}
			if len(sb.GetBody()) > 0 {
				if _, err := ex.w.Write(sb.GetBody()); err != nil {
					return fmt.Errorf("writing to the client: %w", err)
				}
				if err := rc.Flush(); err != nil {
					return fmt.Errorf("flushing to the client: %w", err)
				}
			}
			if sb.GetEndOfStream() {
				return nil
			}
		case *extprocv3.ProcessingResponse_ResponseTrailers:
			// No trailers are sent; nothing to apply.
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			return errors.New("the picker sent an immediate response after the response started")
		default:
			return fmt.Errorf("unexpected %T on the response body path", m)
		}
	}
}

// failOver answers a request the picker could not decide, per the pool's
// failure mode: FailOpen sends the original request to a pool endpoint
// chosen at random (the others in turn if it refuses the connection),
// FailClose answers 503.
func (ex *exchange) failOver(cause error, original []byte) {
	view := ex.g.pool()
	if view.FailureMode != infv1.EndpointPickerFailOpen || len(view.Endpoints) == 0 {
		ex.log.Warn("the endpoint picker did not decide; failing closed", "err", cause, "failure_mode", view.FailureMode, "endpoints", len(view.Endpoints))
		http.Error(ex.w, "endpoint picker unavailable", http.StatusServiceUnavailable)
		return
	}
	choose := ex.g.Choose
	if choose == nil {
		choose = rand.IntN
	}
	start := choose(len(view.Endpoints))
	order := append(slices.Clone(view.Endpoints[start:]), view.Endpoints[:start]...)
	u := &upstreamRequest{
		method:       ex.r.Method,
		path:         ex.r.URL.RequestURI(),
		host:         ex.r.Host,
		header:       ex.r.Header,
		body:         original,
		destinations: order,
	}
	resp, served, err := ex.g.forward(ex.r.Context(), u, ex.log)
	if err != nil {
		if ex.r.Context().Err() == nil {
			ex.log.Warn("failing open found no endpoint", "err", err)
			http.Error(ex.w, "upstream connect error", http.StatusServiceUnavailable)
		}
		return
	}
	defer resp.Body.Close()
	ex.log.Warn("the endpoint picker did not decide; failed open", "err", cause, "served", served)
	h := resp.Header.Clone()
	removeHopByHop(h)
	for k, v := range h {
		ex.w.Header()[k] = v
	}
	ex.w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(ex.w)
	_ = rc.Flush()
	buf := make([]byte, ex.g.chunkBytes())
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := ex.w.Write(buf[:n]); werr != nil {
				return
			}
			_ = rc.Flush()
		}
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			panic(http.ErrAbortHandler)
		}
	}
}

// localReply is the response the gateway itself gives, as Envoy's local
// replies do; it still goes through the picker's response path.
func localReply(status int, body string) *http.Response {
	return &http.Response{
		StatusCode:    status,
		Header:        http.Header{"Content-Type": {"text/plain; charset=utf-8"}},
		Body:          io.NopCloser(strings.NewReader(body)),
		ContentLength: int64(len(body)),
	}
}

func immediateStatus(ir *extprocv3.ImmediateResponse) int {
	// Envoy answers 200 when the status is missing or not a valid response code.
	if c := int(ir.GetStatus().GetCode()); c >= 200 && c <= 999 {
		return c
	}
	return http.StatusOK
}

func writeImmediate(w http.ResponseWriter, ir *extprocv3.ImmediateResponse) {
	h := http.Header{}
	if len(ir.GetBody()) > 0 {
		h.Set("Content-Type", "text/plain")
	}
	// A bad mutation of a local reply is dropped, not fatal: the status and
	// body still reach the client.
	_ = applyHeaderMutation(h, ir.GetHeaders())
	for k, v := range h {
		if !strings.HasPrefix(k, ":") {
			w.Header()[k] = v
		}
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(ir.GetBody())))
	w.WriteHeader(immediateStatus(ir))
	_, _ = w.Write(ir.GetBody())
}

// applyHeaderMutation applies removals, then sets, with Envoy's semantics:
// an unset append_action falls back to the deprecated append flag, which
// defaults to overwrite.
func applyHeaderMutation(h http.Header, m *extprocv3.HeaderMutation) error {
	if m == nil {
		return nil
	}
	for _, name := range m.GetRemoveHeaders() {
		delete(h, headerKey(name))
	}
	for _, opt := range m.GetSetHeaders() {
		hv := opt.GetHeader()
		if hv == nil {
			continue
		}
		if hv.GetValue() != "" && len(hv.GetRawValue()) > 0 {
			return fmt.Errorf("header %q sets both value and raw_value", hv.GetKey())
		}
		value := hv.GetValue()
		if len(hv.GetRawValue()) > 0 {
			value = string(hv.GetRawValue())
		}
		key := headerKey(hv.GetKey())
		if key == "" {
			return errors.New("a header mutation has an empty key")
		}
		_, exists := h[key]
		switch opt.GetAppendAction() {
		case corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD:
			if opt.GetAppend().GetValue() {
				h[key] = append(h[key], value)
			} else {
				h[key] = []string{value}
			}
		case corev3.HeaderValueOption_ADD_IF_ABSENT:
			if !exists {
				h[key] = []string{value}
			}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD:
			h[key] = []string{value}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
			if exists {
				h[key] = []string{value}
			}
		default:
			return fmt.Errorf("header %q has an unknown append_action %d", hv.GetKey(), opt.GetAppendAction())
		}
	}
	return nil
}

// headerKey maps a wire header name to its http.Header key; pseudo-headers
// stay lower case.
func headerKey(name string) string {
	name = strings.ToLower(name)
	if strings.HasPrefix(name, ":") {
		return name
	}
	return http.CanonicalHeaderKey(name)
}

// removeHopByHop deletes the connection-level headers a proxy does not
// forward (RFC 9110 §7.6.1).
func removeHopByHop(h http.Header) {
	for _, f := range h.Values("Connection") {
		for _, name := range strings.Split(f, ",") {
			if name = strings.TrimSpace(name); name != "" {
				h.Del(name)
			}
		}
	}
	for _, name := range [...]string{
		"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
		"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
	} {
		h.Del(name)
	}
}

func requestHeaderMap(r *http.Request) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{}
	add := func(k, v string) {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: k, RawValue: []byte(v)})
	}
	add(":method", r.Method)
	add(":scheme", "http")
	add(":path", r.URL.RequestURI())
	add(":authority", r.Host)
	h := r.Header.Clone()
	removeHopByHop(h)
	if r.ContentLength > 0 && h.Get("Content-Length") == "" {
		h.Set("Content-Length", strconv.FormatInt(r.ContentLength, 10))
	}
	appendHeaders(hm, h)
	return hm
}

func responseHeaderMap(resp *http.Response) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":status", RawValue: []byte(strconv.Itoa(resp.StatusCode))},
	}}
	h := resp.Header.Clone()
	removeHopByHop(h)
	appendHeaders(hm, h)
	return hm
}

// appendHeaders adds h in a stable order, lower-cased as HTTP/2 and Envoy
// spell them, one entry per value.
func appendHeaders(hm *corev3.HeaderMap, h http.Header) {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		lk := strings.ToLower(k)
		for _, v := range h[k] {
			hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: lk, RawValue: []byte(v)})
		}
	}
}
