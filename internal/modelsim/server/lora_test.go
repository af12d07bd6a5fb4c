package server

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// withAdapters serves a1 (with a path) and a2 besides the base model.
func withAdapters(maxLoRAs int) func(*Config) {
	return func(c *Config) {
		c.LoRAModules = []LoRAModule{{Name: "a1", Path: "/adapters/a1"}, {Name: "a2"}}
		c.Engine.MaxLoRAs = maxLoRAs
	}
}

// newestLoRAInfo returns the labels of the newest vllm:lora_requests_info
// series, as a reader of vLLM's metrics must pick it.
func newestLoRAInfo(t *testing.T, fams map[string]*dto.MetricFamily) map[string]string {
	t.Helper()
	fam := fams["vllm:lora_requests_info"]
	if fam == nil || fam.GetType() != dto.MetricType_GAUGE || len(fam.Metric) == 0 {
		t.Fatalf("vllm:lora_requests_info: %v, want a gauge with series", fam)
	}
	newest := slices.MaxFunc(fam.Metric, func(a, b *dto.Metric) int {
		return cmp.Compare(a.GetGauge().GetValue(), b.GetGauge().GetValue())
	})
	return labels(newest)
}

func complete(t *testing.T, url, model, prompt string) (responseJSON, int) {
	t.Helper()
	var c responseJSON
	resp := post(t, t.Context(), url+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, model, prompt))
	status := resp.StatusCode
	decodeJSON(t, resp, &c)
	return c, status
}

func TestAdapterRequestsAreServedAndCounted(t *testing.T) {
	srv, url := startServer(t, withAdapters(1))
	// With one slot, a1, a1, a2, a1 loads a1, a2, then a1 again; the base
	// model needs no slot.
	for i, tc := range []struct {
		model string
		loads int64
	}{{"a1", 1}, {"a1", 1}, {"a2", 2}, {"sim-model", 2}, {"a1", 3}, {"", 3}} {
		c, status := complete(t, url, tc.model, "hello there")
		if want := cmp.Or(tc.model, "sim-model"); status != http.StatusOK || c.Model != want {
			t.Fatalf("request %d for %q: status %d, model %q; want 200 and %q", i, tc.model, status, c.Model, want)
		}
		if got := srv.Stats().AdapterLoads; got != tc.loads {
			t.Fatalf("request %d for %q: %d adapter loads, want %d", i, tc.model, got, tc.loads)
		}
	}
	fams := scrape(t, url)
	if got := value(t, fams, "vllm:request_success_total", map[string]string{"finished_reason": "length"}); got != 6 {
		t.Errorf("request_success_total{length} = %v, want 6", got)
	}
	if got := value(t, fams, "modelsim_lora_adapter_loads_total", map[string]string{"model_name": "sim-model"}); got != 3 {
		t.Errorf("modelsim_lora_adapter_loads_total = %v, want 3", got)
	}
	// An unknown model is answered as before, the adapters named.
	resp := post(t, t.Context(), url+"/v1/completions", `{"model":"a3","prompt":"hi"}`)
	var e struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	decodeJSON(t, resp, &e)
	if resp.StatusCode != http.StatusNotFound || e.Error.Type != "NotFoundError" || e.Error.Code != 404 ||
		!strings.Contains(e.Error.Message, "The model `a3` does not exist") || !strings.Contains(e.Error.Message, `"a1", "a2"`) {
		t.Fatalf("unknown model: status %d, error %+v", resp.StatusCode, e.Error)
	}
}

func TestModelsListTheAdaptersUnderTheBaseModel(t *testing.T) {
	_, url := startServer(t, withAdapters(2))
	resp, err := http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var models struct {
		Object string           `json:"object"`
		Data   []map[string]any `json:"data"`
	}
	decodeJSON(t, resp, &models)
	if models.Object != "list" || len(models.Data) != 3 {
		t.Fatalf("models: %+v", models)
	}
	maxLen := float64(DefaultConfig().Engine.KVBlocks * DefaultConfig().Engine.BlockSizeTokens)
	for i, want := range []map[string]any{
		{"id": "sim-model", "object": "model", "owned_by": "vllm", "root": "sim-model", "parent": nil, "max_model_len": maxLen},
		{"id": "a1", "object": "model", "owned_by": "vllm", "root": "/adapters/a1", "parent": "sim-model", "max_model_len": nil},
		{"id": "a2", "object": "model", "owned_by": "vllm", "root": "a2", "parent": "sim-model", "max_model_len": nil},
	} {
		got := maps.Clone(models.Data[i])
		if _, ok := got["created"].(float64); !ok {
			t.Errorf("card %d: created %v, want a unix time", i, got["created"])
		}
		delete(got, "created")
		if !maps.Equal(got, want) {
			t.Errorf("card %d: %v, want %v", i, got, want)
		}
	}
}

