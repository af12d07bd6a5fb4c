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

// scanUsage scans body in the given pieces, as a response's chunks.
func scanUsage(pool *sync.Pool, pieces ...[]byte) (usage, bool, *usageScanner) {
	var s usageScanner
	for _, p := range pieces {
		s.write(p, pool)
	}
	return s.u, s.ok, &s
}

func capturePool() *sync.Pool {
	return &sync.Pool{New: func() any { return new([usageTailBytes]byte) }}
}

func TestUsageScannerReadsTheTopLevelUsage(t *testing.T) {
	long := strings.Repeat(`word \"quoted\" {[}] \\ `, 300) // past usageTailBytes, brackets and escapes in a string
	for _, c := range []struct {
		name, body string
		want       usage
		ok         bool
	}{
		{"usage first", `{"id":"x","usage":{"prompt_tokens":1234,"completion_tokens":56,"prompt_tokens_details":{"cached_tokens":1024}},"choices":[{"text":"` + long + `"}]}`,
			usage{promptTokens: 1234, completionTokens: 56, cachedTokens: 1024, hasCached: true}, true},
		{"usage last, spaces", "{ \"choices\" : [ {\"text\": \"" + long + "\"} ] ,\n \"usage\" : { \"prompt_tokens\" : 7 , \"completion_tokens\" : 2 } , \"kv_transfer_params\" : null }",
			usage{promptTokens: 7, completionTokens: 2}, true},
		{"responses API", `{"object":"response","output":[],"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":9}}`,
			usage{promptTokens: 40, completionTokens: 9, cachedTokens: 32, hasCached: true}, true},
		{"nested usage is not the response's", `{"choices":[{"message":{"usage":{"prompt_tokens":1}}}],"data":{"usage":{"prompt_tokens":2}}}`, usage{}, false},
		{"usage as text", `{"choices":[{"text":"\"usage\": {\"prompt_tokens\":1}"}],"note":"usage","usage":{"prompt_tokens":3}}`, usage{promptTokens: 3}, true},
		{"usage null", `{"usage":null,"choices":[]}`, usage{}, false},
		{"the last of two", `{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}`, usage{promptTokens: 2}, true},
		{"a later null", `{"usage":{"prompt_tokens":1},"usage":null}`, usage{}, false},
		{"a key ending in usage", `{"xusage":{"prompt_tokens":1},"usagex":{"prompt_tokens":2},"usag":{"prompt_tokens":3}}`, usage{}, false},
		{"not a number", `{"usage":{"prompt_tokens":"many"}}`, usage{}, false},
		{"cut off", `{"usage":{"prompt_tokens":12,"comp`, usage{}, false},
		{"too long to keep", `{"usage":{"prompt_tokens":5,"x":"` + long + `"}}`, usage{}, false},
		{"an array", `[{"usage":{"prompt_tokens":1}}]`, usage{}, false},
		{"JSON lines", "{\"a\":1}\n{\"usage\":{\"prompt_tokens\":4}}\n", usage{promptTokens: 4}, true},
	} {
		body := []byte(c.body)
		for _, n := range []int{len(body), 4096, 7, 1} {
			var pieces [][]byte
			for b := body; len(b) > 0; b = b[min(n, len(b)):] {
				pieces = append(pieces, b[:min(n, len(b))])
			}
			pool := capturePool()
			got, ok, s := scanUsage(pool, pieces...)
			if got != c.want || ok != c.ok {
				t.Errorf("%s, in pieces of %d bytes: got %+v %v, want %+v %v", c.name, n, got, ok, c.want, c.ok)
			}
			if c.name != "cut off" && s.buf != nil {
				t.Errorf("%s: the capture buffer is held after the usage object ended", c.name)
			}
			s.close(pool)
		}
	}
}

// topLevelUsage is what encoding/json reads as the usage of body, a valid
// JSON document: the value of its top-level object's last key written
// "usage" (an object; null or anything else is none), decoded as the
// scanner decodes it. big: the value is larger than the scanner keeps.
func topLevelUsage(t *testing.T, body []byte) (u usage, ok, big bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return usage{}, false, false
	}
	var last json.RawMessage
	for dec.More() {
		before := dec.InputOffset()
		if _, err := dec.Token(); err != nil {
			t.Fatalf("%q: reading a key: %v", body, err)
		}
		key := bytes.TrimLeft(body[before:dec.InputOffset()], " \t\r\n,")
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatalf("%q: reading a value: %v", body, err)
		}
		if string(key) == `"usage"` {
			last = v
		}
	}
	if len(last) == 0 || last[0] != '{' {
		return usage{}, false, false
	}
	var w wireUsage
	if err := json.Unmarshal(last, &w); err != nil {
		return usage{}, false, len(last) > usageTailBytes
	}
	return w.usage(), true, len(last) > usageTailBytes
}

