//go:build goexperiment.jsonv2

package request

import (
	"bytes"
	"encoding/json/jsontext"
	"fmt"
	"testing"

	"github.com/tallyepp/tally/test/benchcpu"
)

// BenchmarkJSONTextChat is the measurement beside the hand-written scanner:
// the same chat bodies as BenchmarkParse, read with encoding/json/jsontext
// (GOEXPERIMENT=jsonv2) doing the least that Parse does: validate the whole
// body, unquote the model, the roles and the string contents into one
// reused buffer, and copy the raw tools. It does not build markers or move
// tools in front of the messages, so it is a lower bound on what Parse would
// cost on top of jsontext.
//
//	GOEXPERIMENT=jsonv2 go test -run '^$' -bench 'Parse|JSONText' -benchmem ./picker/request
func BenchmarkJSONTextChat(b *testing.B) {
	for _, tokens := range []int{1000, 8000, 32000} {
		body := chatBody(tokens)
		b.Run(fmt.Sprintf("chat-%dk-tokens", tokens/1000), func(b *testing.B) {
			var (
				dst []byte
				r   bytes.Reader
				dec jsontext.Decoder
			)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			cpu, cpuOK := benchcpu.ProcessCPU()
			for b.Loop() {
				r.Reset(body)
				dec.Reset(&r)
				var err error
				if dst, err = jsontextChat(&dec, dst[:0]); err != nil {
					b.Fatal(err)
				}
			}
			if end, ok := benchcpu.ProcessCPU(); ok && cpuOK {
				b.ReportMetric(float64(end-cpu)/float64(b.N), "cpu-ns/op")
			}
		})
	}
}

func jsontextChat(dec *jsontext.Decoder, dst []byte) ([]byte, error) {
	if _, err := dec.ReadToken(); err != nil { // {
		return dst, err
	}
	for dec.PeekKind() != '}' {
		name, err := dec.ReadValue()
		if err != nil {
			return dst, err
		}
		switch string(name) {
		case `"model"`:
			v, err := dec.ReadValue()
			if err != nil {
				return dst, err
			}
			if dst, err = jsontext.AppendUnquote(dst, v); err != nil {
				return dst, err
			}
		case `"tools"`:
			v, err := dec.ReadValue()
			if err != nil {
				return dst, err
			}
			dst = append(dst, v...)
		case `"messages"`:
			if dst, err = jsontextMessages(dec, dst); err != nil {
				return dst, err
			}
		default:
			if err := dec.SkipValue(); err != nil {
				return dst, err
			}
		}
	}
	if _, err := dec.ReadToken(); err != nil { // }
		return dst, err
	}
	return dst, nil
}

func jsontextMessages(dec *jsontext.Decoder, dst []byte) ([]byte, error) {
	if _, err := dec.ReadToken(); err != nil { // [
		return dst, err
	}
	for dec.PeekKind() != ']' {
		if _, err := dec.ReadToken(); err != nil { // {
			return dst, err
		}
		for dec.PeekKind() != '}' {
			name, err := dec.ReadValue()
			if err != nil {
				return dst, err
			}
			if (string(name) == `"role"` || string(name) == `"content"`) && dec.PeekKind() == '"' {
				v, err := dec.ReadValue()
				if err != nil {
					return dst, err
				}
				if dst, err = jsontext.AppendUnquote(dst, v); err != nil {
					return dst, err
				}
			} else if err := dec.SkipValue(); err != nil {
				return dst, err
			}
		}
		if _, err := dec.ReadToken(); err != nil { // }
			return dst, err
		}
	}
	_, err := dec.ReadToken() // ]
	return dst, err
}
