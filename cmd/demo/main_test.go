package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/modelsim/server"
	"github.com/tallyepp/tally/internal/stack"
)

func TestBadFlagsExitTwoNamingTheFlag(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--pods=0"}, "flag --pods: 0 is invalid"},
		{[]string{"--pods=65"}, "flag --pods: 65 is invalid: must be from 1 to 64"},
		{[]string{"--time-scale=0.5"}, "flag --time-scale: 0.5 is invalid"},
		{[]string{"--burst=0"}, "flag --burst: 0 is invalid"},
		{[]string{"--system-tokens=-1"}, "flag --system-tokens: -1 is invalid"},
		{[]string{"--trace-requests=-3"}, "flag --trace-requests: -3 is invalid"},
		{[]string{"--first-pod-ip=10.0.0.2"}, `invalid value "10.0.0.2" for flag -first-pod-ip: "10.0.0.2" is not an IPv4 loopback address`},
		{[]string{"--first-pod-ip=::1"}, "is not an IPv4 loopback address"},
		{[]string{"--first-pod-ip=127.0.80.250", "--pods=6", "--pd=false"}, "flag --first-pod-ip: 127.0.80.250 is invalid with --pods 6: the last pod's IP would pass 127.0.80.254"},
		// The P/D pool's pods follow the pool's.
		{[]string{"--first-pod-ip=127.0.80.245", "--pods=6"}, "flag --first-pod-ip: 127.0.80.245 is invalid with --pods 6 and --pd (the P/D pool's 6 pods follow; --pd=false leaves them out): the last pod's IP would pass 127.0.80.254"},
		{[]string{"--pods=1"}, "flag --pd: needs --pods of 2 or more"},
		{[]string{"--no-such-flag"}, "no-such-flag"},
		{[]string{"extra"}, `unexpected argument "extra"`},
	}
	for _, c := range cases {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), c.args, &stdout, &stderr)
		if code != exitBadUsage {
			t.Errorf("%v: exit %d, want %d", c.args, code, exitBadUsage)
		}
		if !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%v: stderr %q does not contain %q", c.args, stderr.String(), c.want)
		}
		if stdout.Len() != 0 {
			t.Errorf("%v: wrote %q on stdout; nothing should start", c.args, stdout.String())
		}
	}
}

func TestDefaultsAreValid(t *testing.T) {
	o, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.pods != 4 || o.timeScale != defaultTimeScale || o.gatewayListen != "localhost:8080" || o.keep {
		t.Fatalf("defaults %+v: want 4 pods, time scale %d, gateway on localhost:8080, no --keep", o, defaultTimeScale)
	}
	if o.firstPodIP != stack.DefaultFirstPodIP {
		t.Errorf("first pod IP %v by default, want the stack's %v", o.firstPodIP, stack.DefaultFirstPodIP)
	}
	// Pods may go elsewhere on the loopback network, up to .254: the
	// pool's, then the P/D pool's.
	if o, err := parseFlags([]string{"--first-pod-ip=127.0.80.247", "--pods=4"}, &bytes.Buffer{}); err != nil || o.firstPodIP.String() != "127.0.80.247" {
		t.Errorf("--first-pod-ip=127.0.80.247 --pods=4: %v, %v", o.firstPodIP, err)
	}
	if o, err := parseFlags([]string{"--first-pod-ip=127.0.80.251", "--pods=4", "--pd=false"}, &bytes.Buffer{}); err != nil || o.firstPodIP.String() != "127.0.80.251" {
		t.Errorf("--first-pod-ip=127.0.80.251 --pods=4 --pd=false: %v, %v", o.firstPodIP, err)
	}
}

