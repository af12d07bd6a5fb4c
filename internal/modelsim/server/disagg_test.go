package server

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"
)

// promptOf is a prompt of n tokens at the default 4 characters a token.
func promptOf(n int) string { return strings.Repeat("abcd", n) }

type kvParamsJSON struct {
	DoRemoteDecode  bool   `json:"do_remote_decode"`
	DoRemotePrefill bool   `json:"do_remote_prefill"`
	RemoteBlockIDs  []int  `json:"remote_block_ids"`
	RemoteEngineID  string `json:"remote_engine_id"`
	RemoteRequestID string `json:"remote_request_id"`
	RemoteHost      string `json:"remote_host"`
	RemotePort      int    `json:"remote_port"`
	TPSize          *int   `json:"tp_size"`
}

// prefillLeg posts a prefill leg as llm-d's sidecar builds it and returns
// the kv_transfer_params of the answer, raw and decoded.
func prefillLeg(t *testing.T, base, prompt string) (json.RawMessage, kvParamsJSON) {
	t.Helper()
	body := fmt.Sprintf(`{"prompt":%q,"max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`, prompt)
	resp := post(t, context.Background(), base+"/v1/completions", body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("prefill leg: status %d", resp.StatusCode)
	}
	var out struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage            usageJSON       `json:"usage"`
		KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	}
	decodeJSON(t, resp, &out)
	if out.Usage.CompletionTokens != 1 || len(out.Choices) != 1 || out.Choices[0].FinishReason != "length" {
		t.Fatalf("prefill leg answered %+v; want one token, finished by length", out)
	}
	var kv kvParamsJSON
	if err := json.Unmarshal(out.KVTransferParams, &kv); err != nil || len(out.KVTransferParams) == 0 {
		t.Fatalf("prefill leg's kv_transfer_params %s: %v", out.KVTransferParams, err)
	}
	return out.KVTransferParams, kv
}

func decodeLegBody(prompt string, kv json.RawMessage, stream bool) string {
	return fmt.Sprintf(`{"prompt":%q,"max_tokens":5,"stream":%t,"kv_transfer_params":%s}`, prompt, stream, kv)
}

func TestPrefillLegHoldsBlocksAndDecodeLegPullsThem(t *testing.T) {
	p, pURL := startServer(t, nil)
	d, dURL := startServer(t, nil)
	const tokens = 2000 // 125 blocks
	prompt := promptOf(tokens)

	raw, kv := prefillLeg(t, pURL, prompt)
	u, _ := url.Parse(pURL)
	if !kv.DoRemotePrefill || kv.DoRemoteDecode || kv.RemoteEngineID != p.EngineID() || kv.RemoteRequestID == "" ||
		kv.RemoteHost != u.Hostname() || strconv.Itoa(kv.RemotePort) != u.Port() || kv.TPSize == nil || *kv.TPSize != 1 ||
		len(kv.RemoteBlockIDs) != tokens/16 {
		t.Fatalf("kv_transfer_params = %s; want do_remote_prefill, engine %q, host %s, port %s, tp_size 1, %d block ids",
			raw, p.EngineID(), u.Hostname(), u.Port(), tokens/16)
	}
	if st := p.Stats(); st.HeldRequests != 1 || st.KVBlocksInUse != tokens/16+1 {
		t.Fatalf("prefill server after the leg: held %d, blocks in use %d; want 1, %d", st.HeldRequests, st.KVBlocksInUse, tokens/16+1)
	}

	resp := post(t, context.Background(), dURL+"/v1/completions", decodeLegBody(prompt, raw, true))
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("decode leg: status %d", resp.StatusCode)
	}
	chunks, done := readStream(t, resp.Body)
	resp.Body.Close()
	if !done || len(chunks) != 6 { // five tokens and the usage chunk
		t.Fatalf("decode leg streamed %d chunks (done %v), want 5 tokens and usage", len(chunks), done)
	}
	st := d.Stats()
	if st.PrefillTokens != 1 || st.KVBlocksPulled != tokens/16 || st.OutputTokens != 5 {
		t.Fatalf("decode server: %d prefill tokens, %d blocks pulled, %d output tokens; want 1 (the last), %d, 5",
			st.PrefillTokens, st.KVBlocksPulled, st.OutputTokens, tokens/16)
	}
	if st := p.Stats(); st.HeldRequests != 0 || st.LeasesReleased != 1 || st.KVBlocksInUse != 0 {
		t.Fatalf("prefill server after the pull: held %d, released %d, in use %d; want 0, 1, 0", st.HeldRequests, st.LeasesReleased, st.KVBlocksInUse)
	}

	// The blocks were taken: a second decode leg naming them fails to load.
	resp = post(t, context.Background(), dURL+"/v1/completions", decodeLegBody(prompt, raw, false))
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	decodeJSON(t, resp, &e)
	if resp.StatusCode != http.StatusInternalServerError || !strings.Contains(e.Error.Message, kv.RemoteRequestID) {
		t.Fatalf("decode leg naming pulled blocks: status %d, %q; want 500 naming %s", resp.StatusCode, e.Error.Message, kv.RemoteRequestID)
	}
}

