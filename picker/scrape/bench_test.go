package scrape

import (
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"testing"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/test/benchcpu"
)

// BenchmarkRound scrapes 100 endpoints per op over real HTTP on loopback
// pod IPs. Each serves a fixed copy of a simulator's exposition, padded to
// the size of a real vLLM one (about 60 KB: vLLM publishes dozens of
// histograms), so the CPU measured is the scraper's (and the kernel's), not
// the exposition's encoding. It reports CPU and allocations per endpoint
// scraped, and the CPU one endpoint costs per second at the default
// 250 ms interval.
func BenchmarkRound(b *testing.B) {
	const endpoints = 100
	sims, _ := simulators(b, 1, 25_000)
	resp, err := http.Get("http://" + sims[0].Address.String() + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for len(body) < 60_000 {
		body = fmt.Appendf(body, "vllm:request_prompt_tokens_bucket{engine=\"0\",le=\"%d\",model_name=\"m\"} 12345\n", len(body))
	}
	static := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(body) })
	var eps []picker.Endpoint
	for i := range endpoints {
		ep, stop := serve(b, netip.AddrFrom4([4]byte{127, 0, 46, byte(2 + i)}), static)
		b.Cleanup(stop)
		eps = append(eps, picker.Endpoint{Pod: fmt.Sprint("p", i), UID: fmt.Sprint("u", i), Address: ep})
	}
	p := picker.New(v1alpha1.Default(), picker.Options{})
	p.Replace(eps)
	s := New(p, Options{})
	targets := p.ScrapeTargets(nil)
	s.Round(b.Context(), targets) // open the connections
	b.ReportAllocs()
	start, ok := benchcpu.ProcessCPU()
	for b.Loop() {
		s.Round(b.Context(), targets)
	}
	if end, ok2 := benchcpu.ProcessCPU(); ok && ok2 {
		perScrape := float64(end-start) / float64(b.N*endpoints)
		b.ReportMetric(perScrape, "cpu-ns/scrape")
		b.ReportMetric(perScrape*float64(1e9/DefaultInterval.Nanoseconds())/1e3, "cpu-µs/endpoint/s")
	}
}

// BenchmarkParse parses one 60 KB vLLM exposition.
func BenchmarkParse(b *testing.B) {
	var body []byte
	body = append(body, "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"28800\"} 1\n"...)
	for len(body) < 60_000 {
		body = fmt.Appendf(body, "vllm:request_prompt_tokens_bucket{engine=\"0\",le=\"%d\",model_name=\"m\"} 12345\n", len(body))
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		parse(body, engines[EngineVLLM])
	}
}
