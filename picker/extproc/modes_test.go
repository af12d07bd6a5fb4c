package extproc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
	"github.com/tallyepp/tally/picker/protocol"
)

// recording remembers what each pick was asked, the prompt by its length
// only (the stream reuses its buffer).
type recording struct {
	extproc.Picker
	mu   sync.Mutex
	reqs []picked
}

type picked struct {
	model       string
	promptBytes int
	promptChars int
	stream      bool
}

func (r *recording) Admit(ctx context.Context, req picker.Request) (*picker.Reservation, error) {
	r.mu.Lock()
	r.reqs = append(r.reqs, picked{req.Model, len(req.Prompt), req.PromptChars, req.Stream})
	r.mu.Unlock()
	return r.Picker.Admit(ctx, req)
}

func (r *recording) all() []picked {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.reqs)
}

// headersMessage is the request headers of a POST of body to path, with its
// content-length, announcing mode unless announce is false.
func headersMessage(path string, body []byte, mode filterv3.ProcessingMode_BodySendMode, announce bool) *extprocv3.ProcessingRequest {
	return headersDeclaring(path, len(body), mode, announce)
}

// headersDeclaring is headersMessage for a body of contentLength bytes.
func headersDeclaring(path string, contentLength int, mode filterv3.ProcessingMode_BodySendMode, announce bool) *extprocv3.ProcessingRequest {
	m := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: envoy.HeaderMap(
			":path", path, ":method", "POST", "content-length", strconv.Itoa(contentLength))},
	}}
	if announce {
		m.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode}
	}
	return m
}

// TestEveryBodyModeRoutes plays one request in each request body mode and
// checks that its destination is written where Envoy applies it in that
// mode: the headers answer, or the body answer in BUFFERED mode (the only
// mode in which Envoy applies a body answer's header mutation).
func TestEveryBodyModeRoutes(t *testing.T) {
	body := []byte(`{"model":"m","prompt":"` + letters(70, 3000) + `","stream":true}`)
	for _, tc := range []struct {
		name     string
		mode     filterv3.ProcessingMode_BodySendMode
		announce bool
		chunks   int // body messages the gateway sends
		// loadOnly: routed on the headers by load alone, the body passing by.
		loadOnly bool
	}{
		{name: "FULL_DUPLEX_STREAMED, not announced", mode: fullDuplexMode, chunks: 3},
		{name: "FULL_DUPLEX_STREAMED", mode: fullDuplexMode, announce: true, chunks: 3},
		{name: "BUFFERED", mode: filterv3.ProcessingMode_BUFFERED, announce: true, chunks: 1},
		// An older Envoy announces no mode: one that waits for the headers
		// answer before it sends the body is told by its silence.
		{name: "BUFFERED, not announced", mode: filterv3.ProcessingMode_BUFFERED, chunks: 1},
		{name: "BUFFERED_PARTIAL", mode: filterv3.ProcessingMode_BUFFERED_PARTIAL, announce: true, chunks: 1, loadOnly: true},
		{name: "STREAMED", mode: filterv3.ProcessingMode_STREAMED, announce: true, chunks: 3, loadOnly: true},
		{name: "NONE", mode: filterv3.ProcessingMode_NONE, announce: true, chunks: 0, loadOnly: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rec *recording
			f := newFixture(t, fixtureOptions{wrap: func(p extproc.Picker) extproc.Picker {
				rec = &recording{Picker: p}
				return rec
			}})
			x := openWithin(t, f)
			x.ResponseMode = tc.mode // not announced: the request's mode, inferred, serves the response

			if err := x.Send(headersMessage("/v1/completions", body, tc.mode, tc.announce)); err != nil {
				t.Fatal(err)
			}
			pieces := split(body, tc.chunks)
			switch {
			case tc.mode == fullDuplexMode:
				playFullDuplex(t, x, body, pieces)
			case tc.mode == filterv3.ProcessingMode_BUFFERED:
				playBuffered(t, x, body)
			default:
				playLoadOnly(t, x, pieces)
			}

			got := rec.all()
			if len(got) != 1 {
				t.Fatalf("picks %+v, want one", got)
			}
			want := picked{model: "m", promptBytes: 3000, stream: true}
			if tc.loadOnly {
				want = picked{promptChars: len(body)}
			}
			if got[0] != want {
				t.Errorf("the picker was asked %+v, want %+v", got[0], want)
			}
			if in := f.picker.Snapshot().InFlight; in != 1 {
				t.Errorf("in flight %d, want 1", in)
			}
			if err := x.Respond(okResponse); err != nil {
				t.Fatal(err)
			}
			if ok, state := ledgerEmpty(f.picker); !ok {
				t.Error(state)
			}
			wantLoadOnly := 0.0
			if tc.loadOnly {
				wantLoadOnly = 1
			}
			if got := f.counter(t, "tally_load_only_routes_total", map[string]string{"reason": "request_body_mode"}); got != wantLoadOnly {
				t.Errorf("tally_load_only_routes_total{reason=request_body_mode} = %v, want %v", got, wantLoadOnly)
			}
		})
	}
}

