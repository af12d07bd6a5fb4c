package wire

import (
	"bytes"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// bufferSlice cuts b into gRPC buffers of at most size bytes (0: one buffer).
func bufferSlice(b []byte, size int) mem.BufferSlice {
	if size <= 0 {
		size = max(len(b), 1)
	}
	var s mem.BufferSlice
	for len(b) > 0 {
		n := min(size, len(b))
		s = append(s, mem.SliceBuffer(bytes.Clone(b[:n])))
		b = b[n:]
	}
	return s
}

// checkLikeProto decodes wire with the Codec into a reused Inbound and
// with proto.Unmarshal, and fails unless both fail or both give equal
// messages.
func checkLikeProto(t *testing.T, c Codec, in *Inbound, wire []byte, bufSize int) {
	t.Helper()
	var want extprocv3.ProcessingRequest
	wantErr := proto.Unmarshal(wire, &want)
	gotErr := c.Unmarshal(bufferSlice(wire, bufSize), in)
	if (gotErr == nil) != (wantErr == nil) {
		t.Fatalf("codec error %v, proto.Unmarshal error %v, for %x", gotErr, wantErr, wire)
	}
	if wantErr == nil && !proto.Equal(&in.ProcessingRequest, &want) {
		t.Fatalf("codec decoded\n%v\nproto.Unmarshal\n%v\nfrom %x", &in.ProcessingRequest, &want, wire)
	}
}

func TestCodecDecodesAsProtoDoes(t *testing.T) {
	body := bytes.Repeat([]byte(`{"prompt":"abc"}`), 5000)
	meta, err := structpb.NewStruct(map[string]any{"k": "v"})
	if err != nil {
		t.Fatal(err)
	}
	msgs := []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":path", RawValue: []byte("/v1/completions")}}}}},
			MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb": meta}},
			ProtocolConfig:  &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body[:10]}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{EndOfStream: true}}},
		{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("data: [DONE]\n\n"), EndOfStream: true}},
			MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb": meta}}},
		{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}},
		{},
	}
	c := NewCodec(&DirtyPool{})
	var in Inbound // reused, as a stream reuses it
	for _, m := range msgs {
		wire, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		for _, size := range []int{0, 1, 7, 16384} {
			checkLikeProto(t, c, &in, wire, size)
		}
	}

	// Fields a broken client may repeat: proto merges a oneof member seen
	// twice (the later body wins, an absent one keeps the earlier) and
	// replaces it when another member follows.
	field := func(num protowire.Number, m proto.Message) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), b)
	}
	withBody := &extprocv3.HttpBody{Body: []byte("first")}
	later := &extprocv3.HttpBody{Body: []byte("second")}
	noBody := &extprocv3.HttpBody{EndOfStream: true}
	headers := &extprocv3.HttpHeaders{EndOfStream: true}
	twoBodies := append(protowire.AppendTag(nil, fieldBodyBytes, protowire.BytesType), 1, 'a')
	twoBodies = protowire.AppendBytes(protowire.AppendTag(twoBodies, fieldBodyBytes, protowire.BytesType), []byte("bb"))
	for name, wire := range map[string][]byte{
		"body twice":                   append(field(fieldRequestBody, withBody), field(fieldRequestBody, later)...),
		"body then none":               append(field(fieldRequestBody, withBody), field(fieldRequestBody, noBody)...),
		"request then response body":   append(field(fieldRequestBody, withBody), field(fieldResponseBody, noBody)...),
		"body, headers, body":          append(append(field(fieldRequestBody, withBody), field(2, headers)...), field(fieldRequestBody, noBody)...),
		"body then headers":            append(field(fieldResponseBody, withBody), field(3, headers)...),
		"two body fields in one":       protowire.AppendBytes(protowire.AppendTag(nil, fieldRequestBody, protowire.BytesType), twoBodies),
		"body field of the wrong type": protowire.AppendVarint(protowire.AppendTag(nil, fieldRequestBody, protowire.VarintType), 3),
		"truncated":                    field(fieldRequestBody, withBody)[:5],
	} {
		t.Run(name, func(t *testing.T) {
			checkLikeProto(t, c, &in, wire, 0)
			checkLikeProto(t, c, &in, wire, 3)
		})
	}
}

