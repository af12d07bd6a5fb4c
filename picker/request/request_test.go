package request

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

const (
	completionsPath = "/v1/completions"
	chatPath        = "/v1/chat/completions"
	responsesPath   = "/v1/responses"
	embeddingsPath  = "/v1/embeddings"
)

// le encodes token ids the way Prompt holds them.
func le(ids ...uint32) string {
	var b []byte
	for _, id := range ids {
		b = append(b, byte(id), byte(id>>8), byte(id>>16), byte(id>>24))
	}
	return string(b)
}

func TestParseKinds(t *testing.T) {
	for _, tc := range []struct {
		path string
		want Kind
	}{
		{"/v1/completions", KindCompletions},
		{"/v1/completions?api-version=1", KindCompletions},
		{"/v1/completions/", KindCompletions},
		{"/v1/completions/?stream=1", KindCompletions},
		{"/openai/v1/completions", KindCompletions},
		{"/team-a/llama/v1/completions", KindCompletions},
		{"/v1/chat/completions", KindChat},
		{"/v1/chat/completions?x=1&y=2", KindChat},
		{"/v1/chat/completions/", KindChat},
		{"/openai/v1/chat/completions?api-version=2024-10-21", KindChat},
		{"/v1/responses", KindResponses},
		{"/openai/v1/responses/", KindResponses},
		{"/v1/embeddings", KindEmbeddings},
		{"/openai/v1/embeddings?x=y", KindEmbeddings},
		// Any prefix, as the upstream picker matches paths: Azure OpenAI's
		// deployments, Vertex AI's endpoints, another version, none.
		{"/openai/deployments/gpt/chat/completions?api-version=2024-10-21", KindChat},
		{"/v1/projects/p/locations/us/endpoints/openapi/chat/completions", KindChat},
		{"/openai/deployments/gpt/completions", KindCompletions},
		{"/v2/completions", KindCompletions},
		{"/chat/completions", KindChat},
		{"/completions", KindCompletions},
		{"/team-a/responses", KindResponses},
		{"/embeddings/", KindEmbeddings},
		{"/v1/completions//", KindOther},
		{"/v1/responses/resp_123", KindOther},
		{"/v1/responses/resp_123/cancel", KindOther},
		{"/v1/chat/completions/chatcmpl-123", KindOther},
		{"/v1/completionsx", KindOther},
		{"/v1/xcompletions", KindOther},
		{"completions", KindOther},
		{"/v1/models", KindOther},
		{"/v1/conversations", KindOther},
		{"/primary-gateway-test", KindOther},
		{"/", KindOther},
		{"", KindOther},
	} {
		// The body is not JSON: for other paths it must not be looked at.
		p, err := Parse(tc.path, []byte("not json"), nil)
		if p.Kind != tc.want {
			t.Errorf("Parse(%q): kind %v, want %v", tc.path, p.Kind, tc.want)
		}
		if gotErr := err != nil; gotErr != (tc.want != KindOther) {
			t.Errorf("Parse(%q, invalid body): err = %v", tc.path, err)
		}
		if got := KindOf(tc.path); got != tc.want {
			t.Errorf("KindOf(%q) = %v, want %v", tc.path, got, tc.want)
		}
	}
}

// Of a body to another path only a top-level "model" string is read, for
// rewrites and placement: the last one, as the server reads it; and no
// body is an error there, whatever it holds.
func TestParseOtherReadsOnlyTheModel(t *testing.T) {
	for _, tc := range []struct {
		name, body, model string
	}{
		{"tokenize", `{"model":"llama","prompt":"hi","add_special_tokens":true}`, "llama"},
		{"spaced, nested models skipped", ` { "input" : {"model":"inner"} , "model" : "m\u00e9" } `, "mé"},
		{"the last model wins", `{"model":"a","model":"b"}`, "b"},
		{"a later model that is not a string names none", `{"model":"a","model":7}`, ""},
		{"an empty model", `{"model":""}`, ""},
		{"no model", `{"messages":[]}`, ""},
		{"not JSON", `--boundary\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper`, ""},
		{"malformed after the model", `{"model":"llama","prompt":}`, ""},
		{"trailing bytes", `{"model":"llama"} x`, ""},
		{"an array", `[{"model":"llama"}]`, ""},
		{"empty", ``, ""},
	} {
		p, err := Parse("/tokenize", []byte(tc.body), nil)
		if err != nil || p.Kind != KindOther || len(p.Prompt) != 0 {
			t.Errorf("%s: kind %v, prompt %q, err %v; want KindOther, no prompt, no error", tc.name, p.Kind, p.Prompt, err)
			continue
		}
		if p.Model != tc.model {
			t.Errorf("%s: model %q, want %q", tc.name, p.Model, tc.model)
		}
		switch {
		case tc.model == "" && (p.ModelStart != 0 || p.ModelEnd != 0):
			t.Errorf("%s: no model, but a span %d:%d", tc.name, p.ModelStart, p.ModelEnd)
		case tc.model != "":
			var got string
			if err := json.Unmarshal([]byte(tc.body[p.ModelStart:p.ModelEnd]), &got); err != nil || got != tc.model {
				t.Errorf("%s: body[%d:%d] = %q, not the model's JSON string", tc.name, p.ModelStart, p.ModelEnd, tc.body[p.ModelStart:p.ModelEnd])
			}
		}
	}
}