const fullDuplexMode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED

// split cuts b into n pieces (n = 0: none).
func split(b []byte, n int) [][]byte {
	var out [][]byte
	for i := range n {
		out = append(out, b[len(b)*i/n:len(b)*(i+1)/n])
	}
	return out
}

// playFullDuplex sends the body chunks, then expects the held-back headers
// answer, routed and restoring content-length, and the body back unchanged.
func playFullDuplex(t *testing.T, x *envoy.Stream, body []byte, pieces [][]byte) {
	t.Helper()
	for i, p := range pieces {
		if err := x.Send(envoy.BodyChunk(p, i == len(pieces)-1)); err != nil {
			t.Fatal(err)
		}
	}
	var r envoy.Routed
	if err := x.RecvHeadersAnswer(&r); err != nil || r.Destination == "" || r.Metadata != r.Destination {
		t.Fatalf("headers answer %+v, %v: want routed", r, err)
	}
	if cl, _ := envoy.HeaderValue(r.HeadersAnswer, "content-length"); cl != strconv.Itoa(len(body)) {
		t.Errorf("content-length in the headers answer = %q, want %d: Envoy drops it in this mode", cl, len(body))
	}
	var echoed []byte
	for {
		resp, err := x.Recv()
		if err != nil {
			t.Fatal(err)
		}
		sb := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sb == nil {
			t.Fatalf("got %v while the body streams back", resp)
		}
		echoed = append(echoed, sb.GetBody()...)
		if sb.GetEndOfStream() {
			break
		}
	}
	if !bytes.Equal(echoed, body) {
		t.Errorf("the body came back changed: %d bytes, sent %d", len(echoed), len(body))
	}
}

// playBuffered expects an unrouted headers answer, then the destination in
// the answer to the one body message.
func playBuffered(t *testing.T, x *envoy.Stream, body []byte) {
	t.Helper()
	var r envoy.Routed
	if err := x.RecvHeadersAnswer(&r); err != nil || r.Immediate != nil {
		t.Fatalf("headers answer %+v, %v", r, err)
	}
	if r.Destination != "" || r.HeadersAnswer.GetClearRouteCache() {
		t.Errorf("the headers answer routes already: %v", r.HeadersAnswer)
	}
	if err := x.Send(envoy.BodyChunk(body, true)); err != nil {
		t.Fatal(err)
	}
	resp, err := x.Recv()
	if err != nil {
		t.Fatal(err)
	}
	common := resp.GetRequestBody().GetResponse()
	if d := destination(common); d == "" || envoy.LBMetadata(resp, protocol.DestinationKey) != d || !common.GetClearRouteCache() {
		t.Fatalf("body answer %v: want the destination in its header mutation and metadata", resp)
	}
	if cl, ok := envoy.HeaderValue(common, "content-length"); ok {
		t.Errorf("content-length %q set in BUFFERED mode, where Envoy keeps the client's", cl)
	}
}

// playLoadOnly expects the headers answer routed at once, then an empty
// answer to each body message.
func playLoadOnly(t *testing.T, x *envoy.Stream, pieces [][]byte) {
	t.Helper()
	var r envoy.Routed
	if err := x.RecvHeadersAnswer(&r); err != nil || r.Destination == "" || r.Metadata != r.Destination || !r.HeadersAnswer.GetClearRouteCache() {
		t.Fatalf("headers answer %+v, %v: want routed on the headers", r, err)
	}
	if cl, ok := envoy.HeaderValue(r.HeadersAnswer, "content-length"); ok {
		t.Errorf("content-length %q set in the headers answer, want the client's left alone", cl)
	}
	for i, p := range pieces {
		if err := x.Send(envoy.BodyChunk(p, i == len(pieces)-1)); err != nil {
			t.Fatal(err)
		}
		resp, err := x.Recv()
		if err != nil {
			t.Fatal(err)
		}
		common := resp.GetRequestBody().GetResponse()
		if common == nil || !proto.Equal(common, &extprocv3.CommonResponse{}) || resp.GetDynamicMetadata() != nil {
			t.Fatalf("answer to body message %d: %v, want an empty body answer", i, resp)
		}
	}
}

