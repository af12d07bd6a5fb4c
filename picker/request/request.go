// Package request reads the parts of an OpenAI-compatible request body that
// the picker routes on: the model, whether the response streams, the token
// budget, and the prompt text that the prefix index hashes.
//
// The invariant not to break: Prompt is a deterministic function of the
// request, and two requests that begin with the same tools and messages (or
// the same prompt) produce Prompts that begin with the same bytes. The prefix
// index, and with it every cache-aware placement, relies on that. Any change
// to the format below changes which requests share prefixes and must be made
// on purpose.
//
// The body is read once, left to right, by a small purpose-built scanner that
// validates strict JSON (RFC 8259) as it goes; strings the picker needs are
// decoded straight into the caller's Prompt buffer, everything else is
// stepped over. Where the body's key order differs from the Prompt's (below),
// the bytes already in the buffer are moved with one memmove. It accepts
// what encoding/json accepts except for fields read twice (see Parse) and
// nesting deeper than 1,000 levels; invalid UTF-8 inside strings is kept as
// bytes rather than replaced.
//
// # Prompt format
//
// Completions (/v1/completions), by the shape of "prompt":
//   - a string: its text;
//   - an array of strings: their texts joined with "\n";
//   - an array of token ids: each id as 4 bytes, little-endian (so that
//     len(Prompt)/4 is the token count);
//   - an array of token-id arrays: all ids, in order, encoded likewise.
//
// Chat (/v1/chat/completions): markers are a NUL byte followed by one tag
// byte. A NUL inside any decoded text is written as "\x00\xff", and raw JSON
// text cannot contain NUL, so a marker can never be imitated by content.
//
//	Prompt    = [ "\x00T" tools ] { message }
//	message   = "\x00R" role [ "\x00C" content ] [ "\x00F" tool_calls ]
//	            [ "\x00I" tool_call_id ] [ "\x00N" name ] "\x00E"
//	content   = text | { text-part | "\x00P" other-part }
//
// tools, tool_calls and other-part are the raw JSON text of those values as
// they appear in the body (so that different images or tool sets differ);
// role, text, tool_call_id and name are decoded strings. A string content
// and the same text split over "text" parts give the same bytes. Tools come
// first and the fields of a message come in the order above whatever their
// order in the body, because that is how chat templates lay them out: the
// OpenAI Python client, for one, writes "tools" after "messages".
package request

import (
	"fmt"
	"math"
	"strings"
)

// Kind says which API a request path names.
type Kind int

const (
	// KindOther is any path other than the two below; its body is not read and
	// the request is routed by load alone.
	KindOther Kind = iota
	// KindCompletions is POST /v1/completions.
	KindCompletions
	// KindChat is POST /v1/chat/completions.
	KindChat
)

