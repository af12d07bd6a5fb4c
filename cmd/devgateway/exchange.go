package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/tallyepp/tally/internal/envoy"
)

// The ext_proc side of one request: the stream the gateway plays as Envoy
// plays it (internal/envoy writes and reads its messages), the request
// body sent as the client sends it and the response streamed through the
// picker to the client.

// exchange is one client request and its ext_proc stream.
type exchange struct {
	g            *Gateway
	w            http.ResponseWriter
	r            *http.Request
	streamCtx    context.Context
	cancelStream context.CancelFunc
	stream       *envoy.Stream
	log          *slog.Logger
}

// upload is the request body as read from the client and sent to the picker.
type upload struct {
	done     chan struct{}
	original []byte // everything read, kept for a FailOpen retry without the picker
	readErr  error
}

// run serves the request. It reports whether the stream ended cleanly and
// may be half-closed rather than cancelled.
func (ex *exchange) run() bool {
	bodiless := ex.r.ContentLength == 0
	var timedOut atomic.Bool
	timer := time.AfterFunc(ex.g.pickerTimeout(), func() { timedOut.Store(true); ex.cancelStream() })
	pickers := ex.g.pickers()
	first := ex.g.nextPicker(len(pickers))
	up, d, err := ex.requestPath(pickers[first], bodiless, ex.r.Body, ex.r.ContentLength)
	if err != nil && len(pickers) > 1 && !answered(d) && !timedOut.Load() && ex.r.Context().Err() == nil {
		// The picker failed before it answered anything (refused, or died
		// with the request): one retry on the next picker, with the body
		// read whole, as a gRPC retry policy on the ext_proc service
		// retries a stream that got no response.
		ex.log.Warn("the picker stream failed before an answer; retrying on the next picker", "picker", first, "err", err)
		if ex.stream != nil {
			ex.stream.Cancel() // this stream only: streamCtx carries the retry
		}
		up = ex.wholeBody(up, bodiless)
		if up.readErr == nil {
			next := ex.g.healthyFrom((first+1)%len(pickers), len(pickers))
			if next == first {
				next = (first + 1) % len(pickers)
			}
			retried, rd, rerr := ex.requestPath(pickers[next], bodiless, bytes.NewReader(up.original), int64(len(up.original)))
			if retried != nil {
				up = retried // the same bytes, sent again
			}
			d, err = rd, rerr
		}
	}
	stopped := timer.Stop()
	if up != nil && (err != nil || d.Immediate != nil) {
		// The client body is still being read; it must be complete (for a
		// FailOpen retry) and no longer in use before the handler returns.
		ex.cancelStream()
		<-up.done
	}
	if up != nil && up.readErr != nil {
		ex.log.Warn("reading the request body failed", "err", up.readErr)
		ex.cancelStream()
		if ex.r.Context().Err() == nil {
			http.Error(ex.w, "reading the request body failed", http.StatusBadRequest)
		}
		return false
	}
	if err != nil {
		if ex.r.Context().Err() != nil {
			return false // the client left; nobody to answer
		}
		if !stopped && timedOut.Load() {
			err = fmt.Errorf("no decision within %s: %w", ex.g.pickerTimeout(), err)
		}
		var original []byte
		switch {
		case up != nil:
			original = up.original
		case !bodiless:
			// The stream failed before the body was sent: read it here.
			var readErr error
			if original, readErr = io.ReadAll(ex.r.Body); readErr != nil {
				ex.log.Warn("reading the request body failed", "err", readErr)
				http.Error(ex.w, "reading the request body failed", http.StatusBadRequest)
				return false
			}
		}
		ex.failOver(err, original)
		return false
	}
	if d.Immediate != nil {
		ex.log.Debug("picker answered", "status", immediateStatus(d.Immediate))
		writeImmediate(ex.w, d.Immediate)
		return false
	}

	out, err := newUpstreamRequest(ex.r, d)
	if err != nil {
		ex.log.Warn("applying the picker's header mutation failed", "err", err)
		http.Error(ex.w, "bad header mutation from the endpoint picker", http.StatusInternalServerError)
		return false
	}
	if len(out.destinations) == 0 {
		ex.log.Warn("the picker's decision names no destination")
		http.Error(ex.w, "the endpoint picker named no destination endpoint", http.StatusServiceUnavailable)
		return false
	}
	resp, served, err := ex.g.forward(ex.r.Context(), out, ex.log)
	if err != nil {
		if ex.r.Context().Err() != nil {
			return false
		}
		resp = localReply(http.StatusServiceUnavailable, "upstream connect error: "+err.Error())
	}
	ex.log.Debug("routed", "destination", strings.Join(out.destinations, ","), "served", served, "status", resp.StatusCode)
	return ex.responsePath(resp, served)
}

