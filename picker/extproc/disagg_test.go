package extproc_test

import (
	"slices"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/protocol"
)

// A split request goes to its decode pod, naming its prefill pod in
// x-prefiller-host-port (over a client's own copy), in the answer that
// routes it whatever the body mode.
func TestASplitRequestNamesItsPrefiller(t *testing.T) {
	cfg := v1alpha1.Default()
	cfg.Disaggregation.NonCachedTokens = 16
	eps := endpoints(epA, epB)
	eps[0].Role, eps[1].Role = picker.RolePrefill, picker.RoleDecode
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED} {
		f := newFixture(t, fixtureOptions{cfg: &cfg, endpoints: eps})
		req := completion("m", letters(7, 4000))
		req.Mode = mode
		req.Headers = append(req.Headers, protocol.PrefillerHeader, "10.9.9.9:80") // a client trying to choose
		x, err := f.gw.Open(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		r, err := x.SendRequest(req)
		if err != nil {
			t.Fatal(err)
		}
		if r.Immediate != nil {
			t.Fatalf("%v: refused with %v %s", mode, r.Immediate.GetStatus().GetCode(), r.Immediate.GetBody())
		}
		answer := r.HeadersAnswer
		if mode == filterv3.ProcessingMode_BUFFERED {
			answer = r.BodyAnswer
		}
		if r.First() != epB.String() || r.Metadata != r.Destination {
			t.Errorf("%v: destination %q, metadata %q; want the decode pod %s first in both", mode, r.Destination, r.Metadata, epB)
		}
		if got, _ := envoy.HeaderValue(answer, protocol.PrefillerHeader); got != epA.String() {
			t.Errorf("%v: %s = %q, want the prefill pod %s", mode, protocol.PrefillerHeader, got, epA)
		}
		if s := statsOf(f.picker, epA); s.InFlight != 1 || s.PrefillTokens != 1000 {
			t.Errorf("%v: the prefill pod holds %s, want the request's 1000 prefill tokens", mode, statsString(s))
		}
		if err := x.Respond(okResponse); err != nil {
			t.Fatal(err)
		}
		if ok, state := ledgerEmpty(f.picker); !ok {
			t.Errorf("%v: %s", mode, state)
		}
	}
}

// An unsplit request's answer removes a prefill pod the client named: the
// decode pod's sidecar must not send the prefill where a client says.
func TestAClientsOwnPrefillerIsRemovedFromAnUnsplitRequest(t *testing.T) {
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED} {
		f := newFixture(t, fixtureOptions{endpoints: endpoints(epA, epB)})
		req := completion("m", letters(7, 4000))
		req.Mode = mode
		req.Headers = append(req.Headers, protocol.PrefillerHeader, "10.9.9.9:80")
		x, err := f.gw.Open(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		r, err := x.SendRequest(req)
		if err != nil {
			t.Fatal(err)
		}
		answer := r.HeadersAnswer
		if mode == filterv3.ProcessingMode_BUFFERED {
			answer = r.BodyAnswer
		}
		if r.Destination == "" {
			t.Fatalf("%v: not routed", mode)
		}
		if !slices.Contains(answer.GetHeaderMutation().GetRemoveHeaders(), protocol.PrefillerHeader) {
			t.Errorf("%v: the answer keeps the client's %s (removes %v)", mode, protocol.PrefillerHeader, answer.GetHeaderMutation().GetRemoveHeaders())
		}
		if _, set := envoy.HeaderValue(answer, protocol.PrefillerHeader); set {
			t.Errorf("%v: the answer sets %s on an unsplit request", mode, protocol.PrefillerHeader)
		}
		if err := x.Respond(okResponse); err != nil {
			t.Fatal(err)
		}
	}
}

// A split request whose response is a server error before any first byte
// failed its prefill leg (llm-d's sidecar answers with that leg's error):
// the error's body teaches no prefill rate, and a prefill pod that fails
// its legs in a row prefills for no one for a while, its requests then
// prefilled on their decode pods.
func TestFailingPrefillLegsAreFedBack(t *testing.T) {
	cfg := v1alpha1.Default()
	cfg.Disaggregation.NonCachedTokens = 16
	eps := endpoints(epA, epB)
	eps[0].Role, eps[1].Role = picker.RolePrefill, picker.RoleDecode
	f := newFixture(t, fixtureOptions{cfg: &cfg, endpoints: eps})
	failed := response(500, `{"error":{"message":"prefill leg failed"}}`)
	rate := statsOf(f.picker, epA).PrefillTokensPerSecond
	for i := range 4 {
		x, err := f.gw.Open(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		r, err := x.SendRequest(completion("m", letters(uint64(10+i), 20_000)))
		if err != nil {
			t.Fatal(err)
		}
		pre, _ := envoy.HeaderValue(r.HeadersAnswer, protocol.PrefillerHeader)
		if i < 3 && pre != epA.String() {
			t.Fatalf("request %d: %s = %q, want the prefill pod %s (it failed %d legs)", i, protocol.PrefillerHeader, pre, epA, i)
		}
		if i == 3 && pre != "" {
			t.Errorf("after 3 failed legs: %s = %q, want none (the decode pod prefills)", protocol.PrefillerHeader, pre)
		}
		if err := x.Respond(failed); err != nil {
			t.Fatal(err)
		}
	}
	s := statsOf(f.picker, epA)
	if s.PrefillLegFailures != 3 || !s.PrefillLegsOff {
		t.Errorf("the prefill pod: %d leg failures, off %v; want 3, off", s.PrefillLegFailures, s.PrefillLegsOff)
	}
	if s.PrefillTokensPerSecond != rate {
		t.Errorf("the prefill pod's rate moved from %g to %g on error responses", rate, s.PrefillTokensPerSecond)
	}
	if b := statsOf(f.picker, epB); b.PrefillLegFailures != 0 {
		t.Errorf("the decode pod counts %d leg failures, want none (its own prefill failed)", b.PrefillLegFailures)
	}
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Error(state)
	}
}
