// Package pdsidecar is the decode pod's prefill/decode sidecar as llm-d
// runs it (cmd/pd-sidecar of llm-d-router, NixlConnector protocol v2), for
// tests and the local stack: it listens on the decode pod's port and
// proxies to the vLLM beside it.
//
// A request without the PrefillerHeader passes through. A completion or
// chat completion with it is served in two legs, both named by one
// x-request-id (the client's, or a new one):
//
//  1. the prefill leg, POSTed to the first prefiller the header names, on
//     the same path: a copy of the request with stream false, no
//     stream_options or min_tokens, max_tokens and max_completion_tokens
//     1, and kv_transfer_params asking for a remote decode;
//  2. the decode leg, to the local vLLM: the original request plus the
//     kv_transfer_params the prefill leg answered, its answer streamed
//     back to the client.
//
// A failed prefill leg is the client's answer (its status, headers and
// body): the sidecar never falls back to a local prefill. llm-d's retries
// of a prefill leg answered 502, 503 or 504 (off by default) are left out.
//
// Invariant: the decode leg carries the client's request unchanged but for
// kv_transfer_params; only the prefill leg is rewritten.
package pdsidecar

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"

	"github.com/google/uuid"
)

const (
	// PrefillerHeader names the prefill pod(s), host:port or a comma
	// list of them, as llm-d's picker sets it.
	PrefillerHeader = "x-prefiller-host-port"
	// RequestIDHeader names both legs of a request.
	RequestIDHeader = "x-request-id"
	// maxBodyBytes bounds a request body the sidecar reads to rewrite.
	maxBodyBytes = 64 << 20
)

// Config configures a Sidecar.
type Config struct {
	// Decoder is the local vLLM's base URL, such as http://127.0.0.1:8200.
	Decoder *url.URL
	// Client sends prefill legs; nil uses a client of its own.
	Client *http.Client
}

// Sidecar is an http.Handler. Create it with New.
type Sidecar struct {
	client *http.Client
	decode *httputil.ReverseProxy
}

// New checks cfg and returns a sidecar.
func New(cfg Config) (*Sidecar, error) {
	if cfg.Decoder == nil || cfg.Decoder.Host == "" || (cfg.Decoder.Scheme != "http" && cfg.Decoder.Scheme != "https") {
		return nil, fmt.Errorf("pdsidecar config: Decoder: %v is invalid: must be an http or https URL with a host", cfg.Decoder)
	}
	client := cfg.Client
	if client == nil {
		client = &http.Client{}
	}
	decoder := cfg.Decoder
	return &Sidecar{
		client: client,
		decode: &httputil.ReverseProxy{
			Rewrite: func(pr *httputil.ProxyRequest) {
				pr.SetURL(decoder)
				pr.Out.Host = pr.In.Host
			},
			FlushInterval: -1, // stream tokens as vLLM writes them
		},
	}, nil
}

// ServeHTTP implements http.Handler.
func (s *Sidecar) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	prefiller := firstPrefiller(r.Header.Get(PrefillerHeader))
	if prefiller == "" || r.Method != http.MethodPost ||
		(r.URL.Path != "/v1/completions" && r.URL.Path != "/v1/chat/completions") {
		s.decode.ServeHTTP(w, r)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		httpError(w, http.StatusBadRequest, fmt.Sprintf("reading the request body: %v", err))
		return
	}
	var req map[string]any
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber() // the decode leg keeps the client's numbers as written
	if err := dec.Decode(&req); err != nil {
		httpError(w, http.StatusBadRequest, fmt.Sprintf("the request body is not a JSON object: %v", err))
		return
	}
	id := r.Header.Get(RequestIDHeader)
	if id == "" {
		id = uuid.NewString()
	}

	kv, ok := s.prefill(w, r, prefiller, id, req)
	if !ok {
		return
	}
	req["kv_transfer_params"] = kv
	dbody, err := json.Marshal(req)
	if err != nil {
		httpError(w, http.StatusBadRequest, fmt.Sprintf("encoding the decode leg: %v", err))
		return
	}
	dreq := r.Clone(r.Context())
	dreq.Header.Set(RequestIDHeader, id)
	dreq.Header.Del(PrefillerHeader)
	dreq.Body = io.NopCloser(bytes.NewReader(dbody))
	dreq.ContentLength = int64(len(dbody))
	s.decode.ServeHTTP(w, dreq)
}

// prefill sends the prefill leg and returns the kv_transfer_params it
// answered (nil when it answered none, as llm-d forwards it). A failure is
// written to w and ok is false.
func (s *Sidecar) prefill(w http.ResponseWriter, r *http.Request, prefiller, id string, req map[string]any) (kv any, ok bool) {
	leg := maps.Clone(req) // one level: only top-level fields are replaced
	leg["kv_transfer_params"] = map[string]any{
		"do_remote_decode":  true,
		"do_remote_prefill": false,
		"remote_engine_id":  nil,
		"remote_block_ids":  nil,
		"remote_host":       nil,
		"remote_port":       nil,
	}
	leg["max_tokens"] = 1
	leg["max_completion_tokens"] = 1
	delete(leg, "min_tokens") // a floor above the cap would be refused
	leg["stream"] = false
	delete(leg, "stream_options")
	pbody, err := json.Marshal(leg)
	if err != nil {
		httpError(w, http.StatusBadRequest, fmt.Sprintf("encoding the prefill leg: %v", err))
		return nil, false
	}
	u := "http://" + prefiller + r.URL.RequestURI()
	preq, err := http.NewRequestWithContext(r.Context(), http.MethodPost, u, bytes.NewReader(pbody))
	if err != nil {
		httpError(w, http.StatusBadGateway, fmt.Sprintf("prefiller %q: %v", prefiller, err))
		return nil, false
	}
	preq.Header = r.Header.Clone()
	preq.Header.Del(PrefillerHeader)
	preq.Header.Del("Content-Length")
	preq.Header.Set(RequestIDHeader, id)
	resp, err := s.client.Do(preq)
	if err != nil {
		httpError(w, http.StatusBadGateway, fmt.Sprintf("prefill leg to %s: %v", prefiller, err))
		return nil, false
	}
	defer resp.Body.Close()
	rbody, err := io.ReadAll(io.LimitReader(resp.Body, maxBodyBytes))
	if err != nil {
		httpError(w, http.StatusBadGateway, fmt.Sprintf("reading the prefill leg's answer from %s: %v", prefiller, err))
		return nil, false
	}
	if resp.StatusCode >= 400 {
		// The client's error, as llm-d passes it on (no local fallback).
		maps.Copy(w.Header(), resp.Header)
		w.Header().Del("Content-Length")
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(rbody)
		return nil, false
	}
	var answer map[string]json.RawMessage
	if err := json.Unmarshal(rbody, &answer); err != nil {
		httpError(w, http.StatusBadGateway, fmt.Sprintf("the prefill leg's answer from %s is not a JSON object: %v", prefiller, err))
		return nil, false
	}
	if raw, ok := answer["kv_transfer_params"]; ok {
		return raw, true
	}
	return nil, true
}

// firstPrefiller is the first host:port of a comma list: llm-d's sidecar
// may sample one; taking the first keeps tests deterministic.
func firstPrefiller(header string) string {
	for p := range strings.SplitSeq(header, ",") {
		if p = strings.TrimSpace(p); p != "" {
			return p
		}
	}
	return ""
}

// httpError answers in the OpenAI error shape, as vLLM's errors are.
func httpError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"error": map[string]any{"message": msg, "type": http.StatusText(status), "param": nil, "code": status},
	})
}
