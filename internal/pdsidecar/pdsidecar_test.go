package pdsidecar

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/tallyepp/tally/internal/modelsim/server"
)

// recorder is an upstream on loopback that keeps what it was sent and
// answers with answer.
type recorder struct {
	mu     sync.Mutex
	seen   []seenRequest
	answer func(w http.ResponseWriter, r *http.Request)
	srv    *httptest.Server
}

type seenRequest struct {
	path   string
	header http.Header
	body   map[string]any
}

func newRecorder(t *testing.T, answer func(w http.ResponseWriter, r *http.Request)) *recorder {
	t.Helper()
	rec := &recorder{answer: answer}
	rec.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		b, _ := io.ReadAll(r.Body)
		if err := json.Unmarshal(b, &body); err != nil {
			http.Error(w, "not JSON", http.StatusBadRequest)
			return
		}
		rec.mu.Lock()
		rec.seen = append(rec.seen, seenRequest{r.URL.Path, r.Header.Clone(), body})
		rec.mu.Unlock()
		rec.answer(w, r)
	}))
	t.Cleanup(rec.srv.Close)
	return rec
}

func (rec *recorder) requests() []seenRequest {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]seenRequest(nil), rec.seen...)
}

func (rec *recorder) hostPort() string { return strings.TrimPrefix(rec.srv.URL, "http://") }

// startSidecar serves a sidecar in front of decoder on loopback.
func startSidecar(t *testing.T, decoder string) string {
	t.Helper()
	u, err := url.Parse(decoder)
	if err != nil {
		t.Fatal(err)
	}
	sc, err := New(Config{Decoder: u})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ts := httptest.NewServer(sc)
	t.Cleanup(ts.Close)
	return ts.URL
}

func send(t *testing.T, url, body string, header map[string]string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	return resp, string(b)
}

const kvAnswer = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[3,4],"remote_engine_id":"e1","remote_request_id":"cmpl-9","remote_host":"10.0.0.7","remote_port":8000,"tp_size":1}`

func TestTwoLegsCarryTheRightBodiesAndHeaders(t *testing.T) {
	prefiller := newRecorder(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"cmpl-9","choices":[{"text":"x"}],"kv_transfer_params":%s}`, kvAnswer)
	})
	decoder := newRecorder(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n")
	})
	sidecar := startSidecar(t, decoder.srv.URL)

	client := `{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"min_tokens":5,"temperature":0.25}`
	resp, answer := send(t, sidecar+"/v1/chat/completions", client, map[string]string{
		PrefillerHeader: prefiller.hostPort() + ", 10.9.9.9:8000", RequestIDHeader: "req-1", "X-Custom": "kept",
	})
	if resp.StatusCode != http.StatusOK || !strings.Contains(answer, `"hi"`) || !strings.HasSuffix(answer, "data: [DONE]\n\n") {
		t.Fatalf("client got %d %q; want the decoder's stream", resp.StatusCode, answer)
	}

	ps, ds := prefiller.requests(), decoder.requests()
	if len(ps) != 1 || len(ds) != 1 {
		t.Fatalf("prefiller saw %d requests, decoder %d; want one each", len(ps), len(ds))
	}
	p, d := ps[0], ds[0]
	for _, leg := range []struct {
		name string
		r    seenRequest
	}{{"prefill", p}, {"decode", d}} {
		if leg.r.path != "/v1/chat/completions" || leg.r.header.Get(RequestIDHeader) != "req-1" ||
			leg.r.header.Get("X-Custom") != "kept" || leg.r.header.Get(PrefillerHeader) != "" {
			t.Errorf("%s leg: path %s, headers %v; want the client's path, x-request-id req-1, its other headers, no %s",
				leg.name, leg.r.path, leg.r.header, PrefillerHeader)
		}
	}
	wantPrefill := `{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":false,"max_tokens":1,"max_completion_tokens":1,"temperature":0.25,` +
		`"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`
	if diff := jsonDiff(t, p.body, wantPrefill); diff != "" {
		t.Errorf("prefill leg body: %s", diff)
	}
	wantDecode := strings.TrimSuffix(client, "}") + `,"kv_transfer_params":` + kvAnswer + `}`
	if diff := jsonDiff(t, d.body, wantDecode); diff != "" {
		t.Errorf("decode leg body: %s", diff)
	}
}

// jsonDiff compares a decoded body with the JSON want, as values.
func jsonDiff(t *testing.T, got map[string]any, want string) string {
	t.Helper()
	var w map[string]any
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatalf("bad want %s: %v", want, err)
	}
	g, _ := json.Marshal(got)
	wb, _ := json.Marshal(w)
	if string(g) != string(wb) {
		return fmt.Sprintf("got %s\nwant %s", g, wb)
	}
	return ""
}