// "stream" and the token budgets are read as vLLM's pydantic reads them in
// its lax mode where it can ("true", 1, "100"), and anything else is no
// stream and no budget, never an error: the upstream picker routes such a
// request, and the model server judges it.
func TestStreamAndBudgetsOfOtherTypesAreReadLaxly(t *testing.T) {
	for _, tc := range []struct {
		name, path, body string
		stream           bool
		maxTokens        int
	}{
		{"stream string true", completionsPath, `{"model":"m","prompt":"x","stream":"true"}`, true, 0},
		{"stream string, spaced and capitalised", completionsPath, `{"model":"m","prompt":"x","stream":" Yes "}`, true, 0},
		{"stream string false", completionsPath, `{"model":"m","prompt":"x","stream":"false"}`, false, 0},
		{"stream string other", responsesPath, `{"model":"m","stream":"maybe"}`, false, 0},
		{"stream number 1", completionsPath, `{"model":"m","prompt":"x","stream":1}`, true, 0},
		{"stream number 1.0", completionsPath, `{"model":"m","prompt":"x","stream":1.0}`, true, 0},
		{"stream number 2", completionsPath, `{"model":"m","prompt":"x","stream":2}`, false, 0},
		{"stream object", chatPath, `{"model":"m","messages":[],"stream":{"x":true}}`, false, 0},
		{"a later odd stream replaces an earlier true", chatPath, `{"model":"m","messages":[],"stream":true,"stream":[]}`, false, 0},
		{"max_tokens string", completionsPath, `{"model":"m","prompt":"x","max_tokens":"5"}`, false, 5},
		{"max_tokens spaced string", completionsPath, `{"model":"m","prompt":"x","max_tokens":" 12 "}`, false, 12},
		{"max_tokens string not an integer", completionsPath, `{"model":"m","prompt":"x","max_tokens":"5.5"}`, false, 0},
		{"max_tokens string too large", completionsPath, `{"model":"m","prompt":"x","max_tokens":"2147483648"}`, false, 0},
		{"max_tokens negative", completionsPath, `{"model":"m","prompt":"x","max_tokens":-1}`, false, 0},
		{"max_tokens fraction", completionsPath, `{"model":"m","prompt":"x","max_tokens":1.5}`, false, 0},
		{"max_tokens too large", completionsPath, `{"model":"m","prompt":"x","max_tokens":2147483648}`, false, 0},
		{"max_tokens huge", completionsPath, `{"model":"m","prompt":"x","max_tokens":99999999999999999999999}`, false, 0},
		{"max_tokens float overflow", completionsPath, `{"model":"m","prompt":"x","max_tokens":1e400}`, false, 0},
		{"max_tokens negative float", completionsPath, `{"model":"m","prompt":"x","max_tokens":-1.0}`, false, 0},
		{"max_tokens whole float", completionsPath, `{"model":"m","prompt":"x","max_tokens":100.0}`, false, 100},
		{"the last budget counts", completionsPath, `{"model":"m","prompt":"x","max_tokens":"5","max_tokens":-3}`, false, 0},
		{"an odd max_completion_tokens leaves max_tokens", chatPath, `{"model":"m","messages":[],"max_tokens":9,"max_completion_tokens":{}}`, false, 9},
		{"max_output_tokens fraction", responsesPath, `{"model":"m","max_output_tokens":0.5}`, false, 0},
	} {
		p, err := Parse(tc.path, []byte(tc.body), nil)
		if err != nil {
			t.Errorf("%s: %v, want no error", tc.name, err)
			continue
		}
		if p.Model != "m" || p.Stream != tc.stream || p.MaxTokens != tc.maxTokens {
			t.Errorf("%s: model %q, stream %v, max tokens %d; want m, %v, %d", tc.name, p.Model, p.Stream, p.MaxTokens, tc.stream, tc.maxTokens)
		}
	}
}

func TestKindString(t *testing.T) {
	for k, want := range map[Kind]string{KindOther: "other", KindCompletions: "completions", KindChat: "chat",
		KindResponses: "responses", KindEmbeddings: "embeddings", Kind(7): "Kind(7)"} {
		if got := k.String(); got != want {
			t.Errorf("Kind(%d).String() = %q, want %q", int(k), got, want)
		}
	}
}

