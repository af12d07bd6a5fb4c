package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/tallyepp/tally/internal/modelsim/engine"
)

// startServer serves a simulator on 127.0.0.1:0 (httptest's loopback
// listener) and stops it when the test ends.
func startServer(t *testing.T, mutate func(*Config)) (*Server, string) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.TimeScale = 100
	if mutate != nil {
		mutate(&cfg)
	}
	srv, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ts := httptest.NewServer(srv)
	// Cleanups run last first: Close the simulator before the HTTP server,
	// which waits for handlers that only Close releases.
	t.Cleanup(ts.Close)
	t.Cleanup(srv.Close)
	return srv, ts.URL
}

func post(t *testing.T, ctx context.Context, url, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return resp
}

func decodeJSON(t *testing.T, resp *http.Response, v any) {
	t.Helper()
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("decoding response (status %d): %v", resp.StatusCode, err)
	}
}

type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

type responseJSON struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Index   int     `json:"index"`
		Text    *string `json:"text"`
		Message *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *usageJSON `json:"usage"`
}

// readStream reads SSE events until the body ends; it returns the JSON
// chunks and whether the last event was [DONE].
func readStream(t *testing.T, r io.Reader) (chunks []responseJSON, done bool) {
	t.Helper()
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("stream line %q is not an SSE data line", line)
		}
		if done {
			t.Fatalf("event %q after [DONE]", data)
		}
		if data == "[DONE]" {
			done = true
			continue
		}
		var c responseJSON
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("chunk %q: %v", data, err)
		}
		chunks = append(chunks, c)
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("reading stream: %v", err)
	}
	return chunks, done
}

func TestStreamingEndsWithDoneAndCarriesUsage(t *testing.T) {
	_, url := startServer(t, nil)
	promptText := strings.Repeat("abcd", 100) // 100 tokens
	for _, tc := range []struct {
		path, body, object string
	}{
		{"/v1/completions", `{"model":"sim-model","prompt":%q,"max_tokens":5,"stream":true}`, "text_completion"},
		{"/v1/chat/completions", `{"model":"sim-model","messages":[{"role":"user","content":%q}],"max_completion_tokens":5,"stream":true}`, "chat.completion.chunk"},
	} {
		t.Run(tc.path, func(t *testing.T) {
			resp := post(t, t.Context(), url+tc.path, fmt.Sprintf(tc.body, promptText))
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
				t.Fatalf("status %d, content type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
			}
			chunks, done := readStream(t, resp.Body)
			if !done {
				t.Fatal("stream did not end with data: [DONE]")
			}
			if len(chunks) != 6 {
				t.Fatalf("%d chunks, want 5 tokens and a usage chunk", len(chunks))
			}
			var text strings.Builder
			for i, c := range chunks[:5] {
				if c.Object != tc.object || len(c.Choices) != 1 || c.Usage != nil {
					t.Fatalf("chunk %d: %+v", i, c)
				}
				ch := c.Choices[0]
				switch {
				case ch.Text != nil:
					text.WriteString(*ch.Text)
				case ch.Delta != nil:
					text.WriteString(ch.Delta.Content)
					if (i == 0) != (ch.Delta.Role == "assistant") {
						t.Errorf("chunk %d delta role %q: only the first names the assistant", i, ch.Delta.Role)
					}
				default:
					t.Fatalf("chunk %d has neither text nor delta", i)
				}
				if last := i == 4; last != (ch.FinishReason != nil && *ch.FinishReason == "length") {
					t.Errorf("chunk %d finish_reason %v", i, ch.FinishReason)
				}
			}
			if got := text.Len(); got != 5*DefaultCharsPerToken {
				t.Errorf("generated %d bytes (%q), want %d", got, text.String(), 5*DefaultCharsPerToken)
			}
			u := chunks[5]
			if u.Object != tc.object || len(u.Choices) != 0 || u.Usage == nil || u.Usage.PromptTokensDetails == nil {
				t.Fatalf("usage chunk: %+v", u)
			}
			if u.Usage.PromptTokens < 100 || u.Usage.CompletionTokens != 5 || u.Usage.TotalTokens != u.Usage.PromptTokens+5 {
				t.Errorf("usage %+v", *u.Usage)
			}
		})
	}
}

