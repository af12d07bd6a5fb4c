package main

import (
	"fmt"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
)

// kvBlocks is each simulated engine's KV cache size in 16-token blocks: a
// 460,800-token cache, as in the routing benchmarks.
const kvBlocks = 28_800

// pods is what the pool's pods show the pickers. The tool plays the model
// servers itself (it answers each routed request on the ext_proc stream),
// so a pod needs no engine: its address serves only the vLLM metrics page
// the pickers scrape. The page reports the requests the tool holds at that
// pod as vllm:num_requests_waiting: during a burst of long prompts none of
// them would have been prefilled yet on a real engine.
type pods struct {
	mu   sync.Mutex
	held map[string]*atomic.Int64 // by "ip:port"
}

func newPods() *pods { return &pods{held: map[string]*atomic.Int64{}} }

func (p *pods) counter(endpoint string) *atomic.Int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.held[endpoint]
	if c == nil {
		c = new(atomic.Int64)
		p.held[endpoint] = c
	}
	return c
}

// hold records a request placed at endpoint until the returned func runs.
func (p *pods) hold(endpoint string) (release func()) {
	if p == nil || endpoint == "" {
		return func() {}
	}
	c := p.counter(endpoint)
	c.Add(1)
	var once sync.Once
	return func() { once.Do(func() { c.Add(-1) }) }
}

// counts reads what the tool holds at each endpoint, in order.
func (p *pods) counts(endpoints []string) []int64 {
	out := make([]int64, len(endpoints))
	for i, e := range endpoints {
		out[i] = p.counter(e).Load()
	}
	return out
}

// handler serves one pod's address.
func (p *pods) handler(addr netip.AddrPort) http.Handler {
	c := p.counter(addr.String())
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		fmt.Fprintf(w, `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="bench"} 0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="bench"} %d
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="bench"} 0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="%d"} 1
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09
`, c.Load(), kvBlocks)
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	return mux
}