// A decode leg whose blocks' lease ran out: "recompute" prefills locally.
func TestDecodeLegAfterTheLeaseRecomputesWhenTold(t *testing.T) {
	p, pURL := startServer(t, func(c *Config) { c.Engine.KVLease = time.Second }) // 10 ms of wall time at TimeScale 100
	d, dURL := startServer(t, func(c *Config) { c.KVLoadFailurePolicy = KVLoadFailureRecompute })
	const tokens = 800
	prompt := promptOf(tokens)
	raw, _ := prefillLeg(t, pURL, prompt)
	eventually(t, 5*time.Second, func() error {
		if st := p.Stats(); st.LeasesExpired != 1 || st.KVBlocksInUse != 0 {
			return fmt.Errorf("expired %d, in use %d; want 1, 0", st.LeasesExpired, st.KVBlocksInUse)
		}
		return nil
	})
	resp := post(t, context.Background(), dURL+"/v1/completions", decodeLegBody(prompt, raw, false))
	var out responseJSON
	decodeJSON(t, resp, &out)
	if resp.StatusCode != http.StatusOK || out.Usage == nil || out.Usage.CompletionTokens != 5 {
		t.Fatalf("recomputed decode leg: status %d, %+v", resp.StatusCode, out)
	}
	if st := d.Stats(); st.PrefillTokens != tokens || st.KVBlocksPulled != 0 {
		t.Fatalf("decode server: %d prefill tokens, %d pulled; want the whole prompt %d computed, 0 pulled", st.PrefillTokens, st.KVBlocksPulled, tokens)
	}
}

func TestPullRefusesOtherEnginesAndOtherBlocks(t *testing.T) {
	p, pURL := startServer(t, nil)
	_, kv := prefillLeg(t, pURL, promptOf(64))
	for _, c := range []struct {
		name string
		body pullRequest
		want int
	}{
		{"another engine", pullRequest{EngineID: "other", RequestID: kv.RemoteRequestID, BlockIDs: kv.RemoteBlockIDs}, http.StatusNotFound},
		{"another request", pullRequest{EngineID: p.EngineID(), RequestID: "nope", BlockIDs: kv.RemoteBlockIDs}, http.StatusNotFound},
		{"other blocks", pullRequest{EngineID: p.EngineID(), RequestID: kv.RemoteRequestID, BlockIDs: []int{7}}, http.StatusConflict},
		{"the leg's blocks", pullRequest{EngineID: p.EngineID(), RequestID: kv.RemoteRequestID, BlockIDs: kv.RemoteBlockIDs}, http.StatusOK},
		{"the same, again", pullRequest{EngineID: p.EngineID(), RequestID: kv.RemoteRequestID, BlockIDs: kv.RemoteBlockIDs}, http.StatusNotFound},
	} {
		b, _ := json.Marshal(c.body)
		resp := post(t, context.Background(), pURL+PullPath, string(b))
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("pull of %s: status %d, want %d", c.name, resp.StatusCode, c.want)
		}
	}
	if _, err := New(func() Config { c := DefaultConfig(); c.KVLoadFailurePolicy = "retry"; return c }()); err == nil ||
		!strings.Contains(err.Error(), "KVLoadFailurePolicy") {
		t.Fatalf("New with KVLoadFailurePolicy retry: %v; want an error naming the field", err)
	}
}