// requestPath opens the stream, sends the request headers and body, and
// returns the picker's decision. The returned upload, when not nil, is still
// running if err is not nil or the decision is an immediate response.
func (ex *exchange) requestPath(picker *envoy.Client, bodiless bool, body io.Reader, size int64) (*upload, *envoy.Routed, error) {
	ex.stream = nil
	d := &envoy.Routed{}
	stream, err := picker.Open(ex.streamCtx)
	if err != nil {
		return nil, d, err
	}
	ex.stream = stream
	first := stream.HeadersMessage(envoy.Request{
		Headers:     envoy.RequestHeaders(ex.r),
		BodyFollows: !bodiless,
		Mode:        filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
	})
	if err := stream.Send(first); err != nil {
		return nil, d, fmt.Errorf("sending the request headers: %w", err)
	}
	var up *upload
	if !bodiless {
		up = &upload{done: make(chan struct{})}
		go ex.sendRequestBody(up, body, size)
	}
	err = stream.RecvDecision(d, bodiless)
	if err == nil && d.Immediate == nil && up != nil {
		// The picker has returned the whole body, so it has read all of ours.
		<-up.done
	}
	return up, d, err
}

// answered reports whether the picker answered anything on the request
// path: a stream it answered is its own, not retried elsewhere.
func answered(d *envoy.Routed) bool {
	return d != nil && (!d.Decided.IsZero() || len(d.BodyChunks) > 0)
}

// wholeBody waits for the upload of a failed stream (or, if the stream
// failed before the body was sent, reads the client's body itself) and
// returns it complete, for a retry or the failure mode.
func (ex *exchange) wholeBody(up *upload, bodiless bool) *upload {
	if up != nil {
		<-up.done
		return up
	}
	up = &upload{done: make(chan struct{})}
	close(up.done)
	if !bodiless {
		up.original, up.readErr = io.ReadAll(ex.r.Body)
	}
	return up
}

// sendRequestBody streams the body (the client's, or a retry's copy) to
// the picker, the last chunk with end_of_stream. It keeps reading after a
// send failure so that a retry or FailOpen has the whole body.
func (ex *exchange) sendRequestBody(up *upload, body io.Reader, sizeHint int64) {
	defer close(up.done)
	size := ex.g.chunkBytes()
	var all bytes.Buffer
	if sizeHint > 0 {
		all.Grow(int(sizeHint))
	}
	br := bufio.NewReaderSize(body, size)
	sending := true
	for {
		chunk := make([]byte, size)
		n, err := io.ReadFull(br, chunk)
		last := false
		switch {
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			last = true
		case err != nil:
			up.readErr = err
			ex.cancelStream() // no end_of_stream will come: stop waiting for a decision
			return
		default:
			// A full chunk: it is the last one if nothing follows.
			if _, err := br.Peek(1); errors.Is(err, io.EOF) {
				last = true
			} else if err != nil {
				up.readErr = err
				ex.cancelStream()
				return
			}
		}
		all.Write(chunk[:n])
		if sending {
			if err := ex.stream.Send(envoy.BodyChunk(chunk[:n], last)); err != nil {
				sending = false // the receiving side sees the stream's error
			}
		}
		if last {
			up.original = all.Bytes()
			return
		}
	}
}

