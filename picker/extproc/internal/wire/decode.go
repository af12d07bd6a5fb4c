package wire

import (
	"math"
	"unicode/utf8"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/structpb"
)

// decoder decodes, without protobuf's reflection, the ProcessingRequests
// gateways send: headers, bodies (their bytes already split off), the
// metadata context and the protocol configuration. Whatever else it meets
// (another field, a field repeated where protobuf would merge, a wrong wire
// type, a string that is not UTF-8, deep nesting) makes it give up, and the
// caller falls back to proto.Unmarshal: it gives the same message as
// proto.Unmarshal or none.
//
// Every string of the message is a substring of one copy of the wire, and
// every bytes field a piece of another: two allocations where protobuf
// makes one per field.
type decoder struct {
	wire  []byte
	str   string // wire as a string, made on first use
	bytes []byte // a copy of wire, made on first use
	depth int
}

// maxStructDepth bounds the nesting of metadata values decoded here;
// deeper ones are left to protobuf.
const maxStructDepth = 8

// field is one field of a message: its value is v for varint and fixed64
// fields, wire[lo:hi] for length-delimited ones.
type field struct {
	num    protowire.Number
	typ    protowire.Type
	v      uint64
	lo, hi int
}

// next reads the field at pos, which must end by end.
func (d *decoder) next(pos, end int) (f field, _ int, ok bool) {
	b := d.wire[pos:end]
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return f, 0, false
	}
	f.num, f.typ = num, typ
	b = b[n:]
	switch typ {
	case protowire.VarintType:
		v, m := protowire.ConsumeVarint(b)
		if m < 0 {
			return f, 0, false
		}
		f.v = v
		return f, pos + n + m, true
	case protowire.Fixed64Type:
		v, m := protowire.ConsumeFixed64(b)
		if m < 0 {
			return f, 0, false
		}
		f.v = v
		return f, pos + n + m, true
	case protowire.BytesType:
		v, m := protowire.ConsumeBytes(b)
		if m < 0 {
			return f, 0, false
		}
		f.hi = pos + n + m
		f.lo = f.hi - len(v)
		return f, f.hi, true
	}
	return f, 0, false // groups and fixed32: nothing here uses them
}

func (d *decoder) string(f field) (string, bool) {
	if d.str == "" {
		d.str = string(d.wire)
	}
	s := d.str[f.lo:f.hi]
	return s, utf8.ValidString(s)
}

func (d *decoder) bytesOf(f field) []byte {
	if d.bytes == nil {
		d.bytes = append([]byte(nil), d.wire...)
	}
	return d.bytes[f.lo:f.hi:f.hi]
}

// decodeFast decodes wire into m (reset first) as proto.Unmarshal would, or
// reports false, leaving m to be reset and decoded by proto.Unmarshal.
func decodeFast(wire []byte, m *extprocv3.ProcessingRequest) bool {
	m.Reset()
	d := decoder{wire: wire}
	var member, metadata, config bool
	for pos := 0; pos < len(wire); {
		f, next, ok := d.next(pos, len(wire))
		if !ok {
			return false
		}
		pos = next
		switch {
		case f.num >= fieldFirstOneof && f.num <= fieldResponseBody && f.typ == protowire.BytesType:
			if member {
				return false // merged or replaced: protobuf's business
			}
			member = true
			if !d.request(f, m) {
				return false
			}
		case f.num == 8 && f.typ == protowire.BytesType && !metadata:
			metadata = true
			if m.MetadataContext, ok = d.metadata(f); !ok {
				return false
			}
		case f.num == 10 && f.typ == protowire.VarintType:
			m.ObservabilityMode = f.v != 0
		case f.num == 11 && f.typ == protowire.BytesType && !config:
			config = true
			if m.ProtocolConfig, ok = d.protocolConfig(f); !ok {
				return false
			}
		default:
			return false
		}
	}
	return true
}

