package envoy

import (
	"bytes"
	"errors"
	"io"
	"net"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tallyepp/tally/picker/protocol"
)

// echoPicker answers as a FULL_DUPLEX_STREAMED picker does: the headers
// answer (routed to 10.0.0.1:8000) once the request body has ended, then
// the body echoed; response messages echoed too, the response body with
// alter applied. It keeps the messages it got.
type echoPicker struct {
	extprocv3.UnimplementedExternalProcessorServer
	alter func([]byte) []byte
	got   chan *extprocv3.ProcessingRequest
}

func (p *echoPicker) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	var held []*extprocv3.ProcessingResponse
	for {
		m, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		p.got <- m
		var answers []*extprocv3.ProcessingResponse
		switch {
		case m.GetRequestBody() != nil:
			b := m.GetRequestBody()
			held = append(held, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
				Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b.GetBody(), EndOfStream: b.GetEndOfStream()}}}},
			}}})
			if b.GetEndOfStream() {
				answers = append([]*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
					Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
						Header: &corev3.HeaderValue{Key: protocol.DestinationHeader, RawValue: []byte("10.0.0.1:8000,10.0.0.2:8000")}}}}},
				}}}}, held...)
			}
		case m.GetResponseHeaders() != nil:
			answers = append(answers, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}})
		case m.GetResponseBody() != nil:
			b := m.GetResponseBody()
			answers = append(answers, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
				Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: p.alter(b.GetBody()), EndOfStream: b.GetEndOfStream()}}}},
			}}})
		}
		for _, a := range answers {
			if err := s.Send(a); err != nil {
				return err
			}
		}
	}
}

func startEcho(t *testing.T, alter func([]byte) []byte, strict bool) (*Client, *echoPicker) {
	t.Helper()
	p := &echoPicker{alter: alter, got: make(chan *extprocv3.ProcessingRequest, 100)}
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, p)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return NewClient(Options{Strict: strict}, conn), p
}

func TestARequestIsStreamedInChunksAndRoutedAsEnvoyDoes(t *testing.T) {
	c, p := startEcho(t, func(b []byte) []byte { return b }, true)
	x, err := c.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer x.Cancel()
	body := bytes.Repeat([]byte("x"), 2500)
	r, err := x.SendRequest(Request{Headers: []string{":path", "/v1/completions"}, Body: body, ChunkBytes: 1000, Mode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED})
	if err != nil {
		t.Fatal(err)
	}
	if r.First() != "10.0.0.1:8000" || !bytes.Equal(r.Body, body) || len(r.BodyChunks) != 3 {
		t.Fatalf("routed to %q, body back %d bytes in %v; want 10.0.0.1:8000, all 2500 in 3 chunks", r.First(), len(r.Body), r.BodyChunks)
	}
	first := <-p.got
	var keys []string
	for _, h := range first.GetRequestHeaders().GetHeaders().GetHeaders() {
		keys = append(keys, h.GetKey()+"="+string(h.GetRawValue()))
	}
	if got := strings.Join(keys, " "); got != ":path=/v1/completions content-length=2500" {
		t.Errorf("request headers %s, want :path and then content-length", got)
	}
	if first.GetProtocolConfig().GetRequestBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		t.Errorf("protocol_config %v, want FULL_DUPLEX_STREAMED announced", first.GetProtocolConfig())
	}
	resp := Response{Status: 200, ContentType: eventStream, ServedBy: "10.0.0.1:8000", Chunks: [][]byte{[]byte("data: a\n\n"), []byte("data: [DONE]\n\n")}}
	if err := x.Respond(resp); err != nil {
		t.Fatal(err)
	}
}

func TestStrictCatchesAResponseChunkThatComesBackChanged(t *testing.T) {
	for _, strict := range []bool{false, true} {
		c, _ := startEcho(t, func(b []byte) []byte { return bytes.ToUpper(b) }, strict)
		x, err := c.Open(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.SendRequest(Request{Body: []byte("{}")}); err != nil {
			t.Fatal(err)
		}
		err = x.Respond(Response{Status: 200, ContentType: eventStream, Chunks: [][]byte{[]byte("data: a\n\n")}})
		if strict != (err != nil) {
			t.Errorf("strict %v: Respond gave %v", strict, err)
		}
		x.Cancel()
	}
}
