package server

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/tallyepp/tally/internal/modelsim/engine"
)

// generateRequest holds the fields of /v1/completions and
// /v1/chat/completions that the simulator reads; others are ignored, as an
// OpenAI-compatible server would.
type generateRequest struct {
	Model               string            `json:"model"`
	Prompt              json.RawMessage   `json:"prompt"`
	Messages            []chatMessage     `json:"messages"`
	Stream              bool              `json:"stream"`
	MaxTokens           *int              `json:"max_tokens"`
	MaxCompletionTokens *int              `json:"max_completion_tokens"`
	KVTransferParams    *kvTransferParams `json:"kv_transfer_params"`
	// adapter is the LoRA adapter Model names; "" is the base model.
	adapter string
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// prompt is a request's prompt as the engine sees it.
type prompt struct {
	tokens int
	hashes []uint64
	// key hashes the whole prompt: it names a request that has no id.
	key uint64
}

type apiError struct {
	status int
	typ    string
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func badRequest(format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "BadRequestError", msg: fmt.Sprintf(format, args...)}
}

// writeError answers in the OpenAI error shape.
func writeError(w http.ResponseWriter, e *apiError) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"error": map[string]any{"message": e.msg, "type": e.typ, "param": nil, "code": e.status},
	})
}

func (s *Server) handleGenerate(w http.ResponseWriter, r *http.Request, chat bool) {
	ctx := r.Context()
	if s.closed() {
		writeError(w, &apiError{http.StatusServiceUnavailable, "ServiceUnavailableError", "the server is shutting down"})
		return
	}
	req, p, apiErr := s.parse(w, r, chat)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}

	if d := s.cfg.AddedLatency; d > 0 {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		case <-s.done:
			t.Stop()
			writeError(w, &apiError{http.StatusServiceUnavailable, "ServiceUnavailableError", "the server is shutting down"})
			return
		}
	}
	switch fail, hang := s.fault(); {
	case fail:
		writeError(w, &apiError{http.StatusInternalServerError, "InternalServerError", "injected error (error rate)"})
		return
	case hang:
		select {
		case <-ctx.Done():
		case <-s.done:
		}
		return
	}

	prefix := "cmpl-"
	if chat {
		prefix = "chatcmpl-"
	}
	out := &output{
		id:            prefix + strconv.FormatUint(s.nextID.Add(1), 10),
		chat:          chat,
		model:         cmp.Or(req.adapter, s.cfg.Model), // vLLM answers with the adapter's name
		created:       time.Now().Unix(),
		charsPerToken: s.cfg.CharsPerToken,
		promptTokens:  p.tokens,
		maxTokens:     req.maxTokens(),
	}
	var requestID string
	if h := s.cfg.RequestIDHeader; h != "" {
		requestID = r.Header.Get(h)
	}
	late := req.Stream && s.lateFirstBytes(requestID, p.key)
	er := engine.Request{ID: out.id, PromptTokens: p.tokens, OutputTokens: out.maxTokens, BlockHashes: p.hashes, Adapter: req.adapter}
	if kv := req.KVTransferParams; kv != nil {
		switch {
		case kv.DoRemotePrefill:
			url, pull, apiErr := kv.remoteSource()
			if apiErr != nil {
				writeError(w, apiErr)
				return
			}
			if err := s.pullBlocks(ctx, url, pull); err == nil {
				er.RemotePrefill = true
			} else if s.cfg.KVLoadFailurePolicy == KVLoadFailureFail {
				writeError(w, &apiError{http.StatusInternalServerError, "InternalServerError", fmt.Sprintf("KV load failed (kv_load_failure_policy fail): %v", err)})
				return
			} // recompute: an ordinary request, prefilled here
		case kv.DoRemoteDecode:
			er.RemoteDecode = true
		}
	}
	pend, err := s.submit(er)
	if err != nil {
		writeError(w, badRequest("%v", err))
		return
	}

	written := 0 // tokens streamed so far
	var firstToken time.Time
	for {
		select {
		case <-pend.notify:
		case <-ctx.Done():
			s.cancel(out.id)
			return
		case <-s.done:
			if written == 0 {
				writeError(w, &apiError{http.StatusServiceUnavailable, "ServiceUnavailableError", "the server is shutting down"})
			}
			return
		}
		tokens, cached, finished := s.snapshot(pend)
		if tokens > 0 && firstToken.IsZero() {
			firstToken = time.Now()
		}
		if !req.Stream {
			if finished {
				if er.RemoteDecode {
					out.kvParams = s.heldParams(r, out.id)
				}
				out.writeJSON(w, cached)
				return
			}
			continue
		}
		// Headers go out with the first token, so the first response byte
		// marks the end of prefill, as the picker expects; a late response
		// holds everything back, headers too, until the last token.
		if tokens > written && (!late || finished) {
			if written == 0 {
				w.Header().Set("Content-Type", "text/event-stream")
				w.Header().Set("Cache-Control", "no-cache")
				if late {
					w.Header().Set(HeldBackHeader, strconv.FormatFloat(float64(time.Since(firstToken))/float64(time.Millisecond), 'f', 3, 64))
				}
				w.WriteHeader(http.StatusOK)
			}
			var buf bytes.Buffer
			for ; written < tokens; written++ {
				out.appendChunk(&buf, written, finished && written == tokens-1)
			}
			if finished {
				out.appendUsageChunk(&buf, cached)
				buf.WriteString("data: [DONE]\n\n")
			}
			if _, err := w.Write(buf.Bytes()); err != nil {
				s.cancel(out.id)
				return
			}
			_ = http.NewResponseController(w).Flush()
		}
		if finished {
			return
		}
	}
}

