package request

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzParse checks Parse against a reference built on encoding/json: the
// reference decodes the body into a tree (keeping duplicate keys and each
// value's raw text) and applies the rules of the package documentation to
// it. Parse must agree on whether the body is acceptable and, if it is, on
// every field and on Prompt. In particular a body encoding/json rejects must
// be rejected, and Parse must never panic.
func FuzzParse(f *testing.F) {
	for _, seed := range []struct {
		chat bool
		body string
	}{
		{false, `{"model":"m","prompt":"Hello\n\u00e9\ud83d\ude00","stream":true,"max_tokens":16}`},
		{false, `{"model":"m","prompt":["a","b"],"max_completion_tokens":3,"max_tokens":9}`},
		{false, `{"model":"m","prompt":[[1,2],[3]]}`},
		{true, `{"messages":[{"content":[{"text":"hi","type":"text"},{"type":"image_url","image_url":{"url":"u"}}],"role":"user"}],"model":"m","tools":[{"type":"function"}]}`},
		{true, `{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","tool_call_id":"1","name":"f","content":"\u0000"}]}`},
		{true, `{"model":"m","messages":[{"role":"user","content":"x"}],"model":"n"}`},
	} {
		f.Add(seed.chat, []byte(seed.body))
	}
	f.Fuzz(func(t *testing.T, chat bool, body []byte) {
		path := completionsPath
		if chat {
			path = chatPath
		}
		orig := bytes.Clone(body)
		got, err := Parse(path, body, nil)
		if !bytes.Equal(body, orig) {
			t.Fatalf("Parse modified the body")
		}
		want, wantErr := reference(chat, body)

		if err != nil {
			var perr *Error
			if !errors.As(err, &perr) || perr.Message == "" {
				t.Fatalf("Parse error %T %q is not a *Error with a message", err, err)
			}
			if wantErr == nil {
				t.Fatalf("Parse(%q) failed: %v\nbut the reference accepts it: %+v", body, err, want)
			}
			return
		}
		if !json.Valid(body) {
			t.Fatalf("Parse accepted %q, which encoding/json rejects", body)
		}
		if wantErr != nil {
			t.Fatalf("Parse(%q) = %+v\nbut the reference rejects it: %v", body, got, wantErr)
		}
		valid := utf8.Valid(body)
		if model := got.Model; !valid {
			// encoding/json decodes each invalid byte as U+FFFD; Parse keeps it.
			if model = replaceInvalid(model); model != want.Model {
				t.Fatalf("model %q (as decoded: %q), want %q", got.Model, model, want.Model)
			}
		} else if model != want.Model {
			t.Fatalf("model %q, want %q", model, want.Model)
		}
		if got.Stream != want.Stream || got.MaxTokens != want.MaxTokens {
			t.Fatalf("stream %v max %d, want %v %d", got.Stream, got.MaxTokens, want.Stream, want.MaxTokens)
		}
		switch {
		case valid:
			if !bytes.Equal(got.Prompt, want.Prompt) {
				t.Fatalf("prompt\n %q\nwant\n %q", got.Prompt, want.Prompt)
			}
		case !chat:
			// Completions strings are joined by "\n", so decoding invalid
			// bytes one by one gives the same text either way.
			if g, w := replaceInvalid(string(got.Prompt)), replaceInvalid(string(want.Prompt)); g != w {
				t.Fatalf("prompt (as decoded)\n %q\nwant\n %q", g, w)
			}
			// With invalid UTF-8, chat Prompts are not compared: raw bytes of
			// adjacent parts may join into valid characters that encoding/json,
			// decoding each part alone, replaced.
		}
	})
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

// integer returns the value of a number written as a plain non-negative
// integer no larger than limit.
func integer(n node, limit uint64) (uint64, bool) {
	digits := string(n.num)
	if n.kind != '0' || strings.Trim(digits, "0123456789") != "" || len(digits) > 1 && digits[0] == '0' {
		return 0, false
	}
	v, err := strconv.ParseUint(string(n.num), 10, 64)
	return v, err == nil && v <= limit
}

func withNULEscaped(s string) string { return strings.ReplaceAll(s, "\x00", "\x00\xff") }

// reference is Parse written the slow, obvious way.
func reference(chat bool, body []byte) (Parsed, error) {
	var p Parsed
	reject := func(why string) (Parsed, error) { return Parsed{}, errors.New(why) }
	if !json.Valid(body) {
		return reject("invalid JSON")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	top, err := decodeTree(dec, body)
	if err != nil {
		return reject(err.Error())
	}
	if _, err := dec.Token(); err != io.EOF {
		return reject("trailing data")
	}
	if top.depth() > maxDepth {
		return reject("too deep")
	}
	if top.kind != '{' {
		return reject("not an object")
	}
	used := []string{"model", "stream", "max_tokens", "max_completion_tokens"}
	if chat {
		used = append(used, "messages", "tools")
	} else {
		used = append(used, "prompt")
	}
	for _, k := range used {
		if _, count := top.get(k); count > 1 {
			return reject("duplicate " + k)
		}
	}
	model, count := top.get("model")
	if count == 0 || model.kind != '"' || model.str == "" {
		return reject("bad model")
	}
	p.Model = model.str
	if stream, count := top.get("stream"); count > 0 {
		switch stream.kind {
		case 'b':
			p.Stream = stream.b
		case 'n':
		default:
			return reject("bad stream")
		}
	}
	for _, k := range []string{"max_tokens", "max_completion_tokens"} {
		v, count := top.get(k)
		if count == 0 || v.kind == 'n' {
			continue
		}
		n, ok := integer(v, math.MaxInt32)
		if !ok {
			return reject("bad " + k)
		}
		p.MaxTokens = int(n) // max_completion_tokens, second, wins
	}

	if !chat {
		prompt, count := top.get("prompt")
		if count == 0 {
			return reject("no prompt")
		}
		token := func(n node) bool {
			id, ok := integer(n, math.MaxUint32)
			p.Prompt = append(p.Prompt, byte(id), byte(id>>8), byte(id>>16), byte(id>>24))
			return ok
		}
		switch {
		case prompt.kind == '"':
			p.Prompt = []byte(prompt.str)
		case prompt.kind != '[':
			return reject("bad prompt")
		case len(prompt.elems) == 0:
		case prompt.elems[0].kind == '"':
			var texts []string
			for _, e := range prompt.elems {
				if e.kind != '"' {
					return reject("mixed prompt")
				}
				texts = append(texts, e.str)
			}
			p.Prompt = []byte(strings.Join(texts, "\n"))
		case prompt.elems[0].kind == '0':
			for _, e := range prompt.elems {
				if !token(e) {
					return reject("bad token")
				}
			}
		case prompt.elems[0].kind == '[':
			for _, e := range prompt.elems {
				if e.kind != '[' {
					return reject("mixed prompt")
				}
				for _, id := range e.elems {
					if !token(id) {
						return reject("bad token")
					}
				}
			}
		default:
			return reject("bad prompt")
		}
		return p, nil
	}

	if tools, count := top.get("tools"); count > 0 {
		switch tools.kind {
		case '[':
			p.Prompt = append(append(p.Prompt, "\x00T"...), tools.raw...)
		case 'n':
		default:
			return reject("bad tools")
		}
	}
	messages, count := top.get("messages")
	if count == 0 || messages.kind != '[' {
		return reject("bad messages")
	}
	for _, m := range messages.elems {
		if m.kind != '{' {
			return reject("message not an object")
		}
		for _, k := range []string{"role", "content", "tool_calls", "tool_call_id", "name"} {
			if _, count := m.get(k); count > 1 {
				return reject("duplicate " + k)
			}
		}
		role, count := m.get("role")
		if count == 0 || role.kind != '"' {
			return reject("bad role")
		}
		p.Prompt = append(append(p.Prompt, "\x00R"...), withNULEscaped(role.str)...)
		if content, count := m.get("content"); count > 0 {
			switch content.kind {
			case 'n':
			case '"':
				p.Prompt = append(append(p.Prompt, "\x00C"...), withNULEscaped(content.str)...)
			case '[':
				p.Prompt = append(p.Prompt, "\x00C"...)
				for _, part := range content.elems {
					if part.kind != '{' {
						return reject("part not an object")
					}
					typ, typeCount := part.get("type")
					text, textCount := part.get("text")
					if typeCount > 1 || textCount > 1 {
						return reject("duplicate in part")
					}
					if typ.kind == '"' && typ.str == "text" {
						if text.kind != '"' {
							return reject("text part without text")
						}
						p.Prompt = append(p.Prompt, withNULEscaped(text.str)...)
					} else {
						p.Prompt = append(append(p.Prompt, "\x00P"...), part.raw...)
					}
				}
			default:
				return reject("bad content")
			}
		}
		if calls, count := m.get("tool_calls"); count > 0 {
			switch calls.kind {
			case '[':
				p.Prompt = append(append(p.Prompt, "\x00F"...), calls.raw...)
			case 'n':
			default:
				return reject("bad tool_calls")
			}
		}
		for _, f := range []struct{ key, mark string }{{"tool_call_id", "\x00I"}, {"name", "\x00N"}} {
			if v, count := m.get(f.key); count > 0 {
				switch v.kind {
				case '"':
					p.Prompt = append(append(p.Prompt, f.mark...), withNULEscaped(v.str)...)
				case 'n':
				default:
					return reject("bad " + f.key)
				}
			}
		}
		p.Prompt = append(p.Prompt, "\x00E"...)
	}
	return p, nil
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
