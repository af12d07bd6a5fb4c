package request

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// fuzzPaths are the paths FuzzParse sends bodies to, by its kind argument.
var fuzzPaths = [...]string{completionsPath, chatPath, responsesPath, embeddingsPath}

// FuzzParse checks Parse against a reference built on encoding/json: the
// reference decodes the body into a tree (keeping duplicate keys and each
// value's raw text) and applies the rules of the package documentation to
// it. Parse must agree on whether the body is acceptable and, if it is, on
// every field and on Prompt. In particular a body encoding/json rejects must
// be rejected, and Parse must never panic.
func FuzzParse(f *testing.F) {
	for _, seed := range []struct {
		kind byte // an index into fuzzPaths
		body string
	}{
		{0, `{"model":"m","prompt":"Hello\n\u00e9\ud83d\ude00","stream":true,"max_tokens":16}`},
		{0, `{"model":"m","prompt":["a","b"],"max_completion_tokens":3,"max_tokens":9}`},
		{0, `{"model":"m","prompt":[[1,2],[3]]}`},
		{1, `{"messages":[{"content":[{"text":"hi","type":"text"},{"type":"image_url","image_url":{"url":"u"}}],"role":"user"}],"model":"m","tools":[{"type":"function"}]}`},
		{1, `{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","tool_call_id":"1","name":"f","content":"\u0000"}]}`},
		{1, `{"model":"m","messages":[{"role":"user","content":"x"}],"model":"n"}`},
		{2, `{"model":"m","instructions":"S","input":[{"role":"user","content":[{"type":"input_text","text":"Q"}]},{"type":"function_call","call_id":"c"}],"tools":[],"cache_salt":"s"}`},
		{3, `{"model":"m","input":[[1,2.0],[3e0]],"cache_salt":null}`},
	} {
		f.Add(seed.kind, []byte(seed.body))
	}
	// Runs longer than shortRun, ended by each kind of special byte.
	long := strings.Repeat("plain words ", 3*shortRun/12)
	for _, end := range []string{`\n`, `\"`, `\u00e9`, "\x01", `"`} {
		f.Add(byte(0), []byte(`{"model":"m","prompt":"`+long+end+long[:shortRun+5]+`\\`+long+`"}`))
		f.Add(byte(1), []byte(`{"model":"m","messages":[{"role":"user","content":"`+long+end+`"},{"role":"user","content":"x"}]}`))
	}
	f.Fuzz(func(t *testing.T, kind byte, body []byte) {
		path := fuzzPaths[int(kind)%len(fuzzPaths)]
		k := kindOf(path)
		orig := bytes.Clone(body)
		got, err := Parse(path, body, nil)
		if !bytes.Equal(body, orig) {
			t.Fatalf("Parse modified the body")
		}
		want, wantErr := reference(k, body)

		if err != nil {
			var perr *Error
			if !errors.As(err, &perr) || perr.Message == "" {
				t.Fatalf("Parse error %T %q is not a *Error with a message", err, err)
			}
			if wantErr == nil {
				t.Fatalf("Parse(%s, %q) failed: %v\nbut the reference accepts it: %+v", path, body, err, want)
			}
			return
		}
		if !json.Valid(body) {
			t.Fatalf("Parse accepted %q, which encoding/json rejects", body)
		}
		if wantErr != nil {
			t.Fatalf("Parse(%s, %q) = %+v\nbut the reference rejects it: %v", path, body, got, wantErr)
		}
		valid := utf8.Valid(body)
		for _, str := range []struct{ name, got, want string }{{"model", got.Model, want.Model}, {"cache_salt", got.CacheSalt, want.CacheSalt}} {
			if decoded := str.got; !valid {
				// encoding/json decodes each invalid byte as U+FFFD; Parse keeps it.
				if decoded = replaceInvalid(decoded); decoded != str.want {
					t.Fatalf("%s %q (as decoded: %q), want %q", str.name, str.got, decoded, str.want)
				}
			} else if decoded != str.want {
				t.Fatalf("%s %q, want %q", str.name, decoded, str.want)
			}
		}
		// The model's span holds exactly its JSON string, and a rewrite of
		// just those bytes changes the model and nothing else.
		var span string
		if err := json.Unmarshal(body[got.ModelStart:got.ModelEnd], &span); err != nil || (valid && span != got.Model) {
			t.Fatalf("body[%d:%d] = %q (%v), want the model %q as a JSON string", got.ModelStart, got.ModelEnd, body[got.ModelStart:got.ModelEnd], err, got.Model)
		}
		rewritten := slices.Concat(body[:got.ModelStart], []byte(`"rewritten\u00e9"`), body[got.ModelEnd:])
		again, err := Parse(path, rewritten, nil)
		if err != nil || again.Model != "rewritten\u00e9" || !bytes.Equal(again.Prompt, got.Prompt) ||
			again.Stream != got.Stream || again.MaxTokens != got.MaxTokens || again.CacheSalt != got.CacheSalt {
			t.Fatalf("with the model's span rewritten: %+v, %v; want model %q and the rest as %+v", again, err, "rewritten\u00e9", got)
		}
		if got.Kind != k || got.Stream != want.Stream || got.MaxTokens != want.MaxTokens {
			t.Fatalf("kind %v stream %v max %d, want %v %v %d", got.Kind, got.Stream, got.MaxTokens, k, want.Stream, want.MaxTokens)
		}
		switch {
		case valid:
			if !bytes.Equal(got.Prompt, want.Prompt) {
				t.Fatalf("prompt\n %q\nwant\n %q", got.Prompt, want.Prompt)
			}
		case k == KindCompletions || k == KindEmbeddings && hasInput(body):
			// Prompt strings are joined by "\n", so decoding invalid
			// bytes one by one gives the same text either way.
			if g, w := replaceInvalid(string(got.Prompt)), replaceInvalid(string(want.Prompt)); g != w {
				t.Fatalf("prompt (as decoded)\n %q\nwant\n %q", g, w)
			}
			// With invalid UTF-8, chat and Responses Prompts are not
			// compared: raw bytes of adjacent parts may join into valid
			// characters that encoding/json, decoding each part alone,
			// replaced.
		}
	})
}

