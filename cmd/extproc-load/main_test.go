package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/docsection"
	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/internal/testtier"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/debugledger"
	"github.com/tallyepp/tally/picker/extproc"
)

// A smoke test of each scenario against Tally's real ext_proc server,
// in-process (the picker and gRPC server as cmd/epp assembles them), so it
// runs in `make test` without the API server; TestChurnThroughTheStack runs
// the whole tool against the epp binary when the e2e binaries are built.

var smokeEndpoints = []string{"127.0.0.21:8000", "127.0.0.22:8000", "127.0.0.23:8000"}

// inProcessTally serves a Tally picker over the three smoke endpoints on a
// loopback port and returns a target driving it.
func inProcessTally(t *testing.T) (*target, *picker.Picker) {
	t.Helper()
	return inProcessTallyReplicas(t, 1)
}

// inProcessTallyReplicas is inProcessTally served on replicas addresses.
func inProcessTallyReplicas(t *testing.T, replicas int) (*target, *picker.Picker) {
	t.Helper()
	return inProcessPicker(t, v1alpha1.Default(), smokeEndpoints, nil, replicas, nil)
}

// pdEndpoints and pdRoles are the pool of the prefill/decode smoke tests:
// two prefill pods, then two decode pods, as --pd starts.
var pdEndpoints = []string{"127.0.0.31:8000", "127.0.0.32:8000", "127.0.0.33:8000", "127.0.0.34:8000"}

// inProcessTallyPD serves a Tally picker with disaggregation on
// (nonCachedTokens) over pdEndpoints, labelled with pdRoles.
func inProcessTallyPD(t *testing.T, nonCachedTokens int) *target {
	t.Helper()
	cfg := v1alpha1.Default()
	cfg.Disaggregation.NonCachedTokens = nonCachedTokens
	reg := prometheus.NewRegistry()
	tg, _ := inProcessPicker(t, cfg, pdEndpoints, pdRoles, 1, reg)
	tg.nonCachedTokens = nonCachedTokens
	// The picker's metrics over HTTP, as a started picker serves them:
	// the burst reads its split decisions there.
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	tg.metricsURLs = []string{srv.URL}
	return tg
}

// pickerLegs reads the picker's own count of prefill legs per endpoint
// (tally_prefill_legs_total), from the metrics tg reads.
func pickerLegs(t *testing.T, tg *target) map[string]int {
	t.Helper()
	m, err := stack.ReadMetrics(t.Context(), http.DefaultClient, tg.metricsURLs[0])
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, e := range pdEndpoints {
		if v, ok := m.Value("tally_prefill_legs_total", "endpoint", e); ok {
			out[e] = int(v)
		}
	}
	return out
}

// inProcessPicker serves a Tally picker of cfg over endpoints, the first
// labelled with roles, on replicas addresses.
func inProcessPicker(t *testing.T, cfg v1alpha1.PickerConfig, endpoints, roles []string, replicas int, reg prometheus.Registerer) (*target, *picker.Picker) {
	t.Helper()
	p := picker.New(cfg, picker.Options{Log: logr.Discard(), Rand: rand.New(rand.NewPCG(1, 2)), Registerer: reg})
	var eps []picker.Endpoint
	var byEndpoint map[string]string
	for i, e := range endpoints {
		a := netip.MustParseAddrPort(e)
		ep := picker.Endpoint{Pod: "pod-" + a.Addr().String(), Address: a}
		if i < len(roles) {
			ep.Role = roles[i]
			if byEndpoint == nil {
				byEndpoint = map[string]string{}
			}
			byEndpoint[e] = roles[i]
		}
		eps = append(eps, ep)
	}
	p.Replace(eps)
	srv := extproc.NewServer(p, extproc.Options{MaxRequestBytes: cfg.MaxRequestBytes, Log: logr.Discard()})
	g := grpc.NewServer(extproc.GRPCServerOptions(cfg.MaxRequestBytes)...)
	srv.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	addrs := []string{lis.Addr().String()}
	for range replicas - 1 {
		// Another server in front of the same picker: a replica that
		// shares its ledger, as followers share the leader's.
		g := grpc.NewServer(extproc.GRPCServerOptions(cfg.MaxRequestBytes)...)
		extproc.NewServer(p, extproc.Options{MaxRequestBytes: cfg.MaxRequestBytes, Log: logr.Discard()}).Register(g)
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go g.Serve(lis)
		t.Cleanup(g.Stop)
		addrs = append(addrs, lis.Addr().String())
	}
	c, err := dialAll(addrs, false, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.close)
	ledger := func(context.Context) (debugledger.Ledger, error) {
		snap := p.Snapshot()
		l := debugledger.Ledger{InFlight: snap.InFlight, PrefillTokens: snap.PrefillTokens}
		for _, s := range snap.Endpoints {
			l.Endpoints = append(l.Endpoints, debugledger.Endpoint{
				Pod: s.Endpoint.Pod, Endpoint: s.Endpoint.Address.String(),
				InFlight: s.InFlight, PrefillTokens: s.PrefillTokens, Decoding: s.Decoding,
			})
		}
		return l, nil
	}
	return &target{name: "tally", client: c, prompts: newPrompts(1), pods: newPods(), pids: []int{os.Getpid()}, ledger: ledger, endpoints: endpoints, roles: byEndpoint}, p
}