func TestAMissingTraceFailsBeforeStartingAnything(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"--bin-dir=" + t.TempDir(), "--trace=/nonexistent/trace.jsonl"}, &stdout, &stderr)
	if code != exitFailure {
		t.Fatalf("exit %d, want %d", code, exitFailure)
	}
	if !strings.Contains(stderr.String(), "flag --trace") || !strings.Contains(stderr.String(), "/nonexistent/trace.jsonl") {
		t.Fatalf("stderr %q does not name --trace and the path", stderr.String())
	}
	if stdout.Len() != 0 {
		t.Fatalf("stdout %q: nothing should have started", stdout.String())
	}
}

func TestNonStreamingFractionIsDeterministicAndSpread(t *testing.T) {
	trace := make([]stack.TraceRequest, 200)
	for i := range trace {
		trace[i] = stack.TraceRequest{InputTokens: 512, OutputTokens: 4, HashIDs: []int{i}}
	}
	reqs := withNonStreaming(trace, stack.TraceWorkload(trace, stack.DefaultModel, 1), 0.5)
	off := 0
	for i, r := range reqs {
		if !r.Stream {
			off++
			if !strings.Contains(string(r.Body), `"stream":false`) {
				t.Fatalf("request %d is marked non-streaming but its body is %s", i, r.Body)
			}
		}
	}
	if off < 95 || off > 105 {
		t.Errorf("%d of 200 requests are non-streaming with --non-streaming=0.5, want about 100", off)
	}
	if _, err := parseFlags([]string{"--non-streaming=1.5"}, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "--non-streaming") {
		t.Errorf("--non-streaming=1.5: err = %v, want one naming the flag", err)
	}
}

func TestBypassingSendsTheFractionStraightToThePods(t *testing.T) {
	through := 0
	base := func(int) string { return "gateway" }
	// With no pods to bypass to, every request must stay on base when the
	// fraction is 0.
	f := bypassing(base, nil, 0)
	for i := range 100 {
		if f(i) == "gateway" {
			through++
		}
	}
	if through != 100 {
		t.Errorf("--direct=0 sent %d of 100 through the gateway, want all", through)
	}
	if _, err := parseFlags([]string{"--direct=-0.1"}, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "--direct") {
		t.Errorf("--direct=-0.1: err = %v, want one naming the flag", err)
	}
}

// The flow control picker's configuration is valid and means the defaults
// in simulated time.
func TestFlowPickerConfigScalesTheDefaults(t *testing.T) {
	for _, tc := range []struct {
		timeScale      float64
		hold, maxReord int
	}{{1, 250, 4000}, {5, 50, 800}, {100, 3, 40}} {
		cfg, err := v1alpha1.Load([]byte(flowPickerConfig(tc.timeScale)))
		if err != nil {
			t.Fatalf("time scale %g: %v", tc.timeScale, err)
		}
		fc := cfg.FlowControl
		if !fc.Enabled || fc.HoldPrefillMilliseconds != tc.hold || fc.MaxReorderMilliseconds != tc.maxReord {
			t.Errorf("time scale %g: %+v, want enabled, hold %d ms, reordering %d ms", tc.timeScale, fc, tc.hold, tc.maxReord)
		}
	}
	if o, err := parseFlags([]string{"--flow=false"}, &bytes.Buffer{}); err != nil || o.flow {
		t.Errorf("--flow=false: %+v, %v", o, err)
	}
}

// --upstream-bin must name a file: a missing one or a directory is refused
// before anything starts, naming the flag.
func TestUpstreamBinFlag(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "upstream-epp")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if o, err := parseFlags([]string{"--upstream-bin=" + bin}, &bytes.Buffer{}); err != nil || o.upstreamBin != bin {
		t.Errorf("--upstream-bin=%s: %+v, %v", bin, o, err)
	}
	for _, c := range []struct{ arg, want string }{
		{"--upstream-bin=" + filepath.Join(dir, "none"), "flag --upstream-bin: stat " + filepath.Join(dir, "none") + ": no such file"},
		{"--upstream-bin=" + dir, "flag --upstream-bin: " + dir + " is a directory"},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), []string{c.arg}, &stdout, &stderr); code != exitBadUsage || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%s: exit %d, stderr %q; want %d naming %q", c.arg, code, stderr.String(), exitBadUsage, c.want)
		}
	}
}