func TestNonStreamingAnswersOneJSON(t *testing.T) {
	_, url := startServer(t, nil)
	var c responseJSON
	decodeJSON(t, post(t, t.Context(), url+"/v1/completions", `{"prompt":"hello world, this is forty characters long!","max_tokens":7}`), &c)
	if c.Object != "text_completion" || c.Model != "sim-model" || len(c.Choices) != 1 || c.Choices[0].Text == nil {
		t.Fatalf("completion: %+v", c)
	}
	if len(*c.Choices[0].Text) != 7*DefaultCharsPerToken || *c.Choices[0].FinishReason != "length" {
		t.Errorf("choice text %q, finish %v", *c.Choices[0].Text, c.Choices[0].FinishReason)
	}
	if c.Usage == nil || c.Usage.PromptTokens != 10 || c.Usage.CompletionTokens != 7 {
		t.Errorf("usage %+v", c.Usage)
	}

	var chat responseJSON
	decodeJSON(t, post(t, t.Context(), url+"/v1/chat/completions",
		`{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi there"}]}]}`), &chat)
	if chat.Object != "chat.completion" || len(chat.Choices) != 1 || chat.Choices[0].Message == nil {
		t.Fatalf("chat completion: %+v", chat)
	}
	if m := chat.Choices[0].Message; m.Role != "assistant" || len(m.Content) != DefaultMaxTokens*DefaultCharsPerToken {
		t.Errorf("message %+v, want %d tokens by default", m, DefaultMaxTokens)
	}
	if chat.Usage == nil || chat.Usage.CompletionTokens != DefaultMaxTokens {
		t.Errorf("usage %+v", chat.Usage)
	}

	// Token-id prompts count one token per id.
	var ids responseJSON
	decodeJSON(t, post(t, t.Context(), url+"/v1/completions", `{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":1}`), &ids)
	if ids.Usage == nil || ids.Usage.PromptTokens != 17 {
		t.Errorf("token-id prompt usage %+v, want 17 prompt tokens", ids.Usage)
	}
}

func TestRepeatedPromptReportsCachedTokens(t *testing.T) {
	srv, url := startServer(t, nil)
	body := fmt.Sprintf(`{"prompt":%q,"max_tokens":2}`, strings.Repeat("0123456789", 200)) // 500 tokens
	var first, second responseJSON
	decodeJSON(t, post(t, t.Context(), url+"/v1/completions", body), &first)
	decodeJSON(t, post(t, t.Context(), url+"/v1/completions", body), &second)
	if first.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("first request cached_tokens = %d, want 0", first.Usage.PromptTokensDetails.CachedTokens)
	}
	// 500 tokens hold 31 full blocks of 16; all are reused.
	if got, want := second.Usage.PromptTokensDetails.CachedTokens, 31*16; got != want {
		t.Fatalf("repeat cached_tokens = %d, want %d", got, want)
	}
	fams := scrape(t, url)
	if got := value(t, fams, "vllm:prefix_cache_queries_total", nil); got != 1000 {
		t.Errorf("prefix_cache_queries_total = %v, want 1000", got)
	}
	if got := value(t, fams, "vllm:prefix_cache_hits_total", nil); got != 31*16 {
		t.Errorf("prefix_cache_hits_total = %v, want %d", got, 31*16)
	}
	if got := value(t, fams, "vllm:request_success_total", map[string]string{"finished_reason": "length"}); got != 2 {
		t.Errorf("request_success_total{length} = %v, want 2", got)
	}
	// vLLM counts whole prompts, cached tokens included.
	if got := value(t, fams, "vllm:prompt_tokens_total", nil); got != 1000 {
		t.Errorf("prompt_tokens_total = %v, want 1000", got)
	}
	// Each request ran alone on an idle engine: one prefill step each, of
	// 500 tokens, then of the 4 past the cached blocks.
	cfg := srv.cfg.Engine
	want := prefillStep(cfg, 500) + prefillStep(cfg, 500-31*16)
	// In wall time: engine time over the time scale.
	if h := histogram(t, fams, "vllm:request_prefill_time_seconds"); h.GetSampleCount() != 2 || math.Abs(h.GetSampleSum()*srv.cfg.TimeScale-want.Seconds()) > 1e-9 {
		t.Errorf("request_prefill_time_seconds count %d sum %v, want 2 and %v engine seconds over the time scale %v", h.GetSampleCount(), h.GetSampleSum(), want.Seconds(), srv.cfg.TimeScale)
	}
	// Each finished request's output tokens, 2 each.
	if h := histogram(t, fams, "vllm:request_generation_tokens"); h.GetSampleCount() != 2 || h.GetSampleSum() != 4 {
		t.Errorf("request_generation_tokens count %d sum %v, want 2 and 4", h.GetSampleCount(), h.GetSampleSum())
	}
}

