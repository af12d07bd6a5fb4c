// Package envoy plays a gateway's side of ext_proc as Envoy's ext_proc filter
// plays it, for the picker's tests (picker/extproc) and its load tool
// (cmd/extproc-load): it opens one stream per HTTP request, sends the request
// headers, the body in the mode the request announces, the response headers
// and body chunks and the half-close, in the order Envoy sends them, and
// reads the picker's answers. The dev gateway (cmd/devgateway) plays its
// ext_proc side with it too.
//
// The invariant: the client sends only what Envoy sends and reads only what
// Envoy reads; what a caller wants to check beyond that is either its own
// (the answers are handed back) or asked for with Options.Strict. Of the
// picker it imports only the names of the endpoint picker protocol
// (picker/protocol), which are the Inference Extension's, as they are
// Envoy's configuration's.
package envoy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync/atomic"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
)

// Options configure a Client as a gateway's configuration does.
type Options struct {
	// Strict checks what Envoy takes on trust: that the answer to each
	// response chunk passes it on unchanged in FULL_DUPLEX_STREAMED mode
	// and leaves it alone in the other modes, and that nothing but the
	// stream's end follows the half-close.
	Strict bool
}

// Client is a gateway's connections to one picker. Envoy multiplexes the
// streams of each worker thread over one HTTP/2 connection; a Client
// spreads its streams over its connections in turn the same way.
type Client struct {
	o     Options
	procs []extprocv3.ExternalProcessorClient
	next  atomic.Uint64
}

// NewClient is a Client over conns (at least one).
func NewClient(o Options, conns ...grpc.ClientConnInterface) *Client {
	c := &Client{o: o}
	for _, conn := range conns {
		c.procs = append(c.procs, extprocv3.NewExternalProcessorClient(conn))
	}
	return c
}

// Open starts the stream of one HTTP request. Cancel ends it.
func (c *Client) Open(ctx context.Context) (*Stream, error) {
	i := (c.next.Add(1) - 1) % uint64(len(c.procs))
	ctx, cancel := context.WithCancel(ctx)
	s, err := c.procs[i].Process(ctx)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("opening an ext_proc stream: %w", err)
	}
	return &Stream{o: c.o, stream: s, cancel: cancel, ResponseMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}, nil
}

// Stream is one HTTP request going through the gateway: one ext_proc
// stream. Its methods play the request's phases in order; Send and Recv
// play single messages where a caller needs another order.
type Stream struct {
	// ResponseMode is the response body mode the picker serves the stream
	// in: FULL_DUPLEX_STREAMED unless SendRequest announced another. Only
	// Strict reads it.
	ResponseMode filterv3.ProcessingMode_BodySendMode

	o      Options
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
}

// Send sends one message. An io.EOF (the picker has ended the stream, its
// answer waiting to be read) is returned as it is.
func (s *Stream) Send(m *extprocv3.ProcessingRequest) error {
	if err := s.stream.Send(m); err != nil {
		if errors.Is(err, io.EOF) {
			return err
		}
		return fmt.Errorf("sending %T: %w", m.GetRequest(), err)
	}
	return nil
}

// Recv reads the picker's next answer.
func (s *Stream) Recv() (*extprocv3.ProcessingResponse, error) { return s.stream.Recv() }

// CloseSend half-closes the stream without waiting for its end.
func (s *Stream) CloseSend() error { return s.stream.CloseSend() }

// Cancel resets the stream, as Envoy does when the client goes away. It
// may be called more than once.
func (s *Stream) Cancel() { s.cancel() }

// Finish half-closes the stream as Envoy does at the end of a request and
// waits for the picker to end it (and so to have released the request).
func (s *Stream) Finish() error {
	defer s.cancel()
	if err := s.stream.CloseSend(); err != nil {
		return err
	}
	for {
		resp, err := s.stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("waiting for the stream's end: %w", err)
		}
		if s.o.Strict {
			return fmt.Errorf("got %T after the half-close, want the stream's end", resp.GetResponse())
		}
	}
}
