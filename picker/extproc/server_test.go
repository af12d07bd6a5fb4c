package extproc_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
)

// letters returns n lowercase letters that start with a block of 64
// pseudo-random ones drawn from seed, then a fixed filler. Prefix blocks are
// hashed in a chain, so two such strings share no block unless their seeds
// agree; the filler keeps megabyte prompts cheap to build under -race.
func letters(seed uint64, n int) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz"
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	var b strings.Builder
	b.Grow(n)
	for range min(n, 64) {
		b.WriteByte(alphabet[r.IntN(len(alphabet))])
	}
	if rest := n - 64; rest > 0 {
		b.WriteString(strings.Repeat(alphabet, rest/len(alphabet)+1)[:rest])
	}
	return b.String()
}

func TestRoutesOneRequestAndReleasesIt(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	ctx := t.Context()
	req := completion("m", letters(1, 4000))

	x, err := f.gw.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r, err := x.SendRequest(req)
	if err != nil {
		t.Fatal(err)
	}
	if r.Immediate != nil {
		t.Fatalf("refused with %v %s", r.Immediate.GetStatus().GetCode(), r.Immediate.GetBody())
	}
	if !r.HeadersAnswer.GetClearRouteCache() {
		t.Error("the routed headers answer does not clear the route cache")
	}
	eps := strings.Split(r.Destination, ",")
	if len(eps) != 3 || r.Metadata != r.Destination {
		t.Errorf("destination header %q, metadata %q: want the same list of the 3 endpoints in both", r.Destination, r.Metadata)
	}
	if !bytes.Equal(r.Body, req.Body) {
		t.Errorf("the body came back changed (%d bytes, sent %d)", len(r.Body), len(req.Body))
	}
	if l := f.picker.Snapshot(); l.InFlight != 1 || l.PrefillTokens != 1000 {
		t.Errorf("while the request is in flight: totals in-flight=%d prefill=%d, want 1 and 1000 (4000 chars / 4)", l.InFlight, l.PrefillTokens)
	}
	if s := statsOf(f.picker, netip.MustParseAddrPort(r.First())); s.InFlight != 1 {
		t.Errorf("the chosen endpoint %s holds %d requests, want 1", r.First(), s.InFlight)
	}

	if err := x.SendResponseHeaders(okResponse); err != nil {
		t.Fatal(err)
	}
	if err := x.SendResponseChunk(okResponse.Chunks[0], false, true); err != nil {
		t.Fatal(err)
	}
	s := statsOf(f.picker, netip.MustParseAddrPort(r.First()))
	if s.InFlight != 1 || s.PrefillTokens != 0 || s.Decoding != 1 {
		t.Errorf("after the first response bytes: %+v, want in-flight 1, prefill 0, decoding 1", s)
	}
	if err := x.SendResponseChunk(okResponse.Chunks[1], true, true); err != nil {
		t.Fatal(err)
	}
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Errorf("after the response's end: %s", state)
	}
	if err := x.Finish(); err != nil {
		t.Fatal(err)
	}
	if got := f.counter(t, "tally_requests_total", map[string]string{"code": "200"}); got != 1 {
		t.Errorf("tally_requests_total{code=200} = %v, want 1", got)
	}
}

func TestLargeBodyPassesThroughInChunks(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	req := completion("m", letters(2, 5<<20))
	req.ChunkBytes = 64 << 10
	r, err := f.gw.roundTrip(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	if r.Immediate != nil {
		t.Fatalf("refused with %v %s", r.Immediate.GetStatus().GetCode(), r.Immediate.GetBody())
	}
	if !bytes.Equal(r.Body, req.Body) {
		t.Fatalf("the body came back changed: %d bytes, sent %d", len(r.Body), len(req.Body))
	}
	for i, n := range r.BodyChunks {
		if n > 62_000 {
			t.Fatalf("chunk %d has %d bytes, want at most 62000", i, n)
		}
	}
	t.Logf("%d bytes came back in %d chunks", len(r.Body), len(r.BodyChunks))
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Error(state)
	}
}

