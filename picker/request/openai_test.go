package request

import (
	"strings"
	"testing"
)

// parseOK parses body sent to path and fails the test on error.
func parseOK(t *testing.T, path, body string) Parsed {
	t.Helper()
	p, err := Parse(path, []byte(body), nil)
	if err != nil {
		t.Fatalf("Parse(%s, %s): %v", path, body, err)
	}
	return p
}

func TestParseResponses(t *testing.T) {
	for _, tc := range []struct {
		name      string
		body      string
		stream    bool
		maxTokens int
		prompt    string
	}{
		{"string input", `{"model":"m","input":"Tell me a joke"}`, false, 0,
			"\x00Ruser\x00CTell me a joke\x00E"},
		{"no input", `{"model":"m","previous_response_id":"resp_1"}`, false, 0,
			"\x00Qresp_1"},
		{"null fields", `{"model":"m","input":null,"instructions":null,"tools":null,"previous_response_id":null}`, false, 0, ""},
		{"instructions, tools and input in canonical order",
			`{"input":"Hi","tools":[{"type":"function","name":"f"}],"model":"m","instructions":"Be brief.","stream":true,"max_output_tokens":64}`, true, 64,
			"\x00T[{\"type\":\"function\",\"name\":\"f\"}]\x00Rsystem\x00CBe brief.\x00E\x00Ruser\x00CHi\x00E"},
		{"previous_response_id first",
			`{"model":"m","input":"more","previous_response_id":"resp_\u0031","instructions":"S"}`, false, 0,
			"\x00Qresp_1\x00Rsystem\x00CS\x00E\x00Ruser\x00Cmore\x00E"},
		{"messages with string and part content",
			`{"model":"m","input":[{"role":"developer","content":"Rules"},{"type":"message","content":[{"type":"input_text","text":"What is "},{"text":"this?","type":"input_text"},{"type":"input_image","image_url":"https://x/a.png","detail":"low"}],"role":"user"}]}`, false, 0,
			"\x00Rdeveloper\x00CRules\x00E\x00Ruser\x00CWhat is this?\x00P{\"type\":\"input_image\",\"image_url\":\"https://x/a.png\",\"detail\":\"low\"}\x00E"},
		{"an earlier output message",
			`{"model":"m","input":[{"id":"msg_1","type":"message","role":"assistant","status":"completed","content":[{"type":"output_text","text":"42","annotations":[]}]},{"role":"user","content":"Why?"}]}`, false, 0,
			"\x00Rassistant\x00C42\x00E\x00Ruser\x00CWhy?\x00E"},
		{"other items are raw JSON, whatever the key order",
			`{"model":"m","input":[{"call_id":"c1","type":"function_call","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c1","output":"18C"}]}`, false, 0,
			"\x00X{\"call_id\":\"c1\",\"type\":\"function_call\",\"name\":\"f\",\"arguments\":\"{}\"}\x00X{\"type\":\"function_call_output\",\"call_id\":\"c1\",\"output\":\"18C\"}"},
		{"an item referred to by its id alone, and a message without a role, are raw",
			`{"model":"m","input":[{"id":"msg_123"},{"type":"message","content":"hi"},{"role":"user","content":"Q"}]}`, false, 0,
			"\x00X{\"id\":\"msg_123\"}\x00X{\"type\":\"message\",\"content\":\"hi\"}\x00Ruser\x00CQ\x00E"},
		{"a reasoning item with content is raw",
			`{"model":"m","input":[{"content":[{"type":"reasoning_text","text":"hmm"}],"type":"reasoning","id":"r1","summary":[]}]}`, false, 0,
			"\x00X{\"content\":[{\"type\":\"reasoning_text\",\"text\":\"hmm\"}],\"type\":\"reasoning\",\"id\":\"r1\",\"summary\":[]}"},
		{"chat text parts are not Responses text",
			`{"model":"m","input":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`, false, 0,
			"\x00Ruser\x00C\x00P{\"type\":\"text\",\"text\":\"x\"}\x00E"},
		{"message fields in any order, null content",
			`{"model":"m","input":[{"content":null,"role":"user"},{"content":"b","role":"user"}]}`, false, 0,
			"\x00Ruser\x00E\x00Ruser\x00Cb\x00E"},
		{"NUL escaped", `{"model":"m","instructions":"a\u0000E","input":[{"role":"u\u0000","content":"\u0000"}]}`, false, 0,
			"\x00Rsystem\x00Ca\x00\xffE\x00E\x00Ru\x00\xff\x00C\x00\xff\x00E"},
		{"chat-only fields ignored", `{"model":"m","input":"x","messages":7,"prompt":{},"max_tokens":"no","max_completion_tokens":[]}`, false, 0,
			"\x00Ruser\x00Cx\x00E"},
		{"empty input array", `{"model":"m","input":[]}`, false, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := parseOK(t, responsesPath, tc.body)
			if p.Kind != KindResponses || p.Model != "m" || p.Stream != tc.stream || p.MaxTokens != tc.maxTokens {
				t.Errorf("got %v %q stream %v max %d, want responses \"m\" %v %d", p.Kind, p.Model, p.Stream, p.MaxTokens, tc.stream, tc.maxTokens)
			}
			if string(p.Prompt) != tc.prompt {
				t.Errorf("prompt\n %q\nwant\n %q", p.Prompt, tc.prompt)
			}
		})
	}
}

