package request

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/tallyepp/tally/test/benchcpu"
)

// chatBody builds a realistic chat request of about the given number of
// prompt tokens (4 bytes of text per token): a long system prompt, a few
// turns with escapes and non-ASCII text, and tools after the messages, the
// order in which the OpenAI Python client writes them.
func chatBody(tokens int) []byte {
	rng := rand.New(rand.NewPCG(1, 2))
	words := []string{"the", "model", "server", "prefix", "cache", "request", "token", "pod",
		"latency", "schedule", "é", "naïve", "日本語", "\"quoted\"", "line\n", "tab\t", "path/to"}
	text := func(bytes int) string {
		var b strings.Builder
		for b.Len() < bytes {
			b.WriteString(words[rng.IntN(len(words))])
			b.WriteByte(' ')
		}
		return b.String()
	}
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	total := tokens * 4
	msgs := []message{{"system", text(total / 2)}}
	for i := 0; i < 6; i++ {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, message{role, text(total / 12)})
	}
	body, err := json.Marshal(struct {
		Messages  []message `json:"messages"`
		Model     string    `json:"model"`
		MaxTokens int       `json:"max_completion_tokens"`
		Stream    bool      `json:"stream"`
		Tools     []any     `json:"tools"`
	}{
		Messages:  msgs,
		Model:     "meta-llama/Llama-3.1-8B-Instruct",
		MaxTokens: 512,
		Stream:    true,
		Tools: []any{map[string]any{"type": "function", "function": map[string]any{
			"name": "get_weather", "description": "Current weather for a city.",
			"parameters": map[string]any{"type": "object", "properties": map[string]any{
				"city": map[string]any{"type": "string"}}, "required": []string{"city"}},
		}}},
	})
	if err != nil {
		panic(err)
	}
	return body
}

// completionBody is a completion request with a prompt of plain words of
// about the given number of tokens: no escapes, as in the load tool's.
func completionBody(tokens int) []byte {
	rng := rand.New(rand.NewPCG(3, 4))
	words := []string{"alpha", "beam", "cache", "delta", "engine", "flow", "graph", "hash", "index", "joule"}
	b := []byte(`{"model":"m","prompt":"`)
	for n := len(b) + tokens*4; len(b) < n; {
		b = append(append(b, words[rng.IntN(len(words))]...), ' ')
	}
	return append(b, `","max_tokens":16,"stream":true}`...)
}

func BenchmarkParse(b *testing.B) {
	for _, tokens := range []int{1000, 8000, 32000} {
		benchmarkParse(b, fmt.Sprintf("chat-%dk-tokens", tokens/1000), "/v1/chat/completions", chatBody(tokens))
	}
	benchmarkParse(b, "plain-8k-tokens", "/v1/completions", completionBody(8000))
}

func benchmarkParse(b *testing.B, name, path string, body []byte) {
	b.Run(name, func(b *testing.B) {
		var dst []byte
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		cpu, cpuOK := benchcpu.ProcessCPU()
		for b.Loop() {
			p, err := Parse(path, body, dst)
			if err != nil {
				b.Fatal(err)
			}
			dst = p.Prompt
		}
		if end, ok := benchcpu.ProcessCPU(); ok && cpuOK {
			// CPU time per operation (GC included): see benchcpu.ProcessCPU.
			b.ReportMetric(float64(end-cpu)/float64(b.N), "cpu-ns/op")
		}
	})
}