// TestBurstPlacesEveryRequest plays the bursts through each gateway: every
// request placed, a fresh burst spread within one of even. Through NGF's
// shim the picker never sees a response phase: it detaches each
// reservation at the half-close, so they still count while the burst is
// placed.
func TestBurstPlacesEveryRequest(t *testing.T) {
	for _, gateway := range []string{gatewayEnvoy, gatewayNGF} {
		tg, _ := inProcessTally(t)
		tg.gateway = gateway
		for _, tc := range []struct {
			kind      string
			n, tokens int
		}{
			{kindFresh, 30, 2_000},
			{kindCold, 30, 2_000},
			{kindShared, 30, 2_000},
			{kindLong, 6, 31_000},
		} {
			t.Run(gateway+"/"+tc.kind, func(t *testing.T) {
				r, err := runBurst(t.Context(), tg, tc.kind, tc.n, tc.tokens)
				if err != nil {
					t.Fatal(err)
				}
				if r.errors != 0 || r.refused != 0 {
					t.Fatalf("%d failed (first: %s), %d refused", r.errors, r.firstError, r.refused)
				}
				if got := r.placement.total(); got != tc.n {
					t.Fatalf("placement %s sums to %d, want %d", r.placement.spread(), got, tc.n)
				}
				if warm := tc.kind == kindShared || tc.kind == kindLong; warm != (r.warm != "") {
					t.Errorf("warm endpoint %q for kind %s", r.warm, tc.kind)
				}
				if r.pickP50 <= 0 || r.pickP50 > r.pickP99 {
					t.Errorf("pick p50 %v, p99 %v: want 0 < p50 <= p99", r.pickP50, r.pickP99)
				}
				if tc.kind == kindFresh {
					even := tc.n / len(smokeEndpoints)
					for _, e := range smokeEndpoints {
						if c := r.placement.counts[e]; c < even-1 || c > even+1 {
							t.Errorf("fresh burst placed %s: %s has %d, want %d ± 1", r.placement.spread(), e, c, even)
						}
					}
				}
				var out bytes.Buffer
				printBurst(&out, r)
				if !strings.Contains(out.String(), "placed "+strconv.Itoa(tc.n)+", refused 0, failed 0") {
					t.Errorf("output does not report %d placed:\n%s", tc.n, out.String())
				}
			})
		}
	}
}

