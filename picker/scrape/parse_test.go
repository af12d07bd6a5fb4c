package scrape

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

func TestParseEachEngine(t *testing.T) {
	cases := []struct {
		engine, body string
		running      int
		waiting      int
		cacheTokens  int
		kvUsage      float64 // -1: none
	}{
		{EngineVLLM, `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 2
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="28800",engine="0"} 1
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
`, 5, 4, 16 * 28800, 0.375},
		{EngineVLLM, "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.8\n", 1, 0, 0, 0.8},
		{EngineSGLang, "sglang:num_running_reqs{model_name=\"m\"} 7\nsglang:num_queue_reqs{model_name=\"m\"} 1 1712345678000\nsglang:max_total_num_tokens 500000\nsglang:cache_config_info{page_size=\"1\"} 1\nsglang:token_usage{model_name=\"m\"} 0.125\n", 7, 1, 500000, 0.125},
		{EngineTRTLLM, "trtllm_num_requests_running 2\ntrtllm_num_requests_waiting 9\n", 2, 9, 0, -1},
		{EngineTRTLLM, "trtllm_num_requests_running 2\ntrtllm_kv_cache_utilization 1.5\n", 2, 0, 0, 1},
	}
	for _, c := range cases {
		st, seen := parse([]byte(c.body), engines[c.engine])
		if !seen || st.Running != c.running || st.Waiting != c.waiting || st.CacheTokens != c.cacheTokens {
			t.Errorf("%s: %+v (seen %v), want running %d, waiting %d, cache %d tokens", c.engine, st, seen, c.running, c.waiting, c.cacheTokens)
		}
		if got := map[bool]float64{true: st.KVCacheUsage, false: -1}[st.HasKVCacheUsage]; got != c.kvUsage {
			t.Errorf("%s: KV cache usage %v, want %v (-1: none)", c.engine, got, c.kvUsage)
		}
	}
	if _, seen := parse([]byte("other_metric 1\n"), engines[EngineVLLM]); seen {
		t.Error("an exposition without the engine's families counts as a scrape")
	}
}

func TestParseVLLMPrefillTiming(t *testing.T) {
	// Two data-parallel engines; the histogram's buckets and count, the
	// counters' _created gauges and the prefix cache's queries are
	// neighbours that must not be read.
	const full = `vllm:num_requests_running{engine="0",model_name="m"} 1
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 7
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 9
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.25
vllm:request_prefill_time_seconds_sum{engine="1",model_name="m"} 0.5
vllm:request_prefill_time_seconds_created{engine="0",model_name="m"} 1.7e+09
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1.5e+06
vllm:prompt_tokens_total{engine="1",model_name="m"} 4096
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 9e+06
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1e+06
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 2048
`
	cases := []struct {
		name, engine, body      string
		has                     bool
		seconds, prompt, cached float64
	}{
		{"full", EngineVLLM, full, true, 1.75, 1_504_096, 1_002_048},
		{"no prefix cache counter", EngineVLLM, "vllm:num_requests_running 0\nvllm:request_prefill_time_seconds_sum 2\nvllm:prompt_tokens_total 10\n", true, 2, 10, 0},
		{"no prefill histogram", EngineVLLM, "vllm:num_requests_running 0\nvllm:prompt_tokens_total 10\nvllm:prefix_cache_hits_total 5\n", false, 0, 0, 0},
		{"no prompt counter", EngineVLLM, "vllm:num_requests_running 0\nvllm:request_prefill_time_seconds_sum 2\nvllm:prefix_cache_hits_total 5\n", false, 0, 0, 0},
		{"only the histogram count", EngineVLLM, "vllm:num_requests_running 0\nvllm:request_prefill_time_seconds_count 2\nvllm:prompt_tokens_total 10\n", false, 0, 0, 0},
		{"a fresh engine", EngineVLLM, "vllm:num_requests_running 0\nvllm:request_prefill_time_seconds_sum 0\nvllm:prompt_tokens_total 0\nvllm:prefix_cache_hits_total 0\n", true, 0, 0, 0},
		{"sglang", EngineSGLang, "sglang:num_running_reqs 1\nsglang:prompt_tokens_total 10\nsglang:cached_tokens_total 5\nvllm:request_prefill_time_seconds_sum 2\nvllm:prompt_tokens_total 10\n", false, 0, 0, 0},
	}
	for _, c := range cases {
		st, seen := parse([]byte(c.body), engines[c.engine])
		if !seen || st.HasPrefillTiming != c.has || st.PrefillSecondsTotal != c.seconds || st.PromptTokensTotal != c.prompt || st.CachedTokensTotal != c.cached {
			t.Errorf("%s: has %v, prefill %vs, prompt %v, cached %v (seen %v); want %v, %vs, %v, %v",
				c.name, st.HasPrefillTiming, st.PrefillSecondsTotal, st.PromptTokensTotal, st.CachedTokensTotal, seen, c.has, c.seconds, c.prompt, c.cached)
		}
	}
	// The timing alone is not a scrape: running or waiting must be there.
	if _, seen := parse([]byte("vllm:request_prefill_time_seconds_sum 2\nvllm:prompt_tokens_total 10\n"), engines[EngineVLLM]); seen {
		t.Error("an exposition with prefill timing but no running or waiting gauge counts as a scrape")
	}
}