// logLines is a logger that keeps what it logs.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		l.mu.Lock()
		l.lines = append(l.lines, prefix+" "+args)
		l.mu.Unlock()
	}, funcr.Options{})
}

func (l *logLines) count(substr string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		if strings.Contains(line, substr) {
			n++
		}
	}
	return n
}

func TestLoadOnlyRoutingIsWarnedOnce(t *testing.T) {
	var lines logLines
	log := lines.logger()
	f := newFixture(t, fixtureOptions{log: &log})
	for i := range 3 {
		req := completion("m", letters(uint64(80+i), 500))
		req.Mode = filterv3.ProcessingMode_STREAMED
		if r, err := f.gw.roundTrip(t.Context(), req); err != nil || r.Destination == "" {
			t.Fatalf("request %d: %+v, %v", i, r, err)
		}
	}
	if n := lines.count("FULL_DUPLEX_STREAMED"); n != 1 {
		t.Errorf("the body-mode warning was logged %d times, want once:\n%s", n, strings.Join(lines.lines, "\n"))
	}
	if got := f.counter(t, "tally_load_only_routes_total", map[string]string{"reason": "request_body_mode"}); got != 3 {
		t.Errorf("tally_load_only_routes_total = %v, want 3", got)
	}
}

// shimHeaders is what NGINX Gateway Fabric's shim sends: the client's
// headers only. More headers may follow (kv: name, value, ...).
func shimHeaders(kv ...string) *extprocv3.ProcessingRequest {
	headers := []*corev3.HeaderValue{{Key: "content-type", Value: "application/json"}, {Key: "x-request-id", Value: "abc"}}
	for i := 0; i+1 < len(kv); i += 2 {
		headers = append(headers, &corev3.HeaderValue{Key: kv[i], Value: kv[i+1]})
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: headers}},
	}}
}