// TestPrefillTimeLeavesOutTheQueue queues a request behind a running one:
// its time to first token includes the wait, its prefill time does not.
// The running one is cancelled once its prefill is done: its prompt counts,
// its prefill time does not (vLLM observes finished requests only).
func TestPrefillTimeLeavesOutTheQueue(t *testing.T) {
	srv, url := startServer(t, func(c *Config) { c.Engine.MaxRunningRequests = 1 })
	cfg := srv.cfg.Engine
	ctx, cancelFirst := context.WithCancel(t.Context())
	defer cancelFirst()
	first := post(t, ctx, url+"/v1/completions", fmt.Sprintf(`{"prompt":%q,"max_tokens":100000,"stream":true}`, strings.Repeat("a", 4*100)))
	defer first.Body.Close()
	if line, err := bufio.NewReader(first.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("first line %q: %v", line, err)
	}

	queued := make(chan *http.Response, 1)
	go func() {
		resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(fmt.Sprintf(`{"prompt":%q,"max_tokens":1}`, strings.Repeat("b", 4*200))))
		if err != nil {
			t.Errorf("POST: %v", err)
		}
		queued <- resp
	}()
	var since time.Duration
	eventually(t, 10*time.Second, func() error {
		st := srv.Stats()
		if st.WaitingRequests != 1 {
			return fmt.Errorf("%d requests waiting, want 1", st.WaitingRequests)
		}
		since = st.Now
		return nil
	})
	const minWait = time.Second // engine time: 10 ms of wall time
	eventually(t, 10*time.Second, func() error {
		if now := srv.Stats().Now; now < since+minWait {
			return fmt.Errorf("engine clock at %v, want %v", now, since+minWait)
		}
		return nil
	})
	cancelFirst()
	if resp := <-queued; resp != nil {
		var c responseJSON
		decodeJSON(t, resp, &c)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("queued request: status %d", resp.StatusCode)
		}
	}

	fams := scrape(t, url)
	// Times are published in wall time: engine time over the time scale.
	scale := srv.cfg.TimeScale
	prefill := histogram(t, fams, "vllm:request_prefill_time_seconds")
	if want := prefillStep(cfg, 200); prefill.GetSampleCount() != 1 || math.Abs(prefill.GetSampleSum()*scale-want.Seconds()) > 1e-9 {
		t.Fatalf("request_prefill_time_seconds count %d sum %v, want 1 (the finished request) and %v engine seconds", prefill.GetSampleCount(), prefill.GetSampleSum(), want.Seconds())
	}
	// The first request ran alone: its time to first token is its prefill.
	ttft := histogram(t, fams, "vllm:time_to_first_token_seconds")
	queuedTTFT := ttft.GetSampleSum()*scale - prefillStep(cfg, 100).Seconds()
	if ttft.GetSampleCount() != 2 || queuedTTFT < (prefillStep(cfg, 200)+minWait).Seconds() {
		t.Fatalf("time_to_first_token_seconds count %d, queued request's %vs; want 2 and at least its prefill %v and the %v it waited",
			ttft.GetSampleCount(), queuedTTFT, prefillStep(cfg, 200), minWait)
	}
	if got := value(t, fams, "vllm:prompt_tokens_total", nil); got != 300 {
		t.Fatalf("prompt_tokens_total = %v, want 300 (both prefills ended)", got)
	}
}

// prefillStep is the latency model's one step prefilling n tokens, n up to
// the step budget.
func prefillStep(cfg engine.Config, n int) time.Duration {
	return cfg.StepBaseDuration + time.Duration(n)*cfg.PrefillDurationPerToken
}