func TestWithoutTheHeaderItProxies(t *testing.T) {
	prefiller := newRecorder(t, func(w http.ResponseWriter, _ *http.Request) { t.Error("the prefiller was called") })
	decoder := newRecorder(t, func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, `{"ok":true}`) })
	sidecar := startSidecar(t, decoder.srv.URL)
	client := `{"prompt":"hello","max_tokens":7,"stream":false}`
	resp, answer := send(t, sidecar+"/v1/completions", client, map[string]string{RequestIDHeader: "r2"})
	if resp.StatusCode != http.StatusOK || answer != `{"ok":true}` {
		t.Fatalf("client got %d %q; want the decoder's answer", resp.StatusCode, answer)
	}
	ds := decoder.requests()
	if len(ds) != 1 || ds[0].header.Get(RequestIDHeader) != "r2" {
		t.Fatalf("decoder saw %+v; want the request once with its id", ds)
	}
	if diff := jsonDiff(t, ds[0].body, client); diff != "" {
		t.Errorf("passed-through body: %s", diff)
	}
	if len(prefiller.requests()) != 0 {
		t.Error("the prefiller saw a request")
	}
}

func TestAFailedPrefillLegIsTheClientsAnswer(t *testing.T) {
	prefiller := newRecorder(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprint(w, `{"error":{"message":"overloaded"}}`)
	})
	decoder := newRecorder(t, func(w http.ResponseWriter, _ *http.Request) { t.Error("the decoder was called") })
	sidecar := startSidecar(t, decoder.srv.URL)
	resp, answer := send(t, sidecar+"/v1/completions", `{"prompt":"hello","max_tokens":7}`, map[string]string{PrefillerHeader: prefiller.hostPort()})
	if resp.StatusCode != http.StatusServiceUnavailable || answer != `{"error":{"message":"overloaded"}}` {
		t.Fatalf("client got %d %q; want the prefiller's 503 and body", resp.StatusCode, answer)
	}
	if ps := prefiller.requests(); len(ps) != 1 || ps[0].header.Get(RequestIDHeader) == "" {
		t.Fatalf("prefiller saw %+v; want one request with a generated x-request-id", ps)
	}

	// A prefiller nobody listens on is a 502.
	dead := httptest.NewServer(http.NotFoundHandler())
	deadAddr := strings.TrimPrefix(dead.URL, "http://")
	dead.Close()
	resp, answer = send(t, sidecar+"/v1/completions", `{"prompt":"hello"}`, map[string]string{PrefillerHeader: deadAddr})
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(answer, deadAddr) {
		t.Fatalf("with the prefiller down the client got %d %q; want 502 naming %s", resp.StatusCode, answer, deadAddr)
	}
}

// The whole path on simulated vLLM servers: the decode server computes
// one prompt token and the prefill server's blocks are pulled.
func TestOnSimulatedVLLM(t *testing.T) {
	sim := func() (*server.Server, *httptest.Server) {
		cfg := server.DefaultConfig()
		cfg.TimeScale = 100
		s, err := server.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ts := httptest.NewServer(s)
		t.Cleanup(ts.Close)
		t.Cleanup(s.Close)
		return s, ts
	}
	p, pts := sim()
	d, dts := sim()
	sidecar := startSidecar(t, dts.URL)
	prompt := strings.Repeat("abcd", 1600) // 100 blocks
	body := fmt.Sprintf(`{"prompt":%q,"max_tokens":4,"stream":true}`, prompt)
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, sidecar+"/v1/completions", strings.NewReader(body))
	req.Header.Set(PrefillerHeader, strings.TrimPrefix(pts.URL, "http://"))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	events, done := 0, false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, "data: ") {
			events++
			done = line == "data: [DONE]"
		}
	}
	if !done || events != 6 { // 4 tokens, usage, [DONE]
		t.Fatalf("streamed %d events (done %v); want 4 tokens, usage and [DONE]", events, done)
	}
	if st := d.Stats(); st.PrefillTokens != 1 || st.KVBlocksPulled != 100 {
		t.Fatalf("decode server computed %d prefill tokens and pulled %d blocks; want 1 and 100", st.PrefillTokens, st.KVBlocksPulled)
	}
	if st := p.Stats(); st.PrefillTokens != 1600 || st.LeasesReleased != 1 || st.HeldRequests != 0 {
		t.Fatalf("prefill server: %d prefill tokens, %d released, %d held; want 1600, 1, 0", st.PrefillTokens, st.LeasesReleased, st.HeldRequests)
	}
}

func TestNewNamesABadDecoder(t *testing.T) {
	for _, u := range []*url.URL{nil, {Path: "/x"}, {Scheme: "ftp", Host: "h"}} {
		if _, err := New(Config{Decoder: u}); err == nil || !strings.Contains(err.Error(), "Decoder") {
			t.Errorf("New with Decoder %v: %v; want an error naming Decoder", u, err)
		}
	}
}
