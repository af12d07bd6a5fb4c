package envoy

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tallyepp/tally/picker/protocol"
)

// eventStream is the content type of a streamed (SSE) response.
const eventStream = "text/event-stream"

// Response is a model server's response as the gateway relays it.
type Response struct {
	Status int
	// ContentType is the response's content-type ("": none sent). The
	// picker answers a text/event-stream body chunk for chunk and any
	// other once, at its end.
	ContentType string
	// ServedBy names the endpoint that served (Envoy's envoy.lb
	// metadata); "": none.
	ServedBy string
	// Headers are the response's other headers as key, value pairs.
	Headers []string
	// Chunks are the body's chunks; none: end_of_stream on the headers.
	Chunks [][]byte
	// BodyFollows announces a body (no end_of_stream on the headers) that
	// the caller sends itself as it arrives (ResponseChunk), Chunks being
	// empty: a gateway relaying its upstream.
	BodyFollows bool
}

// Respond plays a whole response and the end of the stream; it returns
// once the picker has ended the stream (and so has released the request).
func (s *Stream) Respond(r Response) error {
	if err := s.SendResponseHeaders(r); err != nil {
		return err
	}
	for i, c := range r.Chunks {
		if err := s.SendResponseChunk(c, i == len(r.Chunks)-1, r.ContentType == eventStream); err != nil {
			return err
		}
	}
	return s.Finish()
}

// ResponseHeadersMessage is the response headers message of r.
func (s *Stream) ResponseHeadersMessage(r Response) *extprocv3.ProcessingRequest {
	headers := HeaderMap(":status", strconv.Itoa(r.Status))
	if r.ContentType != "" {
		headers.Headers = append(headers.Headers, &corev3.HeaderValue{Key: "content-type", RawValue: []byte(r.ContentType)})
	}
	for i := 0; i+1 < len(r.Headers); i += 2 {
		headers.Headers = append(headers.Headers, &corev3.HeaderValue{Key: r.Headers[i], RawValue: []byte(r.Headers[i+1])})
	}
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headers, EndOfStream: len(r.Chunks) == 0 && !r.BodyFollows},
	}}
	if r.ServedBy != "" {
		msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			protocol.LBNamespace: {Fields: map[string]*structpb.Value{protocol.ServedKey: structpb.NewStringValue(r.ServedBy)}},
		}}
	}
	return msg
}

// SendResponseHeaders plays the response headers and reads their answer.
func (s *Stream) SendResponseHeaders(r Response) error {
	if err := s.Send(s.ResponseHeadersMessage(r)); err != nil {
		return err
	}
	immediate, _, err := s.RecvResponseHeadersAnswer()
	if err == nil && immediate != nil {
		return errors.New("answer to the response headers is an immediate response")
	}
	return err
}

// RecvResponseHeadersAnswer reads the picker's answer to the response
// headers: the mutation to apply to them, or an immediate response that
// replaces the response.
func (s *Stream) RecvResponseHeadersAnswer() (*extprocv3.ImmediateResponse, *extprocv3.CommonResponse, error) {
	for {
		resp, err := s.stream.Recv()
		if err != nil {
			return nil, nil, fmt.Errorf("waiting for the response headers answer: %w", err)
		}
		switch m := resp.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			return m.ImmediateResponse, nil, nil
		case *extprocv3.ProcessingResponse_ResponseHeaders:
			return nil, m.ResponseHeaders.GetResponse(), nil
		case *extprocv3.ProcessingResponse_RequestTrailers:
			// Not sent, so nothing to apply.
		default:
			return nil, nil, fmt.Errorf("answer to the response headers is %T", m)
		}
	}
}

// ResponseChunk is a response body message.
func ResponseChunk(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos},
	}}
}

// RecvResponseChunk reads the next response body chunk the picker streams
// back in FULL_DUPLEX_STREAMED mode, and whether it is the last.
func (s *Stream) RecvResponseChunk() ([]byte, bool, error) {
	for {
		resp, err := s.stream.Recv()
		if err != nil {
			return nil, false, fmt.Errorf("receiving response body from the picker: %w", err)
		}
		switch m := resp.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ResponseBody:
			sb := m.ResponseBody.GetResponse().GetBodyMutation().GetStreamedResponse()
			if sb == nil {
				return nil, false, errors.New("the picker's response body response has no streamed_response, which FULL_DUPLEX_STREAMED mode requires")
			}
			return sb.GetBody(), sb.GetEndOfStream(), nil
		case *extprocv3.ProcessingResponse_ResponseTrailers:
			// No trailers are sent; nothing to apply.
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			return nil, false, errors.New("the picker sent an immediate response after the response started")
		default:
			return nil, false, fmt.Errorf("unexpected %T on the response body path", m)
		}
	}
}

// SendResponseChunk plays one response body chunk. With wait, or for the
// last chunk (eos), it then reads the answers to it: for the last, until
// the body streamed back ends. Whether to wait is the caller's to know
// (see Response.ContentType): Envoy itself does not wait.
func (s *Stream) SendResponseChunk(chunk []byte, eos, wait bool) error {
	if err := s.Send(ResponseChunk(chunk, eos)); err != nil {
		return err
	}
	if !wait && !eos {
		return nil
	}
	for {
		got, err := s.stream.Recv()
		if err != nil {
			return fmt.Errorf("waiting for the response body answer: %w", err)
		}
		common := got.GetResponseBody().GetResponse()
		if common == nil {
			return fmt.Errorf("answer to a response body chunk is %T", got.GetResponse())
		}
		if s.o.Strict {
			if err := s.checkChunkAnswer(chunk, eos, common); err != nil {
				return err
			}
		}
		sb := common.GetBodyMutation().GetStreamedResponse()
		if sb == nil || !eos || sb.GetEndOfStream() {
			return nil
		}
	}
}

// checkChunkAnswer is Strict's check of the answer to a response chunk:
// in FULL_DUPLEX_STREAMED mode the chunk comes back unchanged; in the
// others the answer leaves the body alone or replaces the chunk whole
// (the client's model name put back after a rewrite).
func (s *Stream) checkChunkAnswer(chunk []byte, eos bool, common *extprocv3.CommonResponse) error {
	if s.ResponseMode != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		if m := common.GetBodyMutation(); m != nil && m.GetMutation() != nil {
			if _, whole := m.GetMutation().(*extprocv3.BodyMutation_Body); !whole {
				return fmt.Errorf("response chunk answered with a body mutation other than a whole body in mode %v: %v", s.ResponseMode, common)
			}
		}
		return nil
	}
	sb := common.GetBodyMutation().GetStreamedResponse()
	if !bytes.Equal(sb.GetBody(), chunk) || sb.GetEndOfStream() != eos {
		return fmt.Errorf("response chunk came back as %q (end %v), want %q (end %v)", sb.GetBody(), sb.GetEndOfStream(), chunk, eos)
	}
	return nil
}
