// Package request reads the parts of an OpenAI-compatible request body that
// the picker routes on: the model, the cache salt, whether the response
// streams, the token budget, and the prompt text that the prefix index
// hashes.
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
// what encoding/json accepts except nesting deeper than 1,000 levels; a key
// given twice is read each time and the last one wins, as encoding/json and
// Python's json module do; invalid UTF-8 inside strings is kept as bytes
// rather than replaced.
//
// # Paths
//
// A path is matched by its suffix, its query string and one trailing slash
// cut, as the upstream picker matches it: "/completions",
// "/chat/completions", "/responses" and "/embeddings", under any prefix
// ("/v1/completions", "/openai/v1/completions", Azure's
// "/openai/deployments/d/chat/completions", Vertex AI's
// "/v1/projects/p/locations/l/endpoints/openapi/chat/completions"). Any
// other path is KindOther: of its body only a top-level "model" string is
// read, for model rewrites and placement; it has no prompt.
//
// # Prompt format
//
// Completions (/v1/completions, "prompt") and embeddings (/v1/embeddings,
// "input"; vLLM also takes chat-style "messages" there, read as chat below,
// and "input" wins over them), by the shape of the value:
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
//
// Responses (/v1/responses), with the chat markers, laid out the way a
// server renders the request into its chat template:
//
//	Prompt    = [ "\x00Q" previous_response_id ] [ "\x00T" tools ]
//	            [ "\x00Rsystem\x00C" instructions "\x00E" ] input
//	input     = "\x00Ruser\x00C" text "\x00E" | { item }
//	item      = "\x00R" role [ "\x00C" content ] "\x00E" | "\x00X" other-item
//
// A string input is a user message and the instructions a system message,
// so a Responses request and the same conversation sent to chat completions
// share their Prompt bytes. An item with a "role" whose "type" is absent or
// "message" is a message; its text parts are those of type "input_text" or
// "output_text". Any other item (function_call, function_call_output,
// reasoning, a reference to an earlier item by its "id" alone, ...) is its
// raw JSON text. previous_response_id comes first because a request that
// continues a stored response begins, on the server, with that response's
// whole conversation: only continuations of the same response share it.
package request