func TestLoRAFlags(t *testing.T) {
	o, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.adapters != 8 || o.adapterRequests != 100 || o.adapterZipf != 1.1 || o.maxLoRAs != 2 {
		t.Errorf("defaults %+v: want 8 adapters, 100 requests, Zipf 1.1, max_loras 2", o)
	}
	if o, err := parseFlags([]string{"--adapters=0", "--max-loras=0"}, &bytes.Buffer{}); err != nil || o.adapters != 0 {
		t.Errorf("--adapters=0 (the other LoRA flags unused): %+v, %v", o, err)
	}
	for _, c := range []struct{ args, want string }{
		{"--adapters=-1", "flag --adapters: -1 is invalid"},
		{"--adapters=65", "flag --adapters: 65 is invalid"},
		{"--max-loras=0", "flag --max-loras: 0 is invalid"},
		{"--adapter-requests=0", "flag --adapter-requests: 0 is invalid"},
		{"--adapter-zipf=-2", "flag --adapter-zipf: -2 is invalid"},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), []string{c.args}, &stdout, &stderr); code != exitBadUsage || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%s: exit %d, stderr %q; want %d naming %q", c.args, code, stderr.String(), exitBadUsage, c.want)
		}
	}
}

// The lora workload: the same adapters on every run, drawn by rank, each
// request's body naming its adapter as the model.
func TestAdapterWorkload(t *testing.T) {
	trace := make([]stack.TraceRequest, 400)
	for i := range trace {
		trace[i] = stack.TraceRequest{InputTokens: 512, OutputTokens: 4, HashIDs: []int{i}}
	}
	names := adapterNames(4)
	a, b := adapterWorkload(trace, names, 1, 5), adapterWorkload(trace, names, 1, 5)
	count := map[string]int{}
	for i := range a {
		if !bytes.Equal(a[i].Body, b[i].Body) || !a[i].Stream {
			t.Fatalf("request %d differs between two builds or does not stream", i)
		}
		for _, n := range names {
			if strings.Contains(string(a[i].Body), `"model":"`+n+`"`) {
				count[n]++
			}
		}
	}
	// Weights 1, 1/2, 1/3, 1/4: 48%, 24%, 16%, 12%.
	if count["lora-0"] < 160 || count["lora-3"] < 25 || count["lora-0"] <= count["lora-1"] || count["lora-1"] <= count["lora-3"] {
		t.Errorf("mix %v: want about 192 / 96 / 64 / 48", count)
	}
}

// The picker's load cost is the simulators' load time in their time; a
// configuration the user gives is left alone.
func TestLoRAPickerArgs(t *testing.T) {
	args := loraPickerArgs(5, nil)
	if len(args) != 1 || args[0] != "--config-text={loraLoadMilliseconds: 40}" {
		t.Fatalf("time scale 5: %q", args)
	}
	if _, err := v1alpha1.Load([]byte(strings.TrimPrefix(args[0], "--config-text="))); err != nil {
		t.Fatal(err)
	}
	for _, user := range []string{"--config-text={}", "-config-file=x.yaml", "--config-file"} {
		if got := loraPickerArgs(5, []string{"--v=2", user}); got != nil {
			t.Errorf("with %s: %q, want none", user, got)
		}
	}
	if got := loraPickerArgs(5, []string{"--config-texts=1"}); got == nil {
		t.Errorf("--config-texts is another flag")
	}
}