// responsePath sends the response headers (with the endpoint that served),
// applies the picker's answer, then streams the body through the picker to
// the client chunk by chunk. It reports whether the stream ended cleanly.
//
// The response phase is best effort: the pick is made and the model server
// has answered, so a picker stream that breaks now (a replica restarting,
// its leader lost) must not cost the client its response. The rest of the
// response goes to the client without the picker: the headers as the
// model server sent them if the picker had not answered them yet, and the
// body bytes the picker had not returned yet from the gateway's own copy
// (the picker returns response chunks unchanged in FULL_DUPLEX_STREAMED
// mode). The picker, if alive, releases its reservation when its stream
// ends, as for any stream cancelled early.
func (ex *exchange) responsePath(resp *http.Response, served string) bool {
	defer resp.Body.Close()
	bodiless := resp.Body == http.NoBody || ex.r.Method == http.MethodHead
	msg := ex.stream.ResponseHeadersMessage(envoy.Response{
		Status:      resp.StatusCode,
		Headers:     envoy.ResponseHeaders(resp),
		ServedBy:    served,
		BodyFollows: !bodiless,
	})
	timer := time.AfterFunc(ex.g.pickerTimeout(), ex.cancelStream)
	immediate, answer, err := ex.sendResponseHeaders(msg)
	timer.Stop()
	if err != nil {
		if ex.r.Context().Err() != nil {
			return false
		}
		ex.log.Warn("the picker stream failed at the response headers; passing the response on without the picker", "err", err)
		ex.cancelStream()
		h := resp.Header.Clone()
		envoy.RemoveHopByHop(h)
		for k, v := range h {
			ex.w.Header()[k] = v
		}
		ex.w.WriteHeader(resp.StatusCode)
		rc := http.NewResponseController(ex.w)
		_ = rc.Flush()
		if !bodiless {
			ex.copyRest(rc, nil, resp.Body)
		}
		return false
	}
	if immediate != nil {
		writeImmediate(ex.w, immediate)
		return true
	}

	h := resp.Header.Clone()
	envoy.RemoveHopByHop(h)
	h[":status"] = []string{strconv.Itoa(resp.StatusCode)}
	if err := envoy.ApplyHeaderMutation(h, answer.GetHeaderMutation()); err != nil {
		ex.log.Warn("applying the picker's response header mutation failed", "err", err)
		http.Error(ex.w, "bad header mutation from the endpoint picker", http.StatusInternalServerError)
		return false
	}
	status, err := strconv.Atoi(h.Get(":status"))
	if err != nil || status < 100 || status > 999 {
		ex.log.Warn("the picker set an invalid :status", "status", h.Get(":status"))
		http.Error(ex.w, "bad :status from the endpoint picker", http.StatusInternalServerError)
		return false
	}
	delete(h, ":status")
	if !bodiless {
		// The picker may change the body; its length is known only at the end.
		h.Del("Content-Length")
	}
	for k, v := range h {
		ex.w.Header()[k] = v
	}
	ex.w.WriteHeader(status)
	rc := http.NewResponseController(ex.w)
	_ = rc.Flush() // streaming clients see the headers now
	if bodiless {
		return true
	}

	held := &heldBytes{}
	pumpDone := make(chan error, 1)
	go func() { pumpDone <- ex.sendResponseBody(resp.Body, held) }()
	relayErr := ex.relayResponseBody(rc, held)
	if relayErr != nil {
		// Unblock the pump: it may be waiting on the stream, or (the
		// client gone) on the upstream.
		ex.cancelStream()
		if !errors.As(relayErr, new(pickerStreamError)) {
			resp.Body.Close()
		}
	}
	pumpErr := <-pumpDone
	if relayErr == nil && pumpErr == nil {
		return true
	}
	if ex.r.Context().Err() == nil && errors.As(relayErr, new(pickerStreamError)) &&
		(pumpErr == nil || errors.As(pumpErr, new(pickerStreamError))) {
		// The pump has stopped reading the upstream: what it read is sent
		// to the picker (and held) or still to be read; nothing is lost.
		ex.log.Warn("the picker stream failed while the response streamed; passing the rest on without the picker", "err", relayErr)
		ex.copyRest(rc, held.take(), resp.Body)
		return false
	}
	if ex.r.Context().Err() == nil {
		ex.log.Warn("streaming the response failed; cutting the connection", "err", errors.Join(relayErr, pumpErr))
	}
	ex.cancelStream()
	// The status is sent: a truncated body must not look complete.
	panic(http.ErrAbortHandler)
}

// pickerStreamError is a failure of the picker's stream on the response
// path, as opposed to one of the client or of the model server.
type pickerStreamError struct{ err error }

func (e pickerStreamError) Error() string { return e.err.Error() }
func (e pickerStreamError) Unwrap() error { return e.err }

// heldBytes are the response body bytes sent to the picker that it has not
// returned yet: what the client would lose if the stream broke now.
type heldBytes struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *heldBytes) hold(p []byte) {
	b.mu.Lock()
	b.buf.Write(p)
	b.mu.Unlock()
}