// checkPDBurst checks a burst's split as the tool reads it from the
// answers against the picker's own counts: every request placed on a
// decode pod, every prefill leg on a prefill pod, the split ones those
// the picker counts as split, with the legs it counts per prefill pod.
func checkPDBurst(t *testing.T, tg *target, r burstResult, n int) {
	t.Helper()
	var out bytes.Buffer
	printBurst(&out, r)
	t.Log(out.String())
	if r.errors != 0 || r.refused != 0 || r.placement.total() != n {
		t.Fatalf("placed %d of %d, %d failed (first: %s), %d refused", r.placement.total(), n, r.errors, r.firstError, r.refused)
	}
	if !slices.Equal(r.placement.endpoints, pdEndpoints[2:]) || !slices.Equal(r.prefill.endpoints, pdEndpoints[:2]) {
		t.Fatalf("destinations %v, prefill legs %v: want the decode pods %v and the prefill pods %v", r.placement.endpoints, r.prefill.endpoints, pdEndpoints[2:], pdEndpoints[:2])
	}
	atDest := 0
	for _, k := range r.splitAt {
		atDest += k
	}
	decided := 0
	for _, k := range r.decisions {
		decided += k
	}
	if r.split != r.prefill.total() || r.split != atDest || r.split != r.decisions["split"] || decided != n {
		t.Errorf("%d split, %d prefill legs, %d split by destination; the picker decided %v: want the same split count, %d decisions", r.split, r.prefill.total(), atDest, r.decisions, n)
	}
	legs := pickerLegs(t, tg)
	if r.warmPrefiller != "" {
		legs[r.warmPrefiller]-- // the warm request's, before the burst
	}
	for _, e := range pdEndpoints[:2] {
		if legs[e] != r.prefill.counts[e] {
			t.Errorf("prefill legs on %s: %d read from the answers, %d counted by the picker", e, r.prefill.counts[e], legs[e])
		}
	}
	if want := fmt.Sprintf("split %d, not split %d (nonCachedTokens %d)", r.split, n-r.split, tg.nonCachedTokens); !strings.Contains(out.String(), want) {
		t.Errorf("output lacks %q:\n%s", want, out.String())
	}
}

// TestPDBurstReadsEachSplit plays bursts of 32,000-token prompts over two
// prefill and two decode pods with disaggregation on. With nothing shared
// each request lacks its whole prompt wherever it goes: each is split, the
// legs and the destinations each within one of even.
func TestPDBurstReadsEachSplit(t *testing.T) {
	const n = 24
	for _, kind := range []string{kindFresh, kindCold, kindShared} {
		t.Run(kind, func(t *testing.T) {
			tg := inProcessTallyPD(t, 16)
			r, err := runBurst(t.Context(), tg, kind, n, 32_000)
			if err != nil {
				t.Fatal(err)
			}
			checkPDBurst(t, tg, r, n)
			if kind != kindFresh {
				return
			}
			if r.split != n {
				t.Errorf("%d of %d split: want every one", r.split, n)
			}
			if d := worstSpread(r.placement, n); d > 1 {
				t.Errorf("destinations %s: %.1f from the even share, want at most 1", r.placement.spread(), d)
			}
			if d := worstSpread(r.prefill, r.split); d > 1 {
				t.Errorf("prefill legs %s: %.1f from the even share, want at most 1", r.prefill.spread(), d)
			}
		})
	}
}

// TestPDBurstLeavesTheCachedUnsplit warms a 30,000-token prefix on one
// decode pod, then plays a burst sharing it with nonCachedTokens above the
// 2,000 tokens each request adds: on the holder a request lacks fewer
// than that, so it is not split there, and the picker says why.
func TestPDBurstLeavesTheCachedUnsplit(t *testing.T) {
	const n = 12
	tg := inProcessTallyPD(t, 4096)
	r, err := runBurst(t.Context(), tg, kindLong, n, 32_000)
	if err != nil {
		t.Fatal(err)
	}
	checkPDBurst(t, tg, r, n)
	if !slices.Contains(pdEndpoints[2:], r.warm) || !slices.Contains(pdEndpoints[:2], r.warmPrefiller) {
		t.Fatalf("prefix warmed on %q, prefilled on %q: want a decode pod, its prefill leg on a prefill pod", r.warm, r.warmPrefiller)
	}
	held := r.placement.counts[r.warm]
	if held == 0 {
		t.Fatalf("the prefix holder %s took none of %s", r.warm, r.placement.spread())
	}
	if r.splitAt[r.warm] != 0 {
		t.Errorf("the holder split %d of its %d requests: want none (2,000 uncached < nonCachedTokens 4096)", r.splitAt[r.warm], held)
	}
	// A split request's KV lands on its decode pod, which then holds the
	// prefix too: the unsplit there are as cached as the holder's.
	if r.decisions["cached"] != n-r.split {
		t.Errorf("the picker counts %d of the %d unsplit as cached (%v): want all", r.decisions["cached"], n-r.split, r.decisions)
	}
}

