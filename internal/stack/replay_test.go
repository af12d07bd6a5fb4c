package stack

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// serveLoopback serves h on 127.0.0.1:0 until the test ends.
func serveLoopback(t *testing.T, h http.Handler) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	return "http://" + lis.Addr().String()
}

// firstReadBody closes signal on the first read that returns bytes.
type firstReadBody struct {
	io.ReadCloser
	once   *sync.Once
	signal chan struct{}
}

func (b firstReadBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.once.Do(func() { close(b.signal) })
	}
	return n, err
}

type signalTransport struct {
	base   http.RoundTripper
	signal chan struct{}
	once   sync.Once
}

func (s *signalTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := s.base.RoundTrip(r)
	if err == nil {
		resp.Body = firstReadBody{ReadCloser: resp.Body, once: &s.once, signal: s.signal}
	}
	return resp, err
}

func TestSendMeasuresTheFirstEventNotTheWholeStream(t *testing.T) {
	firstRead := make(chan struct{})
	const gap = 200 * time.Millisecond
	url := serveLoopback(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\n")
		w.(http.Flusher).Flush()
		// Hold the rest until the client has read the first event, and then
		// some, so the first event's time cannot include the rest.
		select {
		case <-firstRead:
		case <-r.Context().Done():
			return
		}
		time.Sleep(gap)
		fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"b\"}]}\n\n")
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	client := &http.Client{Transport: &signalTransport{base: NewHTTPClient().Transport, signal: firstRead}}
	res := Send(context.Background(), client, url, "r-1", Completion("m", "hello", 2, true))
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	if res.Status != http.StatusOK || res.PromptTokens != 100 || res.CachedTokens != 64 || res.CompletionTokens != 2 {
		t.Fatalf("result %+v: want status 200 and usage 100/64/2", res)
	}
	if res.TTFT <= 0 || res.Latency-res.TTFT < gap/2 {
		t.Fatalf("TTFT %v, latency %v: the first event was read at least %v before the end", res.TTFT, res.Latency, gap)
	}
}

func TestSendReportsBrokenResponses(t *testing.T) {
	url := serveLoopback(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/status503":
			http.Error(w, `{"error":{"message":"no endpoint"}}`, http.StatusServiceUnavailable)
		case "/v1/cut":
			fmt.Fprint(w, "data: {\"choices\":[]}\n\n")
		case "/v1/garbage":
			fmt.Fprint(w, "data: {not json\n\n")
		case "/v1/errorevent":
			fmt.Fprint(w, "data: {\"error\":{\"message\":\"engine died\"}}\n\n")
		case "/v1/json":
			fmt.Fprint(w, `{"choices":[{"text":"x"}],"usage":{"prompt_tokens":8,"completion_tokens":1}}`)
		}
	}))
	client := NewHTTPClient()
	cases := []struct {
		path   string
		stream bool
		want   string // "" for success
	}{
		{"/v1/status503", true, "HTTP 503: {\"error\":{\"message\":\"no endpoint\"}}"},
		{"/v1/cut", true, "stream ended before data: [DONE]"},
		{"/v1/garbage", true, "not JSON"},
		{"/v1/errorevent", true, "engine died"},
		{"/v1/json", false, ""},
	}
	for _, c := range cases {
		req := Completion("m", "p", 1, c.stream)
		req.Path = c.path
		res := Send(context.Background(), client, url, "id-7", req)
		if c.want == "" {
			if res.Err != nil || res.PromptTokens != 8 || res.CompletionTokens != 1 || res.CachedTokens != 0 {
				t.Errorf("%s: %+v, want success with usage 8/1/0", c.path, res)
			}
			continue
		}
		if res.Err == nil || !strings.Contains(res.Err.Error(), c.want) || !strings.Contains(res.Err.Error(), "id-7") {
			t.Errorf("%s: error %v, want one naming the request and %q", c.path, res.Err, c.want)
		}
	}
	res := Send(context.Background(), client, "http://127.0.0.1:1", "id-8", Completion("m", "p", 1, true))
	if res.Err == nil || res.Status != 0 {
		t.Errorf("closed port: %+v, want a transport error", res)
	}
}

func TestReplayKeepsOffsetsRoutesAndIDs(t *testing.T) {
	type arrival struct {
		id, server string
		at         time.Time
	}
	var mu sync.Mutex
	var arrivals []arrival
	handler := func(name string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			mu.Lock()
			arrivals = append(arrivals, arrival{id: r.Header.Get(RequestIDHeader), server: name, at: time.Now()})
			mu.Unlock()
			if !bytes.Contains(body, []byte(`"prompt":"p`)) {
				http.Error(w, "body lost", http.StatusBadRequest)
				return
			}
			fmt.Fprint(w, "data: {\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n")
		})
	}
	urls := []string{serveLoopback(t, handler("a")), serveLoopback(t, handler("b"))}
	offsets := []time.Duration{0, 0, 150 * time.Millisecond, 300 * time.Millisecond, 300 * time.Millisecond}
	reqs := make([]Request, len(offsets))
	for i, at := range offsets {
		reqs[i] = Completion("m", fmt.Sprintf("p%d", i), 1, true)
		reqs[i].At = at
	}
	var progress [][2]int
	r := &Replayer{
		BaseURL:          func(i int) string { return urls[i%2] },
		IDPrefix:         "run",
		Progress:         func(done, total int) { progress = append(progress, [2]int{done, total}) },
		ProgressInterval: time.Hour,
	}
	before := time.Now()
	results := r.Run(context.Background(), reqs)
	for i, res := range results {
		if res.Err != nil {
			t.Fatalf("request %d: %v", i, res.Err)
		}
		if want := fmt.Sprintf("run-%d", i); res.ID != want {
			t.Fatalf("result %d has id %q, want %q", i, res.ID, want)
		}
	}
	if len(arrivals) != len(reqs) {
		t.Fatalf("%d arrivals, want %d", len(arrivals), len(reqs))
	}
	for _, a := range arrivals {
		var i int
		if _, err := fmt.Sscanf(a.id, "run-%d", &i); err != nil {
			t.Fatalf("arrival with id %q: %v", a.id, err)
		}
		if want := []string{"a", "b"}[i%2]; a.server != want {
			t.Errorf("request %d went to %s, want %s", i, a.server, want)
		}
		if a.at.Sub(before) < offsets[i] {
			t.Errorf("request %d arrived %v after the start, before its offset %v", i, a.at.Sub(before), offsets[i])
		}
	}
	if want := [][2]int{{len(reqs), len(reqs)}}; !slices.Equal(progress, want) {
		t.Errorf("progress calls %v, want one final %v", progress, want)
	}
}