// request decodes the oneof member in f: headers or a body.
func (d *decoder) request(f field, m *extprocv3.ProcessingRequest) bool {
	switch f.num {
	case 2, 3:
		h, ok := d.httpHeaders(f)
		if f.num == 2 {
			m.Request = &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: h}
		} else {
			m.Request = &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: h}
		}
		return ok
	default:
		b, ok := d.httpBody(f)
		if f.num == fieldRequestBody {
			m.Request = &extprocv3.ProcessingRequest_RequestBody{RequestBody: b}
		} else {
			m.Request = &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: b}
		}
		return ok
	}
}

func (d *decoder) httpHeaders(in field) (*extprocv3.HttpHeaders, bool) {
	h := &extprocv3.HttpHeaders{}
	for pos := in.lo; pos < in.hi; {
		f, next, ok := d.next(pos, in.hi)
		if !ok {
			return nil, false
		}
		pos = next
		switch {
		case f.num == 1 && f.typ == protowire.BytesType && h.Headers == nil:
			if h.Headers, ok = d.headerMap(f); !ok {
				return nil, false
			}
		case f.num == 3 && f.typ == protowire.VarintType:
			h.EndOfStream = f.v != 0
		default:
			return nil, false
		}
	}
	return h, true
}

func (d *decoder) headerMap(in field) (*corev3.HeaderMap, bool) {
	n := 0
	for pos := in.lo; pos < in.hi; {
		f, next, ok := d.next(pos, in.hi)
		if !ok || f.num != 1 || f.typ != protowire.BytesType {
			return nil, false
		}
		pos = next
		n++
	}
	values := make([]corev3.HeaderValue, n)
	m := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, n)}
	for i, pos := 0, in.lo; pos < in.hi; i++ {
		f, next, _ := d.next(pos, in.hi)
		pos = next
		hv := &values[i]
		m.Headers[i] = hv
		for p := f.lo; p < f.hi; {
			g, next, ok := d.next(p, f.hi)
			if !ok || g.typ != protowire.BytesType {
				return nil, false
			}
			p = next
			switch g.num {
			case 1:
				hv.Key, ok = d.string(g)
			case 2:
				hv.Value, ok = d.string(g)
			case 3:
				hv.RawValue = d.bytesOf(g)
			default:
				ok = false
			}
			if !ok {
				return nil, false
			}
		}
	}
	return m, true
}

func (d *decoder) httpBody(in field) (*extprocv3.HttpBody, bool) {
	b := &extprocv3.HttpBody{}
	for pos := in.lo; pos < in.hi; {
		f, next, ok := d.next(pos, in.hi)
		if !ok || f.typ != protowire.VarintType {
			return nil, false // the body bytes never reach here
		}
		pos = next
		switch f.num {
		case 2:
			b.EndOfStream = f.v != 0
		case 3:
			b.EndOfStreamWithoutMessage = f.v != 0
		case 4:
			b.GrpcMessageCompressed = f.v != 0
		case 5:
			b.DrainComplete = f.v != 0
		default:
			return nil, false
		}
	}
	return b, true
}

func (d *decoder) protocolConfig(in field) (*extprocv3.ProtocolConfiguration, bool) {
	c := &extprocv3.ProtocolConfiguration{}
	for pos := in.lo; pos < in.hi; {
		f, next, ok := d.next(pos, in.hi)
		if !ok || f.typ != protowire.VarintType {
			return nil, false
		}
		pos = next
		switch f.num {
		case 1:
			c.RequestBodyMode = filterv3.ProcessingMode_BodySendMode(int32(f.v))
		case 2:
			c.ResponseBodyMode = filterv3.ProcessingMode_BodySendMode(int32(f.v))
		case 3:
			c.SendBodyWithoutWaitingForHeaderResponse = f.v != 0
		default:
			return nil, false
		}
	}
	return c, true
}

// metadata decodes filter_metadata, a map of Structs by filter name.
func (d *decoder) metadata(in field) (*corev3.Metadata, bool) {
	fm, ok := messageMap(d, in, d.structValue, func() *structpb.Struct { return &structpb.Struct{} })
	if !ok {
		return nil, false
	}
	return &corev3.Metadata{FilterMetadata: fm}, true
}