func TestLoadMeasuresRequestsLatencyAndCPU(t *testing.T) {
	tg, _ := inProcessTally(t)
	r, err := runLoad(t.Context(), tg, 4, 0, 2_000, 200*time.Millisecond, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if r.errors != 0 || r.refused != 0 {
		t.Fatalf("%d failed (first: %s), %d refused", r.errors, r.firstError, r.refused)
	}
	if r.requests == 0 || r.rps <= 0 {
		t.Fatalf("no requests completed: %+v", r)
	}
	if !(0 < r.pickP50 && r.pickP50 <= r.pickP99 && r.pickP99 <= r.pickP999) {
		t.Errorf("pick p50 %v, p99 %v, p999 %v: want 0 < p50 <= p99 <= p999", r.pickP50, r.pickP99, r.pickP999)
	}
	if r.use.cpu <= 0 || r.use.peak <= 0 || r.clientCPU <= 0 {
		t.Errorf("CPU %v and peak RSS %d of this process as the picker, CPU %v as the load tool: want all above 0", r.use.cpu, r.use.peak, r.clientCPU)
	}
	if got := r.placement.total(); got == 0 {
		t.Errorf("no placement recorded")
	}
}

// TestOpenLoopLoadSpreadsOverEveryAddress drives two servers of one
// picker (replicas sharing a ledger) at a fixed rate: the streams go to
// each in turn, and each address's picks are reported on their own.
func TestOpenLoopLoadSpreadsOverEveryAddress(t *testing.T) {
	tg, _ := inProcessTallyReplicas(t, 2)
	tg.echo = echoProcess(t)
	r, err := runLoad(t.Context(), tg, 0, 200, 2_000, 200*time.Millisecond, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if r.errors != 0 || r.refused != 0 {
		t.Fatalf("%d failed (first: %s), %d refused", r.errors, r.firstError, r.refused)
	}
	if len(r.byAddr) != 2 {
		t.Fatalf("per-address picks %+v, want one entry per address", r.byAddr)
	}
	a, b := r.byAddr[0], r.byAddr[1]
	if a.n == 0 || a.n-b.n > 1 || b.n-a.n > 1 {
		t.Errorf("picks per address %d and %d: want each in turn (within one)", a.n, b.n)
	}
	if a.n+b.n != r.placement.total() {
		t.Errorf("per-address picks %d + %d, placement %d: want the same requests", a.n, b.n, r.placement.total())
	}
	if a.addr == b.addr || a.p99 <= 0 || b.p99 <= 0 || a.role != "role unknown" {
		t.Errorf("per-address picks %+v: want two addresses, each with latencies, roles unknown without metrics", r.byAddr)
	}
	// Each bare round trip is timed as often as each address gets a pick
	// (a tick a slow round trip overran is skipped).
	if len(r.bareRTT) != len(rttNames) {
		t.Fatalf("bare round trips %+v: want %v", r.bareRTT, rttNames)
	}
	for _, b := range r.bareRTT {
		if b.every != 10*time.Millisecond || b.n < 20 || b.n > int(r.window/b.every)+1 || b.p50 <= 0 || b.p99 < b.p50 {
			t.Errorf("bare round trip %+v over %v: want one every 10ms, with latencies", b, r.window)
		}
	}
}

// echoProcess runs the echo command as the tool runs it, with its stdin
// and stdout on pipes, until the test ends; then it must end because its
// input closed.
func echoProcess(t *testing.T) echoAddrs {
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	done := make(chan error, 1)
	go func() { done <- runEcho(inR, outW) }()
	line, err := bufio.NewReader(outR).ReadString('\n')
	f := strings.Fields(line)
	if err != nil || len(f) != 2 {
		t.Fatalf("the echo command printed %q (%v): want its TCP and gRPC addresses", line, err)
	}
	t.Cleanup(func() {
		inW.Close()
		select {
		case err := <-done:
			if err != nil {
				t.Error(err)
			}
		case <-time.After(10 * time.Second):
			t.Error("the echo command did not end when its input closed")
		}
	})
	return echoAddrs{tcp: f[0], grpc: f[1]}
}

// TestTheEchoCommandAnswersBothProbes: each probe's round trips come back
// as sent, and stop when the probe ends.
func TestTheEchoCommandAnswersBothProbes(t *testing.T) {
	probes, err := startProbes(echoProcess(t), time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	for i, p := range probes {
		rtts, err := p.end(time.Time{}, time.Now())
		if err != nil || len(rtts) == 0 {
			t.Errorf("%s: %d round trips, error %v: want some and none", rttNames[i], len(rtts), err)
		}
	}
}

// TestAWrongEchoFailsTheProbe: a round trip whose answer is not the
// message is an error, not a sample.
func TestAWrongEchoFailsTheProbe(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		b := make([]byte, rttMessageBytes)
		for {
			if _, err := io.ReadFull(c, b); err != nil {
				return
			}
			b[0]++
			if _, err := c.Write(b); err != nil {
				return
			}
		}
	}()
	rt, closing, err := dialTCP(l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	p := startProbe("TCP", rt, closing, time.Millisecond)
	time.Sleep(50 * time.Millisecond)
	rtts, err := p.end(time.Time{}, time.Now())
	if err == nil || len(rtts) != 0 {
		t.Fatalf("%d round trips, error %v: want none and an error", len(rtts), err)
	}
}

func TestChurnLeavesTheLedgerEmpty(t *testing.T) {
	tg, p := inProcessTally(t)
	r, err := runChurn(t.Context(), tg, 50, 8, 20_000)
	if err != nil {
		t.Fatal(err)
	}
	if r.errors != 0 {
		t.Fatalf("%d failed, first: %s", r.errors, r.firstError)
	}
	for _, k := range churnKinds {
		if r.byKind[k] != 10 {
			t.Errorf("%s: %d requests, want 10 (%v)", k, r.byKind[k], r.byKind)
		}
	}
	if !r.checked || !r.empty {
		l := p.Snapshot()
		in, pre := l.InFlight, l.PrefillTokens
		t.Fatalf("ledger checked %v, empty %v (%s; totals %d in flight, %d prefill)", r.checked, r.empty, r.state, in, pre)
	}
}

// TestChurnThroughTheStack runs the tool as `make bench` does: it starts
// the API server, the pool, the pods and the epp binary, and reads the
// ledger over HTTP.
func TestChurnThroughTheStack(t *testing.T) {
	out := runThroughTheStack(t, "--n", "40", "--concurrency", "8", "--tokens", "4000", "churn")
	if !strings.Contains(out, "ledger: empty") || !strings.Contains(out, "failed 0") {
		t.Fatalf("want an empty ledger and no failure; stdout:\n%s", out)
	}
}

// runThroughTheStack runs the tool with args after --tally-bin (the epp
// binary of $TALLY_E2E_BIN_DIR), which starts the API server, the pool,
// the pods and the picker, and returns its stdout; it fails t unless the
// tool exits 0.
func runThroughTheStack(t *testing.T, args ...string) string {
	t.Helper()
	testtier.SkipIfShort(t, "a kube-apiserver and etcd (envtest), and bin/epp")
	bin := os.Getenv("TALLY_E2E_BIN_DIR")
	if bin == "" {
		t.Skip("TALLY_E2E_BIN_DIR is not set (make test sets it): no epp binary to start")
	}
	var out, errs bytes.Buffer
	if code := run(t.Context(), append([]string{"--tally-bin", filepath.Join(bin, "epp")}, args...), &out, &errs); code != 0 {
		t.Fatalf("exit %d; stdout:\n%s\nstderr:\n%s", code, out.String(), errs.String())
	}
	return out.String()
}

func TestFlagsAreChecked(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"nonsense"},
		{"--picker", "other", "burst"},
		{"--kind", "lukewarm", "--addr", "127.0.0.1:1", "burst"},
		{"--concurrency", "0", "load"},
		{"load", "--duration", "0s"},
		{"burst", "fresh"},
		{"--addr", "127.0.0.1:1", "bench"},
		{"--gateway", "ngf", "load"},
		{"--addr", "127.0.0.1:1,127.0.0.2", "load"},
		{"--replicas", "-1", "burst"},
		{"--bare-rtt", "--replicas", "3", "burst"},
		{"--bare-rtt", "load"},
		{"--bare-rtt", "--replicas", "1", "load"},
		{"--replicas", "2", "--addr", "127.0.0.1:1", "burst"},
		{"--replicas", "2", "--picker", "upstream", "burst"},
		{"--addr", "127.0.0.1:1,127.0.0.2:1", "--metrics-url", "http://a,http://b,http://c", "load"},
		{"--metrics-url", "http://a", "load"},
		{"--rate", "400", "burst"},
		{"--rate", "-1", "load"},
		{"--first-pod-ip", "10.0.0.1", "burst"},
		{"--roles", "prefill,decoder", "burst"},
		{"--pd", "load"},
		{"--pd", "--roles", "decode", "burst"},
		{"--pd", "--non-cached-tokens", "0", "burst"},
		{"--pd", "--pods", "3", "burst"},
		{"--pd", "--gateway", "ngf", "burst"},
		{"--pd", "--picker", "upstream", "burst"},
		{"--pd", "--replicas", "2", "burst"},
		{"--pd", "--addr", "127.0.0.1:1", "burst"},
		{"--pd", "--picker-arg", "--config-text={}", "burst"},
	} {
		var out, errs bytes.Buffer
		code := run(context.Background(), args, &out, &errs)
		want := 2
		if len(args) > 0 && args[0] == "--kind" {
			want = 1 // a kind is checked by the scenario, after connecting
		}
		if code != want {
			t.Errorf("%q: exit %d, want %d; stderr: %s", args, code, want, errs.String())
		}
	}
}

func TestPDFlagsStartTwoPrefillAndTwoDecodePods(t *testing.T) {
	cmd, o, err := parseFlags([]string{"--pd", "burst", "--non-cached-tokens", "4096"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cmd != "burst" || o.pods != 4 || !slices.Equal(o.roles, pdRoles) || o.nonCachedTokens != 4096 || !o.disaggregated() {
		t.Errorf("--pd: %s with %d pods, roles %q, nonCachedTokens %d: want burst, 4, %q, 4096", cmd, o.pods, o.roles, o.nonCachedTokens, pdRoles)
	}
	_, o, err = parseFlags([]string{"--roles", "decode, decode", "--pods", "3", "burst"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.pods != 3 || !slices.Equal(o.roles, []string{"decode", "decode"}) || o.disaggregated() {
		t.Errorf("--roles decode,decode --pods 3: %d pods, roles %q, disaggregated %v: want 3, two decode, off (no prefill pod)", o.pods, o.roles, o.disaggregated())
	}
	var out, errs bytes.Buffer
	if code := run(context.Background(), []string{"--roles", "prefill,decoder", "burst"}, &out, &errs); code != 2 || !strings.Contains(errs.String(), `"decoder"`) || !strings.Contains(errs.String(), "--roles") {
		t.Errorf("exit %d, stderr %q: want 2, naming --roles and the bad role", code, errs.String())
	}
}

// TestPDBurstThroughTheStack runs --pd as the benchmarks do: pods
// labelled with their roles in a real API server, the epp binary with
// disaggregation on.
func TestPDBurstThroughTheStack(t *testing.T) {
	out := runThroughTheStack(t, "--first-pod-ip", "127.0.71.1", "--pd", "--n", "16", "--kind", "fresh", "burst")
	for _, want := range []string{"split 16, not split 0 (nonCachedTokens 16)", "placed 16, refused 0, failed 0", "127.0.71.1:8000        ", "127.0.71.4:8000        "} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q:\n%s", want, out)
		}
	}
}

func TestAnInvalidGatewayIsNamed(t *testing.T) {
	var out, errs bytes.Buffer
	if code := run(context.Background(), []string{"--gateway", "haproxy", "burst"}, &out, &errs); code != 2 {
		t.Fatalf("exit %d, want 2; stderr: %s", code, errs.String())
	}
	if !strings.Contains(errs.String(), "--gateway") || !strings.Contains(errs.String(), `"haproxy"`) {
		t.Errorf("stderr %q names neither the flag nor the value", errs.String())
	}
}

func TestPromptsShareExactlyTheirPrefix(t *testing.T) {
	p := newPrompts(1)
	nonce := p.newNonce()
	prefix := p.prefix(nonce, 512)
	if len(prefix) != 512*bytesPerToken {
		t.Fatalf("prefix of %d bytes, want %d", len(prefix), 512*bytesPerToken)
	}
	var prompts []string
	for i := range 2 {
		var body struct{ Model, Prompt string }
		if err := json.Unmarshal(p.body(nonce, prefix, i, 8_000), &body); err != nil {
			t.Fatal(err)
		}
		if len(body.Prompt) != 8_000*bytesPerToken {
			t.Errorf("prompt of %d bytes, want %d", len(body.Prompt), 8_000*bytesPerToken)
		}
		prompts = append(prompts, body.Prompt)
	}
	common := 0
	for common < len(prompts[0]) && prompts[0][common] == prompts[1][common] {
		common++
	}
	// They share the prefix and the tag's "request N-" before the index.
	if common < len(prefix) || common > len(prefix)+len("request 1-") {
		t.Errorf("the prompts share %d bytes, want the %d of the prefix and the request tag", common, len(prefix))
	}
	if other := p.prefix(p.newNonce(), 512); bytes.Equal(other, prefix) {
		t.Errorf("two runs got the same prefix")
	}
}

func TestWriteSplicesTheTablesAndDrawsTheCPUChart(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "benchmarks.md")
	begin, end := docsection.Markers(sectionName)
	if err := os.WriteFile(out, []byte("# Benchmarks\n\n"+begin+"\nold\n"+end+"\n\nHand-written.\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	b := &bench{o: options{out: out}, plan: quickPlan, began: time.Now(), res: map[string]*results{}}
	for k, name := range []string{pickerTally, pickerUpstream} {
		b.res[name] = newResults()
		for _, lc := range quickPlan.loads {
			b.res[name].loads[loadKey{basePods, lc.concurrency, lc.tokens}] = loadResult{requests: 1000, use: usage{cpu: time.Duration(k+1) * time.Second}, clientCPU: 500 * time.Millisecond}
		}
	}
	var stdout bytes.Buffer
	if err := b.write(&stdout); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(doc), "\nold\n") || !strings.HasSuffix(string(doc), end+"\n\nHand-written.\n") || !strings.Contains(string(doc), "]("+cpuChartFile+")") {
		t.Errorf("the section was not replaced, or lacks the chart's link:\n%s", doc)
	}
	// Picker CPU 1 and 2 ms per request, the load tool's 0.5 with each.
	if !strings.Contains(string(doc), "| 1.000 / 2.000 (0.50×) | 0 / 0 | 0.500 / 0.500 (1.00×) |") {
		t.Errorf("the load table lacks the pickers' and the load tool's CPU per request:\n%s", doc)
	}
	svg, err := os.ReadFile(filepath.Join(dir, "bench", "cpu-per-request.svg"))
	if err != nil {
		t.Fatal(err)
	}
	// The quick plan measures 8,000 tokens at 1, 16 and 64 clients and
	// 32,000 at 16: four lines, eight points.
	if n := strings.Count(string(svg), "<polyline"); n != 4 {
		t.Errorf("%d lines, want 4 (2 pickers × 2 prompt sizes)", n)
	}
	if n := strings.Count(string(svg), "<circle"); n != 8 {
		t.Errorf("%d points, want 8", n)
	}
	for _, want := range []string{"Tally, 8,000-token prompts", "upstream, 32,000-token prompts", ">64<"} {
		if !strings.Contains(string(svg), want) {
			t.Errorf("the chart lacks %q", want)
		}
	}

	if err := os.WriteFile(out, []byte("# Benchmarks without markers\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := b.write(&stdout); err == nil || !strings.Contains(err.Error(), begin) {
		t.Errorf("a file without markers: %v, want an error naming the marker to add", err)
	}
}

func TestProcReadsThisProcess(t *testing.T) {
	cpu, err := procCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	rss, peak, err := procMemory(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if cpu < 0 || rss <= 0 || peak < rss/2 {
		t.Errorf("cpu %v, rss %d, peak %d", cpu, rss, peak)
	}
}

func TestPrefillTime(t *testing.T) {
	if got := prefillTime(32_000); got < 600*time.Millisecond || got > 700*time.Millisecond {
		t.Errorf("prefill of 32,000 tokens takes %v, want about 0.66 s (the simulated engine's latency model)", got)
	}
}

// TestStaggerReadsTheSpreadWhileRequestsOverlap: requests one every 5 ms,
// each held 150 ms, about 30 overlapping. Through Envoy the picker sees
// each one end, so the busiest endpoint stays near the even share (the
// sample after a placement can catch another request between its pick and
// its hold: 1.5 leaves room for that, not for herding, which reads 2 to 3).
// Through NGF the request ends unseen; the run must still place them all.
func TestStaggerReadsTheSpreadWhileRequestsOverlap(t *testing.T) {
	for _, gateway := range []string{gatewayEnvoy, gatewayNGF} {
		t.Run(gateway, func(t *testing.T) {
			tg, _ := inProcessTally(t)
			tg.gateway = gateway
			r, err := runStagger(t.Context(), tg, 80, 2_000, 5*time.Millisecond, 150*time.Millisecond)
			if err != nil {
				t.Fatal(err)
			}
			if r.errors != 0 || r.refused != 0 || r.placement.total() != 80 {
				t.Fatalf("placed %d of 80, %d failed (first: %s), %d refused", r.placement.total(), r.errors, r.firstError, r.refused)
			}
			if r.samples == 0 || r.worst < 1 {
				t.Fatalf("%d samples in the steady state, worst %.2f: want samples, and a busiest endpoint at or over the even share", r.samples, r.worst)
			}
			var out bytes.Buffer
			printStagger(&out, r)
			t.Log(out.String())
			if gateway == gatewayEnvoy && r.worst > 1.5 {
				t.Errorf("through Envoy the busiest endpoint held %.2f times the even share (%v)", r.worst, r.worstAt)
			}
		})
	}
}

// TestSumPercentileIsThatOfEveryPair checks sumPercentile against every
// pair's sum, sorted.
func TestSumPercentileIsThatOfEveryPair(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for try := range 200 {
		a := make([]time.Duration, 1+rng.IntN(60))
		b := make([]time.Duration, 1+rng.IntN(60))
		for i := range a {
			a[i] = time.Duration(rng.IntN(5_000))
		}
		for i := range b {
			b[i] = time.Duration(rng.IntN(3) * rng.IntN(2_000))
		}
		slices.Sort(a)
		slices.Sort(b)
		var sums []time.Duration
		for _, x := range a {
			for _, y := range b {
				sums = append(sums, x+y)
			}
		}
		slices.Sort(sums)
		for _, q := range []float64{0, 0.5, 0.9, 0.99, 1} {
			if got, want := sumPercentile(a, b, q), percentile(sums, q); got != want {
				t.Fatalf("try %d, q %v: %v, want %v (a %v, b %v)", try, q, got, want, a, b)
			}
		}
	}
	if got := sumPercentile(nil, []time.Duration{1}, 0.99); got != 0 {
		t.Errorf("no samples: %v, want 0", got)
	}
}