func TestBodilessRequestIsRoutedOnItsHeaders(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	r, err := x.SendRequest(envoy.Request{Headers: gatewayHeaders("GET", "/v1/models")})
	if err != nil {
		t.Fatal(err)
	}
	if r.Immediate != nil || r.Destination == "" || r.Destination != r.Metadata || !r.HeadersAnswer.GetClearRouteCache() {
		t.Fatalf("got %+v, want a routed headers answer", r)
	}
	if l := f.picker.Snapshot(); l.InFlight != 1 || l.PrefillTokens != 0 {
		t.Errorf("totals in-flight=%d prefill=%d, want 1 request with no prefill", l.InFlight, l.PrefillTokens)
	}
	// A response without a body ends on its headers.
	if err := x.Respond(response(200)); err != nil {
		t.Fatal(err)
	}
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Error(state)
	}
}

func TestBufferedModeRoutesInTheBodyAnswer(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	req := completion("m", letters(3, 2000))
	req.Mode = filterv3.ProcessingMode_BUFFERED
	req.Headers = append(req.Headers, "x-gateway-destination-endpoint", "10.9.9.9:80") // a client trying to choose
	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	r, err := x.SendRequest(req)
	if err != nil {
		t.Fatal(err)
	}
	if r.Immediate != nil {
		t.Fatalf("refused with %v %s", r.Immediate.GetStatus().GetCode(), r.Immediate.GetBody())
	}
	if destination(r.HeadersAnswer) != "" || r.HeadersAnswer.GetClearRouteCache() {
		t.Errorf("the headers answer routes already: %v", r.HeadersAnswer)
	}
	if !slices.Contains(r.HeadersAnswer.GetHeaderMutation().GetRemoveHeaders(), "x-gateway-destination-endpoint") {
		t.Errorf("the headers answer keeps the client's x-gateway-destination-endpoint: %v", r.HeadersAnswer)
	}
	if len(strings.Split(r.Destination, ",")) != 3 || r.Metadata != r.Destination {
		t.Errorf("body answer: destination %q, metadata %q, want the 3 endpoints in both", r.Destination, r.Metadata)
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
}

func TestRequestTrailersEndTheBody(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	body := completionBody("m", letters(4, 1000))
	// Plays the messages itself: the body ends with trailers, not end_of_stream.
	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	msgs := []*extprocv3.ProcessingRequest{
		postHeaders("/v1/completions"),
		envoy.BodyChunk(body, false),
		{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}},
	}
	for _, m := range msgs {
		if err := x.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	var got envoy.Routed
	if err := x.RecvHeadersAnswer(&got); err != nil || got.Destination == "" {
		t.Fatalf("headers answer: %+v, %v; want routed", got, err)
	}
	resp, err := x.Recv()
	if err != nil {
		t.Fatal(err)
	}
	sb := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if !bytes.Equal(sb.GetBody(), body) || sb.GetEndOfStream() {
		t.Fatalf("body answer %v: want the body unchanged and not ending the stream (trailers follow)", resp)
	}
	if resp, err = x.Recv(); err != nil || resp.GetRequestTrailers() == nil {
		t.Fatalf("got %v, %v; want the trailers answer", resp, err)
	}
	if err := x.Respond(okResponse); err != nil {
		t.Fatal(err)
	}
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Error(state)
	}
}