// messageMap decodes the message in, whose only field (1) is a map from
// strings to messages: each entry's value decoded by value, an absent one
// made by empty, a repeated key the last one's (as protobuf does). The map
// is nil when there is no entry.
func messageMap[V comparable](d *decoder, in field, value func(field) (V, bool), empty func() V) (map[string]V, bool) {
	var m map[string]V
	var absent V
	for pos := in.lo; pos < in.hi; {
		f, next, ok := d.next(pos, in.hi)
		if !ok || f.num != 1 || f.typ != protowire.BytesType {
			return nil, false
		}
		pos = next
		key, v, ok := mapEntry(d, f, value)
		if !ok {
			return nil, false
		}
		if m == nil {
			m = make(map[string]V)
		}
		if v == absent {
			v = empty()
		}
		m[key] = v
	}
	return m, true
}

// mapEntry decodes a map entry: a string key (field 1) and a message value
// (field 2) decoded by value, or nil when absent.
func mapEntry[V any](d *decoder, in field, value func(field) (V, bool)) (key string, v V, ok bool) {
	var none V
	var seenKey, seenValue bool
	for pos := in.lo; pos < in.hi; {
		f, next, ok := d.next(pos, in.hi)
		if !ok || f.typ != protowire.BytesType {
			return "", none, false
		}
		pos = next
		switch {
		case f.num == 1 && !seenKey:
			seenKey = true
			if key, ok = d.string(f); !ok {
				return "", none, false
			}
		case f.num == 2 && !seenValue:
			seenValue = true
			if v, ok = value(f); !ok {
				return "", none, false
			}
		default:
			return "", none, false
		}
	}
	return key, v, true
}

func (d *decoder) structValue(in field) (*structpb.Struct, bool) {
	if d.depth >= maxStructDepth {
		return nil, false
	}
	d.depth++
	defer func() { d.depth-- }()
	fields, ok := messageMap(d, in, d.value, func() *structpb.Value { return &structpb.Value{} })
	if !ok {
		return nil, false
	}
	return &structpb.Struct{Fields: fields}, true
}

func (d *decoder) value(in field) (*structpb.Value, bool) {
	v := &structpb.Value{}
	for pos := in.lo; pos < in.hi; {
		f, next, ok := d.next(pos, in.hi)
		if !ok || v.Kind != nil {
			return nil, false // a second kind: merged or replaced by protobuf
		}
		pos = next
		switch {
		case f.num == 1 && f.typ == protowire.VarintType:
			v.Kind = &structpb.Value_NullValue{NullValue: structpb.NullValue(int32(f.v))}
		case f.num == 2 && f.typ == protowire.Fixed64Type:
			v.Kind = &structpb.Value_NumberValue{NumberValue: math.Float64frombits(f.v)}
		case f.num == 3 && f.typ == protowire.BytesType:
			s, ok := d.string(f)
			if !ok {
				return nil, false
			}
			v.Kind = &structpb.Value_StringValue{StringValue: s}
		case f.num == 4 && f.typ == protowire.VarintType:
			v.Kind = &structpb.Value_BoolValue{BoolValue: f.v != 0}
		case f.num == 5 && f.typ == protowire.BytesType:
			s, ok := d.structValue(f)
			if !ok {
				return nil, false
			}
			v.Kind = &structpb.Value_StructValue{StructValue: s}
		case f.num == 6 && f.typ == protowire.BytesType:
			l, ok := d.listValue(f)
			if !ok {
				return nil, false
			}
			v.Kind = &structpb.Value_ListValue{ListValue: l}
		default:
			return nil, false
		}
	}
	return v, true
}

func (d *decoder) listValue(in field) (*structpb.ListValue, bool) {
	if d.depth >= maxStructDepth {
		return nil, false
	}
	d.depth++
	defer func() { d.depth-- }()
	l := &structpb.ListValue{}
	for pos := in.lo; pos < in.hi; {
		f, next, ok := d.next(pos, in.hi)
		if !ok || f.num != 1 || f.typ != protowire.BytesType {
			return nil, false
		}
		pos = next
		v, ok := d.value(f)
		if !ok {
			return nil, false
		}
		l.Values = append(l.Values, v)
	}
	return l, true
}
