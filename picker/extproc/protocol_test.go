package extproc

import (
	"net/netip"
	"slices"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tallyepp/tally/picker/extproc/internal/wire"
	"github.com/tallyepp/tally/picker/protocol"
)

func TestAppendEndpoints(t *testing.T) {
	subset, bad := appendEndpoints(nil, nil, " 10.0.0.7:8000,10.0.0.8, fd00::1,[fd00::2],[fd00::3]:3002,,pod-a,[fd00::4,10.0.0.9:0,10.0.0.10:99999")
	want := []netip.AddrPort{
		netip.MustParseAddrPort("10.0.0.7:8000"),
		netip.MustParseAddrPort("10.0.0.8:0"),
		netip.MustParseAddrPort("[fd00::1]:0"),
		netip.MustParseAddrPort("[fd00::2]:0"),
		netip.MustParseAddrPort("[fd00::3]:3002"),
		netip.MustParseAddrPort("10.0.0.9:0"),
	}
	if !slices.Equal(subset, want) {
		t.Errorf("subset %v, want %v", subset, want)
	}
	if wantBad := []string{"pod-a", "[fd00::4", "10.0.0.10:99999"}; !slices.Equal(bad, wantBad) {
		t.Errorf("bad %q, want %q", bad, wantBad)
	}
}

func TestServedForTest(t *testing.T) {
	lb := func(fields map[string]*structpb.Value) *corev3.Metadata {
		return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{protocol.LBNamespace: {Fields: fields}}}
	}
	for _, tc := range []struct {
		md   *corev3.Metadata
		want string
	}{
		{lb(map[string]*structpb.Value{protocol.ServedKey: structpb.NewStringValue("10.0.0.7:3000")}), "10.0.0.7:3000"},
		{nil, "fail: missing envoy lb metadata"},
		{lb(map[string]*structpb.Value{protocol.DestinationKey: structpb.NewStringValue("10.0.0.7:3000")}), "fail: missing destination endpoint served metadata"},
	} {
		if got := servedForTest(tc.md); got != tc.want {
			t.Errorf("servedForTest(%v) = %q, want %q", tc.md, got, tc.want)
		}
	}
}

// The constant answers reach the gateway as the messages they were made from.
func TestConstantAnswersEncodeAsProtoDoes(t *testing.T) {
	c := wire.NewCodec(&wire.DirtyPool{})
	for _, p := range []*wire.PreEncoded{answerResponseHeaders, answerRequestBody, answerResponseBody, answerRequestTrailers, answerResponseTrailers} {
		got, err := c.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		var back extprocv3.ProcessingResponse
		if err := proto.Unmarshal(got.Materialize(), &back); err != nil || !proto.Equal(&back, p) {
			t.Errorf("constant answer %v decodes as %v (%v)", p, &back, err)
		}
	}
}
