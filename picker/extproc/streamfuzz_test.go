package extproc_test

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/rewrite"
)

// FuzzStreamsLeaveNothingBehind plays an arbitrary sequence of ext_proc
// messages on one stream, in any order and any mix (what gateways send, and
// what none does), reading every answer, then ends the stream as a gateway
// that went away does. Whatever the sequence, the server must not panic,
// and once its stream has ended and every detached request's modelled end
// has passed, the ledger must hold nothing: no request in flight, no
// prefill, nothing detached or waiting.
func FuzzStreamsLeaveNothingBehind(f *testing.F) {
	var offset atomic.Int64
	start := time.Now()
	fx := newFixture(f, fixtureOptions{quiet: true, now: func() time.Time { return start.Add(time.Duration(offset.Load())) }})
	fuzzStreams(f, fx, &offset, nil)
}

// FuzzHeldStreamsLeaveNothingBehind is FuzzStreamsLeaveNothingBehind with
// flow control on and the one endpoint saturated while the stream plays:
// a request the stream completes waits in the picker's queue, and leaves
// it when the gateway goes away. Its model is rewritten too (a split of
// two targets), so its body is mutated on the way.
func FuzzHeldStreamsLeaveNothingBehind(f *testing.F) {
	var offset atomic.Int64
	start := time.Now()
	rw := &rewrite.Table{}
	rw.ReplaceRewrites([]rewrite.Rule{{Name: "split", Models: []string{"m"},
		Targets: []rewrite.Target{{Model: "m-a", Weight: 1}, {Model: "m-bb", Weight: 1}}}})
	fx := flowFixture(f, nil, fixtureOptions{quiet: true, rewrites: rw, now: func() time.Time { return start.Add(time.Duration(offset.Load())) }})
	var inputs atomic.Uint64
	fuzzStreams(f, fx, &offset, func(t *testing.T) func() {
		// With the clock standing still, 3,000 tokens keep it saturated: a
		// prompt of its own each time, which no earlier one left cached.
		r, err := fx.picker.Admit(context.Background(), picker.Request{Model: "m", Prompt: []byte(letters(1000+inputs.Add(1), 12_000))})
		if err != nil {
			t.Fatalf("saturating the endpoint: %v", err)
		}
		return func() { fx.picker.End(r, picker.Outcome{}) }
	})
}

