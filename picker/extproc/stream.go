package extproc

import (
	"fmt"
	"net/netip"
	"runtime/debug"
	"slices"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/request"
)

const (
	fullDuplex = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	streamed   = filterv3.ProcessingMode_STREAMED
	noBody     = filterv3.ProcessingMode_NONE
)

// stream is the state of one ext_proc stream, that is of one HTTP request.
// Only the goroutine serving the stream touches it.
type stream struct {
	s   *Server
	srv extprocv3.ExternalProcessor_ProcessServer

	// Body modes the gateway announced in protocol_config; the gateway's
	// configuration (FULL_DUPLEX_STREAMED both ways) when it announced none.
	requestMode, responseMode filterv3.ProcessingMode_BodySendMode

	path          string
	contentLength int64 // from the content-length header; 0 when absent
	subset        []netip.AddrPort
	hasSubset     bool

	buf      *buffers
	bodySeen bool
	// decided: the request phase is over (routed, or left to the gateway).
	decided   bool
	res       *picker.Reservation // nil until routed
	firstByte bool
}

func (s *Server) newStream(srv extprocv3.ExternalProcessor_ProcessServer) *stream {
	return &stream{s: s, srv: srv, requestMode: fullDuplex, responseMode: fullDuplex, buf: s.getBuffers()}
}

func (st *stream) handle(req *extprocv3.ProcessingRequest) error {
	if pc := req.GetProtocolConfig(); pc != nil {
		st.requestMode, st.responseMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return st.requestHeaders(req.GetMetadataContext(), r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.requestBody(r.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return st.requestTrailers()
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return st.responseHeaders(req.GetMetadataContext(), r.ResponseHeaders)
	case *extprocv3.ProcessingRequest_ResponseBody:
		return st.responseBody(r.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return st.responseTrailers()
	}
	return nil // flow-control-only messages need no answer
}

func (st *stream) requestHeaders(md *corev3.Metadata, h *extprocv3.HttpHeaders) error {
	headers := h.GetHeaders()
	st.path = headerValue(headers, ":path")
	if n, err := strconv.ParseInt(headerValue(headers, "content-length"), 10, 64); err == nil && n > 0 {
		st.contentLength = n
	}
	var bad []string
	st.subset, st.hasSubset, bad = subsetHint(md)
	if len(bad) > 0 {
		st.s.opts.Log.V(1).Info("ignoring subset hint entries that are not ip:port", "entries", bad, "path", st.path)
	}

	switch {
	case h.GetEndOfStream() || st.requestMode == noBody:
		return st.route(false, false) // no body follows: routed on load alone
	case st.requestMode == fullDuplex:
		return nil // answered once the body is complete
	default:
		// The gateway holds the body back until its headers are answered;
		// the destination goes into the body's answer.
		return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: unrouted()},
		}})
	}
}

func (st *stream) requestBody(b *extprocv3.HttpBody) error {
	if st.decided {
		return nil // nothing is expected after the body's end; ignore stragglers
	}
	chunk := b.GetBody()
	if limit := st.s.opts.MaxRequestBytes; limit > 0 && int64(len(st.buf.body)+len(chunk)) > limit {
		return st.reject(fmt.Errorf("%w: the body exceeds the picker's maxRequestBytes of %d bytes", errBodyTooLarge, limit))
	}
	if !st.bodySeen {
		st.bodySeen = true
		if limit := st.s.opts.MaxRequestBytes; st.contentLength > 0 && (limit <= 0 || st.contentLength <= limit) {
			st.buf.body = slices.Grow(st.buf.body, int(st.contentLength))
		}
	}
	st.buf.body = append(st.buf.body, chunk...)

	switch {
	case st.requestMode == fullDuplex:
		if !b.GetEndOfStream() {
			return nil
		}
		if err := st.route(true, false); err != nil {
			return err
		}
		return st.echoRequestBody(true)
	case st.requestMode == streamed && !b.GetEndOfStream():
		// Each streamed chunk must be answered; it passes on unchanged.
		return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}},
		}})
	default:
		// BUFFERED and BUFFERED_PARTIAL send one body message, whether or
		// not trailers follow; STREAMED has reached its last chunk.
		return st.route(true, true)
	}
}

func (st *stream) requestTrailers() error {
	if !st.decided {
		if st.requestMode != fullDuplex {
			// Only a STREAMED body ending in trailers gets here: no answer
			// left can carry the destination, so the gateway routes alone.
			st.decided = true
			st.s.opts.Log.V(1).Info("request not routed: its STREAMED body ended with trailers", "path", st.path)
		} else {
			// The body ended with trailers instead of end_of_stream.
			if err := st.route(st.bodySeen, false); err != nil {
				return err
			}
			if st.bodySeen {
				if err := st.echoRequestBody(false); err != nil {
					return err
				}
			}
		}
	}
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{},
	}})
}

func (st *stream) responseHeaders(md *corev3.Metadata, h *extprocv3.HttpHeaders) error {
	if addr, ok := servedBy(md); ok && st.res != nil {
		st.res.ServedBy(addr)
	}
	if code, err := strconv.Atoi(headerValue(h.GetHeaders(), ":status")); err == nil && code >= 500 {
		st.s.metrics.upstreamErrors.Inc()
	}
	if h.GetEndOfStream() {
		st.release()
	}
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}},
	}})
}

