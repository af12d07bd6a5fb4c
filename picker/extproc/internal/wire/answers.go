package wire

import (
	"fmt"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tallyepp/tally/picker/protocol"
)

// The answers the Codec writes itself. Each is a proto message too
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

// BodyEcho is the answer to a FULL_DUPLEX_STREAMED body chunk: the chunk
// passed on unchanged. The Codec writes its few fields itself: protobuf's
// generic encoder reaches each oneof through reflection, which cost more
// than the rest of the encoding. Any other proto codec encodes it through
// ProtoReflect, as the equivalent message.
type BodyEcho struct {
	Response    bool // the response body, else the request body
	Chunk       []byte
	EndOfStream bool
}

func (e *BodyEcho) message() *extprocv3.ProcessingResponse {
	common := &extprocv3.CommonResponse{BodyMutation: streamedBody(e.Chunk, e.EndOfStream)}
	if e.Response {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: common}}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: common}}}
}

// ProtoReflect makes a BodyEcho a proto message for codecs other than ours.
func (e *BodyEcho) ProtoReflect() protoreflect.Message { return e.message().ProtoReflect() }

func streamedBody(chunk []byte, endOfStream bool) *extprocv3.BodyMutation {
	return &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: endOfStream},
	}}
}

// sizes returns the lengths of the nested messages, innermost first:
// StreamedBodyResponse, BodyMutation, CommonResponse, BodyResponse, and the
// whole ProcessingResponse.
func (e *BodyEcho) sizes() (streamed, mutation, common, body, whole int) {
	if len(e.Chunk) > 0 {
		streamed = lenField(fieldStreamedBody, len(e.Chunk))
	}
	if e.EndOfStream {
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
func (e *BodyEcho) appendWire(b []byte) []byte {
	streamed, mutation, common, body, _ := e.sizes()
	field := protowire.Number(fieldRespRequestBody)
	if e.Response {
		field = fieldRespResponseBody
	}
	b = appendLen(b, field, body)
	b = appendLen(b, fieldBodyResponse, common)
	b = appendLen(b, fieldBodyMutation, mutation)
	b = appendLen(b, fieldStreamedResponse, streamed)
	if len(e.Chunk) > 0 {
		b = protowire.AppendTag(b, fieldStreamedBody, protowire.BytesType)
		b = protowire.AppendBytes(b, e.Chunk)
	}
	if e.EndOfStream {
		b = protowire.AppendTag(b, fieldStreamedEnd, protowire.VarintType)
		b = protowire.AppendVarint(b, 1)
	}
	return b
}

// PreEncoded is a constant answer, encoded once: many streams send it at
// once, so its bytes are never written after it is made.
type PreEncoded struct {
	msg  *extprocv3.ProcessingResponse
	wire []byte
}

// NewPreEncoded encodes m, which must not change afterwards: the answer
// sends the bytes it had then.
func NewPreEncoded(m *extprocv3.ProcessingResponse) *PreEncoded {
	wire, err := proto.Marshal(m)
	if err != nil {
		panic(fmt.Sprintf("encoding a constant ext_proc answer: %v", err)) // a generated message always encodes
	}
	return &PreEncoded{msg: m, wire: wire}
}

// ProtoReflect makes a PreEncoded a proto message for codecs other than ours.
func (p *PreEncoded) ProtoReflect() protoreflect.Message { return p.msg.ProtoReflect() }

// RouteAnswer is the answer that routes a request: the destination header
// (and content-length, set again when the body passes on streamed), a
// route cache clear, and the destination in the dynamic metadata the
// gateway's load balancer reads (see routeTo). The Codec writes it itself
// for the reason BodyEcho says: the metadata's Values are oneofs.
type RouteAnswer struct {
	InBody        bool   // answers the request body (BUFFERED), else the request headers
	Destination   string // the chosen endpoint, then its fallbacks, comma-separated
	ContentLength string // empty: not set
}

// Message is the equivalent generated message, for an answer that must
// carry more than a RouteAnswer holds.
func (r *RouteAnswer) Message() *extprocv3.ProcessingResponse {
	common, metadata := routeTo(r.Destination)
	if r.ContentLength != "" {
		mutation := common.GetHeaderMutation()
		mutation.SetHeaders = append(mutation.SetHeaders, HeaderOption("content-length", r.ContentLength))
	}
	resp := &extprocv3.ProcessingResponse{DynamicMetadata: metadata}
	if r.InBody {
		resp.Response = &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}}
	} else {
		resp.Response = &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: common}}
	}
	return resp
}