// fuzzStreams is the body of both: saturate, when given, runs before each
// input's stream and returns what ends it (idempotent): once the gateway
// went away, or once it half-closed, so that a request it waits on is
// dispatched.
func fuzzStreams(f *testing.F, fx *fixture, offset *atomic.Int64, saturate func(*testing.T) func()) {
	// Each op is a byte, and most take the next byte as their argument
	// (see player.play).
	for _, seed := range [][]byte{
		{opHeaders, 0b0000_0001, opBody, 0xff, opResponseHeaders, 0, opResponseBody, 1},          // Envoy: headers, body, response
		{opHeaders, 0b0000_0000, opBody, 0xff, opCloseSend},                                      // NGF's shim: no pseudo-headers, half-close
		{opHeaders, 0b0001_0001, opBody, 0x20, opBody, 0x21, opBody, 0xff, opResponseHeaders, 0}, // full duplex, chunked
		{opBody, 0xff, opHeaders, 1},                        // body before headers
		{opHeaders, 1, opHeaders, 1},                        // two request headers
		{opHeaders, 0b0000_0011},                            // bodiless
		{opHeaders, 1, opGarbage, 40, opResponseHeaders, 1}, // a body that is not JSON
		{opHeaders, 1, opBody, 0x40, opTrailers, opResponseHeaders, 0, opResponseBody, 0, opResponseTrailers}, // trailers end the body
		{opHeaders, 0b0010_0001, opBody, 0xff, opResponseHeaders, 0, opCloseSend},                             // buffered, half-close mid-response
	} {
		f.Add(seed)
	}
	// Whatever stream the server took up last, it ended and left nothing.
	f.Cleanup(func() {
		offset.Add(int64(24 * time.Hour))
		eventually(f, "every stream to end and the ledger to empty", func() (bool, string) {
			n := fx.gauge("tally_streams_active")
			ok, state := ledgerEmpty(fx.picker)
			return ok && n == 0, fmt.Sprintf("%v streams active; %s", n, state)
		})
	})
	f.Fuzz(func(t *testing.T, ops []byte) {
		ops = ops[:min(len(ops), maxFuzzOps)]
		panics := fx.counter(t, "tally_stream_panics_total", nil)
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		x, err := fx.gw.Open(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ended, answered := make(chan struct{}), make(chan struct{}, 1)
		go func() {
			defer close(ended)
			for {
				if _, err := x.Recv(); err != nil {
					return
				}
				select {
				case answered <- struct{}{}:
				default:
				}
			}
		}()
		unsaturate := func() {}
		if saturate != nil {
			unsaturate = saturate(t)
			defer unsaturate()
		}
		p := player{x: x, open: true, body: completionBody("m", letters(uint64(len(ops)), 3000))}
		for i := 0; i < len(ops) && p.open; i++ {
			var arg byte
			if i+1 < len(ops) {
				arg = ops[i+1]
			}
			if p.play(ops[i], arg) {
				i++
			}
		}
		// The server takes up what was sent: a gateway goes away once
		// answers stop coming (for 5 ms, at most 200 ms in all), not
		// before the server has seen its messages.
		quiet := time.After(200 * time.Millisecond)
	settle:
		for {
			select {
			case <-answered:
			case <-ended:
				break settle
			case <-time.After(5 * time.Millisecond):
				break settle
			case <-quiet:
				break settle
			}
		}
		// A gateway that half-closed reads the answers until the server
		// ends the stream (NGF's shim); then, or at once, it goes away:
		// the stream ends whatever its state.
		if !p.open {
			// Its request may wait in the picker's queue: capacity frees.
			unsaturate()
			select {
			case <-ended:
			case <-time.After(5 * time.Second):
				t.Fatalf("after ops %v the server kept the half-closed stream open for 5 s", ops)
			}
		}
		x.Cancel()
		<-ended
		unsaturate()
		// The server may take up the stream only after the gateway went
		// away, and release what it reserved then: the ledger must empty,
		// not be empty at once.
		offset.Add(int64(24 * time.Hour)) // past every detached request's modelled end
		eventually(t, fmt.Sprintf("the ledger to empty after ops %v", ops), func() (bool, string) {
			l := fx.picker.Snapshot()
			state := fmt.Sprintf("in-flight=%d prefill=%d detached=%d waiting=%d", l.InFlight, l.PrefillTokens, l.Detached, l.Waiting)
			if l.InFlight != 0 || l.PrefillTokens != 0 || l.Detached != 0 || l.Waiting != 0 {
				return false, state
			}
			return ledgerEmpty(fx.picker)
		})
		if n := fx.counter(t, "tally_stream_panics_total", nil); n != panics {
			t.Fatalf("ops %v ended the stream in a recovered panic", ops)
		}
	})
}

// maxFuzzOps bounds the bytes of ops an input plays: a stream of a request
// has a dozen messages, and inputs of hundreds of waits would only slow
// the search.
const maxFuzzOps = 64

// The fuzzed stream's ops.
const (
	opHeaders          = iota // request headers; arg: fuzzHeaders's bits
	opBody                    // the next piece of a valid body; arg: 16 × arg>>1 bytes (0xff: the rest), bit 0: end_of_stream
	opGarbage                 // arg bytes that are not JSON, end_of_stream on odd arg
	opTrailers                // request trailers
	opResponseHeaders         // response headers; arg bit 0: end_of_stream, bit 1: 500 instead of 200, bit 2: JSON instead of SSE
	opResponseBody            // a response chunk; arg bit 0: end_of_stream, bit 1: the usage object
	opResponseTrailers        // response trailers
	opCloseSend               // half-close: nothing more is sent
	opWait                    // let the server answer before the next op
	numOps
)

type player struct {
	x    *envoy.Stream
	body []byte
	sent int // of body
	open bool
}

// play sends op's message and reports whether it used arg.
func (p *player) play(op, arg byte) (usedArg bool) {
	var m *extprocv3.ProcessingRequest
	switch op % numOps {
	case opHeaders:
		m, usedArg = fuzzHeaders(arg, len(p.body)), true
	case opBody:
		n := len(p.body) - p.sent
		if arg != 0xff {
			n = min(n, int(arg>>1)*16)
		}
		m, usedArg = envoy.BodyChunk(p.body[p.sent:p.sent+n], arg&1 == 1), true
		p.sent += n
	case opGarbage:
		junk := make([]byte, arg)
		for i := range junk {
			junk[i] = '{' + byte(i%7)
		}
		m, usedArg = envoy.BodyChunk(junk, arg&1 == 1), true
	case opTrailers:
		m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
	case opResponseHeaders:
		status, ctype := "200", "text/event-stream"
		if arg&2 != 0 {
			status = "500"
		}
		if arg&4 != 0 {
			ctype = "application/json"
		}
		m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: envoy.HeaderMap(":status", status, "content-type", ctype), EndOfStream: arg&1 == 1}}}
		usedArg = true
	case opResponseBody:
		chunk := `data: {"choices":[{"text":"hi"}]}` + "\n\n"
		if arg&2 != 0 {
			chunk = `data: {"choices":[],"usage":{"prompt_tokens":750,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":100}}}` + "\n\ndata: [DONE]\n\n"
		}
		m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
			Body: []byte(chunk), EndOfStream: arg&1 == 1}}}
		usedArg = true
	case opResponseTrailers:
		m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}
	case opCloseSend:
		_ = p.x.CloseSend()
		p.open = false
		return false
	case opWait:
		time.Sleep(time.Millisecond)
		return false
	}
	if err := p.x.Send(m); err != nil {
		p.open = false // the server ended the stream
	}
	return usedArg
}

// fuzzHeaders is a request headers message. Bits of arg: 0: the
// pseudo-headers (:method, :path) as Envoy sends them; 1: end_of_stream (no
// body); 2: a content-length of bodyLen; 3: the chat path; 4 and 5: the
// protocol_config's body mode (none, FULL_DUPLEX_STREAMED, BUFFERED,
// STREAMED); 6: header values in value rather than raw_value; 7: an
// objective header and a model-name rewrite header.
func fuzzHeaders(arg byte, bodyLen int) *extprocv3.ProcessingRequest {
	path := "/v1/completions"
	if arg&8 != 0 {
		path = "/v1/chat/completions"
	}
	var kv []string
	if arg&1 != 0 {
		kv = append(kv, ":method", "POST", ":path", path, ":authority", "gw")
	}
	kv = append(kv, "content-type", "application/json")
	if arg&4 != 0 {
		kv = append(kv, "content-length", strconv.Itoa(bodyLen))
	}
	if arg&128 != 0 {
		kv = append(kv, "x-gateway-inference-objective", "critical", "x-gateway-model-name-rewrite", "model-v2")
	}
	headers := envoy.HeaderMap(kv...)
	if arg&64 != 0 {
		for _, h := range headers.Headers {
			h.Value, h.RawValue = string(h.RawValue), nil
		}
	}
	m := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: headers, EndOfStream: arg&2 != 0}}}
	if mode := []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_NONE, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_STREAMED}[arg>>4&3]; mode != filterv3.ProcessingMode_NONE {
		m.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode}
	}
	return m
}