func TestParseCompletions(t *testing.T) {
	for _, tc := range []struct {
		name      string
		body      string
		model     string
		stream    bool
		maxTokens int
		prompt    string
	}{
		{"string prompt", `{"model":"llama","prompt":"Hello, world"}`, "llama", false, 0, "Hello, world"},
		{"empty model (the server's default)", `{"model":"","prompt":"x"}`, "", false, 0, "x"},
		{"whitespace everywhere", " \t\r\n{ \"model\" : \"m\" ,\n\"prompt\"\t:\r\"x\" } \n", "m", false, 0, "x"},
		{"escapes", `{"model":"m","prompt":"a\"b\\c\/d\be\ff\ng\rh\ti"}`, "m", false, 0, "a\"b\\c/d\be\ff\ng\rh\ti"},
		{"unicode escapes", `{"model":"m","prompt":"\u00e9\u4e2d\uD83D\uDE00"}`, "m", false, 0, "é中😀"},
		{"lone high surrogate", `{"model":"m","prompt":"a\ud800b"}`, "m", false, 0, "a\uFFFDb"},
		{"lone low surrogate", `{"model":"m","prompt":"\udc00"}`, "m", false, 0, "\uFFFD"},
		{"high surrogate then non-surrogate escape", `{"model":"m","prompt":"\ud800\u0041"}`, "m", false, 0, "\uFFFDA"},
		{"two high surrogates then low", `{"model":"m","prompt":"\ud800\ud83d\ude00"}`, "m", false, 0, "\uFFFD😀"},
		{"NUL escape kept in completions", `{"model":"m","prompt":"a\u0000b"}`, "m", false, 0, "a\x00b"},
		{"raw UTF-8", `{"model":"m","prompt":"héllo 世界"}`, "m", false, 0, "héllo 世界"},
		{"invalid UTF-8 passes through", "{\"model\":\"m\",\"prompt\":\"a\xffb\xc3\"}", "m", false, 0, "a\xffb\xc3"},
		{"long plain run", `{"model":"m","prompt":"` + strings.Repeat("abcdefghij", 100) + `"}`, "m", false, 0, strings.Repeat("abcdefghij", 100)},
		{"empty prompt", `{"model":"m","prompt":""}`, "m", false, 0, ""},
		{"array of strings", `{"model":"m","prompt":["one","two","three"]}`, "m", false, 0, "one\ntwo\nthree"},
		{"array of one string", `{"model":"m","prompt":["one"]}`, "m", false, 0, "one"},
		{"empty array", `{"model":"m","prompt":[]}`, "m", false, 0, ""},
		{"token ids", `{"model":"m","prompt":[1, 258, 0, 4294967295]}`, "m", false, 0, le(1, 258, 0, 4294967295)},
		{"token id arrays", `{"model":"m","prompt":[[1,2],[],[65536]]}`, "m", false, 0, le(1, 2, 65536)},
		{"stream true", `{"model":"m","prompt":"x","stream":true}`, "m", true, 0, "x"},
		{"stream false", `{"stream":false,"model":"m","prompt":"x"}`, "m", false, 0, "x"},
		{"stream null", `{"stream":null,"model":"m","prompt":"x"}`, "m", false, 0, "x"},
		{"max_tokens", `{"model":"m","prompt":"x","max_tokens":128}`, "m", false, 128, "x"},
		{"max_tokens largest", `{"model":"m","prompt":"x","max_tokens":2147483647}`, "m", false, 2147483647, "x"},
		{"max_completion_tokens wins", `{"max_completion_tokens":64,"model":"m","prompt":"x","max_tokens":128}`, "m", false, 64, "x"},
		{"max_completion_tokens wins after", `{"max_tokens":128,"model":"m","prompt":"x","max_completion_tokens":0}`, "m", false, 0, "x"},
		{"null max_completion_tokens falls back", `{"max_completion_tokens":null,"model":"m","prompt":"x","max_tokens":9}`, "m", false, 9, "x"},
		{"null max_tokens", `{"model":"m","prompt":"x","max_tokens":null}`, "m", false, 0, "x"},
		{"escaped key", `{"mod\u0065l":"m","\u0070rompt":"x"}`, "m", false, 0, "x"},
		{"escaped model", `{"model":"org\/m\u00e9","prompt":"x"}`, "org/mé", false, 0, "x"},
		{"unknown fields of every type are skipped", `{"a":{"b":[1,-2.5e+3,true,false,null,"s\u1234\n\"\\\/\b\f\r\t",{}],"c":[]},"model":"m","n":0,"prompt":"x","e":1E-2}`, "m", false, 0, "x"},
		{"chat fields ignored", `{"model":"m","prompt":"x","messages":5,"tools":"t"}`, "m", false, 0, "x"},
		{"keys differing in case are not fields", `{"Model":1,"model":"m","PROMPT":2,"prompt":"x"}`, "m", false, 0, "x"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Parse(completionsPath, []byte(tc.body), nil)
			if err != nil {
				t.Fatalf("Parse(%s): %v", tc.body, err)
			}
			want := tc.model
			if p.Kind != KindCompletions || p.Model != want || p.Stream != tc.stream || p.MaxTokens != tc.maxTokens {
				t.Errorf("got kind %v model %q stream %v max %d; want completions %q %v %d",
					p.Kind, p.Model, p.Stream, p.MaxTokens, want, tc.stream, tc.maxTokens)
			}
			if string(p.Prompt) != tc.prompt {
				t.Errorf("prompt %q, want %q", p.Prompt, tc.prompt)
			}
		})
	}
}

