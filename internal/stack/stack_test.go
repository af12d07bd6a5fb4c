package stack

import (
	"context"
	"math/rand/v2"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// newTestPod serves one pod's simulator at a pod-like address, without an
// API server: the part of a Stack that holds and counts requests.
//
// The address is a random one in 127.201.0.0/16, port 8000, as pods have
// IPs of their own: a free 127.0.0.1 port, closed and listened on again
// (by ResetSimulators too), can meanwhile become the local port of some
// other test's outgoing connection, whose source is 127.0.0.1.
func newTestPod(t *testing.T) (*Stack, *Pod) {
	t.Helper()
	s := &Stack{
		opts:     Options{Model: DefaultModel, TimeScale: 10},
		servedBy: map[string]string{},
		http:     NewHTTPClient(),
	}
	p := &Pod{Name: "sim-0", stack: s}
	s.pods = []*Pod{p}
	var err error
	for range 5 { // another test may hold the same address
		p.Addr = netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 201, byte(rand.IntN(256)), byte(1 + rand.IntN(254))}), 8000)
		if err = p.startSimulator(); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Stop's other steps have nothing to do here.
		if err := s.Stop(); err != nil {
			t.Error(err)
		}
	})
	return s, p
}

// waitUntil polls cond every 10 ms until it holds or timeout passes.
func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestHoldKeepsRequestsAtThePodUntilReleased(t *testing.T) {
	s, p := newTestPod(t)
	release := s.Hold()
	results := make(chan Result, 3)
	for i := range 3 {
		go func() {
			results <- Send(context.Background(), s.HTTPClient(), p.URL(), "held-"+string(rune('a'+i)), Completion(DefaultModel, "hello there", 2, true))
		}()
	}
	waitUntil(t, 10*time.Second, "3 requests to reach the pod", func() bool { return p.Served() == 3 })
	select {
	case r := <-results:
		t.Fatalf("request %s finished while held: %+v", r.ID, r)
	default:
	}
	release()
	release() // idempotent
	for range 3 {
		r := <-results
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		if got := s.ServedBy(r.ID); got != "sim-0" {
			t.Fatalf("ServedBy(%s) = %q, want sim-0", r.ID, got)
		}
	}
	if s.ServedBy("never-sent") != "" {
		t.Fatal("ServedBy names a pod for an unknown id")
	}
	// GETs (metrics, health) are not counted as served requests.
	resp, err := s.HTTPClient().Get(p.URL() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if p.Served() != 3 {
		t.Fatalf("Served() = %d after a GET, want 3", p.Served())
	}
}

func TestStopReleasesHeldRequests(t *testing.T) {
	s, p := newTestPod(t)
	s.Hold()
	done := make(chan Result, 1)
	go func() {
		done <- Send(context.Background(), s.HTTPClient(), p.URL(), "x", Completion(DefaultModel, "hi", 1, true))
	}()
	waitUntil(t, 10*time.Second, "the request to reach the pod", func() bool { return p.Served() == 1 })
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a held request outlived Stop")
	}
}

func TestResetSimulatorsEmptiesThePrefixCache(t *testing.T) {
	s, p := newTestPod(t)
	req := Completion(DefaultModel, strings.Repeat("a shared prompt ", 200), 1, true)
	send := func(id string) Result {
		t.Helper()
		r := Send(context.Background(), s.HTTPClient(), p.URL(), id, req)
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		return r
	}
	send("first")
	if r := send("repeat"); r.CachedTokens == 0 {
		t.Fatalf("a repeated prompt reports no cached tokens: %+v", r)
	}
	if err := s.ResetSimulators(0); err != nil {
		t.Fatal(err)
	}
	if r := send("after-reset"); r.CachedTokens != 0 || r.PromptTokens != req.PromptTokens {
		t.Fatalf("after a reset: %d cached of %d prompt tokens, want 0 of %d", r.CachedTokens, r.PromptTokens, req.PromptTokens)
	}
}

// A simulator reset right after it started listens again on its address:
// the old listener is closed even when its server had not yet taken it in
// (srv.Close closes only those). Before, a reset failed with "address
// already in use" after 8 to 227 resets in a row under -race.
func TestAResetRightAfterAStartListensAgain(t *testing.T) {
	s, _ := newTestPod(t)
	for i := range 500 {
		if err := s.ResetSimulators(0); err != nil {
			t.Fatalf("reset %d: %v", i, err)
		}
	}
}

