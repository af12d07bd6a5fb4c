package extproc_test

import (
	"slices"
	"strings"
	"testing"
)

// cutAt cuts body at each offset in at and every size bytes, as a model
// server's writes and the gateway's reads may fall.
func cutAt(body string, size int, at ...int) []string {
	for i := size; i < len(body); i += size {
		at = append(at, i)
	}
	slices.Sort(at)
	at = slices.Compact(at)
	var out []string
	prev := 0
	for _, i := range at {
		if i > prev && i < len(body) {
			out, prev = append(out, body[prev:i]), i
		}
	}
	return append(out, body[prev:])
}

// A non-streamed response's usage is read wherever the server writes it in
// a body far larger than the picker keeps of an event stream: before the
// choices, or after them, in chunks cut inside its key and its numbers. A
// "usage" nested in a choice, or quoted in the generated text, is not the
// response's.
func TestUsageOfANonStreamedBodyIsReadWhereverItStands(t *testing.T) {
	f := newUpstreamFixture(t, 0)
	const usage = `"usage":{"prompt_tokens":1234,"total_tokens":1290,"completion_tokens":56,"prompt_tokens_details":{"cached_tokens":1024}}`
	choices := `"choices":[{"index":0,"message":{"role":"assistant","content":"` + letters(7, 10_000) +
		` say \"usage\": {\"prompt_tokens\": 1} ` + letters(8, 10_000) + `"},` +
		`"logprobs":{"usage":{"prompt_tokens":1,"completion_tokens":1}},"finish_reason":"stop"}]`
	for _, c := range []struct{ model, body string }{
		{"usage-first", `{"id":"chatcmpl-7","object":"chat.completion","created":1745896800,"model":"usage-first",` + usage + `,` + choices + `}`},
		{"usage-last", `{"id":"chatcmpl-8","object":"chat.completion","created":1745896800,"model":"usage-last",` + choices + `,` + usage + `,"prompt_logprobs":null,"kv_transfer_params":null}`},
	} {
		top := strings.LastIndex(c.body, `"usage":{"prompt_tokens":1234`)
		cuts := []int{
			top + len(`"us`),                         // inside the key
			top + len(`"usage":{"prompt_tokens":12`), // inside a number
			top + strings.Index(c.body[top:], `cached_tok`) + 6,
			top + strings.Index(c.body[top:], `1024`) + 1,
			top + len(usage) - 1, // before the object's last brace
		}
		pieces := cutAt(c.body, 3000, cuts...)
		play(t, f, completion(c.model, letters(9, 2000)), response(200, pieces...))

		labels := map[string]string{"model_name": c.model, "target_model_name": c.model}
		for _, h := range []struct {
			name string
			sum  float64
		}{
			{"inference_objective_input_tokens", 1234},
			{"inference_objective_output_tokens", 56},
			{"inference_objective_prompt_cached_tokens", 1024},
		} {
			got := histogramOf(t, f.reg, h.name, labels)
			if got.GetSampleCount() != 1 || got.GetSampleSum() != h.sum {
				t.Errorf("%s, %d bytes in %d chunks: %s has %d samples summing to %v, want 1 of %v",
					c.model, len(c.body), len(pieces), h.name, got.GetSampleCount(), got.GetSampleSum(), h.sum)
			}
		}
	}
}