// parse decodes and checks a request and turns its prompt into tokens.
func (s *Server) parse(w http.ResponseWriter, r *http.Request, chat bool) (generateRequest, prompt, *apiError) {
	var req generateRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxRequestBytes))
	if err := dec.Decode(&req); err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return req, prompt{}, &apiError{http.StatusRequestEntityTooLarge, "BadRequestError", fmt.Sprintf("request body over %d bytes", maxRequestBytes)}
		}
		return req, prompt{}, badRequest("invalid JSON body: %v", err)
	}
	if req.Model != "" && req.Model != s.cfg.Model {
		if _, ok := s.adapters[req.Model]; !ok {
			return req, prompt{}, &apiError{http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist; this server serves %s.", req.Model, s.servedModels())}
		}
		req.adapter = req.Model
	}
	for _, f := range []struct {
		name string
		v    *int
	}{{"max_tokens", req.MaxTokens}, {"max_completion_tokens", req.MaxCompletionTokens}} {
		if f.v != nil && *f.v < 1 {
			return req, prompt{}, badRequest("%s: %d is invalid: must be 1 or more", f.name, *f.v)
		}
	}
	bs := s.cfg.Engine.BlockSizeTokens
	if chat {
		text, err := chatText(req.Messages)
		if err != nil {
			return req, prompt{}, err
		}
		return req, textPrompt(text, s.cfg.CharsPerToken, bs), nil
	}
	p, err := completionPrompt(req.Prompt, s.cfg.CharsPerToken, bs)
	return req, p, err
}

func (r generateRequest) maxTokens() int {
	switch {
	case r.MaxCompletionTokens != nil:
		return *r.MaxCompletionTokens
	case r.MaxTokens != nil:
		return *r.MaxTokens
	}
	return DefaultMaxTokens
}

// completionPrompt accepts a string, a token-id array, or a batch of one
// of either (the simulator serves one sequence per request).
func completionPrompt(raw json.RawMessage, charsPerToken, blockTokens int) (prompt, *apiError) {
	var text string
	if err := json.Unmarshal(raw, &text); err == nil {
		if text == "" {
			return prompt{}, badRequest("prompt: must not be empty")
		}
		return textPrompt(text, charsPerToken, blockTokens), nil
	}
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err == nil && len(ids) > 0 {
		return idsPrompt(ids, blockTokens), nil
	}
	var texts []string
	if err := json.Unmarshal(raw, &texts); err == nil && len(texts) == 1 && texts[0] != "" {
		return textPrompt(texts[0], charsPerToken, blockTokens), nil
	}
	var batches [][]int64
	if err := json.Unmarshal(raw, &batches); err == nil && len(batches) == 1 && len(batches[0]) > 0 {
		return idsPrompt(batches[0], blockTokens), nil
	}
	if len(raw) == 0 {
		return prompt{}, badRequest("prompt: is required")
	}
	return prompt{}, badRequest("prompt: must be a non-empty string, a token-id array, or a list of exactly one of those")
}