// The LoRA section compares Tally's p99 with the best baseline's, lora
// rows only.
func TestLoRAP99RatioTakesTheBestBaseline(t *testing.T) {
	row := func(policy, workload string, p99 time.Duration) replayed {
		return replayed{summary: stack.Summary{Policy: policy, Workload: workload, TTFTP99: p99}}
	}
	runs := []replayed{
		row("tally", "mooncake", time.Second),
		row("tally", loraWorkload, 2*time.Second),
		row("upstream", loraWorkload, 4*time.Second),
		row("round-robin", "mooncake", time.Second),
		row("round-robin", loraWorkload, 2500*time.Millisecond),
	}
	want := "tally's TTFT p99 is 0.80x the best baseline's (round-robin, 2.500s)."
	if got := loraP99Ratio(runs); got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if got := loraP99Ratio(runs[:3]); !strings.Contains(got, "0.50x the best baseline's (upstream") {
		t.Errorf("with upstream alone: %q", got)
	}
	if got := loraP99Ratio(runs[:2]); got != "" {
		t.Errorf("no baseline: %q, want none", got)
	}
}

// A held-back response counts at its end as its client saw it, and at its
// first token less the simulator's hold in the first-token times.
func TestSplitByStreamingTakesTheHoldOff(t *testing.T) {
	const fraction = 0.5
	var reqs []stack.Request
	var results []stack.Result
	held := 0
	for i := range 20 {
		id := fmt.Sprintf("tally-mooncake-%d", i)
		req := stack.Request{Stream: true}
		r := stack.Result{ID: id, TTFT: 100 * time.Millisecond}
		if server.HoldsBack(fraction, req.DrawKeyOf(id)) {
			held++
			r.TTFT, r.HeldBack = 900*time.Millisecond, 800*time.Millisecond
		}
		reqs, results = append(reqs, req), append(results, r)
	}
	reqs = append(reqs, stack.Request{})
	results = append(results, stack.Result{ID: "tally-mooncake-20", TTFT: time.Second, Latency: 2 * time.Second})
	if held == 0 || held == 20 {
		t.Fatalf("%d of 20 held back: the test needs both kinds", held)
	}
	got := splitByStreaming(reqs, results, 5, fraction)
	if got.heldBack != held || got.onTime != 20-held || len(got.nonStreamedLatency) != 1 || got.nonStreamedLatency[0] != 10*time.Second {
		t.Fatalf("held back %d, on time %d, non-streamed %v; want %d, %d and [10s]", got.heldBack, got.onTime, got.nonStreamedLatency, held, 20-held)
	}
	for i, ft := range got.firstToken {
		if ft != 500*time.Millisecond {
			t.Fatalf("first token %d at %v; want 500ms (100ms scaled by 5, the hold taken off)", i, ft)
		}
		if want := results[i].TTFT * 5; got.streamedTTFT[i] != want {
			t.Fatalf("TTFT %d %v; want %v, as the client saw it", i, got.streamedTTFT[i], want)
		}
	}
}

// The P/D row is on by default; off, one pod is enough again.
func TestPDFlag(t *testing.T) {
	if o, err := parseFlags(nil, &bytes.Buffer{}); err != nil || !o.pd {
		t.Errorf("defaults: --pd %v, %v; want on", o.pd, err)
	}
	if o, err := parseFlags([]string{"--pd=false", "--pods=1"}, &bytes.Buffer{}); err != nil || o.pd || o.pods != 1 {
		t.Errorf("--pd=false --pods=1: %+v, %v", o, err)
	}
}

