package extproc_test

import (
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/tallyepp/tally/internal/testtier"
)

// A gateway that keeps its connection to the picker alive with HTTP/2
// pings (Envoy's connection_keepalive) keeps the connection and the
// requests on it. gRPC's default policy takes a ping sooner than every 5
// minutes for abuse and, after the third, closes the connection and every
// stream in flight on it ("too_many_pings").
func TestAGatewaysKeepalivePingsKeepItsRequests(t *testing.T) {
	testtier.SkipIfShort(t, "45 s of wall time: 4.5 keepalive intervals")
	t.Parallel()
	// Every 10 s: the shortest a gRPC client pings.
	const every = 10 * time.Second
	f := newFixture(t, fixtureOptions{dial: []grpc.DialOption{
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: every, Timeout: 5 * time.Second, PermitWithoutStream: true}),
	}})
	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	r, err := x.SendRequest(completion("m", letters(1, 4000)))
	if err != nil {
		t.Fatal(err)
	}
	if r.Immediate != nil {
		t.Fatalf("refused with %v %s", r.Immediate.GetStatus().GetCode(), r.Immediate.GetBody())
	}
	// The request is generating: its stream waits for the response while
	// the gateway pings.
	time.Sleep(4*every + every/2)
	if err := x.SendResponseHeaders(okResponse); err != nil {
		t.Fatalf("after 45 s of the gateway's pings, the stream of a request in flight is gone: %v", err)
	}
	for i, c := range okResponse.Chunks {
		if err := x.SendResponseChunk(c, i == len(okResponse.Chunks)-1, true); err != nil {
			t.Fatalf("after 45 s of the gateway's pings, the stream of a request in flight is gone: %v", err)
		}
	}
	if err := x.Finish(); err != nil {
		t.Fatalf("after 45 s of the gateway's pings, the stream of a request in flight is gone: %v", err)
	}
	if ok, state := ledgerEmpty(f.picker); !ok {
		t.Errorf("after the response's end: %s", state)
	}
}