// TestResponsesPromptSharesPrefixes checks the invariant for the Responses
// API: requests that begin alike share Prompt bytes, with each other and
// with the same conversation sent to chat completions.
func TestResponsesPromptSharesPrefixes(t *testing.T) {
	prompt := func(path, body string) string { return string(parseOK(t, path, body).Prompt) }

	chat := prompt(chatPath, `{"model":"m","tools":[1],"messages":[{"role":"system","content":"S"},{"role":"user","content":"Q"}]}`)
	for _, body := range []string{
		`{"model":"m","tools":[1],"instructions":"S","input":"Q"}`,
		`{"input":"Q","instructions":"S","model":"m","tools":[1]}`,
		`{"model":"m","tools":[1],"input":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"input_text","text":"Q"}]}]}`,
		`{"model":"m","tools":[1],"instructions":"S","input":[{"type":"message","role":"user","content":"Q"}]}`,
	} {
		if got := prompt(responsesPath, body); got != chat {
			t.Errorf("Prompt of %s\n= %q\nwant the chat Prompt %q", body, got, chat)
		}
	}

	short := prompt(responsesPath, `{"model":"m","instructions":"S","input":[{"role":"user","content":"Q1"}]}`)
	long := prompt(responsesPath, `{"model":"m","instructions":"S","input":[{"role":"user","content":"Q1"},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"role":"user","content":"Q2"}]}`)
	if !strings.HasPrefix(long, short) || len(long) == len(short) {
		t.Errorf("extended input %q does not extend %q", long, short)
	}
	distinct := []string{
		`{"model":"m","input":"ab"}`,
		`{"model":"m","instructions":"ab"}`,
		`{"model":"m","input":[{"role":"assistant","content":"ab"}]}`,
		`{"model":"m","previous_response_id":"r1","input":"ab"}`,
		`{"model":"m","previous_response_id":"r2","input":"ab"}`,
		`{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":"ab"}]}`,
		`{"model":"m","input":[{"role":"user","content":[{"type":"input_image","image_url":"ab"}]}]}`,
	}
	seen := map[string]string{}
	for _, body := range distinct {
		got := prompt(responsesPath, body)
		if other, ok := seen[got]; ok {
			t.Errorf("same Prompt %q for\n %s\nand\n %s", got, body, other)
		}
		seen[got] = body
	}
}

func TestParseEmbeddings(t *testing.T) {
	for _, tc := range []struct {
		name, body, prompt string
	}{
		{"string", `{"model":"m","input":"The food was delicious"}`, "The food was delicious"},
		{"strings", `{"model":"m","input":["a","b"],"encoding_format":"float"}`, "a\nb"},
		{"token ids", `{"model":"m","input":[1,2,70000]}`, le(1, 2, 70000)},
		{"token-id arrays", `{"input":[[1],[2,3]],"model":"m","dimensions":256}`, le(1, 2, 3)},
		{"empty array", `{"model":"m","input":[]}`, ""},
		{"completion fields ignored", `{"model":"m","input":"x","prompt":5,"stream":"no","max_tokens":-1}`, "x"},
		{"chat-style messages", `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]}]}`,
			"\x00Ruser\x00Ca\x00P{\"type\":\"image_url\",\"image_url\":{\"url\":\"u\"}}\x00E"},
		{"input wins over messages", `{"model":"m","messages":[{"role":"user","content":"no"}],"input":"yes"}`, "yes"},
		{"input wins over later messages", `{"model":"m","input":"yes","messages":[{"role":"user","content":"no"}],"tools":{}}`, "yes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := parseOK(t, embeddingsPath, tc.body)
			if p.Kind != KindEmbeddings || p.Model != "m" || p.Stream || p.MaxTokens != 0 {
				t.Errorf("got %v %q stream %v max %d, want embeddings \"m\" false 0", p.Kind, p.Model, p.Stream, p.MaxTokens)
			}
			if string(p.Prompt) != tc.prompt {
				t.Errorf("prompt %q, want %q", p.Prompt, tc.prompt)
			}
		})
	}
	// An embeddings input hashes as the same completions prompt.
	if e, c := parseOK(t, embeddingsPath, `{"model":"m","input":["a","b"]}`), parseOK(t, completionsPath, `{"model":"m","prompt":["a","b"]}`); string(e.Prompt) != string(c.Prompt) {
		t.Errorf("embeddings Prompt %q differs from completions %q", e.Prompt, c.Prompt)
	}
}