// chatText renders messages with a small chat template, so a conversation
// that grows keeps its earlier messages as a shared prefix.
func chatText(msgs []chatMessage) (string, *apiError) {
	if len(msgs) == 0 {
		return "", badRequest("messages: must not be empty")
	}
	var b strings.Builder
	for i, m := range msgs {
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|>\n")
		if len(m.Content) > 0 && string(m.Content) != "null" {
			var s string
			if err := json.Unmarshal(m.Content, &s); err == nil {
				b.WriteString(s)
			} else {
				var parts []struct {
					Type string `json:"type"`
					Text string `json:"text"`
				}
				if err := json.Unmarshal(m.Content, &parts); err != nil {
					return "", badRequest("messages[%d].content: must be a string or an array of content parts", i)
				}
				for _, p := range parts {
					b.WriteString(p.Text) // parts that are not text add no tokens
				}
			}
		}
		b.WriteString("\n")
	}
	b.WriteString("<|assistant|>\n")
	return b.String(), nil
}

// textPrompt counts tokens as the picker estimates them and hashes each
// full block of text, chained to the blocks before it.
func textPrompt(text string, charsPerToken, blockTokens int) prompt {
	return prompt{
		tokens: max(len(text)/charsPerToken, 1),
		hashes: engine.TextBlockHashes(text, charsPerToken*blockTokens),
		key:    xxhash.Sum64String(text),
	}
}

func idsPrompt(ids []int64, blockTokens int) prompt {
	hashes := make([]uint64, len(ids)/blockTokens)
	d := xxhash.New()
	var prev, id [8]byte
	for i := range hashes {
		d.Reset()
		_, _ = d.Write(prev[:])
		for _, t := range ids[i*blockTokens : (i+1)*blockTokens] {
			binary.LittleEndian.PutUint64(id[:], uint64(t))
			_, _ = d.Write(id[:])
		}
		hashes[i] = d.Sum64()
		binary.LittleEndian.PutUint64(prev[:], hashes[i])
	}
	d.Reset()
	for _, t := range ids {
		binary.LittleEndian.PutUint64(id[:], uint64(t))
		_, _ = d.Write(id[:])
	}
	return prompt{tokens: len(ids), hashes: hashes, key: d.Sum64()}
}

// output renders one request's response.
type output struct {
	id            string
	chat          bool
	model         string
	created       int64
	charsPerToken int
	promptTokens  int
	maxTokens     int
	// kvParams are a finished prefill leg's, for its non-streamed response.
	kvParams *kvTransferParams
}

// filler is the generated text, repeated: deterministic, and CharsPerToken
// bytes per token like the prompts.
const filler = "the quick brown fox jumps over the lazy dog "

func tokenText(i, charsPerToken int) string {
	b := make([]byte, charsPerToken)
	for j := range b {
		b[j] = filler[(i*charsPerToken+j)%len(filler)]
	}
	return string(b)
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (o *output) usage(cached int) *usage {
	u := &usage{PromptTokens: o.promptTokens, CompletionTokens: o.maxTokens, TotalTokens: o.promptTokens + o.maxTokens}
	u.PromptTokensDetails.CachedTokens = cached
	return u
}

type chatMessageOut struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content"`
}