// TestOneSlotRunsOneAdapterAtATime holds an a1 request running; an a2
// request waits while the base model's runs, and the gauge says so, until
// the a1 request leaves.
func TestOneSlotRunsOneAdapterAtATime(t *testing.T) {
	srv, url := startServer(t, withAdapters(1))
	ctx, cancelA1 := context.WithCancel(t.Context())
	defer cancelA1()
	a1 := post(t, ctx, url+"/v1/completions", `{"model":"a1","prompt":"hold the slot","max_tokens":100000,"stream":true}`)
	defer a1.Body.Close()
	if line, err := bufio.NewReader(a1.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("a1's first line %q: %v", line, err)
	}

	a2 := make(chan responseJSON, 1)
	go func() {
		var c responseJSON
		resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"a2","prompt":"wait for it","max_tokens":1}`))
		if err != nil {
			t.Errorf("POST a2: %v", err)
			a2 <- c
			return
		}
		decodeJSON(t, resp, &c)
		a2 <- c
	}()
	var since time.Duration
	eventually(t, 10*time.Second, func() error {
		st := srv.Stats()
		if st.WaitingRequests != 1 || st.RunningRequests != 1 || st.RunningAdapters != 1 {
			return fmt.Errorf("%d waiting, %d running with %d adapters; want a2 waiting behind a1", st.WaitingRequests, st.RunningRequests, st.RunningAdapters)
		}
		since = st.Now
		return nil
	})
	// The base model is not held back by the waiting adapter.
	if c, status := complete(t, url, "sim-model", "base overtakes"); status != http.StatusOK || c.Model != "sim-model" {
		t.Fatalf("base request while a2 waits: status %d, model %q", status, c.Model)
	}
	const minWait = time.Second // engine time: 10 ms of wall time
	eventually(t, 10*time.Second, func() error {
		if now := srv.Stats().Now; now < since+minWait {
			return fmt.Errorf("engine clock at %v, want %v", now, since+minWait)
		}
		return nil
	})
	if st := srv.Stats(); st.WaitingRequests != 1 || st.RunningAdapters != 1 || st.AdapterLoads != 1 {
		t.Fatalf("after %v: %d waiting, %d adapters running, %d loads; want a2 still waiting and one load", minWait, st.WaitingRequests, st.RunningAdapters, st.AdapterLoads)
	}
	fams := scrape(t, url)
	want := map[string]string{"max_lora": "1", "running_lora_adapters": "a1", "waiting_lora_adapters": "a2"}
	if got := newestLoRAInfo(t, fams); !maps.Equal(got, want) {
		t.Fatalf("newest lora_requests_info labels %v, want exactly %v", got, want)
	}
	if v := fams["vllm:lora_requests_info"].Metric[0].GetGauge().GetValue(); v < float64(time.Now().Add(-time.Minute).Unix()) || v > float64(time.Now().Unix()+1) {
		t.Fatalf("lora_requests_info value %v is not a recent unix time", v)
	}

	cancelA1()
	if c := <-a2; c.Model != "a2" {
		t.Fatalf("a2's response: %+v", c)
	}
	if got := srv.Stats().AdapterLoads; got != 2 {
		t.Fatalf("%d adapter loads, want 2 (a1, then a2 into its slot)", got)
	}
	if got := newestLoRAInfo(t, scrape(t, url)); got["running_lora_adapters"] != "" || got["waiting_lora_adapters"] != "" {
		t.Fatalf("newest lora_requests_info labels %v once idle, want no adapters", got)
	}
}

func TestPrefixCacheIsNotSharedAcrossAdapters(t *testing.T) {
	_, url := startServer(t, withAdapters(2))
	prompt := strings.Repeat("0123456789", 200) // 500 tokens: 31 full blocks
	for i, tc := range []struct {
		model  string
		cached int
	}{
		{"a1", 0},
		{"a2", 0},        // a1's blocks are not a2's
		{"sim-model", 0}, // nor the base model's
		{"a1", 31 * 16},  // the same adapter reuses its own
		{"sim-model", 31 * 16},
		{"a2", 31 * 16},
	} {
		c, status := complete(t, url, tc.model, prompt)
		if status != http.StatusOK || c.Usage == nil || c.Usage.PromptTokensDetails == nil {
			t.Fatalf("request %d for %s: status %d, usage %+v", i, tc.model, status, c.Usage)
		}
		if got := c.Usage.PromptTokensDetails.CachedTokens; got != tc.cached {
			t.Fatalf("request %d for %s: cached_tokens %d, want %d", i, tc.model, got, tc.cached)
		}
	}
}

func TestWithoutAdaptersNoLoRAMetric(t *testing.T) {
	_, url := startServer(t, nil)
	complete(t, url, "sim-model", "hello")
	fams := scrape(t, url)
	for _, name := range []string{"vllm:lora_requests_info", "modelsim_lora_adapter_loads_total"} {
		if fams[name] != nil {
			t.Errorf("%s is written without adapters", name)
		}
	}
}

func TestLoRAConfigErrorsNameTheField(t *testing.T) {
	for _, tc := range []struct {
		mutate func(*Config)
		want   string
	}{
		{func(c *Config) { c.Engine.MaxLoRAs = 1 }, "Engine.MaxLoRAs: 1 is invalid: must be 0 without LoRAModules"},
		{func(c *Config) { c.LoRAModules = []LoRAModule{{Name: "a1"}} }, "Engine.MaxLoRAs: 0 is invalid: must be 1 or more"},
		{withModules("a1", "a1"), `LoRAModules[1].Name: "a1" is invalid: is given twice`},
		{withModules("sim-model"), `LoRAModules[0].Name: "sim-model" is invalid: must differ from Model`},
		{withModules("a,b"), `LoRAModules[0].Name: "a,b" is invalid: must not contain ','`},
		{withModules(""), `LoRAModules[0].Name: "" is invalid`},
	} {
		cfg := DefaultConfig()
		tc.mutate(&cfg)
		if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New: err = %v, want it to contain %q", err, tc.want)
		}
	}
}

func withModules(names ...string) func(*Config) {
	return func(c *Config) {
		for _, n := range names {
			c.LoRAModules = append(c.LoRAModules, LoRAModule{Name: n})
		}
		c.Engine.MaxLoRAs = 1
	}
}