import (
	"bytes"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Kind says which API a request path names.
type Kind int

const (
	// KindOther is any path other than the ones below; of its body only a
	// top-level "model" is read, and the request is routed without a
	// prompt.
	KindOther Kind = iota
	// KindCompletions is POST /v1/completions.
	KindCompletions
	// KindChat is POST /v1/chat/completions.
	KindChat
	// KindResponses is POST /v1/responses (the OpenAI Responses API).
	KindResponses
	// KindEmbeddings is POST /v1/embeddings.
	KindEmbeddings
)

func (k Kind) String() string {
	switch k {
	case KindOther:
		return "other"
	case KindCompletions:
		return "completions"
	case KindChat:
		return "chat"
	case KindResponses:
		return "responses"
	case KindEmbeddings:
		return "embeddings"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Parsed is what the picker needs from one request.
type Parsed struct {
	Kind  Kind
	Model string
	// ModelStart and ModelEnd are where the "model" value (a JSON string,
	// its quotes included) is in the body: body[ModelStart:ModelEnd]. A
	// rewrite of the model replaces just those bytes.
	ModelStart, ModelEnd int
	Stream               bool
	// MaxTokens is max_completion_tokens if present, else max_tokens, else 0
	// (for the Responses API: max_output_tokens).
	MaxTokens int
	// CacheSalt is the request's "cache_salt" ("" when absent, null or
	// empty). vLLM never shares KV cache between requests whose salts differ,
	// so the picker seeds the prompt's block hashes with it. A salt costs one
	// allocation (the string); requests without one cost none.
	CacheSalt string
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

// Parse reads an OpenAI-compatible request body sent to path (see KindOf
// for the paths it reads; its query string is ignored). The body must be a
// JSON object with a string "model" (empty for the server's default) and,
// for completions, a "prompt", for chat a "messages" array, for embeddings
// an "input" (or "messages"); for any other path Parse returns Kind
// KindOther and no error, with the body's top-level "model" where it names
// one (and no prompt).
//
// Prompt is appended to dst[:0], so a caller can reuse one buffer across
// requests; on error Prompt is still that (emptied) buffer. A field that
// appears more than once must be valid each time, and the last one wins, as
// with encoding/json and with the Python servers behind the gateway
// (json.loads keeps the last value): the request is routed for the model
// the server will read.
func Parse(path string, body []byte, dst []byte) (Parsed, error) {
	return ParseKind(kindOf(path), body, dst)
}

// ParseKind is Parse for a body whose API is known (from its path, or
// KindOfBody). Of a KindOther body it reads only the model (otherModel),
// and never fails.
func ParseKind(kind Kind, body []byte, dst []byte) (Parsed, error) {
	s := scanner{buf: body, dst: dst[:0]}
	if kind == KindOther {
		p := s.otherModel()
		p.Kind, p.Prompt = KindOther, s.dst[:0]
		return p, nil
	}
	p, err := s.request(kind)
	if err != nil {
		return Parsed{Kind: kind, Prompt: s.dst[:0]}, err
	}
	p.Kind, p.Prompt = kind, s.dst
	return p, nil
}

// KindOfBody tells the API of a request whose path is not known (a gateway
// that sends no :path) from the shape of its body: the first top-level
// "messages" makes it chat, "prompt" completions, "input" the Responses API
// (whose input may also be an embeddings request's: see the stream). It
// reads the body up to that key. A JSON object with a "model" and none of
// them is an error that says so; one with neither is KindOther, routed on
// load alone.
func KindOfBody(body []byte) (Kind, error) {
	s := scanner{buf: body}
	if err := s.body(); err != nil {
		return KindOther, err
	}
	// Not s.members: the walk stops at the first key that tells.
	model := false
	if !s.open('}') {
		for more := true; more; {
			f, err := s.key()
			if err != nil {
				return KindOther, err
			}
			switch f {
			case fieldMessages:
				return KindChat, nil
			case fieldPrompt:
				return KindCompletions, nil
			case fieldInput:
				return KindResponses, nil
			case fieldModel:
				model = true
			}
			if err := s.skipValue(depthTop); err != nil {
				return KindOther, err
			}
			if more, err = s.next('}'); err != nil {
				return KindOther, err
			}
		}
	}
	if model {
		return KindOther, &Error{Message: `request body has none of "messages", "prompt" or "input", ` +
			`and no :path header says which API it is for`}
	}
	return KindOther, nil
}

// kindOf matches the path by its suffix, after the query string and one
// trailing slash are cut: the same APIs are served under any prefix (a
// version, a provider's deployment path, a gateway's route prefix).
func kindOf(path string) Kind {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	path = strings.TrimSuffix(path, "/")
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		return KindChat
	case strings.HasSuffix(path, "/completions"):
		return KindCompletions
	case strings.HasSuffix(path, "/responses"):
		return KindResponses
	case strings.HasSuffix(path, "/embeddings"):
		return KindEmbeddings
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
	fieldMaxOutputTokens
	fieldCacheSalt
	fieldPrompt
	fieldMessages
	fieldTools
	fieldInput
	fieldInstructions
	fieldPreviousResponseID
	fieldRole
	fieldContent
	fieldToolCalls
	fieldToolCallID
	fieldName
	fieldType
	fieldText
)

// fieldNames are the JSON keys of the fields, indexed by field.
var fieldNames = [...]string{
	fieldUnknown:             "?",
	fieldModel:               "model",
	fieldStream:              "stream",
	fieldMaxTokens:           "max_tokens",
	fieldMaxCompletionTokens: "max_completion_tokens",
	fieldMaxOutputTokens:     "max_output_tokens",
	fieldCacheSalt:           "cache_salt",
	fieldPrompt:              "prompt",
	fieldMessages:            "messages",
	fieldTools:               "tools",
	fieldInput:               "input",
	fieldInstructions:        "instructions",
	fieldPreviousResponseID:  "previous_response_id",
	fieldRole:                "role",
	fieldContent:             "content",
	fieldToolCalls:           "tool_calls",
	fieldToolCallID:          "tool_call_id",
	fieldName:                "name",
	fieldType:                "type",
	fieldText:                "text",
}

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
	case "max_output_tokens":
		return fieldMaxOutputTokens
	case "cache_salt":
		return fieldCacheSalt
	case "prompt":
		return fieldPrompt
	case "messages":
		return fieldMessages
	case "tools":
		return fieldTools
	case "input":
		return fieldInput
	case "instructions":
		return fieldInstructions
	case "previous_response_id":
		return fieldPreviousResponseID
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

func fields(fs ...field) fieldSet {
	var set fieldSet
	for _, f := range fs {
		set.add(f)
	}
	return set
}

func (fs *fieldSet) add(f field) { *fs |= fieldSet(1) << f }

func (fs fieldSet) has(f field) bool { return fs&(fieldSet(1)<<f) != 0 }

// topFields are the top-level fields Parse reads, by kind; any other key is
// stepped over. A lookup table, never written.
var topFields = [...]fieldSet{
	KindCompletions: fields(fieldModel, fieldCacheSalt, fieldStream, fieldMaxTokens, fieldMaxCompletionTokens, fieldPrompt),
	KindChat:        fields(fieldModel, fieldCacheSalt, fieldStream, fieldMaxTokens, fieldMaxCompletionTokens, fieldMessages, fieldTools),
	KindResponses: fields(fieldModel, fieldCacheSalt, fieldStream, fieldMaxOutputTokens,
		fieldPreviousResponseID, fieldTools, fieldInstructions, fieldInput),
	KindEmbeddings: fields(fieldModel, fieldCacheSalt, fieldInput, fieldMessages),
}

// promptRank returns the place a top-level field takes in Prompt (see the
// package documentation), or false for a field that adds nothing to it.
func promptRank(kind Kind, f field) (int, bool) {
	switch kind {
	case KindCompletions:
		return 0, f == fieldPrompt
	case KindEmbeddings:
		switch f {
		case fieldInput:
			return 0, true
		case fieldMessages:
			return 1, true
		}
	case KindChat:
		switch f {
		case fieldTools:
			return 0, true
		case fieldMessages:
			return 1, true
		}
	case KindResponses:
		switch f {
		case fieldPreviousResponseID:
			return 0, true
		case fieldTools:
			return 1, true
		case fieldInstructions:
			return 2, true
		case fieldInput:
			return 3, true
		}
	}
	return 0, false
}

// request reads the top-level object.
func (s *scanner) request(kind Kind) (Parsed, error) {
	var p Parsed
	if err := s.body(); err != nil {
		return p, err
	}
	var (
		seen                fieldSet
		maxTokens           int
		maxCompletionTokens = -1
		order               segments // the Prompt's parts, in rank order
	)
	read := topFields[kind]
	err := s.members(func(f field) (err error) {
		if !read.has(f) {
			f = fieldUnknown // not read on this path
		}
		seen.add(f)
		switch f {
		case fieldModel:
			return s.model(&p)
		case fieldCacheSalt:
			return s.cacheSalt(&p)
		case fieldStream:
			p.Stream, err = s.stream()
		case fieldMaxTokens, fieldMaxOutputTokens:
			maxTokens, err = s.tokenLimit(0)
		case fieldMaxCompletionTokens:
			maxCompletionTokens, err = s.tokenLimit(-1)
		case fieldUnknown:
			return s.skipValue(depthTop)
		default:
			rank, _ := promptRank(kind, f)
			// A repeated field replaces what the earlier one wrote.
			s.dst = order.remove(s.dst, rank)
			start := len(s.dst)
			if err = s.promptField(kind, f); err == nil {
				s.dst = order.place(s.dst, rank, start)
			}
		}
		return err
	})
	if err != nil {
		return p, err
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
	case kind == KindEmbeddings && !seen.has(fieldInput) && !seen.has(fieldMessages):
		return p, &Error{Message: `request body has no "input" (or "messages") field`}
	case kind == KindEmbeddings && seen.has(fieldInput):
		// vLLM reads a body with both as a completion-style request.
		s.dst = order.remove(s.dst, 1)
	}
	p.MaxTokens = maxTokens
	if maxCompletionTokens >= 0 {
		p.MaxTokens = maxCompletionTokens
	}
	return p, nil
}

// otherModel reads the top-level "model" string of a body sent to a path
// Parse does not read (vLLM's /tokenize, /v1/rerank, /v1/messages...): a
// model rewrite replaces it there too, and the request is placed for it.
// A body that is not one well-formed JSON object, or whose last "model" is
// not a non-empty string, names no model: the model server judges it, and
// the request is routed on load alone.
func (s *scanner) otherModel() Parsed {
	var p Parsed
	if s.body() != nil {
		return p
	}
	err := s.members(func(f field) error {
		if f != fieldModel {
			return s.skipValue(depthTop)
		}
		p = Parsed{}
		if s.peek() != '"' {
			return s.skipValue(depthTop)
		}
		return s.model(&p)
	})
	s.skipWS()
	if err != nil || s.pos < len(s.buf) || p.Model == "" {
		return Parsed{}
	}
	return p
}

// body checks that the body, at pos, begins with a JSON object.
func (s *scanner) body() error {
	s.skipWS()
	switch s.peek() {
	case '{':
		return nil
	case 0:
		if s.pos >= len(s.buf) {
			return &Error{Message: "request body is empty; a JSON object is required"}
		}
	}
	return s.typeError(0, "request body must be a JSON object")
}

// promptField reads a top-level field that adds to Prompt.
func (s *scanner) promptField(kind Kind, f field) error {
	switch f {
	case fieldPrompt:
		return s.prompt(f)
	case fieldMessages:
		return s.messages()
	case fieldTools:
		return s.tools()
	case fieldInstructions:
		return s.instructions()
	case fieldPreviousResponseID:
		return s.previousResponse()
	case fieldInput:
		if kind == KindEmbeddings {
			return s.prompt(f)
		}
		return s.responsesInput()
	}
	return s.skipValue(depthTop)
}

// String returns the JSON key of a field, for error messages.
func (f field) String() string {
	if int(f) < len(fieldNames) {
		return fieldNames[f]
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
	p.ModelStart = s.pos
	err := s.appendString(false)
	p.ModelEnd = s.pos
	p.Model = string(s.dst[mark:])
	s.dst = s.dst[:mark]
	// An empty model is the server's default (vLLM serves its base model
	// for it), and the upstream picker routes it.
	return err
}

// stream reads "stream": true, or what vLLM (pydantic, in its lax mode)
// also reads as true: a string such as "true", "yes" or "1", or the number
// 1. Anything else is false, never an error: the upstream picker routes a
// request whatever its "stream" holds, and the model server judges it.
func (s *scanner) stream() (bool, error) {
	switch c := s.peek(); {
	case c == 't':
		return true, s.literal("true")
	case c == '"':
		var on bool
		err := s.inspectString(func(v []byte) { on = laxTrue[strings.ToLower(string(bytes.TrimSpace(v)))] })
		return on, err
	case c == '-' || c >= '0' && c <= '9':
		start := s.pos
		if err := s.skipNumber(); err != nil {
			return false, err
		}
		f, err := strconv.ParseFloat(string(s.buf[start:s.pos]), 64)
		return err == nil && f == 1, nil
	}
	return false, s.skipValue(depthTop)
}

// laxTrue holds the strings pydantic reads as true (lowercased, trimmed).
var laxTrue = map[string]bool{"true": true, "t": true, "yes": true, "y": true, "on": true, "1": true}

// cacheSalt reads "cache_salt": a string or null.
func (s *scanner) cacheSalt(p *Parsed) error {
	switch s.peek() {
	case 'n':
		p.CacheSalt = ""
		return s.literal("null")
	case '"':
		mark := len(s.dst)
		err := s.appendString(false)
		if len(s.dst) > mark { // an empty salt allocates nothing
			p.CacheSalt = string(s.dst[mark:])
		} else {
			p.CacheSalt = ""
		}
		s.dst = s.dst[:mark]
		return err
	}
	return s.typeError(depthTop, `"cache_salt" must be a string or null`)
}

// tokenLimit reads a token budget: a number whose value is an integer from 0
// to maxTokenLimit (see integer), or a string of decimal digits that is one
// (vLLM's pydantic reads "100" as 100). Anything else, null included, is no
// budget (unset), never an error: the upstream picker routes a request
// whatever its budget holds, and the model server judges it.
func (s *scanner) tokenLimit(unset int) (int, error) {
	switch c := s.peek(); {
	case c == '-' || c >= '0' && c <= '9':
		v, ok, err := s.integer(maxTokenLimit)
		if err != nil || !ok {
			return unset, err
		}
		return int(v), nil
	case c == '"':
		limit := unset
		err := s.inspectString(func(v []byte) {
			if n, perr := strconv.ParseUint(string(bytes.TrimSpace(v)), 10, 32); perr == nil && n <= maxTokenLimit {
				limit = int(n)
			}
		})
		if err != nil {
			return unset, err
		}
		return limit, nil
	}
	return unset, s.skipValue(depthTop)
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

// remove takes the field of the given rank out of dst, if it is there, so
// that a repeated key replaces it: the last one wins. Fields lie in dst in
// rank order, so the field ends where the next one present begins.
func (g *segments) remove(dst []byte, rank int) []byte {
	if g.seen&(1<<rank) == 0 {
		return dst
	}
	start, end := g.start[rank], len(dst)
	for r := rank + 1; r < len(g.start); r++ {
		if g.seen&(1<<r) != 0 {
			end = min(end, g.start[r])
		}
	}
	n := end - start
	dst = append(dst[:start], dst[end:]...)
	for r := rank + 1; r < len(g.start); r++ {
		if g.seen&(1<<r) != 0 {
			g.start[r] -= n
		}
	}
	g.seen &^= 1 << rank
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