// returned drops n bytes the picker has passed on. A picker that returns
// more than it was given has changed the body; what it holds back is then
// unknown, and nothing is held.
func (b *heldBytes) returned(n int) {
	b.mu.Lock()
	b.buf.Next(n)
	b.mu.Unlock()
}

func (b *heldBytes) take() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return bytes.Clone(b.buf.Bytes())
}

// copyRest writes held, then the rest of body, to the client, flushing as
// it arrives. A failure cuts the connection: the status is sent, and a
// truncated body must not look complete.
func (ex *exchange) copyRest(rc *http.ResponseController, held []byte, body io.Reader) {
	if len(held) > 0 {
		if _, err := ex.w.Write(held); err != nil {
			panic(http.ErrAbortHandler)
		}
		_ = rc.Flush()
	}
	buf := make([]byte, ex.g.chunkBytes())
	for {
		n, err := body.Read(buf)
		if n > 0 {
			if _, werr := ex.w.Write(buf[:n]); werr != nil {
				panic(http.ErrAbortHandler)
			}
			_ = rc.Flush()
		}
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			ex.log.Warn("reading the upstream response body failed; cutting the connection", "err", err)
			panic(http.ErrAbortHandler)
		}
	}
}

// sendResponseHeaders sends the response headers and waits for the picker's
// answer to them: a header mutation, or an immediate response.
func (ex *exchange) sendResponseHeaders(msg *extprocv3.ProcessingRequest) (*extprocv3.ImmediateResponse, *extprocv3.CommonResponse, error) {
	if err := ex.stream.Send(msg); err != nil {
		return nil, nil, fmt.Errorf("sending the response headers: %w", err)
	}
	return ex.stream.RecvResponseHeadersAnswer()
}

// sendResponseBody sends the upstream body to the picker as it arrives,
// holding each chunk until the picker returns it, then an empty
// end_of_stream message. After a send failure it reads no further.
func (ex *exchange) sendResponseBody(body io.Reader, held *heldBytes) error {
	size := ex.g.chunkBytes()
	for {
		chunk := make([]byte, size)
		n, err := body.Read(chunk)
		if n > 0 {
			held.hold(chunk[:n])
			if serr := ex.stream.Send(envoy.ResponseChunk(chunk[:n], false)); serr != nil {
				return pickerStreamError{fmt.Errorf("sending response body to the picker: %w", serr)}
			}
		}
		if errors.Is(err, io.EOF) {
			if serr := ex.stream.Send(envoy.ResponseChunk(nil, true)); serr != nil {
				return pickerStreamError{fmt.Errorf("sending the response end_of_stream to the picker: %w", serr)}
			}
			return nil
		}
		if err != nil {
			// Stop the relay too: the picker will never see end_of_stream.
			ex.cancelStream()
			return fmt.Errorf("reading the upstream response body: %w", err)
		}
	}
}

// relayResponseBody writes the picker's returned chunks to the client as
// they arrive, flushing each, until end_of_stream.
func (ex *exchange) relayResponseBody(rc *http.ResponseController, held *heldBytes) error {
	for {
		body, eos, err := ex.stream.RecvResponseChunk()
		if err != nil {
			return pickerStreamError{err}
		}
		held.returned(len(body))
		if len(body) > 0 {
			if _, err := ex.w.Write(body); err != nil {
				return fmt.Errorf("writing to the client: %w", err)
			}
			if err := rc.Flush(); err != nil {
				return fmt.Errorf("flushing to the client: %w", err)
			}
		}
		if eos {
			return nil
		}
	}
}

func immediateStatus(ir *extprocv3.ImmediateResponse) int {
	// Envoy answers 200 when the status is missing or not a valid response code.
	if c := int(ir.GetStatus().GetCode()); c >= 200 && c <= 999 {
		return c
	}
	return http.StatusOK
}

func writeImmediate(w http.ResponseWriter, ir *extprocv3.ImmediateResponse) {
	h := http.Header{}
	if len(ir.GetBody()) > 0 {
		h.Set("Content-Type", "text/plain")
	}
	// A bad mutation of a local reply is dropped, not fatal: the status and
	// body still reach the client.
	_ = envoy.ApplyHeaderMutation(h, ir.GetHeaders())
	for k, v := range h {
		if !strings.HasPrefix(k, ":") {
			w.Header()[k] = v
		}
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(ir.GetBody())))
	w.WriteHeader(immediateStatus(ir))
	_, _ = w.Write(ir.GetBody())
}