// ProtoReflect makes a RouteAnswer a proto message for codecs other than ours.
func (r *RouteAnswer) ProtoReflect() protoreflect.Message { return r.Message().ProtoReflect() }

// routeTo is the generated form of a routing answer to value: the
// destination header (and a route cache clear so the gateway routes on
// it), and the metadata the gateway's load balancer reads.
func routeTo(value string) (*extprocv3.CommonResponse, *structpb.Struct) {
	common := &extprocv3.CommonResponse{
		ClearRouteCache: true,
		HeaderMutation: &extprocv3.HeaderMutation{
			SetHeaders: []*corev3.HeaderValueOption{HeaderOption(protocol.DestinationHeader, value)},
		},
	}
	metadata := &structpb.Struct{Fields: map[string]*structpb.Value{
		protocol.LBNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			protocol.DestinationKey: structpb.NewStringValue(value),
		}}),
	}}
	return common, metadata
}

// HeaderOption is the generated message that sets header key to value,
// as the answers this package writes set their headers.
func HeaderOption(key, value string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: key, RawValue: []byte(value)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}

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

func (r *RouteAnswer) sizes() routeSizes {
	var s routeSizes
	s.mutation = lenField(fieldSetHeaders, sizeOption(protocol.DestinationHeader, r.Destination))
	if r.ContentLength != "" {
		s.mutation += lenField(fieldSetHeaders, sizeOption("content-length", r.ContentLength))
	}
	s.common = lenField(fieldHeaderMutation, s.mutation) + protowire.SizeTag(fieldClearRouteCache) + protowire.SizeVarint(1)
	s.response = lenField(fieldBodyResponse, s.common)
	s.innerValue = lenField(fieldValueString, len(r.Destination))
	s.innerEntry = lenField(fieldEntryKey, len(protocol.DestinationKey)) + lenField(fieldEntryValue, s.innerValue)
	s.innerStruct = lenField(fieldStructFields, s.innerEntry)
	s.outerValue = lenField(fieldValueStruct, s.innerStruct)
	s.outerEntry = lenField(fieldEntryKey, len(protocol.LBNamespace)) + lenField(fieldEntryValue, s.outerValue)
	s.metadata = lenField(fieldStructFields, s.outerEntry)
	s.whole = lenField(fieldRespRequestBody, s.response) + lenField(fieldRespMetadata, s.metadata)
	return s
}

// appendWire appends the answer's wire format, fields in the order
// protobuf writes them (the oneof last).
func (r *RouteAnswer) appendWire(b []byte) []byte {
	s := r.sizes()
	field := protowire.Number(fieldRespRequestHeaders)
	if r.InBody {
		field = fieldRespRequestBody
	}
	b = appendLen(b, fieldRespMetadata, s.metadata)
	b = appendLen(b, fieldStructFields, s.outerEntry)
	b = appendLen(b, fieldEntryKey, len(protocol.LBNamespace))
	b = append(b, protocol.LBNamespace...)
	b = appendLen(b, fieldEntryValue, s.outerValue)
	b = appendLen(b, fieldValueStruct, s.innerStruct)
	b = appendLen(b, fieldStructFields, s.innerEntry)
	b = appendLen(b, fieldEntryKey, len(protocol.DestinationKey))
	b = append(b, protocol.DestinationKey...)
	b = appendLen(b, fieldEntryValue, s.innerValue)
	b = appendLen(b, fieldValueString, len(r.Destination))
	b = append(b, r.Destination...)

	b = appendLen(b, field, s.response)
	b = appendLen(b, fieldBodyResponse, s.common) // HeadersResponse.response is field 1 too
	b = appendLen(b, fieldHeaderMutation, s.mutation)
	b = appendOption(b, protocol.DestinationHeader, r.Destination)
	if r.ContentLength != "" {
		b = appendOption(b, "content-length", r.ContentLength)
	}
	b = protowire.AppendTag(b, fieldClearRouteCache, protowire.VarintType)
	b = protowire.AppendVarint(b, 1)
	return b
}
