package extproc

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"sync"
	"testing"
)

func tailOf(chunks ...string) []byte {
	t := usageTail{buf: new([usageTailBytes]byte)}
	for _, c := range chunks {
		t.write([]byte(c))
	}
	return t.bytes()
}

func TestUsageTailKeepsTheLastBytes(t *testing.T) {
	long := strings.Repeat("0123456789", 1000) // 10,000 bytes
	for _, pieces := range [][]string{
		{long},
		{long[:3], long[3:5000], long[5000:]},
		{long[:4096], long[4096:8000], long[8000:8001], long[8001:]},
	} {
		if got := string(tailOf(pieces...)); got != long[len(long)-usageTailBytes:] {
			t.Errorf("tail of %d pieces: %d bytes ending %q, want the last %d bytes", len(pieces), len(got), got[max(len(got)-20, 0):], usageTailBytes)
		}
	}
	if got := string(tailOf("ab", "cd")); got != "abcd" {
		t.Errorf("short tail %q, want abcd", got)
	}
}

func TestParseUsage(t *testing.T) {
	for _, c := range []struct {
		name string
		tail string
		want usage
		ok   bool
	}{
		{"chat completion", `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}`,
			usage{promptTokens: 12, completionTokens: 3}, true},
		{"cached tokens, spaces", `{"usage" : { "prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8} }, "kv_transfer_params": null}`,
			usage{promptTokens: 12, completionTokens: 3, cachedTokens: 8, hasCached: true}, true},
		{"zero cached tokens are reported", `{"usage":{"prompt_tokens":5,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`,
			usage{promptTokens: 5, completionTokens: 1, hasCached: true}, true},
		{"last SSE event", "data: {\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n",
			usage{promptTokens: 7, completionTokens: 2}, true},
		{"running totals: the last wins", "data: {\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1}}\n\ndata: {\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\n",
			usage{promptTokens: 7, completionTokens: 2}, true},
		{"responses API", `event: response.completed` + "\n" + `data: {"type":"response.completed","response":{"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":9,"total_tokens":49},"user":null}}`,
			usage{promptTokens: 40, completionTokens: 9, cachedTokens: 32, hasCached: true}, true},
		{"embeddings", `{"data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}`, usage{promptTokens: 4}, true},
		{"stream without usage", "data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n", usage{}, false},
		{"last usage null", "data: {\"usage\":{\"prompt_tokens\":7}}\n\ndata: {\"usage\":null}\n\n", usage{}, false},
		{"cut off", `{"usage":{"prompt_tokens":12,"comp`, usage{}, false},
		{"escaped in content", `{"choices":[{"text":"say \"usage\": {\"prompt_tokens\":1}"}]}`, usage{}, false},
		{"a string value usage", `{"choices":[{"text":"usage"}],"usage":{"prompt_tokens":2,"completion_tokens":1}}`,
			usage{promptTokens: 2, completionTokens: 1}, true},
		{"the word as the last value", `{"usage":{"prompt_tokens":2,"completion_tokens":1},"note":"usage"}`,
			usage{promptTokens: 2, completionTokens: 1}, true},
		{"not a number", `{"usage":{"prompt_tokens":"many"}}`, usage{}, false},
	} {
		got, ok := parseUsage([]byte(c.tail))
		if got != c.want || ok != c.ok {
			t.Errorf("%s: got %+v %v, want %+v %v", c.name, got, ok, c.want, c.ok)
		}
	}
}

// BenchmarkUsage is one streamed response's usage work: 500 token events
// written to the tail, then the usage read from it.
func BenchmarkUsage(b *testing.B) {
	event := []byte(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" token"}}],"usage":null}` + "\n\n")
	final := []byte(`data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":7000,"completion_tokens":500,"total_tokens":7500,"prompt_tokens_details":{"cached_tokens":4096}}}` + "\n\ndata: [DONE]\n\n")
	buf := new([usageTailBytes]byte)
	b.ReportAllocs()
	for b.Loop() {
		t := usageTail{buf: buf}
		for range 500 {
			t.write(event)
		}
		t.write(final)
		if u, ok := parseUsage(t.bytes()); !ok || u.completionTokens != 500 {
			b.Fatalf("usage %+v %v", u, ok)
		}
	}
}

// objectEnd and json.Unmarshal read a usage object as a json.Decoder does:
// the first value, whatever follows it.
func FuzzObjectEndDecodesAsDecoderDoes(f *testing.F) {
	for _, s := range []string{
		`{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":8}},"x":1}`,
		`{"prompt_tokens":"}\"{","completion_tokens":[1,{"a":"]"}]}`,
		`{"input_tokens":4,"input_tokens_details":null} trailing`,
		`{"prompt_tokens":1]`, `{"prompt_tokens":2`, `{"prompt_tokens":1.5}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) == 0 || b[0] != '{' {
			return
		}
		var want, got wireUsage
		wantErr := json.NewDecoder(bytes.NewReader(b)).Decode(&want)
		end := objectEnd(b)
		gotOK := end > 0 && json.Unmarshal(b[:end], &got) == nil
		if gotOK != (wantErr == nil) {
			t.Fatalf("%q: objectEnd %d, decoded %v; json.Decoder error %v", b, end, gotOK, wantErr)
		}
		if gotOK && !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: got %+v, json.Decoder %+v", b, got, want)
		}
	})
}

// A tail past usageTailBytes whose usage did not parse is read again when
// the reservation is released: the second read must see what the first did.
func TestUsageTailReadsTheSameTwice(t *testing.T) {
	long := strings.Repeat("0123456789", 1000) // past usageTailBytes, no usage
	tail := usageTail{buf: new([usageTailBytes]byte)}
	tail.write([]byte(long[:5001]))
	tail.write([]byte(long[5001:]))
	want := long[len(long)-usageTailBytes:]
	for read := 1; read <= 3; read++ {
		if got := string(tail.bytes()); got != want {
			t.Fatalf("read %d: %d bytes starting %q, want the last %d bytes starting %q", read, len(got), got[:20], usageTailBytes, want[:20])
		}
	}
}

// The metrics recorder reads the usage at the response's end and the
// reservation's release asks again: both get what the tail said.
func TestResponseReadsItsUsageOnce(t *testing.T) {
	var pool sync.Pool
	pool.New = func() any { return new([usageTailBytes]byte) }
	final := `data: {"choices":[],"usage":{"prompt_tokens":70,"completion_tokens":5}}` + "\n\ndata: [DONE]\n\n"
	var r response
	r.body([]byte("data: "+strings.Repeat("x", 5000)+"\n\n"), true, &pool)
	r.body([]byte(final), true, &pool)
	for read := 1; read <= 2; read++ {
		if u, ok := r.usage(); !ok || u.promptTokens != 70 || u.completionTokens != 5 {
			t.Errorf("read %d: usage %+v, %v; want 70 prompt and 5 completion tokens", read, u, ok)
		}
	}
	if got := r.outputTokens(); got != 5 {
		t.Errorf("output tokens %d, want the usage's 5", got)
	}
	r.close(&pool)
	if r.tail.buf != nil {
		t.Error("close kept the tail's buffer")
	}
}