func TestParseChat(t *testing.T) {
	for _, tc := range []struct {
		name   string
		body   string
		prompt string
	}{
		{"string content",
			`{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}`,
			"\x00Rsystem\x00CBe brief.\x00E\x00Ruser\x00CHi\x00E"},
		{"text parts concatenate",
			`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"Hello, "},{"type":"text","text":"world"}]}]}`,
			"\x00Ruser\x00CHello, world\x00E"},
		{"text before type",
			`{"model":"m","messages":[{"role":"user","content":[{"text":"Hello","type":"text"}]}]}`,
			"\x00Ruser\x00CHello\x00E"},
		{"image part is raw JSON",
			`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"What is this?"},{"type": "image_url","image_url":{"url":"data:image/png;base64,iVBO"}},{"type":"text","text":"Be brief."}]}]}`,
			"\x00Ruser\x00CWhat is this?\x00P{\"type\": \"image_url\",\"image_url\":{\"url\":\"data:image/png;base64,iVBO\"}}Be brief.\x00E"},
		{"text decoded before a non-text type is dropped",
			`{"model":"m","messages":[{"role":"user","content":[{"text":"x","type":"input_audio","input_audio":{"data":"AAA","format":"wav"}}]}]}`,
			"\x00Ruser\x00C\x00P{\"text\":\"x\",\"type\":\"input_audio\",\"input_audio\":{\"data\":\"AAA\",\"format\":\"wav\"}}\x00E"},
		{"part without type is raw JSON",
			`{"model":"m","messages":[{"role":"user","content":[{"text":"x"}]}]}`,
			"\x00Ruser\x00C\x00P{\"text\":\"x\"}\x00E"},
		{"empty parts",
			`{"model":"m","messages":[{"role":"user","content":[]}]}`,
			"\x00Ruser\x00C\x00E"},
		{"null content and tool calls",
			`{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"42","name":"f"}]}`,
			"\x00Rassistant\x00F[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]\x00E" +
				"\x00Rtool\x00C42\x00Ic1\x00Nf\x00E"},
		{"message fields in reverse order",
			`{"model":"m","messages":[{"name":"f","content":"42","tool_call_id":"c1","role":"tool"}]}`,
			"\x00Rtool\x00C42\x00Ic1\x00Nf\x00E"},
		{"null optional fields",
			`{"model":"m","messages":[{"role":"user","content":"x","name":null,"tool_call_id":null,"tool_calls":null}]}`,
			"\x00Ruser\x00Cx\x00E"},
		{"message without content",
			`{"model":"m","messages":[{"role":"user"}]}`,
			"\x00Ruser\x00E"},
		{"unknown message fields skipped",
			`{"model":"m","messages":[{"role":"user","x":{"content":"no"},"content":"yes","y":[1,2]}]}`,
			"\x00Ruser\x00Cyes\x00E"},
		{"tools first",
			`{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"Hi"}]}`,
			"\x00T[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]\x00Ruser\x00CHi\x00E"},
		{"tools after messages still come first",
			`{"messages":[{"role":"user","content":"Hi"}],"model":"m","tools":[{"type":"function","function":{"name":"f"}}]}`,
			"\x00T[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]\x00Ruser\x00CHi\x00E"},
		{"null tools",
			`{"model":"m","tools":null,"messages":[{"role":"user","content":"Hi"}]}`,
			"\x00Ruser\x00CHi\x00E"},
		{"NUL in text cannot imitate a marker",
			`{"model":"m","messages":[{"role":"user","content":"a\u0000Eb"}]}`,
			"\x00Ruser\x00Ca\x00\xffEb\x00E"},
		{"NUL escaped in role and parts",
			`{"model":"m","messages":[{"role":"u\u0000","content":[{"type":"text","text":"\u0000"}]}]}`,
			"\x00Ru\x00\xff\x00C\x00\xff\x00E"},
		{"empty messages",
			`{"model":"m","messages":[]}`,
			""},
		{"prompt ignored on chat",
			`{"model":"m","prompt":{"x":1},"messages":[{"role":"user","content":"Hi"}]}`,
			"\x00Ruser\x00CHi\x00E"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Parse(chatPath, []byte(tc.body), nil)
			if err != nil {
				t.Fatalf("Parse(%s): %v", tc.body, err)
			}
			if p.Kind != KindChat || p.Model != "m" {
				t.Errorf("kind %v model %q, want chat \"m\"", p.Kind, p.Model)
			}
			if string(p.Prompt) != tc.prompt {
				t.Errorf("prompt\n %q\nwant\n %q", p.Prompt, tc.prompt)
			}
		})
	}
}