func TestSubsetHint(t *testing.T) {
	for _, tc := range []struct {
		name string
		hint *structpb.Value
		want []string // acceptable destination headers; nil: 503
	}{
		{"list", hintList("127.0.0.12:8000"), []string{"127.0.0.12:8000"}},
		{"comma string", structpb.NewStringValue("127.0.0.13:8000, 127.0.0.12:8000"),
			[]string{"127.0.0.12:8000,127.0.0.13:8000", "127.0.0.13:8000,127.0.0.12:8000"}},
		{"list with an entry that is not an address", hintList("pod-b", "127.0.0.12:8000"), []string{"127.0.0.12:8000"}},
		{"empty list", hintList(), nil},
		{"unknown endpoints only", hintList("127.0.0.99:8000", "[::1]:8000"), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, fixtureOptions{})
			req := completion("m", letters(5, 800))
			req.SubsetHint = tc.hint
			r, err := f.gw.roundTrip(t.Context(), req)
			if err != nil {
				t.Fatal(err)
			}
			if tc.want == nil {
				if r.Immediate.GetStatus().GetCode() != 503 {
					t.Fatalf("got %+v, want a 503", r)
				}
			} else if !slices.Contains(tc.want, r.Destination) {
				t.Fatalf("destination %q (immediate %v), want one of %q", r.Destination, r.Immediate, tc.want)
			}
			if ok, state := ledgerEmpty(f.picker); !ok {
				t.Error(state)
			}
		})
	}
}