func (k Kind) String() string {
	switch k {
	case KindOther:
		return "other"
	case KindCompletions:
		return "completions"
	case KindChat:
		return "chat"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Parsed is what the picker needs from one request.
type Parsed struct {
	Kind   Kind
	Model  string
	Stream bool
	// MaxTokens is max_completion_tokens if present, else max_tokens, else 0.
	MaxTokens int
	// Prompt is the prefix text in the format of the package documentation,
	// appended to the dst buffer given to Parse.
	Prompt []byte
}

// Error is the only error type Parse returns. Message is safe to show to a
// client: it says what is wrong with the body and, for a bad field, which
// field and what it accepts.
type Error struct {
	Message string
}

func (e *Error) Error() string { return e.Message }

// maxTokenLimit is the largest max_tokens (or max_completion_tokens) accepted: far beyond any model's
// context window, and small enough that token arithmetic cannot overflow.
const maxTokenLimit = math.MaxInt32

// Parse reads an OpenAI-compatible request body sent to path (its query
// string is ignored). For "/v1/completions" and "/v1/chat/completions" the
// body must be a JSON object with a non-empty string "model" and,
// respectively, a "prompt" or a "messages" array; for any other path Parse
// returns Kind KindOther and no error without looking at the body.
//
// Prompt is appended to dst[:0], so a caller can reuse one buffer across
// requests; on error Prompt is still that (emptied) buffer. A field that Parse
// reads may appear only once: a body naming "model" twice could be routed for
// one model and served by another.
func Parse(path string, body []byte, dst []byte) (Parsed, error) {
	kind := kindOf(path)
	if kind == KindOther {
		return Parsed{Kind: KindOther, Prompt: dst[:0]}, nil
	}
	s := scanner{buf: body, dst: dst[:0]}
	p, err := s.request(kind)
	if err != nil {
		return Parsed{Kind: kind, Prompt: s.dst[:0]}, err
	}
	p.Kind, p.Prompt = kind, s.dst
	return p, nil
}

func kindOf(path string) Kind {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	switch path {
	case "/v1/completions":
		return KindCompletions
	case "/v1/chat/completions":
		return KindChat
	}
	return KindOther
}

// field names the object keys Parse reads, at any level.
type field uint8

const (
	fieldUnknown field = iota
	fieldModel
	fieldStream
	fieldMaxTokens
	fieldMaxCompletionTokens
	fieldPrompt
	fieldMessages
	fieldTools
	fieldRole
	fieldContent
	fieldToolCalls
	fieldToolCallID
	fieldName
	fieldType
	fieldText
)

func fieldOf(key []byte) field {
	switch string(key) {
	case "model":
		return fieldModel
	case "stream":
		return fieldStream
	case "max_tokens":
		return fieldMaxTokens
	case "max_completion_tokens":
		return fieldMaxCompletionTokens
	case "prompt":
		return fieldPrompt
	case "messages":
		return fieldMessages
	case "tools":
		return fieldTools
	case "role":
		return fieldRole
	case "content":
		return fieldContent
	case "tool_calls":
		return fieldToolCalls
	case "tool_call_id":
		return fieldToolCallID
	case "name":
		return fieldName
	case "type":
		return fieldType
	case "text":
		return fieldText
	}
	return fieldUnknown
}

// fieldSet records which fields of one object have been seen.
type fieldSet uint32

// add marks f as seen and reports whether it already was.
func (fs *fieldSet) add(f field) (dup bool) {
	bit := fieldSet(1) << f
	dup = *fs&bit != 0
	*fs |= bit
	return dup
}

func (fs fieldSet) has(f field) bool { return fs&(fieldSet(1)<<f) != 0 }

// request reads the top-level object.
func (s *scanner) request(kind Kind) (Parsed, error) {
	var p Parsed
	s.skipWS()
	switch s.peek() {
	case '{':
	case 0:
		if s.pos >= len(s.buf) {
			return p, &Error{Message: "request body is empty; a JSON object is required"}
		}
		fallthrough
	default:
		return p, s.typeError(0, "request body must be a JSON object")
	}
	var (
		seen                fieldSet
		maxTokens           int
		maxCompletionTokens = -1
		order               segments // chat: tools, then messages
	)
	if !s.open('}') {
		for more := true; more; {
			f, err := s.key()
			if err != nil {
				return p, err
			}
			switch {
			case f == fieldModel, f == fieldStream, f == fieldMaxTokens, f == fieldMaxCompletionTokens,
				f == fieldPrompt && kind == KindCompletions,
				(f == fieldMessages || f == fieldTools) && kind == KindChat:
				if seen.add(f) {
					return p, &Error{Message: fmt.Sprintf("request body has more than one %q field", f)}
				}
			default:
				f = fieldUnknown // not read on this path
			}
			switch f {
			case fieldModel:
				err = s.model(&p)
			case fieldStream:
				p.Stream, err = s.boolean("stream")
			case fieldMaxTokens:
				maxTokens, err = s.tokenLimit("max_tokens", 0)
			case fieldMaxCompletionTokens:
				maxCompletionTokens, err = s.tokenLimit("max_completion_tokens", -1)
			case fieldPrompt:
				err = s.prompt()
			case fieldMessages:
				start := len(s.dst)
				if err = s.messages(); err == nil {
					s.dst = order.place(s.dst, 1, start)
				}
			case fieldTools:
				start := len(s.dst)
				if err = s.tools(); err == nil {
					s.dst = order.place(s.dst, 0, start)
				}
			default:
				err = s.skipValue(1)
			}
			if err != nil {
				return p, err
			}
			if more, err = s.next('}'); err != nil {
				return p, err
			}
		}
	}
	s.skipWS()
	if s.pos < len(s.buf) {
		return p, s.syntaxError("nothing after the top-level object")
	}
	if !seen.has(fieldModel) {
		return p, &Error{Message: `request body has no "model" field`}
	}
	switch {
	case kind == KindCompletions && !seen.has(fieldPrompt):
		return p, &Error{Message: `request body has no "prompt" field`}
	case kind == KindChat && !seen.has(fieldMessages):
		return p, &Error{Message: `request body has no "messages" field`}
	}
	p.MaxTokens = maxTokens
	if maxCompletionTokens >= 0 {
		p.MaxTokens = maxCompletionTokens
	}
	return p, nil
}

// String returns the JSON key of a field, for error messages.
func (f field) String() string {
	switch f {
	case fieldModel:
		return "model"
	case fieldStream:
		return "stream"
	case fieldMaxTokens:
		return "max_tokens"
	case fieldMaxCompletionTokens:
		return "max_completion_tokens"
	case fieldPrompt:
		return "prompt"
	case fieldMessages:
		return "messages"
	case fieldTools:
		return "tools"
	case fieldRole:
		return "role"
	case fieldContent:
		return "content"
	case fieldToolCalls:
		return "tool_calls"
	case fieldToolCallID:
		return "tool_call_id"
	case fieldName:
		return "name"
	case fieldType:
		return "type"
	case fieldText:
		return "text"
	}
	return "?"
}

func (s *scanner) model(p *Parsed) error {
	if s.peek() != '"' {
		return s.typeError(1, `"model" must be a string`)
	}
	// Decoded into scratch space past the end of dst: the one allocation is
	// the string itself.
	mark := len(s.dst)
	err := s.appendString(false)
	p.Model = string(s.dst[mark:])
	s.dst = s.dst[:mark]
	if err != nil {
		return err
	}
	if p.Model == "" {
		return &Error{Message: `"model" must not be empty`}
	}
	return nil
}

// boolean reads true, false or null (false).
func (s *scanner) boolean(key string) (bool, error) {
	switch s.peek() {
	case 't':
		return true, s.literal("true")
	case 'f':
		return false, s.literal("false")
	case 'n':
		return false, s.literal("null")
	}
	return false, s.typeError(1, "%q must be true, false or null", key)
}

// tokenLimit reads a token budget: an integer from 0 to maxTokenLimit, or
// null (ifNull).
func (s *scanner) tokenLimit(key string, ifNull int) (int, error) {
	switch c := s.peek(); {
	case c == 'n':
		return ifNull, s.literal("null")
	case c == '-' || c >= '0' && c <= '9':
		v, ok, err := s.unsigned(maxTokenLimit)
		if err != nil {
			return 0, err
		}
		if ok {
			return int(v), nil
		}
	default:
		if err := s.skipValue(1); err != nil {
			return 0, err
		}
	}
	return 0, &Error{Message: fmt.Sprintf("%q must be an integer from 0 to %d, or null", key, maxTokenLimit)}
}

// segments keeps the fields of one object in a fixed order in dst although
// the body may list them in any order. Each field is appended at the end of
// dst as it is read; place then moves it in front of any field of a later
// rank that is already there. Moving is a memmove of bytes already in dst,
// needed only when the body's order differs from the Prompt's.
type segments struct {
	start [8]int // by rank: where the field begins in dst
	seen  uint8  // by rank
}

// place records that dst[start:] holds the field of the given rank.
func (g *segments) place(dst []byte, rank, start int) []byte {
	at := start
	for r := rank + 1; r < len(g.start); r++ {
		if g.seen&(1<<r) != 0 && g.start[r] < at {
			at = g.start[r]
		}
	}
	if at < start {
		n := len(dst) - start
		dst = rotate(dst, at, start)
		for r := rank + 1; r < len(g.start); r++ {
			if g.seen&(1<<r) != 0 {
				g.start[r] += n
			}
		}
	}
	g.start[rank] = at
	g.seen |= 1 << rank
	return dst
}

// rotate turns buf[at:from] buf[from:] into buf[from:] buf[at:from]. The tail
// is saved in buf's spare capacity (growing it if needed, which is Prompt
// growth a reused buffer pays once), not in a separate allocation.
func rotate(buf []byte, at, from int) []byte {
	end := len(buf)
	n := end - from
	buf = append(buf, buf[from:end]...)
	copy(buf[at+n:end], buf[at:from])
	copy(buf[at:at+n], buf[end:])
	return buf[:end]
}