func TestParseCacheSalt(t *testing.T) {
	for _, tc := range []struct {
		path, body, salt string
	}{
		{completionsPath, `{"model":"m","prompt":"x","cache_salt":"tenant-a"}`, "tenant-a"},
		{chatPath, `{"cache_salt":"t\u00e9","model":"m","messages":[]}`, "té"},
		{responsesPath, `{"model":"m","input":"x","cache_salt":"s"}`, "s"},
		{embeddingsPath, `{"model":"m","input":"x","cache_salt":"s"}`, "s"},
		{completionsPath, `{"model":"m","prompt":"x"}`, ""},
		{completionsPath, `{"model":"m","prompt":"x","cache_salt":null}`, ""},
		{completionsPath, `{"model":"m","prompt":"x","cache_salt":""}`, ""},
		{completionsPath, `{"model":"m","prompt":"x","cache_salt":"a","cache_salt":"b"}`, "b"},
		{completionsPath, `{"model":"m","prompt":"x","cache_salt":"a","cache_salt":null}`, ""},
	} {
		p := parseOK(t, tc.path, tc.body)
		if p.CacheSalt != tc.salt {
			t.Errorf("Parse(%s, %s): salt %q, want %q", tc.path, tc.body, p.CacheSalt, tc.salt)
		}
		if strings.Contains(string(p.Prompt), "tenant") {
			t.Errorf("the salt leaked into the Prompt %q", p.Prompt)
		}
	}
}

// TestParseIntegralNumbers: integer fields take what vLLM's request models
// take (pydantic, lax mode): a number with an integral value, however
// written.
func TestParseIntegralNumbers(t *testing.T) {
	for _, tc := range []struct {
		value string
		want  int
	}{
		{"100", 100}, {"100.0", 100}, {"100.000", 100}, {"1e2", 100}, {"1E+2", 100}, {"1000e-1", 100},
		{"0.0", 0}, {"-0", 0}, {"-0.0", 0}, {"2147483647.0", 2147483647}, {"2.147483647e9", 2147483647},
		{"100.00000000000000001", 100}, // as Python reads it: the float 100.0
	} {
		p := parseOK(t, completionsPath, `{"model":"m","prompt":"x","max_tokens":`+tc.value+`}`)
		if p.MaxTokens != tc.want {
			t.Errorf("max_tokens %s: %d, want %d", tc.value, p.MaxTokens, tc.want)
		}
		p = parseOK(t, chatPath, `{"model":"m","messages":[],"max_completion_tokens":`+tc.value+`}`)
		if p.MaxTokens != tc.want {
			t.Errorf("max_completion_tokens %s: %d, want %d", tc.value, p.MaxTokens, tc.want)
		}
	}
	if p := parseOK(t, completionsPath, `{"model":"m","prompt":[1.0,2e0,3]}`); string(p.Prompt) != le(1, 2, 3) {
		t.Errorf("token ids 1.0, 2e0, 3: prompt %q", p.Prompt)
	}
}