func TestMetricsReflectInFlightRequestsAndCancellationFreesThem(t *testing.T) {
	srv, url := startServer(t, func(c *Config) { c.TimeScale = 1 })
	const n, maxTokens = 3, 10_000 // over a minute of decoding each
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	bodies := make([]io.ReadCloser, n)
	for i := range n {
		body := fmt.Sprintf(`{"prompt":"%d%s","max_tokens":%d,"stream":true}`, i, strings.Repeat("x", 399), maxTokens) // 100 tokens
		resp := post(t, ctx, url+"/v1/completions", body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
		// The first chunk arrives once the request is running.
		if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: {") {
			t.Fatalf("first line %q: %v", line, err)
		}
		bodies[i] = resp.Body
	}

	fams := scrape(t, url)
	if got := value(t, fams, "vllm:num_requests_running", nil); got != n {
		t.Fatalf("num_requests_running = %v, want %d", got, n)
	}
	if got := value(t, fams, "vllm:num_requests_waiting", nil); got != 0 {
		t.Fatalf("num_requests_waiting = %v, want 0", got)
	}
	blocks := srv.cfg.Engine.KVBlocks
	perRequest := (100 + maxTokens + 15) / 16
	if got, want := value(t, fams, "vllm:kv_cache_usage_perc", nil), float64(n*perRequest)/float64(blocks); got != want {
		t.Fatalf("kv_cache_usage_perc = %v, want %v", got, want)
	}
	if got := value(t, fams, "vllm:cache_config_info", map[string]string{"block_size": "16", "num_gpu_blocks": fmt.Sprint(blocks)}); got != 1 {
		t.Fatalf("cache_config_info = %v", got)
	}
	ttft := fams["vllm:time_to_first_token_seconds"]
	if ttft == nil || ttft.GetType() != dto.MetricType_HISTOGRAM || ttft.Metric[0].Histogram.GetSampleCount() != n {
		t.Fatalf("time_to_first_token_seconds: %v", ttft)
	}
	for name, fam := range fams {
		if !strings.HasPrefix(name, "vllm:") {
			continue
		}
		if l := labels(fam.Metric[0]); l["model_name"] != "sim-model" || l["engine"] != "0" {
			t.Errorf("%s labels %v, want model_name=sim-model engine=0", name, l)
		}
	}

	cancel() // every client goes away
	for _, b := range bodies {
		b.Close()
	}
	eventually(t, 10*time.Second, func() error {
		fams := scrape(t, url)
		running := value(t, fams, "vllm:num_requests_running", nil)
		usage := value(t, fams, "vllm:kv_cache_usage_perc", nil)
		aborted := value(t, fams, "vllm:request_success_total", map[string]string{"finished_reason": "abort"})
		if running != 0 || usage != 0 || aborted != n {
			return fmt.Errorf("running %v, kv usage %v, aborted %v; want 0, 0, %d", running, usage, aborted, n)
		}
		return nil
	})
}

func TestMetricsReportQueuedPrefillUntilTheFirstToken(t *testing.T) {
	// One step of a 1,000-token prompt takes about 2 s, long enough to
	// scrape it twice in the middle.
	_, url := startServer(t, func(c *Config) {
		c.TimeScale = 1
		c.Engine.PrefillDurationPerToken = 2 * time.Millisecond
	})
	const promptTokens = 1000
	body := fmt.Sprintf(`{"prompt":"%s","max_tokens":1,"stream":true}`, strings.Repeat("y", 4*promptTokens))
	got := make(chan *http.Response, 1)
	go func() {
		resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Errorf("POST: %v", err)
		}
		got <- resp
	}()
	// While the step runs, the work left shrinks from the whole prompt.
	var first float64
	eventually(t, 2*time.Second, func() error {
		if first = value(t, scrape(t, url), "modelsim_queued_prefill_tokens", nil); first <= 0 || first > promptTokens {
			return fmt.Errorf("modelsim_queued_prefill_tokens = %v, want from 1 to %d while the prompt is computed", first, promptTokens)
		}
		return nil
	})
	eventually(t, 2*time.Second, func() error {
		if q := value(t, scrape(t, url), "modelsim_queued_prefill_tokens", nil); q >= first || q <= 0 {
			return fmt.Errorf("modelsim_queued_prefill_tokens = %v, want below %v and above 0 later in the step", q, first)
		}
		return nil
	})
	if resp := <-got; resp != nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if q := value(t, scrape(t, url), "modelsim_queued_prefill_tokens", nil); q != 0 {
		t.Fatalf("modelsim_queued_prefill_tokens = %v once the response is done, want 0", q)
	}
}

