package envoy

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tallyepp/tally/picker/protocol"
)

// defaultChunkBytes is the size of the body chunks a Request is sent in
// when it names none.
const defaultChunkBytes = 16 << 10

// Request is a client's HTTP request as the gateway passes it to the picker.
type Request struct {
	// Headers are the request's headers as key, value pairs, in the order
	// sent, pseudo-headers (":path", ":method", ...) among them; a shim in
	// front of a gateway that is not Envoy sends none. A content-length
	// for Body follows them unless Chunked.
	Headers []string
	// Body is the request body; nil: a bodiless request (end_of_stream on
	// the headers).
	Body []byte
	// Chunked leaves content-length out, as for a chunked HTTP/1.1 body.
	Chunked bool
	// BodyFollows announces a body (no end_of_stream on the headers) that
	// the caller sends itself as it arrives, Body being nil: a gateway
	// reading its client. Headers carry its content-length, if known.
	BodyFollows bool
	// ChunkBytes is the size of the body chunks sent in
	// FULL_DUPLEX_STREAMED mode; 0: 16 KiB.
	ChunkBytes int
	// Mode, when set, is announced in protocol_config for both bodies, as
	// Envoy 1.35 and later do; unset, none is announced and the body is
	// streamed as in FULL_DUPLEX_STREAMED. Other modes send the body in
	// one message once the headers are answered (BUFFERED,
	// BUFFERED_PARTIAL, or a STREAMED body of one chunk).
	Mode filterv3.ProcessingMode_BodySendMode
	// ResponseMode, when set with Mode, is announced for the response
	// body instead of Mode (an Envoy configured with two modes).
	ResponseMode filterv3.ProcessingMode_BodySendMode
	// SubsetHint, when set, is the gateway's subset hint: the endpoints
	// the pick may come from.
	SubsetHint *structpb.Value
	// DropEcho checks the body streamed back without keeping it
	// (Routed.Body stays nil): a gateway in the picker's process then does
	// not run the picker's garbage collector for it.
	DropEcho bool
}

// Routed is what the gateway learnt from the request path.
type Routed struct {
	// Immediate is the picker's refusal (an immediate response); nil: routed.
	Immediate *extprocv3.ImmediateResponse
	// HeadersAnswer and BodyAnswer are the answers to the request headers
	// and to a body sent in one message (not FULL_DUPLEX_STREAMED).
	HeadersAnswer, BodyAnswer *extprocv3.CommonResponse
	// Destination is the destination header's value, Metadata the
	// destination in the envoy.lb metadata.
	Destination, Metadata string
	// Body is the body passed on upstream (nil with DropEcho), BodyChunks
	// the sizes of the chunks it came back in (FULL_DUPLEX_STREAMED).
	Body       []byte
	BodyChunks []int
	// Decided is when the answer with the routing decision (or the
	// refusal) arrived.
	Decided time.Time
}

// First is the first of the destinations: the endpoint Envoy tries first.
func (r Routed) First() string {
	first, _, _ := strings.Cut(r.Destination, ",")
	return first
}

// HeadersMessage is the request headers message of req: the first of a
// stream.
func (s *Stream) HeadersMessage(req Request) *extprocv3.ProcessingRequest {
	headers := HeaderMap(req.Headers...)
	if req.Body != nil && !req.Chunked {
		headers.Headers = append(headers.Headers, &corev3.HeaderValue{Key: "content-length", RawValue: strconv.AppendInt(nil, int64(len(req.Body)), 10)})
	}
	m := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: headers, EndOfStream: req.Body == nil && !req.BodyFollows},
	}}
	if req.SubsetHint != nil {
		m.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			protocol.SubsetNamespace: {Fields: map[string]*structpb.Value{protocol.SubsetKey: req.SubsetHint}},
		}}
	}
	if req.Mode != filterv3.ProcessingMode_NONE {
		m.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: req.Mode, ResponseBodyMode: req.responseMode()}
	}
	return m
}

// responseMode is the response body mode announced with Mode.
func (req Request) responseMode() filterv3.ProcessingMode_BodySendMode {
	if req.ResponseMode != filterv3.ProcessingMode_NONE {
		return req.ResponseMode
	}
	return req.Mode
}

// SendRequest plays the request path: the headers, the body, and the
// answers the picker gives, until the request is routed or refused. In
// FULL_DUPLEX_STREAMED mode (announced or not) it sends the body in chunks
// without waiting for answers, as Envoy does, then reads the held-back
// headers answer and the body streamed back; in the other modes it waits
// for the headers answer, then sends the body in one message and reads its
// answer.
func (s *Stream) SendRequest(req Request) (Routed, error) {
	if req.Mode != filterv3.ProcessingMode_NONE {
		s.ResponseMode = req.responseMode()
	}
	var r Routed
	if err := s.Send(s.HeadersMessage(req)); err != nil {
		return r, err
	}
	if req.Body == nil {
		return r, s.RecvHeadersAnswer(&r)
	}
	if req.Mode != filterv3.ProcessingMode_NONE && req.Mode != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return r, s.sendBodyAfterAnswer(req, &r)
	}
	chunk := req.ChunkBytes
	if chunk == 0 {
		chunk = defaultChunkBytes
	}
	for off := 0; ; off += chunk {
		end := min(off+chunk, len(req.Body))
		err := s.Send(BodyChunk(req.Body[off:end], end == len(req.Body)))
		if errors.Is(err, io.EOF) {
			break // the picker answered early and closed: read its answer
		}
		if err != nil {
			return r, err
		}
		if end == len(req.Body) {
			break
		}
	}
	if err := s.RecvHeadersAnswer(&r); err != nil || r.Immediate != nil {
		return r, err
	}
	var echoed int
	for {
		resp, err := s.stream.Recv()
		if err != nil {
			return r, fmt.Errorf("waiting for the request body (%d of %d bytes back): %w", echoed, len(req.Body), err)
		}
		sb := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sb == nil {
			return r, fmt.Errorf("got %T while the request body streams back, want streamed request body chunks", resp.GetResponse())
		}
		if !req.DropEcho {
			r.Body = append(r.Body, sb.GetBody()...)
		}
		echoed += len(sb.GetBody())
		r.BodyChunks = append(r.BodyChunks, len(sb.GetBody()))
		if sb.GetEndOfStream() {
			return r, nil
		}
	}
}

