package extproc

import (
	"errors"
	"fmt"
	"slices"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// codec is gRPC's proto codec, except for the messages a stream receives
// into an inbound: their body bytes are not copied into a fresh slice per
// message (protobuf always copies bytes fields) but into the stream's own
// reused buffer. The body is most of what a picker receives (a whole prompt
// per request); a fresh slice per chunk was most of the picker's garbage.
// And it writes the answers a request gets (the routing answer, body
// echoes, constants) without protobuf's reflection.
type codec struct{ proto encoding.CodecV2 }

// newCodec returns the codec the ext_proc server is forced to use.
func newCodec() codec { return codec{proto: encoding.GetCodecV2("proto")} }

func (c codec) Name() string { return c.proto.Name() }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	switch m := v.(type) {
	case *preEncoded:
		// Read only: gRPC frees a SliceBuffer by doing nothing.
		return mem.BufferSlice{mem.SliceBuffer(m.wire)}, nil
	case *bodyEcho:
		_, _, _, _, n := m.sizes()
		if mem.IsBelowBufferPoolingThreshold(n) {
			return mem.BufferSlice{mem.SliceBuffer(m.appendWire(make([]byte, 0, n)))}, nil
		}
		pool := mem.DefaultBufferPool()
		buf := pool.Get(n)
		*buf = m.appendWire((*buf)[:0])
		return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
	case *routeAnswer:
		if m.destination == "" {
			break // protobuf omits an empty string: leave that to it
		}
		return mem.BufferSlice{mem.SliceBuffer(m.appendWire(make([]byte, 0, m.sizes().whole)))}, nil
	}
	return c.proto.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	in, ok := v.(*inbound)
	if !ok {
		return c.proto.Unmarshal(data, v)
	}
	return in.unmarshal(data)
}

// inbound is one stream's receiving side: the last message received, whose
// request or response body aliases buf until the next message is received.
// The message is embedded so that any other proto codec decodes into it too
// (copying the body, as usual).
type inbound struct {
	extprocv3.ProcessingRequest
	wire []byte // the message without its body bytes, for proto.Unmarshal
	buf  []byte // the whole message (several gRPC buffers), or its body
}

// Field numbers (envoy/service/ext_proc/v3/external_processor.proto).
const (
	// ProcessingRequest's oneof request: request_headers 2, response_headers
	// 3, request_body 4, response_body 5, request_trailers 6,
	// response_trailers 7.
	fieldFirstOneof   = 2
	fieldLastOneof    = 7
	fieldRequestBody  = 4
	fieldResponseBody = 5
	fieldBodyBytes    = 1 // HttpBody.body
)

var errMalformedMessage = errors.New("malformed ProcessingRequest")

// unmarshal decodes data as proto.Unmarshal would, with the body's bytes
// left in in.buf.
func (in *inbound) unmarshal(data mem.BufferSlice) error {
	var b []byte
	aliased := len(data) == 1 // gRPC frees data's buffers once this returns
	if aliased {
		b = data[0].ReadOnlyData()
	} else {
		in.buf = slices.Grow(in.buf[:0], data.Len())
		for _, d := range data {
			in.buf = append(in.buf, d.ReadOnlyData()...)
		}
		b = in.buf
	}
	body, wire, found, err := splitBody(b, in.wire[:0])
	in.wire = wire
	if err != nil {
		return err
	}
	if err := proto.Unmarshal(in.wire, &in.ProcessingRequest); err != nil {
		return err
	}
	if !found {
		return nil
	}
	if aliased {
		in.buf = append(in.buf[:0], body...)
		body = in.buf
	}
	switch r := in.ProcessingRequest.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestBody:
		r.RequestBody.Body = body
	case *extprocv3.ProcessingRequest_ResponseBody:
		r.ResponseBody.Body = body
	}
	return nil
}

