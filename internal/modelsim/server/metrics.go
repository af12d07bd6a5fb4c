package server

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// engineLabel is the value of the engine label: vLLM numbers its engines
// from 0 and a simulator runs one.
const engineLabel = "0"

func commonLabels(model string) prometheus.Labels {
	return prometheus.Labels{"model_name": model, "engine": engineLabel}
}

func newTTFTHistogram(model string) prometheus.Histogram {
	return prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "vllm:time_to_first_token_seconds",
		Help: "Histogram of time to first token in seconds.",
		// vLLM v1's buckets.
		Buckets: []float64{
			0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
			1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
		},
		ConstLabels: commonLabels(model),
	})
}

// newPhaseTimeHistogram is one of vLLM v1's per-request phase times, in
// its request latency buckets:
//   - vllm:request_prefill_time_seconds, from the step that first
//     scheduled the request to its first token, so the time queued before
//     is left out. vLLM observes it when the request finishes, not at its
//     first token, and so does the simulator: a scrape sees a request's
//     prompt tokens (counted at the first token) before its prefill time.
//   - vllm:request_decode_time_seconds, from its first token to its last,
//     observed when it finishes.
func newPhaseTimeHistogram(model, name, help string) prometheus.Histogram {
	return prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: name,
		Help: help,
		Buckets: []float64{
			0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
			40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
		},
		ConstLabels: commonLabels(model),
	})
}

// newGenerationTokensHistogram is vLLM v1's request_generation_tokens: each
// finished request's output tokens, observed when it finishes.
func newGenerationTokensHistogram(model string) prometheus.Histogram {
	return prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "vllm:request_generation_tokens",
		Help: "Number of generation tokens processed.",
		// vLLM's 1-2-5 buckets up to the model's length.
		Buckets:     []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000},
		ConstLabels: commonLabels(model),
	})
}

// collector reads the engine's gauges and counters at scrape time, all from
// one snapshot, so they agree with each other and with the engine's state.
type collector struct {
	s                                                    *Server
	running, waiting, usage, queries, hits, info, finish *prometheus.Desc
	promptTokens                                         *prometheus.Desc
	// queuedPrefill is the simulator's own: vLLM exports no such gauge. It
	// is the truth the picker's prefill estimate is tested against.
	queuedPrefill *prometheus.Desc
	// loraInfo and adapterLoads are nil without LoRA adapters, as vLLM
	// writes lora_requests_info only with LoRA enabled. adapterLoads is
	// the simulator's own: the swaps a benchmark reports.
	loraInfo, adapterLoads *prometheus.Desc
	maxLoRA                string
}

func newCollector(s *Server) *collector {
	l := commonLabels(s.cfg.Model)
	info := commonLabels(s.cfg.Model)
	info["block_size"] = strconv.Itoa(s.cfg.Engine.BlockSizeTokens)
	info["num_gpu_blocks"] = strconv.Itoa(s.cfg.Engine.KVBlocks)
	c := &collector{
		s:       s,
		running: prometheus.NewDesc("vllm:num_requests_running", "Number of requests in model execution batches.", nil, l),
		waiting: prometheus.NewDesc("vllm:num_requests_waiting", "Number of requests waiting to be processed.", nil, l),
		usage:   prometheus.NewDesc("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", nil, l),
		queries: prometheus.NewDesc("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", nil, l),
		hits:    prometheus.NewDesc("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", nil, l),
		info:    prometheus.NewDesc("vllm:cache_config_info", "Information of the KV cache configuration.", nil, info),
		finish:  prometheus.NewDesc("vllm:request_success_total", "Count of successfully processed requests.", []string{"finished_reason"}, l),
		// vLLM counts a request's whole prompt, cached tokens included,
		// when its prefill ends.
		promptTokens: prometheus.NewDesc("vllm:prompt_tokens_total", "Number of prefill tokens processed.", nil, l),
		queuedPrefill: prometheus.NewDesc("modelsim_queued_prefill_tokens",
			"Prompt tokens not yet computed over waiting and running requests (simulator only; cached tokens excluded).", nil, l),
	}
	if len(s.cfg.LoRAModules) > 0 {
		// vLLM gives this gauge its three labels and no others: not
		// model_name, not engine.
		c.loraInfo = prometheus.NewDesc("vllm:lora_requests_info", "Running stats on lora requests.",
			[]string{"max_lora", "waiting_lora_adapters", "running_lora_adapters"}, nil)
		c.maxLoRA = strconv.Itoa(s.cfg.Engine.MaxLoRAs)
		c.adapterLoads = prometheus.NewDesc("modelsim_lora_adapter_loads_total",
			"LoRA adapters loaded into a slot, free or evicted (simulator only).", nil, l)
	}
	return c
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.running, c.waiting, c.usage, c.queries, c.hits, c.info, c.finish, c.promptTokens, c.queuedPrefill, c.loraInfo, c.adapterLoads} {
		if d != nil {
			ch <- d
		}
	}
	for _, h := range c.s.histograms() {
		ch <- h.Desc()
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	st, lora, hists := c.s.metricsSnapshot()
	for _, h := range hists {
		ch <- h
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge(c.running, float64(st.RunningRequests))
	gauge(c.waiting, float64(st.WaitingRequests))
	gauge(c.usage, st.KVCacheUsage())
	gauge(c.info, 1)
	gauge(c.queuedPrefill, float64(st.QueuedPrefillTokens))
	counter(c.queries, float64(st.PrefixQueryTokens))
	counter(c.hits, float64(st.PrefixHitTokens))
	counter(c.promptTokens, float64(st.PromptTokens))
	// The simulator never stops early ("stop"): it always generates the
	// requested length. Aborted requests were cancelled by their client.
	counter(c.finish, 0, "stop")
	counter(c.finish, float64(st.FinishedRequests), "length")
	counter(c.finish, float64(st.AbortedRequests), "abort")
	if c.loraInfo != nil {
		for _, l := range lora {
			gauge(c.loraInfo, l.at, c.maxLoRA, l.labels.waiting, l.labels.running)
		}
		counter(c.adapterLoads, float64(st.AdapterLoads))
	}
}

// frozen is h as it is now: a histogram's own Write reads it when the
// registry comes to it, after observations made since.
func frozen(h prometheus.Histogram) prometheus.Metric {
	var m dto.Metric
	if err := h.Write(&m); err != nil {
		return prometheus.NewInvalidMetric(h.Desc(), err)
	}
	buckets := make(map[float64]uint64, len(m.Histogram.GetBucket()))
	for _, b := range m.Histogram.GetBucket() {
		buckets[b.GetUpperBound()] = b.GetCumulativeCount()
	}
	return prometheus.MustNewConstHistogram(h.Desc(), m.Histogram.GetSampleCount(), m.Histogram.GetSampleSum(), buckets)
}