func TestTimeScaleRunsFasterAndReportsWallTime(t *testing.T) {
	const scale = 10
	srv, url := startServer(t, func(c *Config) { c.TimeScale = scale })
	cfg := srv.cfg.Engine
	tokens := cfg.StepBudgetTokens // exactly one prefill step
	const output = 5
	startWall := time.Now()
	var c responseJSON
	decodeJSON(t, post(t, t.Context(), url+"/v1/completions", fmt.Sprintf(`{"prompt":%q,"max_tokens":%d}`, strings.Repeat("y", tokens*4), output)), &c)
	wall := time.Since(startWall)
	step := cfg.StepBaseDuration + time.Duration(tokens)*cfg.PrefillDurationPerToken
	if wall < step/scale {
		t.Errorf("answered in %v, faster than the scaled step %v", wall, step/scale)
	}
	// The engine's times, as the picker and the client see them: a tenth.
	fams := scrape(t, url)
	if h := histogram(t, fams, "vllm:time_to_first_token_seconds"); h.GetSampleCount() != 1 || math.Abs(h.GetSampleSum()-step.Seconds()/scale) > 1e-9 {
		t.Errorf("TTFT histogram count %d sum %v, want 1 and %v (wall time)", h.GetSampleCount(), h.GetSampleSum(), step.Seconds()/scale)
	}
	// Its decode: one step of one sequence for each token after the first.
	decode := (output - 1) * (cfg.StepBaseDuration + cfg.DecodeDurationPerSequence)
	if h := histogram(t, fams, "vllm:request_decode_time_seconds"); h.GetSampleCount() != 1 || math.Abs(h.GetSampleSum()-decode.Seconds()/scale) > 1e-9 {
		t.Errorf("decode time histogram count %d sum %v, want 1 and %v (wall time)", h.GetSampleCount(), h.GetSampleSum(), decode.Seconds()/scale)
	}
}

func TestLateFirstBytesArriveOnlyWhenGenerationEnds(t *testing.T) {
	srv, url := startServer(t, func(c *Config) { c.TimeScale = 10; c.LateFirstByteFraction = 0.5 })
	cfg := srv.cfg.Engine
	var lateID, onTimeID string
	for i := 0; lateID == "" || onTimeID == ""; i++ {
		id := fmt.Sprintf("req-%d", i)
		if srv.lateFirstBytes(id, 0) {
			lateID = id
		} else {
			onTimeID = id
		}
	}
	send := func(ctx context.Context, id string, maxTokens int) *http.Response {
		t.Helper()
		body := fmt.Sprintf(`{"prompt":%q,"max_tokens":%d,"stream":true}`, strings.Repeat("c", 4*100), maxTokens)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set(srv.cfg.RequestIDHeader, id)
		resp, err := http.DefaultClient.Do(req) // returns once the status and headers arrive
		if err != nil {
			t.Fatalf("POST %s: %v", id, err)
		}
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("POST %s: status %d", id, resp.StatusCode)
		}
		return resp
	}

	// Late: nothing arrives before the engine has produced the last token.
	const lateTokens = 50
	generation := prefillStep(cfg, 100) + (lateTokens-1)*(cfg.StepBaseDuration+cfg.DecodeDurationPerSequence)
	start := time.Now()
	resp := send(t.Context(), lateID, lateTokens)
	took := time.Since(start)
	if finished := srv.Stats().FinishedRequests; took < generation/10 || finished != 1 {
		t.Fatalf("late response's first bytes after %v with %d requests finished; want at least %v (the generation, scaled) and 1", took, finished, generation/10)
	}
	// Held back from the first token on: about the decoding after it,
	// scaled (the server sees each token a little after the engine makes
	// it), and at most the whole wait.
	decoding := (lateTokens - 1) * (cfg.StepBaseDuration + cfg.DecodeDurationPerSequence) / 10 / 2
	held, err := strconv.ParseFloat(resp.Header.Get(HeldBackHeader), 64)
	if err != nil || held < float64(decoding)/float64(time.Millisecond) || held > float64(took)/float64(time.Millisecond) {
		t.Fatalf("late response: %s %q (%v); want from %v (half its decoding, scaled) to %v (the wait)", HeldBackHeader, resp.Header.Get(HeldBackHeader), err, decoding, took)
	}
	chunks, done := readStream(t, resp.Body)
	resp.Body.Close()
	if !done || len(chunks) != lateTokens+1 {
		t.Fatalf("late response: %d chunks, done %v; want %d tokens, a usage chunk and [DONE]", len(chunks), done, lateTokens)
	}

	// On time: the first token arrives while the engine still generates.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	resp = send(ctx, onTimeID, 100_000)
	defer resp.Body.Close()
	if v := resp.Header.Get(HeldBackHeader); v != "" {
		t.Fatalf("response on time: %s %q; want none", HeldBackHeader, v)
	}
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("first line %q: %v", line, err)
	}
	if st := srv.Stats(); st.RunningRequests != 1 || st.FinishedRequests != 1 {
		t.Fatalf("running %d, finished %d at the first chunk of a response on time; want 1 and 1 (the late one)", st.RunningRequests, st.FinishedRequests)
	}
}