// sendBodyAfterAnswer plays the body of a mode other than
// FULL_DUPLEX_STREAMED: Envoy holds it back until the headers are
// answered, then sends it as one message.
func (s *Stream) sendBodyAfterAnswer(req Request, r *Routed) error {
	if err := s.RecvHeadersAnswer(r); err != nil || r.Immediate != nil {
		return err
	}
	if err := s.Send(BodyChunk(req.Body, true)); err != nil {
		return err
	}
	resp, err := s.stream.Recv()
	if err != nil {
		return fmt.Errorf("waiting for the body answer: %w", err)
	}
	if r.Immediate = resp.GetImmediateResponse(); r.Immediate != nil {
		r.Decided = time.Now()
		return nil
	}
	common := resp.GetRequestBody().GetResponse()
	if common == nil {
		return fmt.Errorf("answer to the body is %T, want a request body answer", resp.GetResponse())
	}
	r.BodyAnswer = common
	if r.Destination == "" { // only BUFFERED routes in the body answer
		r.Destination, _ = HeaderValue(common, protocol.DestinationHeader)
		r.Metadata = LBMetadata(resp, protocol.DestinationKey)
		r.Decided = time.Now()
	}
	r.Body = req.Body // the body passes on unless mutated
	if bm, ok := common.GetBodyMutation().GetMutation().(*extprocv3.BodyMutation_Body); ok {
		r.Body = bm.Body
	}
	return nil
}

// RecvHeadersAnswer reads the answer to the request headers into r: a
// refusal, or a headers answer and the destination it names (if any).
func (s *Stream) RecvHeadersAnswer(r *Routed) error {
	resp, err := s.stream.Recv()
	if err != nil {
		return fmt.Errorf("waiting for the headers answer: %w", err)
	}
	r.Decided = time.Now()
	if r.Immediate = resp.GetImmediateResponse(); r.Immediate != nil {
		return nil
	}
	h := resp.GetRequestHeaders()
	if h == nil {
		return fmt.Errorf("answer to the request headers is %T, want a headers answer", resp.GetResponse())
	}
	r.HeadersAnswer = h.GetResponse()
	r.Destination, _ = HeaderValue(h.GetResponse(), protocol.DestinationHeader)
	r.Metadata = LBMetadata(resp, protocol.DestinationKey)
	return nil
}

// RecvDecision reads the picker's answers on the request path of a
// FULL_DUPLEX_STREAMED stream into r, while the caller may still be
// sending the body: until the picker has answered the headers and
// streamed the whole body back (a bodiless request: answered the
// headers), or refused the request.
func (s *Stream) RecvDecision(r *Routed, bodiless bool) error {
	headersDone, bodyDone := false, bodiless
	for !headersDone || !bodyDone {
		resp, err := s.stream.Recv()
		if err != nil {
			return fmt.Errorf("receiving the picker's decision: %w", err)
		}
		switch m := resp.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			r.Immediate, r.Decided = m.ImmediateResponse, time.Now()
			return nil
		case *extprocv3.ProcessingResponse_RequestHeaders:
			if headersDone {
				return errors.New("the picker answered the request headers twice")
			}
			headersDone = true
			r.HeadersAnswer, r.Decided = m.RequestHeaders.GetResponse(), time.Now()
			r.Destination, _ = HeaderValue(r.HeadersAnswer, protocol.DestinationHeader)
			r.Metadata = LBMetadata(resp, protocol.DestinationKey)
		case *extprocv3.ProcessingResponse_RequestBody:
			if bodyDone {
				return errors.New("the picker returned request body after its end_of_stream")
			}
			sb := m.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse()
			if sb == nil {
				return errors.New("the picker's request body response has no streamed_response, which FULL_DUPLEX_STREAMED mode requires")
			}
			r.Body = append(r.Body, sb.GetBody()...)
			r.BodyChunks = append(r.BodyChunks, len(sb.GetBody()))
			bodyDone = sb.GetEndOfStream()
		case *extprocv3.ProcessingResponse_RequestTrailers:
			// No request trailers are sent; nothing to apply.
		default:
			return fmt.Errorf("unexpected %T on the request path", m)
		}
	}
	return nil
}

// BodyChunk is a request body message.
func BodyChunk(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos},
	}}
}

// HeaderMap is the headers kv lists as key, value pairs, as raw values
// (Envoy sends raw_value, never value).
func HeaderMap(kv ...string) *corev3.HeaderMap {
	h := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, 0, len(kv)/2+1)}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Headers = append(h.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return h
}

// HeaderValue is the value an answer's header mutation sets key to, and
// whether it sets it.
func HeaderValue(c *extprocv3.CommonResponse, key string) (string, bool) {
	for _, h := range c.GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == key {
			return string(h.GetHeader().GetRawValue()) + h.GetHeader().GetValue(), true
		}
	}
	return "", false
}

// LBMetadata is the string an answer's dynamic metadata sets under key in
// the envoy.lb namespace ("" if none).
func LBMetadata(resp *extprocv3.ProcessingResponse, key string) string {
	return resp.GetDynamicMetadata().GetFields()[protocol.LBNamespace].GetStructValue().GetFields()[key].GetStringValue()
}