// The P/D pool has as many pods as the demo's, half of them (rounded
// down) prefill pods, on the IPs after the demo's, and a picker with the
// demo's picker flags and then splitting on.
func TestPDPoolOptions(t *testing.T) {
	o, err := parseFlags([]string{"--pods=5", "--first-pod-ip=127.0.9.10", "--picker-arg=--v=2", "--picker-arg=--config-text={}"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	o.pickerArgs = append(make([]string, 0, 4), o.pickerArgs...) // room to grow: the pool must not write into it
	p := newPDPool(o, nil, io.Discard)
	want := []string{stack.RolePrefill, stack.RolePrefill, stack.RoleDecode, stack.RoleDecode, stack.RoleDecode}
	if !slices.Equal(p.opts.Roles, want) || p.opts.Pods != 5 {
		t.Errorf("%d pods, roles %v; want 5, %v", p.opts.Pods, p.opts.Roles, want)
	}
	if got, want := pdRoles(4), append(want[:2:2], want[3:]...); !slices.Equal(got, want) {
		t.Errorf("4 pods: roles %v, want %v", got, want)
	}
	if p.opts.FirstPodIP.String() != "127.0.9.15" {
		t.Errorf("first P/D pod IP %v, want 127.0.9.15 (after the demo's 127.0.9.10 to .14)", p.opts.FirstPodIP)
	}
	if d := p.describe(); !strings.Contains(d, "2 prefill + 3 decode pods (127.0.9.15 to 127.0.9.19") {
		t.Errorf("describe: %q", d)
	}
	args := p.opts.PickerArgs
	if len(args) != 3 || args[0] != "--v=2" || args[1] != "--config-text={}" || !strings.HasPrefix(args[2], "--config-text=") {
		t.Fatalf("picker args %q: want the demo's, then the P/D configuration", args)
	}
	if o.pickerArgs[:3][2] != "" {
		t.Errorf("the P/D picker's args were appended into the demo's: %q", o.pickerArgs[:3])
	}
	cfg, err := v1alpha1.Load([]byte(strings.TrimPrefix(args[2], "--config-text=")))
	if err != nil {
		t.Fatal(err)
	}
	if d := cfg.Disaggregation; !d.Enabled() || d.NonCachedTokens != pdNonCachedTokens || d.PromptTokens != pdPromptTokens {
		t.Errorf("disaggregation %+v: want on, nonCachedTokens %d, promptTokens %d", d, pdNonCachedTokens, pdPromptTokens)
	}
}

// Split requests are counted on the prefill pod that ran their leg, and
// the P/D table shows them beside the decode pods' destinations, for the
// P/D row alone.
func TestPDTableCountsLegs(t *testing.T) {
	prefilledBy := map[string]string{"r0": "sim-0", "r1": "sim-1", "r2": "sim-0", "r4": "sim-0"}
	var results []stack.Result
	for i := range 6 {
		results = append(results, stack.Result{ID: fmt.Sprintf("r%d", i)})
	}
	legs := prefillLegs(results, func(id string) string { return prefilledBy[id] })
	if len(legs) != 2 || legs["sim-0"] != 3 || legs["sim-1"] != 1 {
		t.Fatalf("legs %v: want sim-0 3, sim-1 1", legs)
	}
	p := &pdPool{
		opts:    stack.Options{Pods: 4, Roles: pdRoles(4), FirstPodIP: stack.DefaultFirstPodIP},
		prefill: []string{"sim-0", "sim-1"}, decode: []string{"sim-2", "sim-3"},
	}
	runs := []replayed{
		{summary: stack.Summary{Policy: "tally", Workload: "mooncake", Requests: 6, Placement: map[string]int{"sim-0": 6}}},
		{summary: stack.Summary{Policy: pdPolicyName, Workload: "mooncake", Requests: 6, Placement: map[string]int{"sim-2": 2, "sim-3": 4},
			TTFTP50: 250 * time.Millisecond, TTFTP99: 1500 * time.Millisecond}, legs: legs},
	}
	var out bytes.Buffer
	if err := writePDTable(&out, p, runs); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("%d lines, want the heading, the columns and the P/D row:\n%s", len(lines), out.String())
	}
	if !strings.Contains(lines[0], "2 prefill + 2 decode pods") || !strings.Contains(lines[1], "prefill legs (sim-0/sim-1)") || !strings.Contains(lines[1], "decoded (sim-2/sim-3)") {
		t.Errorf("heading and columns:\n%s", out.String())
	}
	if got := strings.Fields(lines[2]); !slices.Equal(got, []string{pdPolicyName, "6", "4", "3/1", "2/4", "0.250s", "1.500s", "0"}) {
		t.Errorf("row %q: want 6 requests, 4 split, legs 3/1, decoded 2/4, 0.250s, 1.500s, 0 errors", got)
	}
}