func TestLateFirstByteFractionIsDrawnPerRequest(t *testing.T) {
	s := &Server{cfg: Config{LateFirstByteFraction: 0.5}}
	const n = 10_000
	byID, byPrompt := 0, 0
	for i := range n {
		id := fmt.Sprintf("tally-burst-%d", i)
		late := s.lateFirstBytes(id, 0)
		if s.lateFirstBytes(id, 0) != late {
			t.Fatalf("request %s is late on one call and not on the next", id)
		}
		if late {
			byID++
		}
		// Without an id, the prompt decides.
		if s.lateFirstBytes("", textPrompt(fmt.Sprintf("prompt %d", i), 4, 16).key) {
			byPrompt++
		}
	}
	for name, got := range map[string]int{"by id": byID, "by prompt": byPrompt} {
		if math.Abs(float64(got)/n-0.5) > 0.02 {
			t.Errorf("%s: %d of %d requests late, want about half", name, got, n)
		}
	}
	p := textPrompt("the same prompt", 4, 16)
	if s.lateFirstBytes("", p.key) != s.lateFirstBytes("", textPrompt("the same prompt", 4, 16).key) {
		t.Error("the same prompt without an id is late once and not once")
	}
	for _, f := range []float64{0, 1} {
		s := &Server{cfg: Config{LateFirstByteFraction: f}}
		for i := range 100 {
			if got := s.lateFirstBytes(fmt.Sprint(i), uint64(i)); got != (f == 1) {
				t.Fatalf("fraction %v: request %d late = %v", f, i, got)
			}
		}
	}
}

func TestErrorsAnswerOpenAIShapes(t *testing.T) {
	_, url := startServer(t, func(c *Config) { c.Engine.KVBlocks = 100 })
	for _, tc := range []struct {
		name, path, body string
		status           int
		msg              string
	}{
		{"bad JSON", "/v1/completions", `{"prompt": "x"`, 400, "invalid JSON"},
		{"unknown model", "/v1/completions", `{"model":"other","prompt":"x"}`, 404, "other"},
		{"max_tokens 0", "/v1/completions", `{"prompt":"hello","max_tokens":0}`, 400, "max_tokens: 0"},
		{"empty prompt", "/v1/completions", `{"prompt":""}`, 400, "prompt"},
		{"no messages", "/v1/chat/completions", `{"messages":[]}`, 400, "messages"},
		{"bad content", "/v1/chat/completions", `{"messages":[{"role":"user","content":7}]}`, 400, "messages[0].content"},
		{"over the cache", "/v1/completions", fmt.Sprintf(`{"prompt":%q}`, strings.Repeat("z", 4*1600)), 400, "KV blocks"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, t.Context(), url+tc.path, tc.body)
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			decodeJSON(t, resp, &e)
			if resp.StatusCode != tc.status || e.Error.Code != tc.status || e.Error.Type == "" || !strings.Contains(e.Error.Message, tc.msg) {
				t.Fatalf("status %d, error %+v; want %d mentioning %q", resp.StatusCode, e.Error, tc.status, tc.msg)
			}
		})
	}
	resp, err := http.Get(url + "/v1/completions")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET /v1/completions: status %d, want 405", resp.StatusCode)
	}
}

