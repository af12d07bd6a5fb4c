package extproc_test

import (
	"context"
	"net/netip"
	"slices"
	"sync"
	"testing"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
)

// requestLog records the picker requests the server makes.
type requestLog struct {
	extproc.Picker
	mu   sync.Mutex
	reqs []picker.Request
}

func (l *requestLog) Admit(ctx context.Context, req picker.Request) (*picker.Reservation, error) {
	l.mu.Lock()
	req.Prompt = slices.Clone(req.Prompt) // the stream recycles the buffer
	l.reqs = append(l.reqs, req)
	l.mu.Unlock()
	return l.Picker.Admit(ctx, req)
}

func (l *requestLog) last(t *testing.T) picker.Request {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.reqs) == 0 {
		t.Fatal("no pick")
	}
	return l.reqs[len(l.reqs)-1]
}

func logged(t *testing.T, o fixtureOptions) (*fixture, *requestLog) {
	log := &requestLog{}
	o.wrap = func(p extproc.Picker) extproc.Picker { log.Picker = p; return log }
	return newFixture(t, o), log
}

// TestEveryOpenAIPathIsParsed: the paths are matched by suffix and each API's
// prompt reaches the picker, with the request's cache salt.
func TestEveryOpenAIPathIsParsed(t *testing.T) {
	for _, tc := range []struct {
		path, body string
		salt       string
		prompt     string
	}{
		{"/openai/v1/completions?api-version=1", `{"model":"m","prompt":"hello","cache_salt":"tenant-a"}`, "tenant-a", "hello"},
		{"/v1/chat/completions/", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, "", "\x00Ruser\x00Chi\x00E"},
		{"/v1/responses", `{"model":"m","instructions":"S","input":"hi","cache_salt":"s"}`, "s", "\x00Rsystem\x00CS\x00E\x00Ruser\x00Chi\x00E"},
		{"/team/v1/embeddings", `{"model":"m","input":["a","b"]}`, "", "a\nb"},
		// Azure OpenAI's deployment path, with no /v1: the upstream picker
		// reads it by its suffix too.
		{"/openai/deployments/gpt/chat/completions?api-version=2024-10-21", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, "", "\x00Ruser\x00Chi\x00E"},
	} {
		t.Run(tc.path, func(t *testing.T) {
			f, log := logged(t, fixtureOptions{})
			r, err := f.gw.roundTrip(t.Context(), post(tc.path, []byte(tc.body)))
			if err != nil {
				t.Fatal(err)
			}
			if r.Immediate != nil || r.Destination == "" {
				t.Fatalf("not routed: %+v", r)
			}
			req := log.last(t)
			if req.Model != "m" || req.CacheSalt != tc.salt || string(req.Prompt) != tc.prompt {
				t.Errorf("picker got model %q salt %q prompt %q; want \"m\" %q %q", req.Model, req.CacheSalt, req.Prompt, tc.salt, tc.prompt)
			}
		})
	}
}

// TestSubsetHintByIP: the gateway may name endpoints by bare IP, or by
// another port than the endpoints' (a Service port): they match by IP, as
// with the upstream picker.
func TestSubsetHintByIP(t *testing.T) {
	ap := netip.MustParseAddrPort
	eps := []picker.Endpoint{
		{Pod: "dp", Address: ap("127.0.0.21:3000")},
		{Pod: "dp", Address: ap("127.0.0.21:3002")},
		{Pod: "other", Address: ap("127.0.0.22:3000")},
		{Pod: "v6", Address: ap("[fd00::1]:3000")},
	}
	for _, tc := range []struct {
		name string
		hint *structpb.Value
		want []string // every acceptable first destination; nil: 503
	}{
		{"bare IP", hintList("127.0.0.21"), []string{"127.0.0.21:3000", "127.0.0.21:3002"}},
		{"bare IPs in a string", structpb.NewStringValue("127.0.0.22, fd00::1"), []string{"127.0.0.22:3000", "[fd00::1]:3000"}},
		{"bracketed bare IPv6", hintList("[fd00::1]"), []string{"[fd00::1]:3000"}},
		{"another port", hintList("127.0.0.22:80"), []string{"127.0.0.22:3000"}},
		{"exact port", hintList("127.0.0.21:3002"), []string{"127.0.0.21:3002"}},
		{"unknown IP", hintList("127.0.0.99", "[fd00::1"), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, fixtureOptions{endpoints: eps})
			for range 4 {
				req := completion("m", letters(7, 800))
				req.SubsetHint = tc.hint
				r, err := f.gw.roundTrip(t.Context(), req)
				if err != nil {
					t.Fatal(err)
				}
				if tc.want == nil {
					if r.Immediate.GetStatus().GetCode() != 503 {
						t.Fatalf("got %+v, want a 503", r)
					}
					return
				}
				if !slices.Contains(tc.want, r.First()) {
					t.Fatalf("destination %q (immediate %v), want one of %q", r.Destination, r.Immediate, tc.want)
				}
			}
		})
	}
}

// TestConformanceSelectionReplacesTheHint: with the hooks on, the
// test-epp-endpoint-selection header names the candidates in place of the
// gateway's subset hint, as in the suite's own picker, and the response
// headers answer names the served endpoint.
func TestConformanceSelectionReplacesTheHint(t *testing.T) {
	for _, tc := range []struct {
		name      string
		hooks     bool
		selection string
		want      string // the only acceptable destination
		served    string // the x-conformance-test-served-endpoint answer
	}{
		{"hooks on", true, "127.0.0.13", epC.String(), epC.String()},
		{"hooks on, no header", true, "", epA.String(), epA.String()},
		{"hooks off", false, "127.0.0.13", epA.String(), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, fixtureOptions{conformanceTestHooks: tc.hooks})
			x, err := f.gw.Open(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			defer x.Cancel()
			req := completion("m", letters(9, 800))
			req.SubsetHint = hintList(epA.String())
			if tc.selection != "" {
				req.Headers = append(req.Headers, "test-epp-endpoint-selection", tc.selection)
			}
			r, err := x.SendRequest(req)
			if err != nil {
				t.Fatal(err)
			}
			if r.Destination != tc.want {
				t.Fatalf("destination %q (immediate %v), want %q", r.Destination, r.Immediate, tc.want)
			}
			if err := x.Send(x.ResponseHeadersMessage(envoy.Response{Status: 200, ServedBy: tc.want})); err != nil {
				t.Fatal(err)
			}
			answer, err := x.Recv()
			if err != nil {
				t.Fatal(err)
			}
			var served string
			for _, h := range answer.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
				if h.GetHeader().GetKey() == "x-conformance-test-served-endpoint" {
					served = string(h.GetHeader().GetRawValue())
				}
			}
			if served != tc.served {
				t.Errorf("x-conformance-test-served-endpoint %q, want %q", served, tc.served)
			}
			if err := x.Finish(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