func TestIPv6EndpointsAreBracketed(t *testing.T) {
	v6 := netip.MustParseAddrPort("[::1]:8001")
	f := newFixture(t, fixtureOptions{endpoints: endpoints(v6)})
	req := completion("m", letters(6, 800))
	req.SubsetHint = hintList("[::1]:8001")
	r, err := f.gw.roundTrip(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	if r.Destination != "[::1]:8001" || r.Metadata != "[::1]:8001" {
		t.Fatalf("destination %q, metadata %q, want [::1]:8001", r.Destination, r.Metadata)
	}
}

func TestErrorsAreAnsweredAsJSON(t *testing.T) {
	saturated := v1alpha1.Default()
	saturated.Saturation.MaxInFlightRequests = 1
	for _, tc := range []struct {
		name string
		opts fixtureOptions
		// hold, when set, is routed first and kept in flight.
		hold       *envoy.Request
		req        envoy.Request
		wantStatus int32
		wantInMsg  string
	}{
		{name: "bad JSON", req: post("/v1/completions", []byte(`{"model":"m","prompt":`)), wantStatus: 400},
		{name: "no model", req: post("/v1/completions", []byte(`{"prompt":"hello"}`)), wantStatus: 400},
		{
			name: "body too large", opts: fixtureOptions{maxRequestBytes: 4096},
			req:        envoy.Request{Headers: gatewayHeaders("POST", "/v1/completions"), Body: completionBody("m", letters(7, 10_000)), ChunkBytes: 1024},
			wantStatus: 413, wantInMsg: "maxRequestBytes",
		},
		{
			// No content-length to refuse on: the chunks are counted as they come.
			name: "body too large, chunked", opts: fixtureOptions{maxRequestBytes: 4096},
			req:        envoy.Request{Headers: gatewayHeaders("POST", "/v1/completions"), Body: completionBody("m", letters(7, 10_000)), ChunkBytes: 1024, Chunked: true},
			wantStatus: 413, wantInMsg: "maxRequestBytes",
		},
		{
			name: "buffer budget exhausted", opts: fixtureOptions{maxBufferedRequestBytes: 4096},
			req:        envoy.Request{Headers: gatewayHeaders("POST", "/v1/completions"), Body: completionBody("m", letters(7, 10_000)), ChunkBytes: 1024},
			wantStatus: 503, wantInMsg: "budget 4096 bytes",
		},
		{
			name: "body too large, buffered", opts: fixtureOptions{maxRequestBytes: 4096},
			req:        envoy.Request{Headers: gatewayHeaders("POST", "/v1/completions"), Body: completionBody("m", letters(7, 10_000)), Mode: filterv3.ProcessingMode_BUFFERED},
			wantStatus: 413, wantInMsg: "maxRequestBytes",
		},
		{name: "no eligible endpoint", req: func() envoy.Request {
			r := completion("m", "hello")
			r.SubsetHint = hintList("127.0.0.99:8000")
			return r
		}(), wantStatus: 503},
		{
			name: "every endpoint saturated", opts: fixtureOptions{cfg: &saturated, endpoints: endpoints(epA)},
			hold: new(post("/v1/completions", completionBody("m", "first"))),
			req:  completion("m", "second"), wantStatus: 429,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, tc.opts)
			if tc.hold != nil {
				x, err := f.gw.Open(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				defer x.Cancel()
				if r, err := x.SendRequest(*tc.hold); err != nil || r.Destination == "" {
					t.Fatalf("holding request: %+v, %v", r, err)
				}
			}
			r, err := f.gw.roundTrip(t.Context(), tc.req)
			if err != nil {
				t.Fatal(err)
			}
			im := r.Immediate
			if int32(im.GetStatus().GetCode()) != tc.wantStatus {
				t.Fatalf("got %+v, want an immediate %d", r, tc.wantStatus)
			}
			var ct string
			for _, h := range im.GetHeaders().GetSetHeaders() {
				if h.GetHeader().GetKey() == "content-type" {
					ct = string(h.GetHeader().GetRawValue())
				}
			}
			if ct != "application/json" {
				t.Errorf("content-type %q, want application/json", ct)
			}
			var body struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int32  `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(im.GetBody(), &body); err != nil {
				t.Fatalf("body %q: %v", im.GetBody(), err)
			}
			if body.Error.Code != tc.wantStatus || body.Error.Message == "" || body.Error.Type == "" || !strings.Contains(body.Error.Message, tc.wantInMsg) {
				t.Errorf("body %s: want code %d, a type and a message containing %q", im.GetBody(), tc.wantStatus, tc.wantInMsg)
			}
			code := map[string]string{"code": strconv.Itoa(int(tc.wantStatus))}
			if got := f.counter(t, "tally_requests_total", code); got != 1 {
				t.Errorf("tally_requests_total%v = %v, want 1", code, got)
			}
			if tc.hold == nil {
				if ok, state := ledgerEmpty(f.picker); !ok {
					t.Error(state)
				}
			}
		})
	}
}

func TestFallbackListIsBestFirst(t *testing.T) {
	for _, fallbacks := range []int{1, 2, 3} {
		cfg := v1alpha1.Default()
		cfg.FallbackEndpoints = fallbacks
		f := newFixture(t, fixtureOptions{cfg: &cfg})
		ctx, cancel := context.WithCancel(t.Context())
		// Load A with 2,000 prefill tokens and B with 1,000: the order for
		// a fresh request is then C, B, A.
		for i, hold := range []struct {
			ep    string
			chars int
		}{{"127.0.0.11:8000", 8000}, {"127.0.0.12:8000", 4000}} {
			x, err := f.gw.Open(ctx)
			if err != nil {
				t.Fatal(err)
			}
			req := completion("m", letters(uint64(10+i), hold.chars))
			req.SubsetHint = hintList(hold.ep)
			if r, err := x.SendRequest(req); err != nil || r.Destination != hold.ep {
				t.Fatalf("holding request on %s: %+v, %v", hold.ep, r, err)
			}
		}
		x, err := f.gw.Open(ctx)
		if err != nil {
			t.Fatal(err)
		}
		r, err := x.SendRequest(completion("m", letters(20, 400)))
		if err != nil {
			t.Fatal(err)
		}
		want := strings.Join([]string{"127.0.0.13:8000", "127.0.0.12:8000", "127.0.0.11:8000"}[:fallbacks], ",")
		if r.Destination != want || r.Metadata != want {
			t.Errorf("fallbackEndpoints %d: destination %q, metadata %q, want %q", fallbacks, r.Destination, r.Metadata, want)
		}
		cancel()
		eventually(t, "cancelled streams are released", func() (bool, string) { return ledgerEmpty(f.picker) })
	}
}

func TestEndpointRemovedWhileRequestsAreInFlight(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	ctx := t.Context()
	var held []*envoy.Stream
	for i, ep := range []string{"127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.12:8000", "127.0.0.13:8000"} {
		x, err := f.gw.Open(ctx)
		if err != nil {
			t.Fatal(err)
		}
		req := completion("m", letters(uint64(30+i), 1200))
		req.SubsetHint = hintList(ep)
		if r, err := x.SendRequest(req); err != nil || r.Destination != ep {
			t.Fatalf("request on %s: %+v, %v", ep, r, err)
		}
		held = append(held, x)
	}
	// B goes away, then comes back while its two old requests still run: it
	// gets its row back, with them.
	f.picker.Replace(endpoints(epA, epC))
	f.picker.Replace(endpoints(epA, epB, epC))
	x, err := f.gw.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	req := completion("m", letters(40, 1200))
	req.SubsetHint = hintList("127.0.0.12:8000")
	if r, err := x.SendRequest(req); err != nil || r.Destination != "127.0.0.12:8000" {
		t.Fatalf("new request on B: %+v, %v", r, err)
	}
	// One old B request ends normally, the other by a disconnect.
	if err := held[1].Respond(okResponse); err != nil {
		t.Fatal(err)
	}
	held[2].Cancel()
	if err := held[0].Respond(okResponse); err != nil {
		t.Fatal(err)
	}
	eventually(t, "old requests released from B's row, leaving the new one", func() (bool, string) {
		b := statsOf(f.picker, epB)
		l := f.picker.Snapshot()
		in, prefill := l.InFlight, l.PrefillTokens
		return b.InFlight == 1 && b.PrefillTokens == 300 && in == 2 && prefill == 600,
			"B " + statsString(b) + "; " + func() string { _, s := ledgerEmpty(f.picker); return s }()
	})
	for _, s := range f.picker.Snapshot().Endpoints {
		if s.InFlight < 0 || s.PrefillTokens < 0 || s.Decoding < 0 {
			t.Errorf("negative count: %s", statsString(s))
		}
	}
	if err := held[3].Respond(okResponse); err != nil {
		t.Fatal(err)
	}
	if err := x.Respond(okResponse); err != nil {
		t.Fatal(err)
	}
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Error(state)
	}
}

func TestServedByMovesTheReservation(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	req := completion("m", letters(50, 2000))
	req.SubsetHint = hintList("127.0.0.11:8000", "127.0.0.12:8000")
	if r, err := x.SendRequest(req); err != nil || r.First() != "127.0.0.11:8000" && r.First() != "127.0.0.12:8000" {
		t.Fatalf("got %+v, %v", r, err)
	}
	// The gateway fell back to C, which was not even in the hint: the picker
	// follows where the load really went.
	servedByC := okResponse
	servedByC.ServedBy = "127.0.0.13:8000"
	if err := x.SendResponseHeaders(servedByC); err != nil {
		t.Fatal(err)
	}
	c := statsOf(f.picker, epC)
	if c.InFlight != 1 || c.PrefillTokens != 500 {
		t.Errorf("C after served-by: %s, want in-flight 1, prefill 500", statsString(c))
	}
	if l := f.picker.Snapshot(); l.InFlight != 1 || l.PrefillTokens != 500 {
		t.Errorf("totals in-flight=%d prefill=%d, want the one request, counted once", l.InFlight, l.PrefillTokens)
	}
	if err := x.SendResponseChunk(okResponse.Chunks[0], false, true); err != nil {
		t.Fatal(err)
	}
	if c := statsOf(f.picker, epC); c.Decoding != 1 || c.PrefillTokens != 0 {
		t.Errorf("C after the first bytes: %s", statsString(c))
	}
	if err := x.SendResponseChunk(okResponse.Chunks[1], true, true); err != nil {
		t.Fatal(err)
	}
	if err := x.Finish(); err != nil {
		t.Fatal(err)
	}
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Error(state)
	}
}

// panicky panics on requests for the model "boom".
type panicky struct{ extproc.Picker }

func (p panicky) Admit(ctx context.Context, req picker.Request) (*picker.Reservation, error) {
	if req.Model == "boom" {
		panic("injected failure")
	}
	return p.Picker.Admit(ctx, req)
}

func TestPanicInOneStreamIsAnswered500(t *testing.T) {
	f := newFixture(t, fixtureOptions{wrap: func(p extproc.Picker) extproc.Picker { return panicky{p} }})
	ctx := t.Context()
	before, err := f.gw.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := before.SendRequest(completion("m", letters(60, 1000))); err != nil || r.Destination == "" {
		t.Fatalf("got %+v, %v", r, err)
	}

	x, err := f.gw.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r, err := x.SendRequest(completion("boom", letters(61, 1000)))
	if err != nil {
		t.Fatal(err)
	}
	if r.Immediate.GetStatus().GetCode() != 500 {
		t.Fatalf("got %+v, want an immediate 500", r)
	}
	if _, err := x.Recv(); status.Code(err) != codes.Internal {
		t.Errorf("stream ended with %v, want an Internal error for this stream", err)
	}

	// The stream that was already running and a new one both still work.
	if err := before.Respond(okResponse); err != nil {
		t.Fatalf("the stream open during the panic: %v", err)
	}
	if r, err := f.gw.roundTrip(ctx, completion("m", letters(62, 1000))); err != nil || r.Destination == "" {
		t.Fatalf("a stream after the panic: %+v, %v", r, err)
	}
	if got := f.counter(t, "tally_stream_panics_total", nil); got != 1 {
		t.Errorf("tally_stream_panics_total = %v, want 1", got)
	}
	if got := f.counter(t, "tally_requests_total", map[string]string{"code": "500"}); got != 1 {
		t.Errorf("tally_requests_total{code=500} = %v, want 1", got)
	}
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Error(state)
	}
}

func statsString(s picker.EndpointStats) string {
	return fmt.Sprintf("%s: in-flight=%d prefill=%d decoding=%d", s.Endpoint.Address, s.InFlight, s.PrefillTokens, s.Decoding)
}

// postHeaders is the headers message of a request whose body follows.
func postHeaders(path string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: envoy.HeaderMap(":path", path, ":method", "POST")},
	}}
}

// A declared length past maxRequestBytes is refused on the headers, before
// the gateway sends a byte of the body.
func TestDeclaredLengthIsRefusedOnTheHeaders(t *testing.T) {
	f := newFixture(t, fixtureOptions{maxRequestBytes: 4096})
	// Without the check the server would wait for the body: bounded.
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	x, err := f.gw.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Cancel()
	if err := x.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: envoy.HeaderMap(":path", "/v1/completions", ":method", "POST", "content-length", "4097")},
	}}); err != nil {
		t.Fatal(err)
	}
	resp, err := x.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if im := resp.GetImmediateResponse(); im == nil || im.GetStatus().GetCode() != 413 {
		t.Fatalf("answer to headers declaring 4,097 bytes: %v, want an immediate 413", resp)
	}
}

// A content-length that is not a length is ignored, as upstream: the body
// is counted as it comes and routed.
func TestMalformedContentLengthIsIgnored(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	req := completion("m", letters(3, 400))
	req.Chunked = true
	req.Headers = append(req.Headers, "content-length", "12abc")
	r, err := f.gw.roundTrip(t.Context(), req)
	if err != nil || r.Immediate != nil || !bytes.Equal(r.Body, req.Body) {
		t.Fatalf("err %v, immediate %v, body intact %v; want routed", err, r.Immediate, bytes.Equal(r.Body, req.Body))
	}
}