// choice covers the choice shapes of all four responses; the fields a
// shape does not have are left nil and omitted.
type choice struct {
	Index        int             `json:"index"`
	Text         *string         `json:"text,omitempty"`
	Message      *chatMessageOut `json:"message,omitempty"`
	Delta        *chatMessageOut `json:"delta,omitempty"`
	Logprobs     any             `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
}

type response struct {
	ID      string   `json:"id"`
	Object  string   `json:"object"`
	Created int64    `json:"created"`
	Model   string   `json:"model"`
	Choices []choice `json:"choices"`
	Usage   *usage   `json:"usage,omitempty"`
	// KVTransferParams is a prefill leg's, omitted elsewhere and when
	// its blocks are held no longer.
	KVTransferParams *kvTransferParams `json:"kv_transfer_params,omitempty"`
}

func (o *output) response(object string, choices []choice, u *usage) response {
	return response{ID: o.id, Object: object, Created: o.created, Model: o.model, Choices: choices, Usage: u}
}

// finishLength is the only reason the simulator finishes for: it always
// generates the requested number of tokens.
func finishLength() *string { s := "length"; return &s }

func (o *output) appendChunk(buf *bytes.Buffer, i int, last bool) {
	text := tokenText(i, o.charsPerToken)
	c := choice{}
	if last {
		c.FinishReason = finishLength()
	}
	object := "text_completion"
	if o.chat {
		object = "chat.completion.chunk"
		c.Delta = &chatMessageOut{Content: text}
		if i == 0 {
			c.Delta.Role = "assistant"
		}
	} else {
		c.Text = &text
	}
	appendEvent(buf, o.response(object, []choice{c}, nil))
}

// appendUsageChunk is the last chunk before [DONE], as vLLM sends it with
// stream_options.include_usage: no choices, only usage.
func (o *output) appendUsageChunk(buf *bytes.Buffer, cached int) {
	object := "text_completion"
	if o.chat {
		object = "chat.completion.chunk"
	}
	appendEvent(buf, o.response(object, []choice{}, o.usage(cached)))
}

func appendEvent(buf *bytes.Buffer, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("marshalling a response chunk: %v", err)) // only fixed types are marshalled
	}
	buf.WriteString("data: ")
	buf.Write(b)
	buf.WriteString("\n\n")
}

func (o *output) writeJSON(w http.ResponseWriter, cached int) {
	var text strings.Builder
	for i := range o.maxTokens {
		text.WriteString(tokenText(i, o.charsPerToken))
	}
	c := choice{FinishReason: finishLength()}
	object := "text_completion"
	if o.chat {
		object = "chat.completion"
		c.Message = &chatMessageOut{Role: "assistant", Content: text.String()}
	} else {
		s := text.String()
		c.Text = &s
	}
	resp := o.response(object, []choice{c}, o.usage(cached))
	resp.KVTransferParams = o.kvParams
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(resp)
}

// servedModels names the base model and the adapters for an error message.
func (s *Server) servedModels() string {
	served := strconv.Quote(s.cfg.Model)
	if len(s.cfg.LoRAModules) == 0 {
		return served
	}
	names := make([]string, len(s.cfg.LoRAModules))
	for i, m := range s.cfg.LoRAModules {
		names[i] = strconv.Quote(m.Name)
	}
	return served + " and the LoRA adapters " + strings.Join(names, ", ")
}

// modelCard is an entry of GET /v1/models as vLLM writes it (its ModelCard,
// less the permission list): the base model has no parent; an adapter has
// the base model as parent, its path as root and no max_model_len.
type modelCard struct {
	ID          string  `json:"id"`
	Object      string  `json:"object"`
	Created     int64   `json:"created"`
	OwnedBy     string  `json:"owned_by"`
	Root        string  `json:"root"`
	Parent      *string `json:"parent"`
	MaxModelLen *int    `json:"max_model_len"`
}

func (s *Server) handleModels(w http.ResponseWriter, _ *http.Request) {
	maxLen := s.cfg.Engine.KVBlocks * s.cfg.Engine.BlockSizeTokens
	base := s.cfg.Model
	cards := []modelCard{{ID: base, Object: "model", Created: s.start.Unix(), OwnedBy: "vllm", Root: base, MaxModelLen: &maxLen}}
	for _, m := range s.cfg.LoRAModules {
		cards = append(cards, modelCard{
			ID: m.Name, Object: "model", Created: s.start.Unix(), OwnedBy: "vllm",
			Root: cmp.Or(m.Path, m.Name), Parent: &base,
		})
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": cards})
}

func (s *Server) handleHealth(w http.ResponseWriter, _ *http.Request) {
	if s.closed() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}