// TestChatPromptIsCanonical checks the property the prefix index relies on:
// the order of keys in the body does not matter, string content equals the
// same text in parts, and a conversation that extends another starts with
// the other's Prompt.
func TestChatPromptIsCanonical(t *testing.T) {
	parse := func(body string) string {
		t.Helper()
		p, err := Parse(chatPath, []byte(body), nil)
		if err != nil {
			t.Fatalf("Parse(%s): %v", body, err)
		}
		return string(p.Prompt)
	}
	same := [][]string{
		{
			`{"model":"m","tools":[{"t":1}],"messages":[{"role":"user","content":"Hi","name":"a"}]}`,
			`{"messages":[{"content":"Hi","name":"a","role":"user"}],"tools":[{"t":1}],"model":"m"}`,
			`{"messages":[{"name":"a","role":"user","content":[{"type":"text","text":"H"},{"text":"i","type":"text"}]}],"model":"m","tools":[{"t":1}]}`,
		},
		{
			`{"model":"m","messages":[{"role":"assistant","content":"x","tool_calls":[1],"tool_call_id":"i","name":"n"}]}`,
			`{"model":"m","messages":[{"tool_calls":[1],"name":"n","tool_call_id":"i","content":"x","role":"assistant"}]}`,
			`{"model":"m","messages":[{"tool_call_id":"i","role":"assistant","name":"n","tool_calls":[1],"content":"x"}]}`,
		},
	}
	for _, group := range same {
		want := parse(group[0])
		for _, body := range group[1:] {
			if got := parse(body); got != want {
				t.Errorf("Prompt of\n %s\n= %q\nwant (as for %s)\n %q", body, got, group[0], want)
			}
		}
	}

	short := parse(`{"model":"m","tools":[1],"messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"}]}`)
	long := parse(`{"messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"},{"role":"assistant","content":"A1"},{"role":"user","content":"Q2"}],"tools":[1],"model":"m"}`)
	if !strings.HasPrefix(long, short) || len(long) == len(short) {
		t.Errorf("extended conversation %q does not extend %q", long, short)
	}
	// Different images, tools or roles must differ.
	distinct := []string{
		`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a"}}]}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"b"}}]}]}`,
		`{"model":"m","messages":[{"role":"user","content":"{\"type\":\"image_url\",\"image_url\":{\"url\":\"a\"}}"}]}`,
		`{"model":"m","messages":[{"role":"assistant","content":[{"type":"image_url","image_url":{"url":"a"}}]}]}`,
		`{"model":"m","tools":[2],"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a"}}]}]}`,
		`{"model":"m","messages":[{"role":"user","content":"ab"}]}`,
		`{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}`,
		`{"model":"m","messages":[{"role":"user","name":"ab"}]}`,
		`{"model":"m","messages":[{"role":"user","tool_call_id":"ab"}]}`,
	}
	seen := map[string]string{}
	for _, body := range distinct {
		got := parse(body)
		if other, ok := seen[got]; ok {
			t.Errorf("same Prompt %q for\n %s\nand\n %s", got, body, other)
		}
		seen[got] = body
	}
}