func TestInjectedFaults(t *testing.T) {
	t.Run("error rate", func(t *testing.T) {
		srv, url := startServer(t, func(c *Config) { c.ErrorRate = 1 })
		resp := post(t, t.Context(), url+"/v1/completions", `{"prompt":"hello"}`)
		resp.Body.Close()
		if resp.StatusCode != http.StatusInternalServerError {
			t.Fatalf("status %d, want 500", resp.StatusCode)
		}
		if st := srv.Stats(); st.PrefixQueryTokens != 0 {
			t.Fatalf("a failed request reached the engine: %+v", st)
		}
	})
	t.Run("hang rate", func(t *testing.T) {
		srv, url := startServer(t, func(c *Config) { c.HangRate = 1 })
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(`{"prompt":"hello"}`))
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			t.Fatalf("a hanging request was answered: status %d", resp.StatusCode)
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err = %v, want the client's deadline", err)
		}
		if st := srv.Stats(); st.RunningRequests+st.WaitingRequests != 0 {
			t.Fatalf("a hanging request reached the engine: %+v", st)
		}
	})
	t.Run("added latency", func(t *testing.T) {
		const latency = 200 * time.Millisecond
		_, url := startServer(t, func(c *Config) { c.AddedLatency = latency; c.TimeScale = MaxTimeScale })
		start := time.Now()
		resp := post(t, t.Context(), url+"/v1/completions", `{"prompt":"hello","max_tokens":1}`)
		resp.Body.Close()
		if took := time.Since(start); resp.StatusCode != http.StatusOK || took < latency {
			t.Fatalf("status %d after %v, want 200 after at least %v", resp.StatusCode, took, latency)
		}
	})
}

func TestFailMetricsBreaksOnlyTheMetrics(t *testing.T) {
	srv, url := startServer(t, nil)
	metricsStatus := func() int {
		t.Helper()
		resp, err := http.Get(url + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	srv.FailMetrics(true)
	if got := metricsStatus(); got != http.StatusInternalServerError {
		t.Fatalf("GET /metrics while failing: status %d, want 500", got)
	}
	resp := post(t, t.Context(), url+"/v1/completions", `{"prompt":"hello","max_tokens":1}`)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("completion while the metrics fail: status %d, want 200", resp.StatusCode)
	}
	srv.FailMetrics(false)
	if got := metricsStatus(); got != http.StatusOK {
		t.Fatalf("GET /metrics once restored: status %d, want 200", got)
	}
}

func TestModelsHealthAndClose(t *testing.T) {
	srv, url := startServer(t, func(c *Config) { c.Model = "m-1" })
	resp, err := http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	decodeJSON(t, resp, &models)
	if models.Object != "list" || len(models.Data) != 1 || models.Data[0].ID != "m-1" {
		t.Fatalf("models: %+v", models)
	}
	health := func() int {
		resp, err := http.Get(url + "/health")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := health(); got != http.StatusOK {
		t.Fatalf("health %d before Close", got)
	}
	srv.Close()
	if got := health(); got != http.StatusServiceUnavailable {
		t.Fatalf("health %d after Close, want 503", got)
	}
	resp = post(t, t.Context(), url+"/v1/completions", `{"prompt":"hello"}`)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("completion after Close: status %d, want 503", resp.StatusCode)
	}
}

func TestConfigErrorsNameTheField(t *testing.T) {
	cfg := DefaultConfig()
	cfg.TimeScale = 0
	cfg.ErrorRate = 2
	cfg.LateFirstByteFraction = -0.5
	cfg.Engine.KVBlocks = -1
	_, err := New(cfg)
	for _, want := range []string{"TimeScale: 0 is invalid", "ErrorRate: 2 is invalid", "LateFirstByteFraction: -0.5 is invalid", "KVBlocks: -1 is invalid"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("New: err = %v, want it to contain %q", err, want)
		}
	}
}