// splitBody appends to wire the message in b with the body bytes removed
// from its request_body and response_body fields (every other field kept,
// in order), and returns the body proto.Unmarshal would give the message's
// oneof: a member seen again is merged into (a later body replaces an
// earlier one), another member replaces it.
func splitBody(b, wire []byte) (body, _ []byte, found bool, err error) {
	member := 0 // the oneof's member so far
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, wire, false, errMalformedMessage
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return nil, wire, false, errMalformedMessage
		}
		field := b[:n+m]
		b = b[n+m:]
		if num < fieldFirstOneof || num > fieldLastOneof || typ != protowire.BytesType {
			wire = append(wire, field...)
			continue
		}
		if int(num) != member {
			member, body, found = int(num), nil, false
		}
		if num != fieldRequestBody && num != fieldResponseBody {
			wire = append(wire, field...)
			continue
		}
		inner, _ := protowire.ConsumeBytes(field[n:])
		chunk, removed, ok, err := findBodyBytes(inner)
		if err != nil {
			return nil, wire, false, err
		}
		if ok {
			body, found = chunk, true
		}
		wire = protowire.AppendTag(wire, num, protowire.BytesType)
		wire = protowire.AppendVarint(wire, uint64(len(inner)-removed))
		wire = appendWithoutBodyBytes(wire, inner)
	}
	return body, wire, found, nil
}

// findBodyBytes returns the last body field of an HttpBody (the value
// proto.Unmarshal keeps) and the bytes all its body fields take.
func findBodyBytes(b []byte) (body []byte, removed int, found bool, err error) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, 0, false, errMalformedMessage
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return nil, 0, false, errMalformedMessage
		}
		if num == fieldBodyBytes && typ == protowire.BytesType {
			body, _ = protowire.ConsumeBytes(b[n:])
			removed += n + m
			found = true
		}
		b = b[n+m:]
	}
	return body, removed, found, nil
}

// appendWithoutBodyBytes appends the fields of an HttpBody (already
// checked by findBodyBytes) but its body fields.
func appendWithoutBodyBytes(dst, b []byte) []byte {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if num != fieldBodyBytes || typ != protowire.BytesType {
			dst = append(dst, b[:n+m]...)
		}
		b = b[n+m:]
	}
	return dst
}

// Field numbers of the body echo: ProcessingResponse.request_body (3) or
// .response_body (4), a BodyResponse's response (1), a CommonResponse's
// body_mutation (3), a BodyMutation's streamed_response (3), and a
// StreamedBodyResponse's body (1) and end_of_stream (2).
const (
	fieldRespRequestBody  = 3
	fieldRespResponseBody = 4
	fieldBodyResponse     = 1
	fieldBodyMutation     = 3
	fieldStreamedResponse = 3
	fieldStreamedBody     = 1
	fieldStreamedEnd      = 2
)

// bodyEcho is the answer to a FULL_DUPLEX_STREAMED body chunk: the chunk
// passed on unchanged. The codec writes its few fields itself: protobuf's
// generic encoder reaches each oneof through reflection, which cost more
// than the rest of the encoding. Any other proto codec encodes it through
// ProtoReflect, as the equivalent message.
type bodyEcho struct {
	response    bool // the response body, else the request body
	chunk       []byte
	endOfStream bool
}

func (e *bodyEcho) message() *extprocv3.ProcessingResponse {
	common := &extprocv3.CommonResponse{BodyMutation: streamedBody(e.chunk, e.endOfStream)}
	if e.response {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: common}}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: common}}}
}

// ProtoReflect makes a bodyEcho a proto message for codecs other than ours.
func (e *bodyEcho) ProtoReflect() protoreflect.Message { return e.message().ProtoReflect() }

// sizes returns the lengths of the nested messages, innermost first:
// StreamedBodyResponse, BodyMutation, CommonResponse, BodyResponse, and the
// whole ProcessingResponse.
func (e *bodyEcho) sizes() (streamed, mutation, common, body, whole int) {
	if len(e.chunk) > 0 {
		streamed = protowire.SizeTag(fieldStreamedBody) + protowire.SizeBytes(len(e.chunk))
	}
	if e.endOfStream {
		streamed += protowire.SizeTag(fieldStreamedEnd) + protowire.SizeVarint(1)
	}
	mutation = protowire.SizeTag(fieldStreamedResponse) + protowire.SizeBytes(streamed)
	common = protowire.SizeTag(fieldBodyMutation) + protowire.SizeBytes(mutation)
	body = protowire.SizeTag(fieldBodyResponse) + protowire.SizeBytes(common)
	whole = protowire.SizeTag(fieldRespRequestBody) + protowire.SizeBytes(body)
	return
}

