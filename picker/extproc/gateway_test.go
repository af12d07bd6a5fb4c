package extproc_test

import (
	"k8s.io/utils/clock"

	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
	"github.com/tallyepp/tally/picker/protocol"
)

// This file plays the gateway: it drives the real ext_proc server over a real
// gRPC connection on loopback, sending the messages Envoy's ext_proc filter
// sends, in the order it sends them.

// Endpoints of the simulated pool. Only their addresses matter: nothing
// connects to them.
var (
	epA = netip.MustParseAddrPort("127.0.0.11:8000")
	epB = netip.MustParseAddrPort("127.0.0.12:8000")
	epC = netip.MustParseAddrPort("127.0.0.13:8000")
)

func endpoints(addrs ...netip.AddrPort) []picker.Endpoint {
	eps := make([]picker.Endpoint, len(addrs))
	for i, a := range addrs {
		// The pod name follows the address: the same endpoint listed again
		// is the same pod, with its cache.
		eps[i] = picker.Endpoint{Pod: "vllm-" + a.Addr().String(), Address: a}
	}
	return eps
}

type fixtureOptions struct {
	cfg             *v1alpha1.PickerConfig // nil: defaults
	endpoints       []picker.Endpoint      // nil: A, B, C
	maxRequestBytes int64                  // 0: cfg.MaxRequestBytes
	// maxBufferedRequestBytes is the server's buffer budget; 0: none.
	maxBufferedRequestBytes int64
	wrap                    func(extproc.Picker) extproc.Picker
	quiet                   bool         // log nothing (load tests)
	log                     *logr.Logger // nil: the test's log (or none if quiet)
	// conformanceTestHooks turns on extproc.Options.ConformanceTestHooks.
	conformanceTestHooks bool
	// objectives gives requests their priority (flow control); nil: none.
	objectives extproc.Objectives
	// rewrites rewrites requests' models; nil: none.
	rewrites extproc.Rewrites
	// now is the picker's clock; nil: one that stands still.
	now func() time.Time
	// pool says why the pool offers no endpoint; nil: no cause is given.
	pool extproc.Pool
	// dial adds to the gateway's dial options.
	dial []grpc.DialOption
}

type fixture struct {
	picker *picker.Picker
	reg    *prometheus.Registry
	gw     *gateway
}

// newFixture starts a picker, the ext_proc server on 127.0.0.1:0 and a client
// connection to it; all are stopped when the test ends.
func newFixture(t testing.TB, o fixtureOptions) *fixture {
	t.Helper()
	cfg := v1alpha1.Default()
	if o.cfg != nil {
		cfg = *o.cfg
	}
	if o.endpoints == nil {
		o.endpoints = endpoints(epA, epB, epC)
	}
	if o.maxRequestBytes == 0 {
		o.maxRequestBytes = cfg.MaxRequestBytes
	}
	log := logr.Discard()
	switch {
	case o.log != nil:
		log = *o.log
	case !o.quiet:
		log = testr.New(t.(*testing.T))
	}
	reg := prometheus.NewRegistry()
	// A clock that stands still: the picker's drain model then releases no
	// prefill behind the tests' backs, so they can assert exact ledgers.
	frozen := time.Now()
	now := o.now
	if now == nil {
		now = func() time.Time { return frozen }
	}
	p := picker.New(cfg, picker.Options{Rand: rand.New(rand.NewPCG(1, 2)), Log: log, Registerer: reg, Clock: nowClock(now)})
	p.Replace(o.endpoints)
	var routed extproc.Picker = p
	if o.wrap != nil {
		routed = o.wrap(p)
	}
	srv := extproc.NewServer(routed, extproc.Options{
		MaxRequestBytes:         o.maxRequestBytes,
		MaxBufferedRequestBytes: o.maxBufferedRequestBytes,
		Log:                     log,
		Registerer:              reg,
		ConformanceTestHooks:    o.conformanceTestHooks,
		Objectives:              o.objectives,
		Rewrites:                o.rewrites,
		Pool:                    o.pool,
	})
	// WaitForHandlers: Stop returns only once every stream has ended, so no
	// stream logs after its test is over.
	g := grpc.NewServer(append(extproc.GRPCServerOptions(o.maxRequestBytes), grpc.WaitForHandlers(true))...)
	srv.Register(g)
	return &fixture{picker: p, reg: reg, gw: serve(t, g, append(o.dial, grpc.WithTransportCredentials(insecure.NewCredentials()))...)}
}

