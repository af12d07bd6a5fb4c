package server

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"time"
)

// Prefill/decode disaggregation, served as vLLM's NixlConnector serves it.
//
// A prefill leg (kv_transfer_params.do_remote_decode) runs as any request;
// when it ends, the engine holds its blocks for Engine.KVLease and the
// non-streamed response carries the kv_transfer_params a decode leg needs:
// where the blocks are (remote_host and remote_port: the address the leg
// arrived on), which (remote_block_ids, remote_request_id) and of which
// engine (remote_engine_id).
//
// A decode leg (kv_transfer_params.do_remote_prefill) first pulls the
// blocks for real: it POSTs PullPath on remote_host:remote_port, which
// releases them there (as the decode engine's "read done" notification
// frees them in vLLM, so a prefill pod's KV usage falls when its blocks
// are taken, not a lease later). Then the engine simulates the transfer
// time (Engine.KVTransferDurationPerBlock per block) and the decode.
// Blocks gone (the lease ran out, a wrong engine, the prefill pod
// unreachable) are a KV load failure, handled by KVLoadFailurePolicy as
// vLLM's kv_load_failure_policy: "fail" (vLLM's default) answers 500;
// "recompute" computes the prefill locally.
//
// The pull happens when the decode leg arrives, not when its engine admits
// it: a decode engine's queue does not count against the lease.

// PullPath is the simulator's stand-in for the NIXL read: the decode
// server takes a prefill leg's blocks from the prefill server with it.
const PullPath = "/modelsim/kv/pull"

// KV load failure policies, as vLLM's kv_load_failure_policy.
const (
	KVLoadFailureFail      = "fail"
	KVLoadFailureRecompute = "recompute"
)

// kvPullTimeout bounds one pull; a prefill server that does not answer in
// time is a KV load failure.
const kvPullTimeout = 10 * time.Second

// kvTransferParams is the kv_transfer_params field of a request or a
// response, as the NixlConnector reads and writes it.
type kvTransferParams struct {
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	RemoteBlockIDs  []int   `json:"remote_block_ids"`
	RemoteEngineID  *string `json:"remote_engine_id"`
	RemoteRequestID *string `json:"remote_request_id,omitempty"`
	RemoteHost      *string `json:"remote_host"`
	RemotePort      *int    `json:"remote_port"`
	TPSize          *int    `json:"tp_size,omitempty"`
}

// pullRequest is the body of a PullPath request.
type pullRequest struct {
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
	BlockIDs  []int  `json:"block_ids"`
}

// remoteSource checks a decode leg's kv_transfer_params name a place to
// pull from.
func (p *kvTransferParams) remoteSource() (url string, pull pullRequest, err *apiError) {
	switch {
	case p.RemoteHost == nil || *p.RemoteHost == "":
		return "", pull, badRequest("kv_transfer_params.remote_host: is required with do_remote_prefill")
	case p.RemotePort == nil || *p.RemotePort < 1 || *p.RemotePort > 65535:
		return "", pull, badRequest("kv_transfer_params.remote_port: must be a port from 1 to 65535 with do_remote_prefill")
	case p.RemoteEngineID == nil || p.RemoteRequestID == nil:
		return "", pull, badRequest("kv_transfer_params.remote_engine_id and remote_request_id: are required with do_remote_prefill")
	}
	url = "http://" + net.JoinHostPort(*p.RemoteHost, strconv.Itoa(*p.RemotePort)) + PullPath
	return url, pullRequest{EngineID: *p.RemoteEngineID, RequestID: *p.RemoteRequestID, BlockIDs: p.RemoteBlockIDs}, nil
}

// pullBlocks takes a prefill leg's blocks from the server that holds them.
func (s *Server) pullBlocks(ctx context.Context, url string, pull pullRequest) error {
	body, err := json.Marshal(pull)
	if err != nil {
		return fmt.Errorf("encoding the pull: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, kvPullTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("pulling KV blocks from %s: %w", url, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.kvClient.Do(req)
	if err != nil {
		return fmt.Errorf("pulling KV blocks from %s: %w", url, err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("pulling KV blocks of request %q from %s: %s: %s", pull.RequestID, url, resp.Status, bytes.TrimSpace(msg))
	}
	return nil
}

// handlePull releases a held prefill leg's blocks to the decode server
// that read them: 200 when they were held, 404 when not (unknown, taken
// already, lease run out, or another engine's), 409 when the block ids
// are not the leg's.
func (s *Server) handlePull(w http.ResponseWriter, r *http.Request) {
	var req pullRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
		writeError(w, badRequest("invalid pull body: %v", err))
		return
	}
	if req.EngineID != s.engineID {
		writeError(w, &apiError{http.StatusNotFound, "NotFoundError", fmt.Sprintf("engine_id %q is not this engine (%q)", req.EngineID, s.engineID)})
		return
	}
	s.mu.Lock()
	s.advanceLocked()
	ids, held := s.eng.HeldBlockIDs(req.RequestID)
	match := held && slices.Equal(ids, req.BlockIDs)
	if match {
		s.eng.Release(req.RequestID)
	}
	s.mu.Unlock()
	switch {
	case !held:
		writeError(w, &apiError{http.StatusNotFound, "NotFoundError", fmt.Sprintf("request %q holds no KV blocks here: unknown, pulled already, or its %v lease ran out", req.RequestID, s.cfg.Engine.KVLease)})
	case !match:
		writeError(w, &apiError{http.StatusConflict, "ConflictError", fmt.Sprintf("request %q holds blocks %v, not %v", req.RequestID, ids, req.BlockIDs)})
	default:
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]int{"blocks": len(ids)})
	}
}

// heldParams are the kv_transfer_params of a finished prefill leg, or nil
// when its blocks are no longer held.
func (s *Server) heldParams(r *http.Request, id string) *kvTransferParams {
	s.mu.Lock()
	ids, ok := s.eng.HeldBlockIDs(id)
	s.mu.Unlock()
	if !ok {
		return nil
	}
	host, port := "", 0
	if a, ok := r.Context().Value(http.LocalAddrContextKey).(*net.TCPAddr); ok {
		host, port = a.IP.String(), a.Port
	}
	tp := 1
	return &kvTransferParams{
		DoRemotePrefill: true,
		RemoteBlockIDs:  ids,
		RemoteEngineID:  &s.engineID,
		RemoteRequestID: &id,
		RemoteHost:      &host,
		RemotePort:      &port,
		TPSize:          &tp,
	}
}