// TestMalformedStreamsAreAnsweredNotRouted plays message sequences no
// well-formed request produces. Each gets an HTTP answer or, for a broken
// ext_proc protocol, a gRPC InvalidArgument; none leaves a reservation.
func TestMalformedStreamsAreAnsweredNotRouted(t *testing.T) {
	bodiless := func(kv ...string) *extprocv3.ProcessingRequest {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
			RequestHeaders: &extprocv3.HttpHeaders{Headers: envoy.HeaderMap(kv...), EndOfStream: true},
		}}
	}
	body := completionBody("m", letters(90, 400))
	responseHeaders := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: envoy.HeaderMap(":status", "200")},
	}}
	responseBody := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte("data: x\n\n")},
	}}
	trailers := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
	for _, tc := range []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
		// Exactly one of these: the HTTP status answered, a gRPC code the
		// stream ends with, or routed on load alone.
		wantStatus int32
		wantCode   codes.Code
		wantRouted bool
		wantInMsg  string
		// picks is how many picks succeed (released when the stream ends).
		picks int64
		// bodiless: a routed request without a body, released when the
		// stream ends at the pick rather than detached (it runs nothing
		// that outlives its answer).
		bodiless bool
	}{
		{name: "bodiless POST to completions", msgs: msgs(bodiless(":path", "/v1/completions", ":method", "POST")),
			wantStatus: 400, wantInMsg: "empty"},
		{name: "bodiless POST to chat, content-length 0", msgs: msgs(bodiless(":path", "/v1/chat/completions?x=1", ":method", "POST", "content-length", "0")),
			wantStatus: 400, wantInMsg: "empty"},
		{name: "bodiless GET to completions", msgs: msgs(bodiless(":path", "/v1/completions", ":method", "GET")), wantRouted: true, picks: 1, bodiless: true},
		{name: "bodiless POST to another path", msgs: msgs(bodiless(":path", "/v1/models", ":method", "POST")), wantRouted: true, picks: 1, bodiless: true},
		{name: "bodiless POST to embeddings under a prefix", msgs: msgs(bodiless(":path", "/openai/v1/embeddings/", ":method", "POST")),
			wantStatus: 400, wantInMsg: "embeddings request needs a JSON body"},
		// A gateway that asks through a shim (NGINX Gateway Fabric) sends
		// no pseudo-headers: routed on its body, or on load alone.
		{name: "no :path, bodiless", msgs: msgs(bodiless(":method", "GET")), wantRouted: true, picks: 1, bodiless: true},
		{name: "no :method, bodiless", msgs: msgs(bodiless(":path", "/v1/models")), wantRouted: true, picks: 1, bodiless: true},
		{name: "no :method, body follows", msgs: msgs(
			&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
				RequestHeaders: &extprocv3.HttpHeaders{Headers: envoy.HeaderMap(":path", "/v1/completions")},
			}}, envoy.BodyChunk(body, true)), wantRouted: true, picks: 1},
		{name: "no pseudo-headers, completions body", msgs: msgs(shimHeaders(), envoy.BodyChunk(body, true)), wantRouted: true, picks: 1},
		{name: "no pseudo-headers, chat body", msgs: msgs(shimHeaders(),
			envoy.BodyChunk([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`), true)), wantRouted: true, picks: 1},
		{name: "no pseudo-headers, embeddings of token ids", msgs: msgs(shimHeaders(),
			envoy.BodyChunk([]byte(`{"input":[[1,2,3]],"model":"m"}`), true)), wantRouted: true, picks: 1},
		{name: "no pseudo-headers, a model and no prompt", msgs: msgs(shimHeaders(), envoy.BodyChunk([]byte(`{"model":"m"}`), true)),
			wantStatus: 400, wantInMsg: `none of \"messages\", \"prompt\" or \"input\"`},
		// Without :path, the path the upstream picker falls back to tells
		// the API: a Conversations request is no error, routed on load.
		{name: "no pseudo-headers, x-original-path to conversations", msgs: msgs(shimHeaders("x-original-path", "/v1/conversations"),
			envoy.BodyChunk([]byte(`{"model":"m","items":[]}`), true)), wantRouted: true, picks: 1},
		{name: "no pseudo-headers, x-forwarded-path to conversations", msgs: msgs(shimHeaders("x-forwarded-path", "/v1/conversations"),
			envoy.BodyChunk([]byte(`{"model":"m","items":[]}`), true)), wantRouted: true, picks: 1},
		{name: "no pseudo-headers, x-original-path to completions, no prompt", msgs: msgs(shimHeaders("x-original-path", "/v1/completions"),
			envoy.BodyChunk([]byte(`{"model":"m"}`), true)), wantStatus: 400, wantInMsg: "prompt"},
		{name: "no pseudo-headers, malformed JSON", msgs: msgs(shimHeaders(), envoy.BodyChunk([]byte(`{"model":`), true)),
			wantStatus: 400, wantInMsg: "JSON"},
		// A broken ext_proc client: the stream ends InvalidArgument, with
		// a 400 naming the violation while the request is undecided.
		{name: "body before the headers", msgs: msgs(envoy.BodyChunk(body, true)), wantCode: codes.InvalidArgument, wantInMsg: "before the request headers"},
		{name: "trailers before the headers", msgs: msgs(trailers), wantCode: codes.InvalidArgument, wantInMsg: "before the request headers"},
		{name: "second headers while the body is awaited", msgs: msgs(postHeaders("/v1/completions"), postHeaders("/v1/completions")),
			wantCode: codes.InvalidArgument, wantInMsg: "second request headers"},
		{name: "second headers after a bodiless route", msgs: msgs(bodiless(":path", "/v1/models", ":method", "GET"), postHeaders("/v1/completions")),
			wantCode: codes.InvalidArgument, picks: 1},
		{name: "second headers after the body", msgs: msgs(postHeaders("/v1/completions"), envoy.BodyChunk(body, true), postHeaders("/v1/completions")),
			wantCode: codes.InvalidArgument, picks: 1},
		{name: "response headers first", msgs: msgs(responseHeaders), wantCode: codes.InvalidArgument, wantInMsg: "before the request was routed"},
		{name: "response headers before the body ended", msgs: msgs(postHeaders("/v1/completions"), envoy.BodyChunk(body[:10], false), responseHeaders),
			wantCode: codes.InvalidArgument, wantInMsg: "before the request was routed"},
		{name: "response body before the request was routed", msgs: msgs(postHeaders("/v1/completions"), responseBody),
			wantCode: codes.InvalidArgument, wantInMsg: "before the request was routed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var picks *counting
			f := newFixture(t, fixtureOptions{wrap: func(p extproc.Picker) extproc.Picker {
				picks = &counting{Picker: p}
				return picks
			}})
			x, err := f.gw.Open(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			defer x.Cancel()
			for _, m := range tc.msgs {
				if err := x.Send(m); errors.Is(err, io.EOF) {
					break // the server has ended the stream: its answer is waiting
				} else if err != nil {
					t.Fatal(err)
				}
			}
			if err := x.CloseSend(); err != nil {
				t.Fatal(err)
			}
			var (
				immediate *extprocv3.ImmediateResponse
				routedTo  string
				end       error
			)
			for {
				resp, err := x.Recv()
				if err != nil {
					end = err
					break
				}
				if im := resp.GetImmediateResponse(); im != nil {
					immediate = im
				}
				if d := destination(resp.GetRequestHeaders().GetResponse()); d != "" {
					routedTo = d
				}
			}
			switch {
			case tc.wantStatus != 0:
				if int32(immediate.GetStatus().GetCode()) != tc.wantStatus || !strings.Contains(string(immediate.GetBody()), tc.wantInMsg) {
					t.Errorf("answered %v %s (stream end %v), want %d mentioning %q",
						immediate.GetStatus().GetCode(), immediate.GetBody(), end, tc.wantStatus, tc.wantInMsg)
				}
			case tc.wantCode != codes.OK:
				if status.Code(end) != tc.wantCode {
					t.Errorf("stream ended with %v, want %v", end, tc.wantCode)
				}
				if tc.wantInMsg == "" && immediate != nil {
					t.Errorf("answered %s after the request was decided, want no answer", immediate.GetBody())
				}
				if tc.wantInMsg != "" && (immediate.GetStatus().GetCode() != 400 || !strings.Contains(string(immediate.GetBody()), tc.wantInMsg)) {
					t.Errorf("answered %v %s, want 400 mentioning %q", immediate.GetStatus().GetCode(), immediate.GetBody(), tc.wantInMsg)
				}
			case tc.wantRouted:
				if routedTo == "" || !errors.Is(end, io.EOF) {
					t.Errorf("destination %q, stream end %v: want routed and a clean end", routedTo, end)
				}
				if shim := strings.HasPrefix(tc.name, "no :path") || strings.HasPrefix(tc.name, "no pseudo"); shim && strings.Contains(routedTo, ",") {
					t.Errorf("destination %q: a stream without pseudo-headers gets one endpoint", routedTo)
				}
			}
			if got := picks.ok.Load(); got != tc.picks {
				t.Errorf("%d picks, want %d", got, tc.picks)
			}
			if tc.wantRouted && !tc.bodiless {
				// The stream ended at the pick, before any response: its
				// reservation is detached, held until the model ends it.
				eventually(t, "the routed request detached", func() (bool, string) {
					l := f.picker.Snapshot()
					return int64(l.Detached) == tc.picks && int64(l.InFlight) == tc.picks, fmt.Sprintf("in flight %d, detached %d", l.InFlight, l.Detached)
				})
			} else {
				eventually(t, "nothing reserved", func() (bool, string) { return ledgerEmpty(f.picker) })
			}
			eventually(t, "the stream has ended", func() (bool, string) {
				n := f.counter(t, "tally_streams_active", nil)
				return n == 0, fmt.Sprintf("tally_streams_active = %v", n)
			})
			if tc.wantCode != codes.OK {
				if got := f.counter(t, "tally_protocol_errors_total", nil); got != 1 {
					t.Errorf("tally_protocol_errors_total = %v, want 1", got)
				}
			}
		})
	}
}

func msgs(m ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingRequest { return m }

// A gateway that announces no mode, waits for the headers answer, then
// streams the body in pieces is in STREAMED mode (or BUFFERED_PARTIAL): the
// headers answer has gone without a destination, so the request is refused
// with what to configure, not passed on unrouted or left to stall.
func TestUnannouncedStreamedBodyIsRefused(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	x := openWithin(t, f)
	body := []byte(`{"model":"m","prompt":"` + letters(71, 3000) + `"}`)
	if err := x.Send(headersMessage("/v1/completions", body, filterv3.ProcessingMode_STREAMED, false)); err != nil {
		t.Fatal(err)
	}
	var r envoy.Routed
	if err := x.RecvHeadersAnswer(&r); err != nil || r.Immediate != nil || r.Destination != "" {
		t.Fatalf("headers answer %+v, %v: want unrouted", r, err)
	}
	if err := x.Send(envoy.BodyChunk(body[:100], false)); err != nil {
		t.Fatal(err)
	}
	resp, err := x.Recv()
	if err != nil {
		t.Fatal(err)
	}
	im := resp.GetImmediateResponse()
	if im.GetStatus().GetCode() != 500 || !strings.Contains(string(im.GetBody()), "protocol_config") {
		t.Fatalf("answer %v: want a 500 that names protocol_config", resp)
	}
	if in := f.picker.Snapshot().InFlight; in != 0 {
		t.Errorf("in flight %d, want 0", in)
	}
}

// Once a gateway that announces no mode has sent a body unasked, it is known
// to stream: a later request whose body comes late (a slow client) is still
// served as FULL_DUPLEX_STREAMED, not taken for BUFFERED.
func TestUnannouncedStreamingGatewayIsNotTimedAgain(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	body := []byte(`{"model":"m","prompt":"` + letters(72, 3000) + `"}`)
	for i, delay := range []time.Duration{0, 300 * time.Millisecond} {
		x := openWithin(t, f)
		if err := x.Send(headersMessage("/v1/completions", body, fullDuplexMode, false)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(delay) // the client's body is late, past unannouncedBodyWait
		playFullDuplex(t, x, body, split(body, 2))
		x.ResponseMode = fullDuplexMode
		if err := x.Respond(okResponse); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
}

// A stream that began to wait for its body before its gateway showed that
// it streams (another stream's body came unasked) is not taken for
// BUFFERED when its own body comes after unannouncedBodyWait: in a cold
// burst on a picker short of CPU, such a stream's request was refused.
func TestAStreamWaitingWhenItsGatewayShowsItStreamsIsNotTimed(t *testing.T) {
	body := []byte(`{"model":"m","prompt":"` + letters(74, 3000) + `"}`)
	for attempt := 1; ; attempt++ {
		f := newFixture(t, fixtureOptions{})
		late := openWithin(t, f)
		if err := late.Send(headersMessage("/v1/completions", body, fullDuplexMode, false)); err != nil {
			t.Fatal(err)
		}
		began := time.Now()
		time.Sleep(20 * time.Millisecond) // its headers are in, its wait armed
		early := openWithin(t, f)
		if err := early.Send(headersMessage("/v1/completions", body, fullDuplexMode, false)); err != nil {
			t.Fatal(err)
		}
		playFullDuplex(t, early, body, split(body, 2))
		if time.Since(began) > 70*time.Millisecond {
			// The machine was too slow to show the gateway streaming well
			// inside the first stream's wait (100 ms): set the scene again.
			if attempt == 5 {
				t.Fatalf("%d attempts to route a request within 70 ms of another's headers", attempt)
			}
			continue
		}
		time.Sleep(300 * time.Millisecond) // past the late stream's wait
		playFullDuplex(t, late, body, split(body, 2))
		return
	}
}

// openWithin opens a stream that a stall fails within seconds rather than
// at the test's deadline; it ends with the test.
func openWithin(t *testing.T, f *fixture) *envoy.Stream {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	x, err := f.gw.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.Cancel)
	return x
}

// A gateway that asks through a shim (NGINX Gateway Fabric) announces no
// mode either, but sends no pseudo-headers: it is no Envoy, has no BUFFERED
// mode, and reads the destination from the headers answer alone. A late
// body from it (a picker short of CPU between its two messages) is still
// its body, not a sign of BUFFERED.
func TestAShimsLateBodyIsNotTakenForBuffered(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	body := []byte(`{"model":"m","prompt":"` + letters(73, 3000) + `"}`)
	x := openWithin(t, f)
	shim := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: envoy.HeaderMap("content-type", "application/json")},
	}}
	if err := x.Send(shim); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // past unannouncedBodyWait
	if err := x.Send(envoy.BodyChunk(body, true)); err != nil {
		t.Fatal(err)
	}
	var r envoy.Routed
	if err := x.RecvHeadersAnswer(&r); err != nil || r.Destination == "" {
		t.Fatalf("headers answer %+v, %v: want the destination in it", r, err)
	}
}