func TestPercentileIsTheNearestRank(t *testing.T) {
	if Percentile(nil, 50) != 0 {
		t.Fatal("no values must give 0")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 200 {
		n := 1 + rng.IntN(50)
		ds := make([]time.Duration, n)
		for i := range ds {
			ds[i] = time.Duration(rng.IntN(20)) * time.Millisecond
		}
		orig := slices.Clone(ds)
		for _, p := range []float64{1, 25, 50, 90, 99, 100} {
			v := Percentile(ds, p)
			atOrBelow, below := 0, 0
			for _, d := range ds {
				if d <= v {
					atOrBelow++
				}
				if d < v {
					below++
				}
			}
			// v is a value of ds with at least p% at or below it, and no
			// smaller value of ds has that property.
			if !slices.Contains(ds, v) || float64(atOrBelow) < p/100*float64(n) || float64(below) >= p/100*float64(n) {
				t.Fatalf("trial %d: p%v of %v = %v", trial, p, ds, v)
			}
		}
		if !slices.Equal(ds, orig) {
			t.Fatal("Percentile reordered its input")
		}
	}
}

func TestSummarizeAndTable(t *testing.T) {
	results := []Result{
		{ID: "x-0", TTFT: 10 * time.Millisecond, PromptTokens: 100, CachedTokens: 50},
		{ID: "x-1", TTFT: 30 * time.Millisecond, PromptTokens: 100, CachedTokens: 0},
		{ID: "x-2", TTFT: 20 * time.Millisecond, PromptTokens: 200, CachedTokens: 150},
		{ID: "x-3", Status: 503, Err: errors.New("request x-3: HTTP 503"), PromptTokens: 999, CachedTokens: 999},
		{ID: "x-4", Status: 429, Err: errors.New("request x-4: HTTP 429"), PromptTokens: 999, CachedTokens: 999},
	}
	served := map[string]string{"x-0": "sim-0", "x-1": "sim-1", "x-2": "sim-1"}
	s := Summarize("tally", "burst", results, []string{"sim-0", "sim-1", "sim-2"},
		func(id string) string { return served[id] }, 2*time.Second, 10)
	if s.Requests != 5 || s.Errors != 1 || s.Refused != 1 || s.FirstError != results[3].Err {
		t.Fatalf("summary %+v: want 5 requests, 1 error, 1 refused (429)", s)
	}
	if s.Placement["sim-0"] != 1 || s.Placement["sim-1"] != 2 || s.Placement["sim-2"] != 0 {
		t.Fatalf("placement %v", s.Placement)
	}
	// Errors are left out of the token sums and the latencies.
	if s.PromptTokens != 400 || s.CachedTokens != 200 || s.HitRate() != 0.5 {
		t.Fatalf("tokens %d/%d, hit rate %v: want 200/400 = 0.5", s.CachedTokens, s.PromptTokens, s.HitRate())
	}
	if s.TTFTP50 != 200*time.Millisecond || s.TTFTP90 != 300*time.Millisecond || s.TTFTP99 != 300*time.Millisecond || s.Wall != 20*time.Second {
		t.Fatalf("p50 %v p90 %v p99 %v wall %v: want the times x10", s.TTFTP50, s.TTFTP90, s.TTFTP99, s.Wall)
	}

	var buf bytes.Buffer
	rr := Summarize("round-robin", "burst", results[:3], s.Pods, func(string) string { return "sim-2" }, time.Second, 1)
	if err := WriteTable(&buf, []Summary{s, rr}); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if !strings.Contains(lines[0], "time scale") {
		t.Fatalf("header %q does not say times are scaled", lines[0])
	}
	// Each row carries its own time scale and its times are multiplied by it.
	wantRows := [][]string{
		{"tally", "burst", "x10", "5", "1/2/0", "50.0%", "0.200s", "0.300s", "0.300s", "1", "1", "20.0s"},
		{"round-robin", "burst", "x1", "3", "0/0/3", "50.0%", "0.020s", "0.030s", "0.030s", "0", "0", "1.0s"},
	}
	for i, want := range wantRows {
		if got := strings.Fields(lines[2+i]); !slices.Equal(got, want) {
			t.Errorf("row %d: %q, want %q", i, got, want)
		}
	}
	if !strings.Contains(out, "sim-0/sim-1/sim-2") || !strings.Contains(out, "tally/burst: first error: request x-3: HTTP 503") {
		t.Errorf("table lacks the pod legend or the first error:\n%s", out)
	}
}