func TestResetEngineEmptiesTheCacheAndKeepsTheConnection(t *testing.T) {
	s, p := newTestPod(t)
	req := Completion(DefaultModel, strings.Repeat("a shared prompt ", 200), 1, false)
	send := func(id string) Result {
		t.Helper()
		r := Send(context.Background(), s.HTTPClient(), p.URL(), id, req)
		if r.Err != nil || r.Status != http.StatusOK {
			t.Fatalf("request %s: status %d, %v", id, r.Status, r.Err)
		}
		return r
	}
	send("first")
	if r := send("repeat"); r.CachedTokens == 0 {
		t.Fatalf("a repeated prompt reports no cached tokens: %+v", r)
	}
	if err := p.ResetEngine(); err != nil {
		t.Fatal(err)
	}
	// The pooled connection to the pod is still good: no EOF.
	if r := send("after-reset"); r.CachedTokens != 0 {
		t.Fatalf("after a reset: %d cached tokens, want 0", r.CachedTokens)
	}
}

func TestFailMetricsOutlivesAnEngineReset(t *testing.T) {
	s, p := newTestPod(t)
	status := func() int {
		t.Helper()
		resp, err := s.HTTPClient().Get(p.URL() + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	p.FailMetrics(true)
	if err := p.ResetEngine(); err != nil {
		t.Fatal(err)
	}
	if got := status(); got != http.StatusInternalServerError {
		t.Fatalf("GET /metrics while failing, after a reset: %d, want 500", got)
	}
	p.FailMetrics(false)
	if got := status(); got != http.StatusOK {
		t.Fatalf("GET /metrics once restored: %d, want 200", got)
	}
}

func TestProcessOutputStopAndKill(t *testing.T) {
	var seen []string
	ready := make(chan struct{})
	p, err := startProcess("sh", "/bin/sh", []string{"-c", "echo hello; echo ready; exec sleep 60"}, nil, func(line string) {
		seen = append(seen, line)
		if line == "ready" {
			close(ready)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-ready:
	case <-time.After(10 * time.Second):
		t.Fatal("no ready line")
	}
	if !strings.Contains(p.Output(), "hello") {
		t.Fatalf("Output() = %q, want the lines written", p.Output())
	}
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Done():
	default:
		t.Fatal("Stop returned before the process exited")
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("stopping an exited process: %v", err)
	}

	// A process that ignores SIGTERM is ended by Kill.
	q, err := startProcess("sh", "/bin/sh", []string{"-c", "trap '' TERM; echo up; while :; do sleep 1; done"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	q.Kill()
	select {
	case <-q.Done():
	default:
		t.Fatal("Kill returned before the process exited")
	}
	if seen[0] != "hello" {
		t.Fatalf("lines %q", seen)
	}
}

func TestWaitForReportsAnEarlyExitWithItsOutput(t *testing.T) {
	p, err := startProcess("sh", "/bin/sh", []string{"-c", "echo cannot bind port; exit 3"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = p.waitFor(context.Background(), "readiness", time.Minute, 10*time.Millisecond, func(context.Context) bool { return false })
	if err == nil || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "cannot bind port") {
		t.Fatalf("error %v: want one with the exit status and the last output", err)
	}
}

func TestOptionsNeedTheBinaries(t *testing.T) {
	dir := t.TempDir()
	_, err := Start(context.Background(), Options{BinDir: dir})
	if err == nil || !strings.Contains(err.Error(), "BinDir") || !strings.Contains(err.Error(), "epp") {
		t.Fatalf("error %v: want one naming BinDir and the missing binary", err)
	}
	for _, c := range []struct {
		opts Options
		want string
	}{
		{Options{}, "BinDir is required"},
		{Options{BinDir: dir, FirstPodIP: netip.MustParseAddr("10.0.0.1")}, "FirstPodIP: 10.0.0.1 is invalid: must be a loopback address"},
		{Options{BinDir: dir, Pods: -1}, "Pods: -1 is invalid"},
	} {
		_, err := Start(context.Background(), c.opts)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("options %+v: error %v, want one containing %q", c.opts, err, c.want)
		}
	}
}

// A held request whose client gives up leaves the pod at once: it is no
// longer held, and never reaches the engine when the hold lifts.
func TestAGivenUpHeldRequestLeavesThePod(t *testing.T) {
	s, p := newTestPod(t)
	release := s.Hold()
	defer release()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan Result, 1)
	go func() {
		done <- Send(ctx, s.HTTPClient(), p.URL(), "given-up", Completion(DefaultModel, "hello there", 2, true))
	}()
	waitUntil(t, 10*time.Second, "the request to be held", func() bool { return s.Held() == 1 })
	cancel()
	<-done
	waitUntil(t, 10*time.Second, "the pod to let the given-up request go", func() bool { return s.Held() == 0 })
	release()
	if st, ok := p.Stats(); !ok || st.PromptTokens != 0 || st.FinishedRequests+st.AbortedRequests != 0 {
		t.Errorf("engine stats %+v after the hold lifted: the given-up request reached the engine", st)
	}
}