// hasInput reports whether the top-level object of a valid body has an
// "input": an embeddings Prompt is then text, else chat messages.
func hasInput(body []byte) bool {
	var top map[string]json.RawMessage
	_ = json.Unmarshal(body, &top)
	_, ok := top["input"]
	return ok
}

// replaceInvalid replaces each byte that is not part of valid UTF-8 with
// U+FFFD, as encoding/json does when it decodes a string.
func replaceInvalid(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b.WriteRune(utf8.RuneError)
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// node is one JSON value decoded by encoding/json, with its raw text.
type node struct {
	kind   byte // '{', '[', '"' (string), '0' (number), 'b' (bool), 'n' (null)
	str    string
	num    json.Number
	b      bool
	elems  []node
	fields []member // in body order, duplicates kept
	raw    []byte
}

type member struct {
	key   string
	value node
}

func (n node) get(key string) (node, int) {
	var v node
	count := 0
	for _, m := range n.fields {
		if m.key == key {
			v = m.value
			count++
		}
	}
	return v, count
}

func (n node) depth() int {
	d := 0
	for _, e := range n.elems {
		d = max(d, e.depth())
	}
	for _, m := range n.fields {
		d = max(d, m.value.depth())
	}
	if n.kind == '{' || n.kind == '[' {
		d++
	}
	return d
}

// decodeTree reads one value with encoding/json's token API.
func decodeTree(dec *json.Decoder, body []byte) (node, error) {
	start := dec.InputOffset()
	tok, err := dec.Token()
	if err != nil {
		return node{}, err
	}
	var n node
	switch v := tok.(type) {
	case json.Delim:
		n.kind = byte(v)
		for dec.More() {
			if n.kind == '{' {
				k, err := dec.Token()
				if err != nil {
					return node{}, err
				}
				v, err := decodeTree(dec, body)
				if err != nil {
					return node{}, err
				}
				n.fields = append(n.fields, member{k.(string), v})
			} else {
				v, err := decodeTree(dec, body)
				if err != nil {
					return node{}, err
				}
				n.elems = append(n.elems, v)
			}
		}
		if _, err := dec.Token(); err != nil { // the closing delimiter
			return node{}, err
		}
	case string:
		n.kind, n.str = '"', v
	case json.Number:
		n.kind, n.num = '0', v
	case bool:
		n.kind, n.b = 'b', v
	case nil:
		n.kind = 'n'
	}
	// The offset before the value may precede the ',' or ':' that leads to it.
	n.raw = bytes.TrimLeft(body[start:dec.InputOffset()], " \t\r\n,:")
	return n, nil
}

// integer returns the value of a number whose value is an integer from 0 to
// limit, however it is written, as Python reads it: as a float.
func integer(n node, limit uint64) (uint64, bool) {
	if n.kind != '0' {
		return 0, false
	}
	f, err := strconv.ParseFloat(string(n.num), 64)
	if err != nil || f < 0 || f > float64(limit) || f != math.Trunc(f) {
		return 0, false
	}
	return uint64(f), true
}

func withNULEscaped(s string) string { return strings.ReplaceAll(s, "\x00", "\x00\xff") }

// refReject is the reference's error.
type refReject string

func (r refReject) Error() string { return string(r) }

// reference is Parse written the slow, obvious way: every occurrence of a
// field it reads is checked, and the last one counts.
func reference(kind Kind, body []byte) (Parsed, error) {
	var p Parsed
	if !json.Valid(body) {
		return p, refReject("invalid JSON")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	top, err := decodeTree(dec, body)
	if err != nil {
		return p, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return p, refReject("trailing data")
	}
	if top.depth() > maxDepth {
		return p, refReject("too deep")
	}
	if top.kind != '{' {
		return p, refReject("not an object")
	}
	read := map[Kind][]string{
		KindCompletions: {"model", "cache_salt", "stream", "max_tokens", "max_completion_tokens", "prompt"},
		KindChat:        {"model", "cache_salt", "stream", "max_tokens", "max_completion_tokens", "messages", "tools"},
		KindResponses:   {"model", "cache_salt", "stream", "max_output_tokens", "previous_response_id", "tools", "instructions", "input"},
		KindEmbeddings:  {"model", "cache_salt", "input", "messages"},
	}[kind]
	// The Prompt's parts, in the order the package documentation gives.
	order := map[Kind][]string{
		KindCompletions: {"prompt"},
		KindChat:        {"tools", "messages"},
		KindResponses:   {"previous_response_id", "tools", "instructions", "input"},
		KindEmbeddings:  {"input", "messages"},
	}[kind]
	parts := map[string][]byte{}
	maxTokens, maxCompletionTokens := 0, -1
	for _, m := range top.fields {
		if !slices.Contains(read, m.key) {
			continue
		}
		v := m.value
		switch m.key {
		case "model":
			if v.kind != '"' {
				return p, refReject("bad model")
			}
			p.Model = v.str
		case "cache_salt":
			switch v.kind {
			case '"':
				p.CacheSalt = v.str
			case 'n':
				p.CacheSalt = ""
			default:
				return p, refReject("bad cache_salt")
			}
		case "stream":
			// As pydantic reads a bool in its lax mode; else false.
			switch v.kind {
			case 'b':
				p.Stream = v.b
			case '"':
				t := strings.ToLower(strings.TrimSpace(v.str))
				p.Stream = t == "true" || t == "t" || t == "yes" || t == "y" || t == "on" || t == "1"
			case '0':
				f, err := strconv.ParseFloat(string(v.num), 64)
				p.Stream = err == nil && f == 1
			default:
				p.Stream = false
			}
		case "max_tokens", "max_output_tokens", "max_completion_tokens":
			// An integer from 0 to the limit, as a number or a string of
			// digits; anything else is no budget.
			n := -1
			if m.key != "max_completion_tokens" {
				n = 0
			}
			switch v.kind {
			case '0':
				if id, ok := integer(v, math.MaxInt32); ok {
					n = int(id)
				}
			case '"':
				if id, err := strconv.ParseUint(strings.TrimSpace(v.str), 10, 32); err == nil && id <= math.MaxInt32 {
					n = int(id)
				}
			}
			if m.key == "max_completion_tokens" {
				maxCompletionTokens = n
			} else {
				maxTokens = n
			}
		default:
			part, err := refPromptPart(kind, m.key, v)
			if err != nil {
				return p, err
			}
			parts[m.key] = part
		}
	}
	if _, n := top.get("model"); n == 0 {
		return p, refReject("no model")
	}
	required := map[Kind]string{KindCompletions: "prompt", KindChat: "messages"}[kind]
	if _, n := top.get(required); required != "" && n == 0 {
		return p, refReject("no " + required)
	}
	if kind == KindEmbeddings {
		_, inputs := top.get("input")
		_, messages := top.get("messages")
		switch {
		case inputs == 0 && messages == 0:
			return p, refReject("no input or messages")
		case inputs > 0:
			delete(parts, "messages") // input wins
		}
	}
	p.MaxTokens = maxTokens
	if maxCompletionTokens >= 0 {
		p.MaxTokens = maxCompletionTokens
	}
	for _, k := range order {
		p.Prompt = append(p.Prompt, parts[k]...)
	}
	return p, nil
}

// refPromptPart is what one top-level field adds to the Prompt.
func refPromptPart(kind Kind, key string, v node) ([]byte, error) {
	switch {
	case key == "prompt" || key == "input" && kind == KindEmbeddings:
		return refTextOrTokens(v)
	case key == "tools":
		switch v.kind {
		case '[':
			return append([]byte("\x00T"), v.raw...), nil
		case 'n':
			return nil, nil
		}
		return nil, refReject("bad tools")
	case key == "messages":
		if v.kind != '[' {
			return nil, refReject("bad messages")
		}
		var out []byte
		for _, m := range v.elems {
			msg, err := refChatMessage(m)
			if err != nil {
				return nil, err
			}
			out = append(out, msg...)
		}
		return out, nil
	case key == "previous_response_id" || key == "instructions":
		switch v.kind {
		case 'n':
			return nil, nil
		case '"':
			if key == "instructions" {
				return []byte("\x00Rsystem\x00C" + withNULEscaped(v.str) + "\x00E"), nil
			}
			return []byte("\x00Q" + withNULEscaped(v.str)), nil
		}
		return nil, refReject("bad " + key)
	case key == "input": // Responses
		switch v.kind {
		case 'n':
			return nil, nil
		case '"':
			return []byte("\x00Ruser\x00C" + withNULEscaped(v.str) + "\x00E"), nil
		case '[':
		default:
			return nil, refReject("bad input")
		}
		var out []byte
		for _, it := range v.elems {
			item, err := refResponsesItem(it)
			if err != nil {
				return nil, err
			}
			out = append(out, item...)
		}
		return out, nil
	}
	return nil, refReject("unexpected field " + key)
}

// refTextOrTokens reads a completions "prompt" or an embeddings "input".
func refTextOrTokens(prompt node) ([]byte, error) {
	var out []byte
	token := func(n node) bool {
		id, ok := integer(n, math.MaxUint32)
		out = append(out, byte(id), byte(id>>8), byte(id>>16), byte(id>>24))
		return ok
	}
	switch {
	case prompt.kind == '"':
		return []byte(prompt.str), nil
	case prompt.kind != '[':
		return nil, refReject("bad prompt")
	case len(prompt.elems) == 0:
	case prompt.elems[0].kind == '"':
		var texts []string
		for _, e := range prompt.elems {
			if e.kind != '"' {
				return nil, refReject("mixed prompt")
			}
			texts = append(texts, e.str)
		}
		return []byte(strings.Join(texts, "\n")), nil
	case prompt.elems[0].kind == '0':
		for _, e := range prompt.elems {
			if !token(e) {
				return nil, refReject("bad token")
			}
		}
	case prompt.elems[0].kind == '[':
		for _, e := range prompt.elems {
			if e.kind != '[' {
				return nil, refReject("mixed prompt")
			}
			for _, id := range e.elems {
				if !token(id) {
					return nil, refReject("bad token")
				}
			}
		}
	default:
		return nil, refReject("bad prompt")
	}
	return out, nil
}

// refChatMessage is one element of a chat "messages" array.
func refChatMessage(m node) ([]byte, error) {
	if m.kind != '{' {
		return nil, refReject("message not an object")
	}
	fields := map[string][]byte{}
	hasRole := false
	for _, f := range m.fields {
		v := f.value
		switch f.key {
		case "role":
			if v.kind != '"' {
				return nil, refReject("bad role")
			}
			hasRole = true
			fields[f.key] = []byte("\x00R" + withNULEscaped(v.str))
		case "content":
			c, err := refContent(v, false)
			if err != nil {
				return nil, err
			}
			fields[f.key] = c
		case "tool_calls":
			switch v.kind {
			case '[':
				fields[f.key] = append([]byte("\x00F"), v.raw...)
			case 'n':
				fields[f.key] = nil
			default:
				return nil, refReject("bad tool_calls")
			}
		case "tool_call_id", "name":
			mark := map[string]string{"tool_call_id": "\x00I", "name": "\x00N"}[f.key]
			switch v.kind {
			case '"':
				fields[f.key] = []byte(mark + withNULEscaped(v.str))
			case 'n':
				fields[f.key] = nil
			default:
				return nil, refReject("bad " + f.key)
			}
		}
	}
	if !hasRole {
		return nil, refReject("no role")
	}
	var out []byte
	for _, k := range []string{"role", "content", "tool_calls", "tool_call_id", "name"} {
		out = append(out, fields[k]...)
	}
	return append(out, "\x00E"...), nil
}

// refContent is a message's content: nothing for null, else "\x00C" and the
// text or parts.
func refContent(content node, responses bool) ([]byte, error) {
	switch content.kind {
	case 'n':
		return nil, nil
	case '"':
		return []byte("\x00C" + withNULEscaped(content.str)), nil
	case '[':
	default:
		return nil, refReject("bad content")
	}
	out := []byte("\x00C")
	for _, part := range content.elems {
		if part.kind != '{' {
			return nil, refReject("part not an object")
		}
		typ, _ := part.get("type")
		text, _ := part.get("text")
		isText := typ.kind == '"' && typ.str == "text"
		if responses {
			isText = typ.kind == '"' && (typ.str == "input_text" || typ.str == "output_text")
		}
		if isText {
			if text.kind != '"' {
				return nil, refReject("text part without text")
			}
			out = append(out, withNULEscaped(text.str)...)
		} else {
			out = append(append(out, "\x00P"...), part.raw...)
		}
	}
	return out, nil
}

// refResponsesItem is one element of a Responses "input" array.
func refResponsesItem(it node) ([]byte, error) {
	if it.kind != '{' {
		return nil, refReject("item not an object")
	}
	message, hasRole := true, false
	var role, content []byte
	for _, f := range it.fields {
		v := f.value
		switch f.key {
		case "type":
			if v.kind != '"' {
				return nil, refReject("bad type")
			}
			message = v.str == "message"
		case "role":
			if v.kind != '"' {
				return nil, refReject("bad role")
			}
			hasRole = true
			role = []byte("\x00R" + withNULEscaped(v.str))
		case "content":
			c, err := refContent(v, true)
			if err != nil {
				return nil, err
			}
			content = c
		}
	}
	if !message || !hasRole {
		return append([]byte("\x00X"), it.raw...), nil
	}
	return append(append(role, content...), "\x00E"...), nil
}

// TestReferenceRawText checks the one delicate part of the reference: that
// the raw text it keeps for a value is exactly that value's bytes.
func TestReferenceRawText(t *testing.T) {
	body := []byte(` { "a" : [ 1 , { "b" : "c" } ] , "d":"\u00e9" ,"e" :-1.5e3}`)
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	top, err := decodeTree(dec, body)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := top.get("a")
	d, _ := top.get("d")
	e, _ := top.get("e")
	for _, c := range []struct{ got, want string }{
		{string(top.raw), strings.TrimSpace(string(body))},
		{string(a.raw), `[ 1 , { "b" : "c" } ]`},
		{string(a.elems[0].raw), `1`},
		{string(a.elems[1].raw), `{ "b" : "c" }`},
		{string(d.raw), `"\u00e9"`},
		{string(e.raw), `-1.5e3`},
	} {
		if c.got != c.want {
			t.Errorf("raw %q, want %q", c.got, c.want)
		}
	}
}

// FuzzParseOther checks what Parse reads of a body sent to another path
// against encoding/json: the last top-level "model" of one valid JSON
// object, where it is a non-empty string, and its span; otherwise no
// model. It never fails and reads no prompt.
func FuzzParseOther(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","prompt":"x"}`, `{"a":{"model":"n"},"model":"m\u00e9"}`, `{"model":"a","model":1}`,
		`{"model":""}`, `{"model":"m"} {}`, `not json`, `["model"]`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		got, err := Parse("/tokenize", body, nil)
		if err != nil || got.Kind != KindOther || len(got.Prompt) != 0 {
			t.Fatalf("Parse(/tokenize, %q) = %+v, %v; want KindOther, no prompt, no error", body, got, err)
		}
		want := ""
		if json.Valid(body) {
			dec := json.NewDecoder(bytes.NewReader(body))
			dec.UseNumber()
			if top, err := decodeTree(dec, body); err == nil && top.kind == '{' && top.depth() <= maxDepth {
				if m, n := top.get("model"); n > 0 && m.kind == '"' {
					want = m.str
				}
			}
		}
		model := got.Model
		if !utf8.Valid(body) {
			model = replaceInvalid(model) // encoding/json decodes each invalid byte as U+FFFD
		}
		if model != want {
			t.Fatalf("Parse(/tokenize, %q): model %q, want %q", body, got.Model, want)
		}
		if got.Model == "" {
			if got.ModelStart != 0 || got.ModelEnd != 0 {
				t.Fatalf("no model, but a span %d:%d", got.ModelStart, got.ModelEnd)
			}
			return
		}
		var span string
		if err := json.Unmarshal(body[got.ModelStart:got.ModelEnd], &span); err != nil || span != want {
			t.Fatalf("body[%d:%d] = %q (%v), want the model %q as a JSON string", got.ModelStart, got.ModelEnd, body[got.ModelStart:got.ModelEnd], err, want)
		}
	})
}