// serve runs g on a loopback port and returns a gateway connected to it
// with opts (credentials among them).
func serve(t testing.TB, g *grpc.Server, opts ...grpc.DialOption) *gateway {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- g.Serve(lis) }()
	t.Cleanup(func() {
		g.Stop()
		if err := <-served; err != nil {
			t.Errorf("grpc server: %v", err)
		}
	})
	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := envoy.NewClient(envoy.Options{Strict: true}, conn)
	return &gateway{Client: c, conn: conn}
}

// gateway is the tests' Envoy, strict about the picker's answers.
type gateway struct {
	*envoy.Client
	conn *grpc.ClientConn
}

// gatewayHeaders are the headers of a request as Envoy passes them on.
func gatewayHeaders(method, path string) []string {
	return []string{":path", path, ":method", method, ":authority", "gateway.example"}
}

// post is a POST of body to path.
func post(path string, body []byte) envoy.Request {
	return envoy.Request{Headers: gatewayHeaders("POST", path), Body: body}
}

func completion(model, prompt string) envoy.Request {
	return post("/v1/completions", completionBody(model, prompt))
}

func completionBody(model, prompt string) []byte {
	var b bytes.Buffer
	b.WriteString(`{"model":"`)
	b.WriteString(model)
	b.WriteString(`","prompt":"`)
	b.WriteString(prompt) // test prompts need no JSON escaping
	b.WriteString(`","max_tokens":16}`)
	return b.Bytes()
}

// destination is the destination an answer's header mutation sets.
func destination(c *extprocv3.CommonResponse) string {
	d, _ := envoy.HeaderValue(c, protocol.DestinationHeader)
	return d
}

// response is a model server's response, sent as an event stream whatever
// its body (the picker then answers it chunk for chunk).
func response(status int, chunks ...string) envoy.Response {
	r := envoy.Response{Status: status, ContentType: "text/event-stream"}
	for _, c := range chunks {
		r.Chunks = append(r.Chunks, []byte(c))
	}
	return r
}

var okResponse = response(200, `data: {"choices":[{"text":"hi"}]}`+"\n\n", "data: [DONE]\n\n")

// roundTrip plays a whole request and its 200 response.
func (g *gateway) roundTrip(ctx context.Context, req envoy.Request) (envoy.Routed, error) {
	x, err := g.Open(ctx)
	if err != nil {
		return envoy.Routed{}, err
	}
	defer x.Cancel()
	r, err := x.SendRequest(req)
	if err != nil || r.Immediate != nil {
		return r, err
	}
	return r, x.Respond(okResponse)
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t testing.TB, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still not true after 10s: %s", what, state)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ledgerEmpty reports whether the picker holds no reservation at all.
func ledgerEmpty(p *picker.Picker) (bool, string) {
	l := p.Snapshot()
	inFlight, prefill := l.InFlight, l.PrefillTokens
	ok := inFlight == 0 && prefill == 0
	var b strings.Builder
	fmt.Fprintf(&b, "totals in-flight=%d prefill=%d;", inFlight, prefill)
	for _, s := range p.Snapshot().Endpoints {
		fmt.Fprintf(&b, " %s;", statsString(s))
		ok = ok && s.InFlight == 0 && s.PrefillTokens == 0 && s.Decoding == 0
	}
	return ok, b.String()
}

func statsOf(p *picker.Picker, addr netip.AddrPort) picker.EndpointStats {
	for _, s := range p.Snapshot().Endpoints {
		if s.Endpoint.Address == addr {
			return s
		}
	}
	return picker.EndpointStats{}
}

func hintList(addrs ...string) *structpb.Value {
	vals := make([]*structpb.Value, len(addrs))
	for i, a := range addrs {
		vals[i] = structpb.NewStringValue(a)
	}
	return structpb.NewListValue(&structpb.ListValue{Values: vals})
}

// gauge reads an unlabelled gauge from the fixture's registry; unlike
// counter it may be called from any goroutine (0 if it cannot be read).
func (f *fixture) gauge(name string) float64 {
	families, _ := f.reg.Gather()
	for _, fam := range families {
		if fam.GetName() == name && len(fam.GetMetric()) > 0 {
			return fam.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return 0
}

// counter reads a counter (or counter vec member) from the fixture's registry.
func (f *fixture) counter(t testing.TB, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := f.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, fam := range families {
		if fam.GetName() != name {
			continue
		}
	metrics:
		for _, m := range fam.GetMetric() {
			for _, lp := range m.GetLabel() {
				if labels[lp.GetName()] != lp.GetValue() {
					continue metrics
				}
			}
			return m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return 0
}

// nowClock is a picker clock read from now, whose timers run in real time
// (flow control's dispatch timer, as with the real clock).
type nowClock func() time.Time

func (c nowClock) Now() time.Time { return c() }

func (nowClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	return clock.RealClock{}.AfterFunc(d, f)
}