// The output counts are the _sum and _count of vLLM's
// request_generation_tokens histogram, summed over data-parallel engines;
// its buckets are not read, and one series without the other is no count.
func TestParseVLLMOutputCounts(t *testing.T) {
	const full = `vllm:num_requests_running{engine="0",model_name="m"} 1
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_bucket{engine="0",le="100.0",model_name="m"} 3
vllm:request_generation_tokens_bucket{engine="0",le="+Inf",model_name="m"} 4
vllm:request_generation_tokens_count{engine="0",model_name="m"} 4
vllm:request_generation_tokens_sum{engine="0",model_name="m"} 950
vllm:request_generation_tokens_count{engine="1",model_name="m"} 2
vllm:request_generation_tokens_sum{engine="1",model_name="m"} 50
vllm:request_generation_tokens_created{engine="0",model_name="m"} 1.7e+09
vllm:generation_tokens_total{engine="0",model_name="m"} 1e+06
vllm:request_decode_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4
vllm:request_decode_time_seconds_count{engine="0",model_name="m"} 4
vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 7.5
vllm:request_decode_time_seconds_sum{engine="1",model_name="m"} 0.5
`
	const counts = "vllm:num_requests_running 0\nvllm:request_generation_tokens_sum 10\nvllm:request_generation_tokens_count 2\n"
	cases := []struct {
		name, body               string
		has                      bool
		generated, finishedCount float64
		hasDecode                bool
		decodeSeconds            float64
	}{
		{"full", full, true, 1000, 6, true, 8},
		{"no count", "vllm:num_requests_running 0\nvllm:request_generation_tokens_sum 10\n", false, 0, 0, false, 0},
		{"no sum", "vllm:num_requests_running 0\nvllm:request_generation_tokens_count 10\n", false, 0, 0, false, 0},
		{"a fresh engine", "vllm:num_requests_running 0\nvllm:request_generation_tokens_sum 0\nvllm:request_generation_tokens_count 0\n", true, 0, 0, false, 0},
		{"no decode time", counts, true, 10, 2, false, 0},
		{"decode time", counts + "vllm:request_decode_time_seconds_sum 0.25\n", true, 10, 2, true, 0.25},
		{"decode time without the counts", "vllm:num_requests_running 0\nvllm:request_decode_time_seconds_sum 0.25\n", false, 0, 0, false, 0},
	}
	for _, c := range cases {
		st, seen := parse([]byte(c.body), engines[EngineVLLM])
		if !seen || st.HasOutputCounts != c.has || st.GenerationTokensTotal != c.generated || st.FinishedRequestsTotal != c.finishedCount {
			t.Errorf("%s: has %v, generated %v, finished %v (seen %v); want %v, %v, %v",
				c.name, st.HasOutputCounts, st.GenerationTokensTotal, st.FinishedRequestsTotal, seen, c.has, c.generated, c.finishedCount)
		}
		if st.HasDecodeTiming != c.hasDecode || st.DecodeSecondsTotal != c.decodeSeconds {
			t.Errorf("%s: decode timing %v, %v s; want %v, %v s", c.name, st.HasDecodeTiming, st.DecodeSecondsTotal, c.hasDecode, c.decodeSeconds)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte("vllm:num_requests_running{a=\"1\"} 3\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"2\"} 1\n"))
	f.Add([]byte("vllm:request_prefill_time_seconds_sum{engine=\"0\"} 1.5\nvllm:prompt_tokens_total 1e3 1712345678000\nvllm:prefix_cache_hits_total{} NaN\n"))
	f.Add([]byte("x{ 1\n{}\n =\"\n"))
	f.Fuzz(func(t *testing.T, body []byte) {
		for _, n := range engines {
			parse(body, n) // must not panic
		}
	})
}

func TestParseReadsLoRAAdaptersAndTheBaseModel(t *testing.T) {
	body := `vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 2
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora,chat\"x",waiting_lora_adapters="tool-lora"} 1.7000000005e+09
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1
`
	st, seen := parse([]byte(body), engines[EngineVLLM])
	if !seen || !st.HasLoRA || st.MaxLoRAs != 2 || st.Model != "meta-llama/Llama-3.1-8B" {
		t.Fatalf("%+v (seen %v), want LoRA info with max_lora 2 and the base model", st, seen)
	}
	if !slices.Equal(st.RunningAdapters, []string{"sql-lora", `chat"x`}) || !slices.Equal(st.WaitingAdapters, []string{"tool-lora"}) {
		t.Errorf("running %q, waiting %q; want the latest series' adapters", st.RunningAdapters, st.WaitingAdapters)
	}
	st, _ = parse([]byte("vllm:num_requests_running 1\n"), engines[EngineVLLM])
	if st.HasLoRA || st.Model != "" {
		t.Errorf("without lora_requests_info or labels: %+v, want no LoRA and no model", st)
	}
}

// vLLM sets a new lora_requests_info series to the current time each time
// the adapter set changes (labels in the order it declares them); series
// that share the newest value are read the same whatever their order: the
// one that agrees with the engine's request counts, then the fewest
// adapters.
func TestParseLoRATiesAtTheNewestValue(t *testing.T) {
	const (
		help = "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n"
		// Whole seconds, as prometheus_client writes 1745896800.0.
		older = `vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="",running_lora_adapters="sql-lora"} 1.7458967e+09` + "\n"
		idle  = `vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="",running_lora_adapters=""} 1.7458968e+09` + "\n"
		sql   = `vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="",running_lora_adapters="sql-lora"} 1.7458968e+09` + "\n"
		both  = `vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="",running_lora_adapters="sql-lora,chat-lora"} 1.7458968e+09` + "\n"
		queue = `vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="tool-lora",running_lora_adapters=""} 1.7458968e+09` + "\n"
		nan   = `vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="",running_lora_adapters="nan-lora"} NaN` + "\n"
	)
	counts := func(running, waiting int) string {
		return fmt.Sprintf("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} %d.0\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} %d.0\n", running, waiting)
	}
	cases := []struct {
		name             string
		counts           string
		tied             []string // also read in reverse order
		running, waiting []string
	}{
		{"every request ended within the second", counts(0, 0), []string{older, sql, idle}, nil, nil},
		{"one request running, adapter or base model", counts(1, 0), []string{sql, idle}, nil, nil},
		{"two adapters need two requests", counts(1, 0), []string{both, sql}, []string{"sql-lora"}, nil},
		{"two requests, the fewer adapters", counts(2, 0), []string{both, sql}, []string{"sql-lora"}, nil},
		{"a waiting adapter needs a waiting request", counts(1, 0), []string{queue, sql}, []string{"sql-lora"}, nil},
		{"a waiting request", counts(0, 1), []string{queue, sql}, nil, []string{"tool-lora"}},
		{"NaN is no time", counts(1, 0), []string{nan, sql}, []string{"sql-lora"}, nil},
		// With several API server processes vLLM sums the processes' times:
		// an old set both processes set can come out newest.
		{"a stale adapter series on an idle engine", counts(0, 0), []string{idle, strings.Replace(sql, "1.7458968e+09", "3.4917936e+09", 1)}, nil, nil},
		{"no request counts published", "", []string{older, sql}, []string{"sql-lora"}, nil},
	}
	for _, c := range cases {
		for _, reversed := range []bool{false, true} {
			series := slices.Clone(c.tied)
			if reversed {
				slices.Reverse(series)
			}
			body := c.counts + help + strings.Join(series, "") + "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0\n"
			st, _ := parse([]byte(body), engines[EngineVLLM])
			if !st.HasLoRA || st.MaxLoRAs != 1 || !slices.Equal(st.RunningAdapters, c.running) || !slices.Equal(st.WaitingAdapters, c.waiting) {
				t.Errorf("%s (reversed %v): LoRA %v, max %d, running %q, waiting %q; want max 1, running %q, waiting %q",
					c.name, reversed, st.HasLoRA, st.MaxLoRAs, st.RunningAdapters, st.WaitingAdapters, c.running, c.waiting)
			}
		}
	}
}
