package extproc

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
)

// usageTailBytes bounds what a stream keeps of its response body to read the
// token usage from. Of an event stream, it keeps the last 4 KiB, whatever
// the response's size: OpenAI-compatible servers put `usage` in the last
// data event, just before `data: [DONE]` (sent only when the client asked
// for stream_options.include_usage); a stream whose usage lies further from
// its end goes uncounted rather than buffered. Of a non-streamed JSON body,
// whose usage may stand anywhere (vLLM writes it after the choices, other
// servers before them), it keeps the usage object alone (usageScanner).
const usageTailBytes = 4 << 10

// usageTail is a ring holding the last usageTailBytes of a response body.
// The zero value is empty; buf is set before the first write.
type usageTail struct {
	buf *[usageTailBytes]byte
	// n is the bytes written in all, or usageTailBytes once bytes has put
	// a full ring in order: either way n%usageTailBytes is where the
	// oldest byte is once the ring is full.
	n int
}

func (t *usageTail) write(p []byte) {
	total := len(p)
	if len(p) > usageTailBytes {
		p = p[len(p)-usageTailBytes:]
	}
	pos := (t.n + total - len(p)) % usageTailBytes
	k := copy(t.buf[pos:], p)
	copy(t.buf[:], p[k:])
	t.n += total
}

// bytes returns the tail in order, valid until the next write. It rotates
// the ring in place, and leaves it a ring whose oldest byte is the first:
// reading again, or writing after a read, sees the same bytes.
func (t *usageTail) bytes() []byte {
	if t.n <= usageTailBytes {
		return t.buf[:t.n]
	}
	pos := t.n % usageTailBytes
	slices.Reverse(t.buf[:pos])
	slices.Reverse(t.buf[pos:])
	slices.Reverse(t.buf[:])
	t.n = usageTailBytes
	return t.buf[:]
}

// response follows a stream's response for what the stream learns from it:
// whether one came, its first byte, its SSE events, and the token usage,
// read from the tail of an event stream or by scanning a JSON body. It owns
// the tail and the scanner: the metrics recorder and the reservation's
// release both ask it for the usage, which it reads once. Only the stream's
// goroutine touches it.
type response struct {
	// seen: a response phase message came. A stream that ends before one
	// does was cut at the pick by the gateway (see stream.halfClosed).
	seen      bool
	firstByte bool
	// serverError: its status was 500 or more. Its bytes are no first
	// token (picker.Outcome.ServerError).
	serverError bool
	// kind is what the body is, told by its first byte other than
	// whitespace.
	kind bodyKind
	// events counts the response's SSE events ("data:" lines): its output
	// tokens when its usage does not say.
	events int
	// encoded: the body is encoded (compressed), its usage unreadable.
	encoded bool
	// ended: the response was seen to its end; nothing more is kept.
	ended bool
	tail  usageTail    // of an event stream
	scan  usageScanner // of a JSON body
	// read: the usage was read; u and ok are what it said.
	read bool
	u    usage
	ok   bool
}

type bodyKind uint8

const (
	bodyUnknown bodyKind = iota // no byte other than whitespace yet
	bodyJSON                    // starts with '{': a non-streamed response
	bodyEvents                  // anything else: an event stream ("data:", "event:", ":")
)

// kindOf tells a body's kind from its first chunk that holds more than
// whitespace. The content-type is not asked: servers and gateways differ
// in what they put there, never in how a JSON document or an event stream
// begins.
func kindOf(chunk []byte) bodyKind {
	rest := bytes.TrimLeft(chunk, " \t\r\n")
	switch {
	case len(rest) == 0:
		return bodyUnknown
	case rest[0] == '{':
		return bodyJSON
	}
	return bodyEvents
}

func (r *response) headers(h *corev3.HeaderMap) {
	r.seen = true
	if enc := headerValue(h, "content-encoding"); enc != "" && !strings.EqualFold(enc, "identity") {
		r.encoded = true
	}
}

// body follows a chunk of the body; keep says whether anyone wants its
// usage (the request was routed), pool is where the tail's buffer comes from.
func (r *response) body(chunk []byte, keep bool, pool *sync.Pool) {
	r.seen = true
	if len(chunk) == 0 {
		return
	}
	r.firstByte = true
	if r.kind == bodyUnknown {
		r.kind = kindOf(chunk)
	}
	if r.kind == bodyJSON {
		if keep && !r.encoded && !r.ended && !r.read {
			r.scan.write(chunk, pool)
		}
		return
	}
	r.events += bytes.Count(chunk, dataPrefix)
	if !keep || r.encoded || r.ended || r.read || r.kind == bodyUnknown {
		return
	}
	if r.tail.buf == nil {
		r.tail.buf = pool.Get().(*[usageTailBytes]byte)
	}
	r.tail.write(chunk)
}