// appendWire appends the message's wire format: the fields protobuf would
// write, in the order it writes them.
func (e *bodyEcho) appendWire(b []byte) []byte {
	streamed, mutation, common, body, _ := e.sizes()
	field := protowire.Number(fieldRespRequestBody)
	if e.response {
		field = fieldRespResponseBody
	}
	b = protowire.AppendTag(b, field, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(body))
	b = protowire.AppendTag(b, fieldBodyResponse, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(common))
	b = protowire.AppendTag(b, fieldBodyMutation, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(mutation))
	b = protowire.AppendTag(b, fieldStreamedResponse, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(streamed))
	if len(e.chunk) > 0 {
		b = protowire.AppendTag(b, fieldStreamedBody, protowire.BytesType)
		b = protowire.AppendBytes(b, e.chunk)
	}
	if e.endOfStream {
		b = protowire.AppendTag(b, fieldStreamedEnd, protowire.VarintType)
		b = protowire.AppendVarint(b, 1)
	}
	return b
}

// preEncoded is a constant answer, encoded once: many streams send it at
// once, so its bytes are never written after it is made.
type preEncoded struct {
	msg  *extprocv3.ProcessingResponse
	wire []byte
}

func newPreEncoded(m *extprocv3.ProcessingResponse) *preEncoded {
	wire, err := proto.Marshal(m)
	if err != nil {
		panic(fmt.Sprintf("encoding a constant ext_proc answer: %v", err)) // a generated message always encodes
	}
	return &preEncoded{msg: m, wire: wire}
}

// ProtoReflect makes a preEncoded a proto message for codecs other than ours.
func (p *preEncoded) ProtoReflect() protoreflect.Message { return p.msg.ProtoReflect() }

// The constant answers.
var (
	answerResponseHeaders = newPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}}}})
	answerRequestBody = newPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}})
	answerResponseBody = newPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}})
	answerRequestTrailers = newPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{}}})
	answerResponseTrailers = newPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
		ResponseTrailers: &extprocv3.TrailersResponse{}}})
)

// routeAnswer is the answer that routes a request: the destination header
// (and content-length, set again when the body passes on streamed), a
// route cache clear, and the destination in the dynamic metadata the
// gateway's load balancer reads (see routeTo). The codec writes it itself
// for the reason bodyEcho says: the metadata's Values are oneofs.
type routeAnswer struct {
	inBody        bool   // answers the request body (BUFFERED), else the request headers
	destination   string // the chosen endpoint, then its fallbacks, comma-separated
	contentLength string // empty: not set
}

func (r *routeAnswer) message() *extprocv3.ProcessingResponse {
	common, metadata := routeTo(r.destination)
	if r.contentLength != "" {
		mutation := common.GetHeaderMutation()
		mutation.SetHeaders = append(mutation.SetHeaders, headerOption("content-length", r.contentLength))
	}
	resp := &extprocv3.ProcessingResponse{DynamicMetadata: metadata}
	if r.inBody {
		resp.Response = &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}}
	} else {
		resp.Response = &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: common}}
	}
	return resp
}

// ProtoReflect makes a routeAnswer a proto message for codecs other than ours.
func (r *routeAnswer) ProtoReflect() protoreflect.Message { return r.message().ProtoReflect() }

// Field numbers of the routing answer (envoy.service.ext_proc.v3,
// envoy.config.core.v3 and google.protobuf.Struct).
const (
	fieldRespRequestHeaders = 1 // ProcessingResponse.request_headers
	fieldRespMetadata       = 8 // ProcessingResponse.dynamic_metadata
	fieldHeaderMutation     = 2 // CommonResponse.header_mutation
	fieldClearRouteCache    = 5 // CommonResponse.clear_route_cache
	fieldSetHeaders         = 1 // HeaderMutation.set_headers
	fieldOptionHeader       = 1 // HeaderValueOption.header
	fieldOptionAction       = 3 // HeaderValueOption.append_action
	fieldHeaderKey          = 1 // HeaderValue.key
	fieldHeaderRaw          = 3 // HeaderValue.raw_value
	fieldStructFields       = 1 // Struct.fields, a map: entries of key 1, value 2
	fieldValueString        = 3 // Value.string_value
	fieldValueStruct        = 5 // Value.struct_value
)

var overwriteOrAdd = uint64(corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD)

// sizeOption is the length of a HeaderValueOption setting key to value.
func sizeOption(key, value string) int {
	header := protowire.SizeTag(fieldHeaderKey) + protowire.SizeBytes(len(key)) +
		protowire.SizeTag(fieldHeaderRaw) + protowire.SizeBytes(len(value))
	return protowire.SizeTag(fieldOptionHeader) + protowire.SizeBytes(header) +
		protowire.SizeTag(fieldOptionAction) + protowire.SizeVarint(overwriteOrAdd)
}

