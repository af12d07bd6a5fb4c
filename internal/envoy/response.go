package envoy

import (
	"bytes"
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
	// Chunks are the body's chunks; none: end_of_stream on the headers.
	Chunks [][]byte
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
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headers, EndOfStream: len(r.Chunks) == 0},
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
	got, err := s.stream.Recv()
	if err != nil {
		return fmt.Errorf("waiting for the response headers answer: %w", err)
	}
	if got.GetResponseHeaders() == nil {
		return fmt.Errorf("answer to the response headers is %T", got.GetResponse())
	}
	return nil
}

// SendResponseChunk plays one response body chunk. With wait, or for the
// last chunk (eos), it then reads the answers to it: for the last, until
// the body streamed back ends. Whether to wait is the caller's to know
// (see Response.ContentType): Envoy itself does not wait.
func (s *Stream) SendResponseChunk(chunk []byte, eos, wait bool) error {
	if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: chunk, EndOfStream: eos},
	}}); err != nil {
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