// TestParseLastWins: a repeated key is read each time and the last one wins,
// as encoding/json and Python's json.loads do, so that the request is routed
// for what the server reads.
func TestParseLastWins(t *testing.T) {
	for _, tc := range []struct {
		name, path, body string
		model            string
		stream           bool
		maxTokens        int
		prompt           string
	}{
		{"model", completionsPath, `{"model":"a","prompt":"x","model":"b"}`, "b", false, 0, "x"},
		{"escaped model", completionsPath, `{"model":"a","prompt":"x","m\u006fdel":"b"}`, "b", false, 0, "x"},
		{"prompt", completionsPath, `{"model":"m","prompt":"first","prompt":["y","z"]}`, "m", false, 0, "y\nz"},
		{"prompt of another shape", completionsPath, `{"prompt":[1,2],"model":"m","prompt":"t"}`, "m", false, 0, "t"},
		{"stream", chatPath, `{"model":"m","messages":[],"stream":true,"stream":false}`, "m", false, 0, ""},
		{"stream null", chatPath, `{"model":"m","messages":[],"stream":true,"stream":null}`, "m", false, 0, ""},
		{"max_tokens", completionsPath, `{"model":"m","prompt":"x","max_tokens":5,"max_tokens":7}`, "m", false, 7, "x"},
		{"max_completion_tokens null", completionsPath, `{"model":"m","prompt":"x","max_tokens":5,"max_completion_tokens":3,"max_completion_tokens":null}`, "m", false, 5, "x"},
		{"messages", chatPath, `{"model":"m","messages":[{"role":"a","content":"x"}],"tools":[1],"messages":[{"role":"b"}]}`, "m", false, 0,
			"\x00T[1]\x00Rb\x00E"},
		{"tools", chatPath, `{"model":"m","tools":[1],"messages":[{"role":"u"}],"tools":null}`, "m", false, 0, "\x00Ru\x00E"},
		{"tools after messages", chatPath, `{"model":"m","messages":[{"role":"u"}],"tools":[1],"tools":[22]}`, "m", false, 0, "\x00T[22]\x00Ru\x00E"},
		{"message role", chatPath, `{"model":"m","messages":[{"role":"a","content":"x","role":"b"}]}`, "m", false, 0, "\x00Rb\x00Cx\x00E"},
		{"message content", chatPath, `{"model":"m","messages":[{"role":"a","content":"x","name":"n","content":null}]}`, "m", false, 0, "\x00Ra\x00Nn\x00E"},
		{"message content parts", chatPath, `{"model":"m","messages":[{"content":[{"type":"text","text":"p"}],"role":"a","content":"q"}]}`, "m", false, 0, "\x00Ra\x00Cq\x00E"},
		{"tool_calls", chatPath, `{"model":"m","messages":[{"role":"a","tool_calls":[1],"tool_call_id":"i","tool_calls":null,"tool_call_id":"j"}]}`, "m", false, 0, "\x00Ra\x00Ij\x00E"},
		{"part type", chatPath, `{"model":"m","messages":[{"role":"a","content":[{"type":"text","text":"x","type":"image_url"}]}]}`, "m", false, 0,
			"\x00Ra\x00C\x00P{\"type\":\"text\",\"text\":\"x\",\"type\":\"image_url\"}\x00E"},
		{"part type becomes text", chatPath, `{"model":"m","messages":[{"role":"a","content":[{"type":"image_url","text":"x","type":"text"}]}]}`, "m", false, 0,
			"\x00Ra\x00Cx\x00E"},
		{"part text", chatPath, `{"model":"m","messages":[{"role":"a","content":[{"text":"x","type":"text","text":"y"}]}]}`, "m", false, 0, "\x00Ra\x00Cy\x00E"},
		{"responses input and instructions", responsesPath, `{"model":"m","input":"a","instructions":"s","input":[{"role":"u","content":"b"}],"instructions":null}`, "m", false, 0,
			"\x00Ru\x00Cb\x00E"},
		{"responses item type", responsesPath, `{"model":"m","input":[{"type":"function_call","role":"user","content":"c","type":"message"}]}`, "m", false, 0,
			"\x00Ruser\x00Cc\x00E"},
		{"responses item role and content", responsesPath, `{"model":"m","input":[{"role":"a","content":"x","role":"b","content":[{"type":"input_text","text":"y"}]}]}`, "m", false, 0,
			"\x00Rb\x00Cy\x00E"},
		{"embeddings input", embeddingsPath, `{"model":"m","input":"x","input":[3]}`, "m", false, 0, le(3)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := parseOK(t, tc.path, tc.body)
			if p.Model != tc.model || p.Stream != tc.stream || p.MaxTokens != tc.maxTokens {
				t.Errorf("got model %q stream %v max %d, want %q %v %d", p.Model, p.Stream, p.MaxTokens, tc.model, tc.stream, tc.maxTokens)
			}
			if string(p.Prompt) != tc.prompt {
				t.Errorf("prompt\n %q\nwant\n %q", p.Prompt, tc.prompt)
			}
		})
	}
}

func TestParseResponsesAllocations(t *testing.T) {
	body := []byte(`{"model":"m","instructions":"` + strings.Repeat("s", 4000) + `","tools":[{"type":"function","name":"f"}],` +
		`"input":[{"role":"user","content":[{"type":"input_text","text":"` + strings.Repeat("q", 4000) + `"}]},` +
		`{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}],"stream":true}`)
	dst := make([]byte, 0, 64<<10)
	allocs := testing.AllocsPerRun(20, func() {
		if p, err := Parse(responsesPath, body, dst); err != nil || len(p.Prompt) == 0 {
			t.Fatalf("Parse: %v", err)
		}
	})
	if allocs > 1 {
		t.Errorf("%v allocations per Parse, want at most 1 (the model)", allocs)
	}
}