// The body a stream received stays intact after gRPC frees (and reuses)
// the buffers it came in.
func TestCodecBodyOutlivesTheReceiveBuffers(t *testing.T) {
	wire, err := proto.Marshal(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte("the prompt")}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, size := range []int{0, 4} {
		data := bufferSlice(wire, size)
		var in Inbound
		if err := NewCodec(&DirtyPool{}).Unmarshal(data, &in); err != nil {
			t.Fatal(err)
		}
		for _, b := range data {
			clear(b.ReadOnlyData()) // what a reused buffer would hold
		}
		if got := string(in.GetRequestBody().GetBody()); got != "the prompt" {
			t.Fatalf("buffers of %d bytes: body %q after they were reused", size, got)
		}
	}
}

// gatewayMessages are messages as gateways send them, each field decodeFast
// knows present in one of them.
func gatewayMessages(t testing.TB) []*extprocv3.ProcessingRequest {
	meta, err := structpb.NewStruct(map[string]any{
		"x-gateway-destination-endpoint-served": "10.0.0.1:8000",
		"n":                                     1.5,
		"null":                                  nil,
		"yes":                                   true,
		"list":                                  []any{"10.0.0.2:8000", 2.0, []any{}},
		"nested":                                map[string]any{"a": map[string]any{}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":path", RawValue: []byte("/v1/completions")}, {Key: ":method", Value: "POST"}, {Key: "empty"}, {}}}}},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, ResponseBodyMode: 99, SendBodyWithoutWaitingForHeaderResponse: true},
			MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
				"envoy.lb.subset_hint": meta, "": {}}}},
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{}, EndOfStream: true}},
			ObservabilityMode: true, MetadataContext: &corev3.Metadata{}, ProtocolConfig: &extprocv3.ProtocolConfiguration{}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(`{"model":"m"}`), EndOfStream: true}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{EndOfStreamWithoutMessage: true, GrpcMessageCompressed: true, DrainComplete: true}}},
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":status", RawValue: []byte("200")}}}}},
			MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb": meta}}},
		{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("data: x")}}},
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{}},
		{},
	}
}

// decodeFast takes the messages gateways send (the fuzz test below only
// checks that whatever it takes, it decodes as protobuf does).
func TestDecodeFastTakesGatewayMessages(t *testing.T) {
	for _, m := range gatewayMessages(t) {
		wire, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		_, wire, _, err = splitBody(wire, nil)
		if err != nil {
			t.Fatal(err)
		}
		var got, want extprocv3.ProcessingRequest
		if !decodeFast(wire, &got) {
			t.Fatalf("decodeFast left %v to protobuf", m)
		}
		if err := proto.Unmarshal(wire, &want); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(&got, &want) {
			t.Fatalf("decodeFast gave\n%v\nproto.Unmarshal\n%v", &got, &want)
		}
	}
	// And leaves to protobuf what it does not know, and what protobuf refuses.
	marshal := func(m proto.Message) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	nested := func(num protowire.Number, b []byte) []byte {
		return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), b)
	}
	for name, wire := range map[string][]byte{
		"trailers":   marshal(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}),
		"attributes": marshal(&extprocv3.ProcessingRequest{Attributes: map[string]*structpb.Struct{"a": {}}}),
		// request_headers.headers.headers[0].key = "\xff"
		"invalid UTF-8": nested(2, nested(1, nested(1, nested(1, []byte{0xff})))),
	} {
		var got extprocv3.ProcessingRequest
		if decodeFast(wire, &got) {
			t.Errorf("%s: decodeFast took %x", name, wire)
		}
	}
}

func FuzzCodecDecodesAsProtoDoes(f *testing.F) {
	for _, m := range gatewayMessages(f) {
		wire, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(wire, uint8(0))
	}
	c := NewCodec(&DirtyPool{})
	f.Fuzz(func(t *testing.T, wire []byte, size uint8) {
		var in Inbound
		checkLikeProto(t, c, &in, wire, int(size))
	})
}