func TestTextPromptHashesSharePrefixBlocks(t *testing.T) {
	a := textPrompt(strings.Repeat("a", 64*3)+"tail-one", 4, 16)
	b := textPrompt(strings.Repeat("a", 64*2)+strings.Repeat("b", 64)+"tail-two", 4, 16)
	if a.tokens != 50 || len(a.hashes) != 3 || len(b.hashes) != 3 {
		t.Fatalf("tokens %d, hashes %d and %d; want 50 tokens and 3 full blocks each", a.tokens, len(a.hashes), len(b.hashes))
	}
	if a.hashes[0] != b.hashes[0] || a.hashes[1] != b.hashes[1] || a.hashes[2] == b.hashes[2] {
		t.Fatalf("hashes %x and %x: want the first two equal and the third different", a.hashes, b.hashes)
	}
	// Chained: equal block text after different blocks hashes differently.
	if a.hashes[0] == a.hashes[1] {
		t.Fatal("equal blocks at different depths share a hash: the chain is missing")
	}
}

// eventually retries check until it passes or the deadline is reached.
func eventually(t *testing.T, timeout time.Duration, check func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %v", timeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		t.Fatalf("parsing /metrics: %v\n%s", err, body)
	}
	return fams
}

// histogram returns the one series of the histogram name.
func histogram(t *testing.T, fams map[string]*dto.MetricFamily, name string) *dto.Histogram {
	t.Helper()
	fam := fams[name]
	if fam == nil || fam.GetType() != dto.MetricType_HISTOGRAM || len(fam.Metric) != 1 {
		t.Fatalf("%s: %v, want one histogram series", name, fam)
	}
	return fam.Metric[0].Histogram
}

func labels(m *dto.Metric) map[string]string {
	l := map[string]string{}
	for _, p := range m.Label {
		l[p.GetName()] = p.GetValue()
	}
	return l
}

// value returns the value of the one series of name whose labels include want.
func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	t.Helper()
	fam := fams[name]
	if fam == nil {
		t.Fatalf("no metric %s", name)
	}
	var found []float64
series:
	for _, m := range fam.Metric {
		l := labels(m)
		for k, v := range want {
			if l[k] != v {
				continue series
			}
		}
		switch {
		case m.Gauge != nil:
			found = append(found, m.Gauge.GetValue())
		case m.Counter != nil:
			found = append(found, m.Counter.GetValue())
		case m.Untyped != nil:
			found = append(found, m.Untyped.GetValue())
		}
	}
	if len(found) != 1 {
		t.Fatalf("%s%v: %d series", name, want, len(found))
	}
	return found[0]
}

// A scrape that finds requests finished reports them finished everywhere:
// its histograms (observed when a request ends) count what its counters and
// gauges do. A picker reading num_requests_running 0 learns from the same
// scrape's request_generation_tokens that those requests ended.
func TestAScrapeAgreesWithItselfOnFinishedRequests(t *testing.T) {
	_, url := startServer(t, func(c *Config) { c.TimeScale = 10 })
	done := make(chan struct{})
	var wg sync.WaitGroup
	for c := range 8 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-done:
					return
				default:
				}
				body := fmt.Sprintf(`{"prompt":"%d-%d%s","max_tokens":4}`, c, i, strings.Repeat("x", 400))
				resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					t.Errorf("client %d: %v", c, err) // not Fatal: not the test's goroutine
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	defer func() { close(done); wg.Wait() }()
	// Until 10 scrapes have seen requests finish since the one before: on
	// a busy machine a second held only 8 scrapes.
	deadline := time.Now().Add(30 * time.Second)
	scrapes, moved := 0, 0
	last := -1.0
	for moved < 10 && time.Now().Before(deadline) {
		fams := scrape(t, url)
		scrapes++
		finished := value(t, fams, "vllm:request_success_total", map[string]string{"finished_reason": "length"})
		if finished != last {
			moved++
			last = finished
		}
		for _, name := range []string{"vllm:request_generation_tokens", "vllm:request_decode_time_seconds", "vllm:request_prefill_time_seconds"} {
			if got := float64(histogram(t, fams, name).GetSampleCount()); got != finished {
				t.Fatalf("scrape %d: %s counts %v requests, request_success_total %v", scrapes, name, got, finished)
			}
		}
	}
	if moved < 10 {
		t.Fatalf("requests finished between only %d of %d scrapes: the test saw too little", moved, scrapes)
	}
	t.Logf("%d scrapes, %d of them after requests finished", scrapes, moved)
}
