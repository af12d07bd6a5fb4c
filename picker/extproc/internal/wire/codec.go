package wire

import (
	"errors"
	"slices"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// Codec is gRPC's proto codec, except for the messages a stream receives
// into an Inbound: their body bytes are not copied into a fresh slice per
// message (protobuf always copies bytes fields) but into the stream's own
// reused buffer. The body is most of what a picker receives (a whole prompt
// per request); a fresh slice per chunk was most of the picker's garbage.
// And it writes the answers a request gets (the routing answer, body
// echoes, constants) without protobuf's reflection.
type Codec struct {
	proto encoding.CodecV2
	pool  mem.BufferPool // for body echoes
}

// NewCodec returns the Codec the ext_proc server is forced to use, writing
// body echoes into buffers from pool.
func NewCodec(pool mem.BufferPool) Codec {
	return Codec{proto: encoding.GetCodecV2("proto"), pool: pool}
}

// Name is the proto codec's name: gRPC uses this codec in its place.
func (c Codec) Name() string { return c.proto.Name() }

// Marshal writes a PreEncoded, BodyEcho or RouteAnswer itself and leaves
// any other message to protobuf.
func (c Codec) Marshal(v any) (mem.BufferSlice, error) {
	switch m := v.(type) {
	case *PreEncoded:
		// Read only: gRPC frees a SliceBuffer by doing nothing.
		return mem.BufferSlice{mem.SliceBuffer(m.wire)}, nil
	case *BodyEcho:
		_, _, _, _, n := m.sizes()
		if mem.IsBelowBufferPoolingThreshold(n) {
			return mem.BufferSlice{mem.SliceBuffer(m.appendWire(make([]byte, 0, n)))}, nil
		}
		buf := c.pool.Get(n)
		*buf = m.appendWire((*buf)[:0])
		return mem.BufferSlice{mem.NewBuffer(buf, c.pool)}, nil
	case *RouteAnswer:
		if m.Destination == "" {
			break // protobuf omits an empty string: leave that to it
		}
		return mem.BufferSlice{mem.SliceBuffer(m.appendWire(make([]byte, 0, m.sizes().whole)))}, nil
	}
	return c.proto.Marshal(v)
}

// Unmarshal decodes into an Inbound without copying the body per message
// (see Inbound) and leaves any other message to protobuf.
func (c Codec) Unmarshal(data mem.BufferSlice, v any) error {
	in, ok := v.(*Inbound)
	if !ok {
		return c.proto.Unmarshal(data, v)
	}
	return in.unmarshal(data)
}

// Inbound is one stream's receiving side: the last message received, whose
// request or response body aliases Buf until the next message is received.
// The message is embedded so that any other proto codec decodes into it too
// (copying the body, as usual).
//
// Wire and Buf are the buffers it reuses from message to message, exported
// so that a server can lend it pooled buffers before the first message and
// take them back (grown) after the last; nothing else should touch them.
type Inbound struct {
	extprocv3.ProcessingRequest
	Wire []byte // the message without its body bytes, for proto.Unmarshal
	Buf  []byte // the whole message (several gRPC buffers), or its body
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
// left in in.Buf.
func (in *Inbound) unmarshal(data mem.BufferSlice) error {
	var b []byte
	aliased := len(data) == 1 // gRPC frees data's buffers once this returns
	if aliased {
		b = data[0].ReadOnlyData()
	} else {
		in.Buf = slices.Grow(in.Buf[:0], data.Len())
		for _, d := range data {
			in.Buf = append(in.Buf, d.ReadOnlyData()...)
		}
		b = in.Buf
	}
	body, wire, found, err := splitBody(b, in.Wire[:0])
	in.Wire = wire
	if err != nil {
		return err
	}
	if !decodeFast(in.Wire, &in.ProcessingRequest) {
		if err := proto.Unmarshal(in.Wire, &in.ProcessingRequest); err != nil {
			return err
		}
	}
	if !found {
		return nil
	}
	if aliased {
		in.Buf = append(in.Buf[:0], body...)
		body = in.Buf
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
		wire = appendLen(wire, num, len(inner)-removed)
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
