package extproc

import (
	"fmt"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// The answers the codec writes itself. Each is a proto message too
// (ProtoReflect gives the equivalent generated message), and a test checks
// that each writes exactly the bytes protobuf writes for that message.

// lenField is the size of a length-delimited field of n bytes.
func lenField(num protowire.Number, n int) int {
	return protowire.SizeTag(num) + protowire.SizeBytes(n)
}

// appendLen appends the tag and length of a length-delimited field of n
// bytes; its n bytes follow.
func appendLen(b []byte, num protowire.Number, n int) []byte {
	return protowire.AppendVarint(protowire.AppendTag(b, num, protowire.BytesType), uint64(n))
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
		streamed = lenField(fieldStreamedBody, len(e.chunk))
	}
	if e.endOfStream {
		streamed += protowire.SizeTag(fieldStreamedEnd) + protowire.SizeVarint(1)
	}
	mutation = lenField(fieldStreamedResponse, streamed)
	common = lenField(fieldBodyMutation, mutation)
	body = lenField(fieldBodyResponse, common)
	whole = lenField(fieldRespRequestBody, body)
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
	b = appendLen(b, field, body)
	b = appendLen(b, fieldBodyResponse, common)
	b = appendLen(b, fieldBodyMutation, mutation)
	b = appendLen(b, fieldStreamedResponse, streamed)
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
	fieldStructFields       = 1 // Struct.fields, a map of entries:
	fieldEntryKey           = 1 // its entries' key
	fieldEntryValue         = 2 // and value
	fieldValueString        = 3 // Value.string_value
	fieldValueStruct        = 5 // Value.struct_value
)

var overwriteOrAdd = uint64(corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD)

// sizeHeader is the length of a HeaderValue of key and raw value.
func sizeHeader(key, value string) int {
	return lenField(fieldHeaderKey, len(key)) + lenField(fieldHeaderRaw, len(value))
}

// sizeOption is the length of a HeaderValueOption setting key to value.
func sizeOption(key, value string) int {
	return lenField(fieldOptionHeader, sizeHeader(key, value)) +
		protowire.SizeTag(fieldOptionAction) + protowire.SizeVarint(overwriteOrAdd)
}

// appendOption appends a set_headers entry setting key to value.
func appendOption(b []byte, key, value string) []byte {
	b = appendLen(b, fieldSetHeaders, sizeOption(key, value))
	b = appendLen(b, fieldOptionHeader, sizeHeader(key, value))
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
	s.mutation = lenField(fieldSetHeaders, sizeOption(destinationHeader, r.destination))
	if r.contentLength != "" {
		s.mutation += lenField(fieldSetHeaders, sizeOption("content-length", r.contentLength))
	}
	s.common = lenField(fieldHeaderMutation, s.mutation) + protowire.SizeTag(fieldClearRouteCache) + protowire.SizeVarint(1)
	s.response = lenField(fieldBodyResponse, s.common)
	s.innerValue = lenField(fieldValueString, len(r.destination))
	s.innerEntry = lenField(fieldEntryKey, len(destinationKey)) + lenField(fieldEntryValue, s.innerValue)
	s.innerStruct = lenField(fieldStructFields, s.innerEntry)
	s.outerValue = lenField(fieldValueStruct, s.innerStruct)
	s.outerEntry = lenField(fieldEntryKey, len(lbNamespace)) + lenField(fieldEntryValue, s.outerValue)
	s.metadata = lenField(fieldStructFields, s.outerEntry)
	s.whole = lenField(fieldRespRequestBody, s.response) + lenField(fieldRespMetadata, s.metadata)
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
	b = appendLen(b, fieldRespMetadata, s.metadata)
	b = appendLen(b, fieldStructFields, s.outerEntry)
	b = appendLen(b, fieldEntryKey, len(lbNamespace))
	b = append(b, lbNamespace...)
	b = appendLen(b, fieldEntryValue, s.outerValue)
	b = appendLen(b, fieldValueStruct, s.innerStruct)
	b = appendLen(b, fieldStructFields, s.innerEntry)
	b = appendLen(b, fieldEntryKey, len(destinationKey))
	b = append(b, destinationKey...)
	b = appendLen(b, fieldEntryValue, s.innerValue)
	b = appendLen(b, fieldValueString, len(r.destination))
	b = append(b, r.destination...)

	b = appendLen(b, field, s.response)
	b = appendLen(b, fieldBodyResponse, s.common) // HeadersResponse.response is field 1 too
	b = appendLen(b, fieldHeaderMutation, s.mutation)
	b = appendOption(b, destinationHeader, r.destination)
	if r.contentLength != "" {
		b = appendOption(b, "content-length", r.contentLength)
	}
	b = protowire.AppendTag(b, fieldClearRouteCache, protowire.VarintType)
	b = protowire.AppendVarint(b, 1)
	return b
}
