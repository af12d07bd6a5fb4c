package extproc

import (
	"bytes"
	"encoding/json"
	"slices"
)

// usageTailBytes bounds what a stream keeps of its response body to read the
// token usage from: the last 4 KiB, whatever the response's size.
// OpenAI-compatible servers put `usage` at the end of a non-streamed body
// (vLLM follows it with a few short fields) and in the last data event of a
// stream, just before `data: [DONE]` (sent only when the client asked for
// stream_options.include_usage). A response whose usage lies further from
// its end goes uncounted rather than buffered.
const usageTailBytes = 4 << 10

// usageTail is a ring holding the last usageTailBytes of a response body.
// The zero value is empty; buf is set before the first write.
type usageTail struct {
	buf *[usageTailBytes]byte
	n   int // bytes written in all
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

// bytes returns the tail in order. It rotates the ring in place: call it
// once, after the last write.
func (t *usageTail) bytes() []byte {
	if t.n <= usageTailBytes {
		return t.buf[:t.n]
	}
	pos := t.n % usageTailBytes
	slices.Reverse(t.buf[:pos])
	slices.Reverse(t.buf[pos:])
	slices.Reverse(t.buf[:])
	return t.buf[:]
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
		u := usage{promptTokens: max(w.PromptTokens, w.InputTokens), completionTokens: max(w.CompletionTokens, w.OutputTokens)}
		for _, d := range []*tokenDetails{w.PromptTokensDetails, w.InputTokensDetails} {
			if d != nil {
				u.cachedTokens, u.hasCached = max(u.cachedTokens, d.CachedTokens), true
			}
		}
		return u, true
	}
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