func TestParseErrors(t *testing.T) {
	deep := func(n int) string { return strings.Repeat("[", n) + strings.Repeat("]", n) }
	for _, tc := range []struct {
		name string
		path string
		body string
		msg  string // the error message must contain this
	}{
		{"empty", completionsPath, "", "request body is empty"},
		{"only whitespace", chatPath, " \n", "request body is empty"},
		{"array", completionsPath, `[{"model":"m"}]`, "request body must be a JSON object"},
		{"string", chatPath, `"x"`, "request body must be a JSON object"},
		{"garbage", chatPath, `model`, "request body is not valid JSON: unexpected 'm' at byte 0"},
		{"truncated", completionsPath, `{"model":"m","prompt":"ab`, "request body is not valid JSON: unexpected end at byte 25"},
		{"truncated after key", completionsPath, `{"model"`, "unexpected end at byte 8, expected ':'"},
		{"truncated in skipped value", completionsPath, `{"x":[1,{"a":`, "unexpected end at byte 13"},
		{"trailing garbage", completionsPath, `{"model":"m","prompt":"x"}x`, "unexpected 'x' at byte 26"},
		{"second object", completionsPath, `{"model":"m","prompt":"x"} {}`, "unexpected '{' at byte 27"},
		{"trailing comma", completionsPath, `{"model":"m","prompt":"x",}`, "unexpected '}' at byte 26, expected a string key"},
		{"trailing comma in array", completionsPath, `{"model":"m","prompt":"x","a":[1,]}`, "unexpected ']' at byte 33"},
		{"missing colon", completionsPath, `{"model" "m"}`, "expected ':'"},
		{"missing comma", completionsPath, `{"model":"m" "prompt":"x"}`, "expected ',' or '}'"},
		{"single quotes", completionsPath, `{'model':'m'}`, `unexpected '\'' at byte 1`},
		{"invalid escape", completionsPath, `{"model":"m","prompt":"a\x"}`, `invalid escape 'x' at byte 24`},
		{"invalid escape in skipped value", completionsPath, `{"model":"m","prompt":"a","o":"\a"}`, `invalid escape 'a' at byte 31`},
		{"invalid escape in key", completionsPath, `{"mo\del":"m"}`, `invalid escape 'd'`},
		{"escape at end", completionsPath, `{"model":"m","prompt":"a\`, "unexpected end at byte 25, expected an escape sequence"},
		{"escape at end of skipped string", completionsPath, `{"x":"\`, "unexpected end at byte 7, expected an escape sequence"},
		{"short unicode escape in skipped string", completionsPath, `{"x":"\u00g0"}`, `invalid \u escape at byte 6`},
		{"short unicode escape", completionsPath, `{"model":"m","prompt":"\u12"}`, `invalid \u escape at byte 23`},
		{"unicode escape at end", completionsPath, `{"model":"m","prompt":"\u12`, `unexpected end in \u escape at byte 23`},
		{"raw newline in string", completionsPath, "{\"model\":\"m\",\"prompt\":\"a\nb\"}", "control character 0x0a in string at byte 24"},
		{"raw tab in skipped string", completionsPath, "{\"x\":\"\t\",\"model\":\"m\",\"prompt\":\"\"}", "control character 0x09"},
		{"leading zero", completionsPath, `{"model":"m","prompt":"x","n":01}`, "unexpected '1'"},
		{"leading zero token id", completionsPath, `{"model":"m","prompt":[01]}`, "number with a leading zero"},
		{"bare minus", completionsPath, `{"model":"m","prompt":"x","n":-}`, "expected a digit"},
		{"dot without digits", completionsPath, `{"model":"m","prompt":"x","n":1.}`, "expected a digit after '.'"},
		{"exponent without digits", completionsPath, `{"model":"m","prompt":"x","n":1e+}`, "expected a digit in the exponent"},
		{"plus sign", completionsPath, `{"model":"m","prompt":"x","n":+1}`, "unexpected '+'"},
		{"bad literal", completionsPath, `{"model":"m","prompt":"x","n":nul}`, `expected "null"`},
		{"True", completionsPath, `{"model":"m","prompt":"x","stream":True}`, "unexpected 'T'"},
		{"too deep", completionsPath, `{"model":"m","prompt":"x","a":` + deep(1000) + `}`, "nested deeper than 1000 levels"},
		{"too deep in tools", chatPath, `{"model":"m","messages":[],"tools":` + deep(1000) + `}`, "nested deeper than 1000 levels"},
		{"too deep in a part", chatPath, `{"model":"m","messages":[{"role":"u","content":[{"a":` + deep(996) + `}]}]}`, "nested deeper than 1000 levels"},
		{"too deep under a type error", completionsPath, `{"model":` + deep(1000) + `}`, "nested deeper than 1000 levels"},

		{"no model", completionsPath, `{"prompt":"x"}`, `request body has no "model" field`},
		{"no model in chat", chatPath, `{"messages":[]}`, `request body has no "model" field`},
		{"model number", completionsPath, `{"model":7,"prompt":"x"}`, `"model" must be a string`},
		{"model null", chatPath, `{"model":null,"messages":[]}`, `"model" must be a string`},
		{"type error reports bad JSON first", completionsPath, `{"model":[1,}`, `unexpected '}' at byte 12`},

		{"no prompt", completionsPath, `{"model":"m"}`, `request body has no "prompt" field`},
		{"null prompt", completionsPath, `{"model":"m","prompt":null}`, `"prompt" must be a string, an array of strings, an array of token ids or an array of token-id arrays`},
		{"object prompt", completionsPath, `{"model":"m","prompt":{"a":1}}`, `"prompt" must be a string`},
		{"mixed strings and ids", completionsPath, `{"model":"m","prompt":["a",1]}`, `"prompt" must be a string`},
		{"mixed ids and strings", completionsPath, `{"model":"m","prompt":[1,"a"]}`, `"prompt" must be a string`},
		{"mixed ids and arrays", completionsPath, `{"model":"m","prompt":[[1],2]}`, `"prompt" must be a string`},
		{"array of string arrays", completionsPath, `{"model":"m","prompt":[["a"]]}`, `"prompt" must be a string`},
		{"nested too far", completionsPath, `{"model":"m","prompt":[[[1]]]}`, `"prompt" must be a string`},
		{"array of bools", completionsPath, `{"model":"m","prompt":[true]}`, `"prompt" must be a string`},
		{"negative token id", completionsPath, `{"model":"m","prompt":[-1]}`, `"prompt" token ids must be integers from 0 to 4294967295`},
		{"fractional token id", completionsPath, `{"model":"m","prompt":[[1.5]]}`, `"prompt" token ids must be integers`},
		{"token id too large", completionsPath, `{"model":"m","prompt":[4294967296]}`, `"prompt" token ids must be integers`},

		{"no messages", chatPath, `{"model":"m"}`, `request body has no "messages" field`},
		{"messages object", chatPath, `{"model":"m","messages":{"role":"user"}}`, `"messages" must be an array`},
		{"messages null", chatPath, `{"model":"m","messages":null}`, `"messages" must be an array`},
		{"message string", chatPath, `{"model":"m","messages":[{"role":"u"},"hi"]}`, `"messages[1]" must be an object`},
		{"no role", chatPath, `{"model":"m","messages":[{"content":"hi"}]}`, `"messages[0]" has no "role" field`},
		{"role number", chatPath, `{"model":"m","messages":[{"role":1}]}`, `"messages[0].role" must be a string`},
		{"content number", chatPath, `{"model":"m","messages":[{"role":"a","content":1}]}`, `"messages[0].content" must be a string, an array of parts or null`},
		{"part string", chatPath, `{"model":"m","messages":[{"role":"a","content":["x"]}]}`, `"messages[0].content[0]" must be an object`},
		{"text part without text", chatPath, `{"model":"m","messages":[{"role":"a","content":[{"type":"text"}]}]}`, `"messages[0].content[0]" has a text type but no "text" string`},
		{"text part with number text", chatPath, `{"model":"m","messages":[{"role":"a","content":[{"text":1,"type":"text"}]}]}`, `has a text type but no "text" string`},
		{"tool_calls object", chatPath, `{"model":"m","messages":[{"role":"a","tool_calls":{}}]}`, `"messages[0].tool_calls" must be an array or null`},
		{"name number", chatPath, `{"model":"m","messages":[{"role":"a","name":1}]}`, `"messages[0].name" must be a string or null`},
		{"tool_call_id bool", chatPath, `{"model":"m","messages":[{"role":"a","tool_call_id":true}]}`, `"messages[0].tool_call_id" must be a string or null`},
		{"tools object", chatPath, `{"model":"m","messages":[],"tools":{}}`, `"tools" must be an array or null`},
		{"bad JSON inside tools", chatPath, `{"model":"m","messages":[],"tools":[{"a" 1}]}`, `expected ':'`},

		{"max_tokens bad float", completionsPath, `{"model":"m","prompt":"x","max_tokens":1.e3}`, `expected a digit after '.'`},
		{"token id fraction", completionsPath, `{"model":"m","prompt":[1,2.5]}`, `"prompt" token ids must be integers`},
		{"an invalid earlier model", chatPath, `{"model":1,"model":"m","messages":[]}`, `"model" must be a string`},
		{"an invalid earlier message", chatPath, `{"model":"m","messages":[{}],"messages":[]}`, `"messages[0]" has no "role" field`},
		{"cache_salt number", completionsPath, `{"model":"m","prompt":"x","cache_salt":1}`, `"cache_salt" must be a string or null`},
		{"cache_salt object", chatPath, `{"model":"m","messages":[],"cache_salt":{}}`, `"cache_salt" must be a string or null`},

		{"embeddings without input", embeddingsPath, `{"model":"m"}`, `request body has no "input" (or "messages") field`},
		{"embeddings bad messages", embeddingsPath, `{"model":"m","messages":[{"content":"x"}]}`, `"messages[0]" has no "role" field`},
		{"embeddings bad messages beside input", embeddingsPath, `{"model":"m","input":"x","messages":{}}`, `"messages" must be an array`},
		{"embeddings without model", embeddingsPath, `{"input":"x"}`, `request body has no "model" field`},
		{"embeddings object input", embeddingsPath, `{"model":"m","input":{}}`, `"input" must be a string, an array of strings, an array of token ids or an array of token-id arrays`},
		{"embeddings mixed input", embeddingsPath, `{"model":"m","input":["a",1]}`, `"input" must be a string`},
		{"embeddings negative token id", embeddingsPath, `{"model":"m","input":[[-1]]}`, `"input" token ids must be integers from 0 to 4294967295`},
		{"embeddings null input", embeddingsPath, `{"model":"m","input":null}`, `"input" must be a string`},

		{"responses without model", responsesPath, `{"input":"x"}`, `request body has no "model" field`},
		{"responses number input", responsesPath, `{"model":"m","input":1}`, `"input" must be a string, an array of items or null`},
		{"responses item string", responsesPath, `{"model":"m","input":["hi"]}`, `"input[0]" must be an object`},
		{"responses role number", responsesPath, `{"model":"m","input":[{"role":1}]}`, `"input[0].role" must be a string`},
		{"responses type number", responsesPath, `{"model":"m","input":[{"type":1,"role":"user"}]}`, `"input[0].type" must be a string`},
		{"responses content number", responsesPath, `{"model":"m","input":[{"role":"user","content":1}]}`, `"input[0].content" must be a string, an array of parts or null`},
		{"responses part string", responsesPath, `{"model":"m","input":[{"role":"user","content":["x"]}]}`, `"input[0].content[0]" must be an object`},
		{"responses text part without text", responsesPath, `{"model":"m","input":[{"role":"user","content":[{"type":"input_text"}]}]}`, `"input[0].content[0]" has a text type but no "text" string`},
		{"responses instructions array", responsesPath, `{"model":"m","instructions":["a"]}`, `"instructions" must be a string or null`},
		{"responses tools object", responsesPath, `{"model":"m","tools":{}}`, `"tools" must be an array or null`},
		{"responses previous_response_id number", responsesPath, `{"model":"m","previous_response_id":7}`, `"previous_response_id" must be a string or null`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Parse(tc.path, []byte(tc.body), nil)
			var perr *Error
			if !errors.As(err, &perr) {
				t.Fatalf("Parse(%s) = %+v, %v; want *Error containing %q", tc.body, p, err, tc.msg)
			}
			if !strings.Contains(perr.Message, tc.msg) || perr.Error() != perr.Message {
				t.Errorf("error %q, want it to contain %q", perr.Message, tc.msg)
			}
			if len(p.Prompt) != 0 || p.Model != "" {
				t.Errorf("on error got model %q prompt %q, want both empty", p.Model, p.Prompt)
			}
		})
	}
}

func TestParseDepthLimit(t *testing.T) {
	arrays := func(n int) string { return strings.Repeat("[", n) + strings.Repeat("]", n) }
	objects := func(n int) string { return strings.Repeat(`{"a":`, n-1) + "{}" + strings.Repeat("}", n-1) }
	// Each body nests extra+maxDepth levels, counting the top-level object.
	for _, tc := range []struct {
		path string
		body func(extra int) string
	}{
		{completionsPath, func(x int) string { return `{"model":"m","prompt":"x","a":` + arrays(999+x) + `}` }},
		{completionsPath, func(x int) string { return `{"model":"m","prompt":"x","a":` + objects(999+x) + `}` }},
		{chatPath, func(x int) string { return `{"model":"m","messages":[],"tools":` + arrays(999+x) + `}` }},
		{chatPath, func(x int) string { return `{"model":"m","messages":[{"role":"u","x":` + arrays(997+x) + `}]}` }},
		{chatPath, func(x int) string {
			return `{"model":"m","messages":[{"role":"u","tool_calls":` + arrays(997+x) + `}]}`
		}},
		{chatPath, func(x int) string {
			return `{"model":"m","messages":[{"role":"u","content":[{"a":` + arrays(995+x) + `}]}]}`
		}},
	} {
		if _, err := Parse(tc.path, []byte(tc.body(0)), nil); err != nil {
			t.Errorf("depth %d rejected: %v", maxDepth, err)
		}
		if _, err := Parse(tc.path, []byte(tc.body(1)), nil); err == nil || !strings.Contains(err.Error(), "nested deeper than 1000 levels") {
			t.Errorf("depth %d: got %v, want the nesting error", maxDepth+1, err)
		}
	}
}

func TestParseReusesBuffer(t *testing.T) {
	buf := make([]byte, 3, 1024)
	copy(buf, "old")
	p, err := Parse(completionsPath, []byte(`{"model":"m","prompt":"new text"}`), buf)
	if err != nil {
		t.Fatal(err)
	}
	if string(p.Prompt) != "new text" || &p.Prompt[0] != &buf[:1][0] {
		t.Errorf("prompt %q not written into the given buffer", p.Prompt)
	}
	// The buffer comes back, empty, on error too.
	p, err = Parse(completionsPath, []byte(`{"model":"m","prompt":"x`), buf)
	if err == nil || len(p.Prompt) != 0 || cap(p.Prompt) != cap(buf) {
		t.Errorf("on error got %q (cap %d), %v; want the emptied buffer", p.Prompt, cap(p.Prompt), err)
	}
	// Rotating tools in front of messages uses spare capacity, not the body.
	body := []byte(`{"messages":[{"role":"user","content":"` + strings.Repeat("q", 300) + `"}],"model":"m","tools":[{"t":"` + strings.Repeat("t", 200) + `"}]}`)
	orig := bytes.Clone(body)
	p, err = Parse(chatPath, body, buf)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(body, orig) {
		t.Error("Parse modified the body")
	}
	want := "\x00T[{\"t\":\"" + strings.Repeat("t", 200) + "\"}]\x00Ruser\x00C" + strings.Repeat("q", 300) + "\x00E"
	if string(p.Prompt) != want {
		t.Errorf("prompt %q, want %q", p.Prompt, want)
	}
}

func TestParseAllocations(t *testing.T) {
	body := chatBody(8000)
	dst := make([]byte, 0, 64<<10)
	allocs := testing.AllocsPerRun(20, func() {
		p, err := Parse(chatPath, body, dst)
		if err != nil || len(p.Prompt) == 0 {
			t.Fatalf("Parse: %v", err)
		}
	})
	// The model string is the only allocation once dst is large enough.
	if allocs > 1 {
		t.Errorf("%v allocations per Parse, want at most 1", allocs)
	}
}

// runEnds finds the first special byte, whatever its place in a word, and
// a special found ahead of the scan (a later quote) never hides a nearer one.
func TestRunEnds(t *testing.T) {
	specials := []byte{'"', '\\', 0x00, 0x01, 0x1f}
	plain := []byte{' ', '!', '#', '[', ']', 0x7f, 0x80, 0xc3, 0xff, 'a'}
	next := func(b []byte, i int) int { r := newRunEnds(); return r.next(b, i) }
	for _, n := range []int{0, 1, 7, 8, 9, 15, 31, 32, 33, 40, shortRun - 1, shortRun, shortRun + 1, shortRun + 9, shortRun + 40, 2*shortRun + 3} {
		for at := 0; at <= n; at++ {
			for _, p := range plain {
				b := bytes.Repeat([]byte{p}, n)
				if got := next(b, 0); got != n {
					t.Fatalf("next(%q) = %d, want %d", b, got, n)
				}
				for _, sp := range specials {
					if at == n {
						continue
					}
					b[at] = sp
					if got := next(b, 0); got != at {
						t.Fatalf("next(%q) = %d, want %d", b, got, at)
					}
					if got := next(b, at+1); got != n {
						t.Fatalf("next(%q, %d) = %d, want %d", b, at+1, got, n)
					}
					// The same runEnds, after finding a quote further on,
					// still stops at a nearer special.
					if at >= 1 && at+1 < n {
						b[at+1] = '"'
						r := newRunEnds()
						if got := r.next(b, 0); got != at {
							t.Fatalf("next(%q) = %d, want %d", b, got, at)
						}
						if got := r.next(b, at+1); got != at+1 {
							t.Fatalf("then next(%q, %d) = %d, want %d", b, at+1, got, at+1)
						}
						if got := r.next(b, at+2); got != n {
							t.Fatalf("then next(%q, %d) = %d, want %d", b, at+2, got, n)
						}
						b[at+1] = p
					}
					b[at] = p
				}
			}
		}
	}
}