func (st *stream) responseBody(b *extprocv3.HttpBody) error {
	if !st.firstByte && len(b.GetBody()) > 0 {
		st.firstByte = true
		if st.res != nil {
			st.res.FirstByte()
		}
	}
	if b.GetEndOfStream() {
		st.release()
	}
	common := &extprocv3.CommonResponse{}
	if st.responseMode == fullDuplex {
		common.BodyMutation = streamedBody(b.GetBody(), b.GetEndOfStream())
	}
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: &extprocv3.BodyResponse{Response: common},
	}})
}

func (st *stream) responseTrailers() error {
	st.release()
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
		ResponseTrailers: &extprocv3.TrailersResponse{},
	}})
}

// route decides where the request goes and answers the message that carries
// the decision: the request headers (bodiless requests, and
// FULL_DUPLEX_STREAMED mode where their answer was held back until the body
// was complete) or the request body (the other modes, whose headers were
// answered before the body came).
func (st *stream) route(parseBody, inBodyAnswer bool) error {
	res, err := st.pick(parseBody)
	if err != nil {
		return st.reject(err)
	}
	st.res, st.decided = res, true
	st.s.metrics.requests.WithLabelValues("200").Inc()

	common, metadata := routeTo(res.Endpoints())
	resp := &extprocv3.ProcessingResponse{DynamicMetadata: metadata}
	if inBodyAnswer {
		resp.Response = &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}}
	} else {
		resp.Response = &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: common}}
	}
	return st.send(resp)
}

func (st *stream) pick(parseBody bool) (*picker.Reservation, error) {
	req := picker.Request{Subset: st.subset, HasSubset: st.hasSubset}
	if parseBody {
		st.s.metrics.requestBytes.Observe(float64(len(st.buf.body)))
		parsed, err := request.Parse(st.path, st.buf.body, st.buf.prompt)
		// Prompt is always appended to the buffer given (never a view of the
		// body): keeping it recycles the buffer at whatever size it grew to.
		// It stays untouched until the stream ends, after the release, since
		// the picker may read it again when ServedBy moves the request.
		st.buf.prompt = parsed.Prompt
		if err != nil {
			return nil, fmt.Errorf("parsing the request body: %w", err)
		}
		req.Model, req.Prompt = parsed.Model, parsed.Prompt
	}
	return st.s.picker.Pick(req)
}

// echoRequestBody sends the buffered body back unchanged, in chunks the
// gateway accepts; a zero-length body is one empty chunk. The chunks alias
// the pooled buffer: gRPC has encoded each message when Send returns, and the
// buffer goes back to the pool only when the stream ends.
func (st *stream) echoRequestBody(endOfStream bool) error {
	body := st.buf.body
	for {
		n := min(len(body), maxChunkBytes)
		last := n == len(body)
		err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
				BodyMutation: streamedBody(body[:n], last && endOfStream),
			}},
		}})
		if err != nil || last {
			return err
		}
		body = body[n:]
	}
}

func streamedBody(chunk []byte, endOfStream bool) *extprocv3.BodyMutation {
	return &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: endOfStream},
	}}
}

// reject answers the request with the HTTP error errorAnswers gives for err
// and ends the stream.
func (st *stream) reject(err error) error {
	httpStatus, body := answerFor(err)
	st.decided = true
	st.s.metrics.requests.WithLabelValues(strconv.Itoa(httpStatus)).Inc()
	if httpStatus >= 500 && httpStatus != 503 {
		st.s.opts.Log.Error(err, "request failed", "path", st.path, "status", httpStatus)
	} else {
		st.s.opts.Log.V(1).Info("request refused", "path", st.path, "status", httpStatus, "reason", err.Error())
	}
	if err := st.send(immediateResponse(httpStatus, body)); err != nil {
		return err
	}
	return errAnswered
}

// recovered answers a panic in this stream: a 500 if the gateway still takes
// one, and an error for this stream only.
func (st *stream) recovered(r any) error {
	st.s.metrics.streamPanics.Inc()
	st.s.opts.Log.Error(fmt.Errorf("panic: %v", r), "ext_proc stream failed", "path", st.path, "stack", string(debug.Stack()))
	if !st.decided {
		st.s.metrics.requests.WithLabelValues("500").Inc()
	}
	httpStatus, body := answerFor(errPanic)
	_ = st.srv.Send(immediateResponse(httpStatus, body)) // best effort: the stream may be gone
	return status.Error(codes.Internal, errPanic.Error())
}

func (st *stream) release() {
	if st.res != nil {
		st.res.Release()
	}
}

// close runs when the stream ends, however it ends.
func (st *stream) close() {
	st.release()
	st.s.putBuffers(st.buf)
}

func (st *stream) send(resp *extprocv3.ProcessingResponse) error {
	if err := st.srv.Send(resp); err != nil {
		return fmt.Errorf("sending to the gateway: %w", err)
	}
	return nil
}