// A body echo is written byte for byte as protobuf writes the equivalent
// message, through the Codec (pooled buffer or not) and through a plain
// proto codec (ProtoReflect).
func TestBodyEchoEncodesAsProtoDoes(t *testing.T) {
	c := NewCodec(&DirtyPool{})
	for _, n := range []int{0, 1, 127, 128, 20_000, 62_000} {
		for _, response := range []bool{false, true} {
			for _, end := range []bool{false, true} {
				e := &BodyEcho{Response: response, Chunk: bytes.Repeat([]byte{'x'}, n), EndOfStream: end}
				want, err := proto.MarshalOptions{Deterministic: true}.Marshal(e.message())
				if err != nil {
					t.Fatal(err)
				}
				got, err := c.Marshal(e)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got.Materialize(), want) {
					t.Errorf("%d bytes, response %v, end %v: codec wrote %x, protobuf %x", n, response, end, got.Materialize(), want)
				}
				got.Free()
				viaProto, err := c.proto.Marshal(e)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(viaProto.Materialize(), want) {
					t.Errorf("%d bytes: a plain proto codec wrote %x, want %x", n, viaProto.Materialize(), want)
				}
			}
		}
	}
}

// A constant answer is written as protobuf wrote it when it was made.
func TestPreEncodedEncodesAsProtoDoes(t *testing.T) {
	c := NewCodec(&DirtyPool{})
	for _, m := range []*extprocv3.ProcessingResponse{
		{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}},
		{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}},
		{},
	} {
		want, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		got, err := c.Marshal(NewPreEncoded(m))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Materialize(), want) {
			t.Errorf("%v: codec wrote %x, protobuf %x", m, got.Materialize(), want)
		}
	}
}

// The routing answer is written byte for byte as protobuf writes the
// equivalent message.
func TestRouteAnswerEncodesAsProtoDoes(t *testing.T) {
	c := NewCodec(&DirtyPool{})
	long := strings.Repeat("10.0.0.1:8000,", 20) + "10.0.0.2:8000" // lengths past one varint byte
	for _, r := range []RouteAnswer{
		{Destination: "10.0.0.7:8000"},
		{Destination: "10.0.0.7:8000,[fd00::1]:8000", ContentLength: "32000"},
		{InBody: true, Destination: "[fd00::2]:3000"},
		{InBody: true, Destination: long, ContentLength: "1"},
		{Destination: ""},
	} {
		want, err := proto.MarshalOptions{Deterministic: true}.Marshal(r.Message())
		if err != nil {
			t.Fatal(err)
		}
		got, err := c.Marshal(&r)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Materialize(), want) {
			t.Errorf("%+v: codec wrote %x, protobuf %x", r, got.Materialize(), want)
		}
		if r.Destination != "" && r.sizes().whole != len(want) {
			t.Errorf("%+v: size %d, want %d", r, r.sizes().whole, len(want))
		}
	}
}

// BenchmarkDecode compares the Codec with plain proto decoding on the
// messages of one request: headers with metadata, a 32 KB body, response
// headers.
func BenchmarkDecode(b *testing.B) {
	meta, err := structpb.NewStruct(map[string]any{"x-gateway-destination-endpoint-served": "10.0.0.1:8000"})
	if err != nil {
		b.Fatal(err)
	}
	var wires [][]byte
	for _, m := range []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":path", RawValue: []byte("/v1/completions")}, {Key: ":method", RawValue: []byte("POST")},
			{Key: "content-type", RawValue: []byte("application/json")}, {Key: "content-length", RawValue: []byte("32000")}}}}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: bytes.Repeat([]byte("x"), 32000), EndOfStream: true}}},
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":status", RawValue: []byte("200")}}}}},
			MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb": meta}}},
	} {
		w, err := proto.Marshal(m)
		if err != nil {
			b.Fatal(err)
		}
		wires = append(wires, w)
	}
	b.Run("proto", func(b *testing.B) {
		for b.Loop() {
			for _, w := range wires {
				var m extprocv3.ProcessingRequest
				if err := proto.Unmarshal(w, &m); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	b.Run("codec", func(b *testing.B) {
		c := NewCodec(&DirtyPool{})
		var in Inbound
		data := make([]mem.BufferSlice, len(wires))
		for i, w := range wires {
			data[i] = bufferSlice(w, 16384)
		}
		for b.Loop() {
			for _, d := range data {
				if err := c.Unmarshal(d, &in); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}