// The scanner reads what encoding/json reads, however the body is cut into
// chunks; on a body that is not JSON it must only not fail or overrun.
func FuzzUsageScannerReadsAsEncodingJSON(f *testing.F) {
	for _, s := range []string{
		`{"id":"x","usage":{"prompt_tokens":12,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}},"choices":[{"text":"a\"b\\"}]}`,
		`{"choices":[{"message":{"usage":{"prompt_tokens":1}}}],"usage" : {"input_tokens":4,"input_tokens_details":null}}`,
		`{"usage":{"prompt_tokens":1},"usage":null}`,
		`{"usage":{"prompt_tokens":"}\"{","completion_tokens":[1,{"a":"]"}]}}`,
		`{"us\u0061ge":{"prompt_tokens":1},"Usage":{"prompt_tokens":2}}`,
		`{"usage":{"prompt_tokens":1.5}}`, `{"usage":{"prompt_tokens":1]}`, `[{"usage":{}}]`, ` {"usage":{}} `,
	} {
		f.Add([]byte(s), uint16(5), uint16(17))
	}
	f.Fuzz(func(t *testing.T, body []byte, cut1, cut2 uint16) {
		a, b := int(cut1)%(len(body)+1), int(cut2)%(len(body)+1)
		if a > b {
			a, b = b, a
		}
		pool := capturePool()
		gotU, gotOK, s := scanUsage(pool, body[:a], body[a:b], body[b:])
		if s.n > usageTailBytes {
			t.Fatalf("%q: kept %d bytes", body, s.n)
		}
		s.close(pool)
		bytewise := make([][]byte, len(body))
		for i := range body {
			bytewise[i] = body[i : i+1]
		}
		if u, ok, _ := scanUsage(pool, bytewise...); u != gotU || ok != gotOK {
			t.Fatalf("%q: cut at %d and %d: %+v %v; byte by byte: %+v %v", body, a, b, gotU, gotOK, u, ok)
		}
		if !json.Valid(body) {
			return
		}
		wantU, wantOK, big := topLevelUsage(t, body)
		if big {
			if gotOK {
				t.Fatalf("%q: read a usage larger than the bound: %+v", body, gotU)
			}
			return
		}
		if gotU != wantU || gotOK != wantOK {
			t.Fatalf("%q: scanner %+v %v, encoding/json %+v %v", body, gotU, gotOK, wantU, wantOK)
		}
	})
}

// BenchmarkUsageScanPerChunk is the scanner's cost per 16 KiB chunk of a
// non-streamed body: generated text (one long string, with the escapes of
// code), or logprobs (all structure: brackets, keys and numbers), usage
// last. "tail" is what writing the same chunks to an event stream's tail
// costs, for comparison.
func BenchmarkUsageScanPerChunk(b *testing.B) {
	const chunkBytes = 16 << 10
	final := `],"usage":{"prompt_tokens":7000,"completion_tokens":500,"total_tokens":7500,"prompt_tokens_details":{"cached_tokens":4096}}}`
	text := []byte(`{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"`)
	for len(text) < 256<<10 {
		text = append(text, `    if err := f(\"x\"); err != nil {\n        return err\n    }\n`...)
	}
	text = append(append(text, `"}}`...), final...)
	logprobs := []byte(`{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"logprobs":{"content":[`)
	for len(logprobs) < 256<<10 {
		logprobs = append(logprobs, `{"token":" the","logprob":-0.0123,"bytes":[32,116,104,101],"top_logprobs":[{"token":" a","logprob":-4.5,"bytes":[32,97]}]},`...)
	}
	logprobs = append(append(logprobs, `{"token":".","logprob":0,"bytes":[46],"top_logprobs":[]}]}}`...), final...)
	pool := capturePool()
	for _, c := range []struct {
		name string
		body []byte
	}{{"text", text}, {"logprobs", logprobs}} {
		var chunks [][]byte
		for rest := c.body; len(rest) > 0; rest = rest[min(chunkBytes, len(rest)):] {
			chunks = append(chunks, rest[:min(chunkBytes, len(rest))])
		}
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(c.body)))
			for b.Loop() {
				if u, ok, _ := scanUsage(pool, chunks...); !ok || u.completionTokens != 500 {
					b.Fatalf("usage %+v %v", u, ok)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(chunks)), "ns/chunk")
		})
		b.Run(c.name+"/tail", func(b *testing.B) {
			buf := new([usageTailBytes]byte)
			b.ReportAllocs()
			b.SetBytes(int64(len(c.body)))
			for b.Loop() {
				t := usageTail{buf: buf}
				for _, ch := range chunks {
					t.write(ch)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(chunks)), "ns/chunk")
		})
	}
}