var dataPrefix = []byte("data:")

// usage is the response's token usage, read from what has arrived of its
// body: at its end, or, when the stream ended before the response did (a
// client closing at "data: [DONE]"), from what came.
func (r *response) usage() (usage, bool) {
	switch {
	case r.read:
	case r.kind == bodyJSON:
		r.read = true
		r.u, r.ok = r.scan.u, r.scan.ok
	case r.tail.buf != nil:
		r.read = true
		r.u, r.ok = parseUsage(r.tail.bytes())
	}
	return r.u, r.ok
}

// outputTokens is the response's output tokens: its usage's, else its SSE
// events less the final [DONE], else 0 (unknown).
func (r *response) outputTokens() int {
	if u, ok := r.usage(); ok && u.completionTokens > 0 {
		return u.completionTokens
	}
	return max(r.events-1, 0)
}

// close gives the tail's or the scanner's buffer back to pool.
func (r *response) close(pool *sync.Pool) {
	if r.tail.buf != nil {
		pool.Put(r.tail.buf)
		r.tail.buf = nil
	}
	r.scan.close(pool)
}

// usage is a response's token counts.
type usage struct {
	promptTokens, completionTokens int
	cachedTokens                   int
	// hasCached: the server reported prompt token details (cached tokens,
	// possibly zero).
	hasCached bool
}

// wireUsage is `usage` in the Completions and Chat Completions APIs
// (prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens) and
// in the Responses API (input_tokens, output_tokens,
// input_tokens_details.cached_tokens).
type wireUsage struct {
	PromptTokens        int           `json:"prompt_tokens"`
	CompletionTokens    int           `json:"completion_tokens"`
	InputTokens         int           `json:"input_tokens"`
	OutputTokens        int           `json:"output_tokens"`
	PromptTokensDetails *tokenDetails `json:"prompt_tokens_details"`
	InputTokensDetails  *tokenDetails `json:"input_tokens_details"`
}

type tokenDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

var usageKey = []byte(`"usage"`)

// parseUsage reads the last `"usage": {...}` in tail: in a stream, the last
// event that carries one holds the final counts (earlier ones, if any, are
// null or running totals). A last usage that is null, cut off or malformed
// gives nothing. It never looks at more than the tail, and decodes only the
// usage object.
//
// A raw `"usage"` followed by a colon can only be a key: inside a JSON string
// every quote is escaped, so the bytes `"usage"` there end with a backslash
// before the closing quote, or are a string value (followed by `,`, `}` or
// `]`, never by a colon).
func parseUsage(tail []byte) (usage, bool) {
	for end := len(tail); ; {
		i := bytes.LastIndex(tail[:end], usageKey)
		if i < 0 {
			return usage{}, false
		}
		end = i
		if i > 0 && tail[i-1] == '\\' {
			continue
		}
		rest := bytes.TrimLeft(tail[i+len(usageKey):], " \t\r\n")
		if len(rest) == 0 || rest[0] != ':' {
			continue
		}
		rest = bytes.TrimLeft(rest[1:], " \t\r\n")
		if len(rest) == 0 || rest[0] != '{' {
			return usage{}, false // null: the response says it has none
		}
		// What a json.Decoder would read (the object, not what follows it),
		// without the Decoder's buffer and copies.
		end := objectEnd(rest)
		var w wireUsage
		if end < 0 || json.Unmarshal(rest[:end], &w) != nil {
			return usage{}, false
		}
		return w.usage(), true
	}
}

// usage is what w says, whichever API's names it used.
func (w *wireUsage) usage() usage {
	u := usage{promptTokens: max(w.PromptTokens, w.InputTokens), completionTokens: max(w.CompletionTokens, w.OutputTokens)}
	for _, d := range []*tokenDetails{w.PromptTokensDetails, w.InputTokensDetails} {
		if d != nil {
			u.cachedTokens, u.hasCached = max(u.cachedTokens, d.CachedTokens), true
		}
	}
	return u
}

// objectEnd returns the length of the JSON object at the start of b (which
// starts with '{'), found by matching brackets outside strings, or -1 if it
// does not end in b. It does not validate: json.Unmarshal does.
func objectEnd(b []byte) int {
	depth, inString := 0, false
	for i := 0; i < len(b); i++ {
		c := b[i]
		switch {
		case inString:
			switch c {
			case '\\':
				i++
			case '"':
				inString = false
			}
		case c == '"':
			inString = true
		case c == '{' || c == '[':
			depth++
		case c == '}' || c == ']':
			if depth--; depth == 0 {
				return i + 1
			}
		}
	}
	return -1
}