func appendOption(b []byte, key, value string) []byte {
	b = protowire.AppendTag(b, fieldSetHeaders, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(sizeOption(key, value)))
	b = protowire.AppendTag(b, fieldOptionHeader, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(protowire.SizeTag(fieldHeaderKey)+protowire.SizeBytes(len(key))+
		protowire.SizeTag(fieldHeaderRaw)+protowire.SizeBytes(len(value))))
	b = protowire.AppendTag(b, fieldHeaderKey, protowire.BytesType)
	b = protowire.AppendString(b, key)
	b = protowire.AppendTag(b, fieldHeaderRaw, protowire.BytesType)
	b = protowire.AppendString(b, value)
	b = protowire.AppendTag(b, fieldOptionAction, protowire.VarintType)
	return protowire.AppendVarint(b, overwriteOrAdd)
}

// routeSizes are the lengths of the routing answer's nested messages.
type routeSizes struct {
	mutation, common, response              int
	innerValue, innerEntry, innerStruct     int
	outerValue, outerEntry, metadata, whole int
}

func (r *routeAnswer) sizes() routeSizes {
	var s routeSizes
	s.mutation = protowire.SizeTag(fieldSetHeaders) + protowire.SizeBytes(sizeOption(destinationHeader, r.destination))
	if r.contentLength != "" {
		s.mutation += protowire.SizeTag(fieldSetHeaders) + protowire.SizeBytes(sizeOption("content-length", r.contentLength))
	}
	s.common = protowire.SizeTag(fieldHeaderMutation) + protowire.SizeBytes(s.mutation) +
		protowire.SizeTag(fieldClearRouteCache) + protowire.SizeVarint(1)
	s.response = protowire.SizeTag(fieldBodyResponse) + protowire.SizeBytes(s.common)
	s.innerValue = protowire.SizeTag(fieldValueString) + protowire.SizeBytes(len(r.destination))
	s.innerEntry = protowire.SizeTag(1) + protowire.SizeBytes(len(destinationKey)) + protowire.SizeTag(2) + protowire.SizeBytes(s.innerValue)
	s.innerStruct = protowire.SizeTag(fieldStructFields) + protowire.SizeBytes(s.innerEntry)
	s.outerValue = protowire.SizeTag(fieldValueStruct) + protowire.SizeBytes(s.innerStruct)
	s.outerEntry = protowire.SizeTag(1) + protowire.SizeBytes(len(lbNamespace)) + protowire.SizeTag(2) + protowire.SizeBytes(s.outerValue)
	s.metadata = protowire.SizeTag(fieldStructFields) + protowire.SizeBytes(s.outerEntry)
	s.whole = protowire.SizeTag(fieldRespRequestBody) + protowire.SizeBytes(s.response) +
		protowire.SizeTag(fieldRespMetadata) + protowire.SizeBytes(s.metadata)
	return s
}

// appendWire appends the answer's wire format, fields in the order
// protobuf writes them (the oneof last).
func (r *routeAnswer) appendWire(b []byte) []byte {
	s := r.sizes()
	field := protowire.Number(fieldRespRequestHeaders)
	if r.inBody {
		field = fieldRespRequestBody
	}
	b = protowire.AppendTag(b, fieldRespMetadata, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s.metadata))
	b = protowire.AppendTag(b, fieldStructFields, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s.outerEntry))
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendString(b, lbNamespace)
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s.outerValue))
	b = protowire.AppendTag(b, fieldValueStruct, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s.innerStruct))
	b = protowire.AppendTag(b, fieldStructFields, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s.innerEntry))
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendString(b, destinationKey)
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s.innerValue))
	b = protowire.AppendTag(b, fieldValueString, protowire.BytesType)
	b = protowire.AppendString(b, r.destination)

	b = protowire.AppendTag(b, field, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s.response))
	b = protowire.AppendTag(b, fieldBodyResponse, protowire.BytesType) // HeadersResponse.response is field 1 too
	b = protowire.AppendVarint(b, uint64(s.common))
	b = protowire.AppendTag(b, fieldHeaderMutation, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s.mutation))
	b = appendOption(b, destinationHeader, r.destination)
	if r.contentLength != "" {
		b = appendOption(b, "content-length", r.contentLength)
	}
	b = protowire.AppendTag(b, fieldClearRouteCache, protowire.VarintType)
	b = protowire.AppendVarint(b, 1)
	return b
}
