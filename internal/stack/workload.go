package stack

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"
)

// CompletionsPath is the OpenAI API path every workload request uses.
const CompletionsPath = "/v1/completions"

// Request is one request of a workload, ready to send.
type Request struct {
	// At is when to send it, from the start of the replay, in wall time.
	At time.Duration
	// Path is the HTTP path (POST).
	Path string
	// Body is the JSON request body.
	Body []byte
	// PromptTokens is the prompt length as the picker and simulator count it.
	PromptTokens int
	// Stream asks for an SSE response.
	Stream bool
	// Headers are sent besides the content type and the request id (the
	// flow control headers, for example).
	Headers map[string]string
	// DrawKey is sent in DrawKeyHeader; "" sends the request's id. The
	// simulators draw which responses they hold back from it, so requests
	// that share a key (one trace request replayed by two policies) are
	// held back alike.
	DrawKey string
}

// DrawKeyOf is the key the simulators draw from for the request sent with
// id: its DrawKey, or id when it has none.
func (r Request) DrawKeyOf(id string) string {
	if r.DrawKey == "" {
		return id
	}
	return r.DrawKey
}

type completionBody struct {
	Model         string         `json:"model"`
	Prompt        string         `json:"prompt"`
	MaxTokens     int            `json:"max_tokens"`
	Stream        bool           `json:"stream"`
	StreamOptions *streamOptions `json:"stream_options,omitempty"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// Completion builds a /v1/completions request for prompt. Streaming requests
// ask for usage in the stream (OpenAI's stream_options.include_usage) so the
// cache hit rate can be read from them.
func Completion(model, prompt string, maxTokens int, stream bool) Request {
	body := completionBody{Model: model, Prompt: prompt, MaxTokens: maxTokens, Stream: stream}
	if stream {
		body.StreamOptions = &streamOptions{IncludeUsage: true}
	}
	data, err := json.Marshal(body)
	if err != nil {
		// A struct of strings, ints and bools always marshals.
		panic(fmt.Sprintf("marshalling a completion request: %v", err))
	}
	return Request{
		Path:         CompletionsPath,
		Body:         data,
		PromptTokens: len(prompt) / charsPerToken,
		Stream:       stream,
	}
}

// TraceWorkload turns trace rows into streaming completion requests whose
// arrivals are compressed by timeScale (10 sends a 100 s trace in 10 s, to
// match simulators that run ten times faster than real time).
func TraceWorkload(trace []TraceRequest, model string, timeScale float64) []Request {
	out := make([]Request, len(trace))
	var start time.Duration
	if len(trace) > 0 {
		start = trace[0].Arrival
	}
	for i, t := range trace {
		out[i] = Completion(model, t.PromptText(), t.OutputTokens, true)
		out[i].At = time.Duration(float64(t.Arrival-start) / timeScale)
		out[i].DrawKey = TraceDrawKey(i)
	}
	return out
}

// TraceDrawKey is the DrawKey of a trace's i-th request in TraceWorkload.
func TraceDrawKey(i int) string { return "trace-" + strconv.Itoa(i) }

// Burst describes n requests sent at once that share a system prompt.
type Burst struct {
	Requests     int
	SystemTokens int
	UserTokens   int
	MaxTokens    int
	Model        string
	// Seed varies the shared system prompt so that different bursts do not
	// share a prefix with each other.
	Seed int
}

// Workload builds the burst's requests, all at offset zero: one shared
// system prompt followed by a distinct user turn each.
func (b Burst) Workload() []Request {
	system := TraceRequest{InputTokens: b.SystemTokens, HashIDs: hashIDRange(-1_000_000*(b.Seed+1), b.SystemTokens)}.PromptText()
	out := make([]Request, b.Requests)
	for i := range out {
		user := fmt.Sprintf("\nUser %d asks:", i)
		filler := TraceRequest{InputTokens: b.UserTokens, HashIDs: hashIDRange(-1_000_000*(b.Seed+1)-1000*(i+1), b.UserTokens)}.PromptText()
		prompt := system + user + filler
		out[i] = Completion(b.Model, prompt, b.MaxTokens, true)
	}
	return out
}

// hashIDRange gives the ids of a synthetic prompt of tokens tokens, counting
// down from first so synthetic prompts never collide with the trace's
// (non-negative) ids.
func hashIDRange(first, tokens int) []int {
	n := (tokens + traceBlockTokens - 1) / traceBlockTokens
	ids := make([]int, n)
	for i := range ids {
		ids[i] = first - i
	}
	return ids
}
