package extproc_test

import (
	"bytes"
	"slices"
	"strconv"
	"strings"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker/extproc"
	"github.com/tallyepp/tally/picker/rewrite"
)

func TestModelRewriteRewritesTheBodyAndWhatIsScored(t *testing.T) {
	rw := &rewrite.Table{}
	rw.ReplaceRewrites([]rewrite.Rule{{Name: "canary", Models: []string{"llama"},
		Targets: []rewrite.Target{{Model: "llama-v2\u00e9", Weight: 1}}}})
	body := []byte(`{"stream":false,"model" : "llama","prompt":"` + letters(5, 3000) + `","max_tokens":7,"extra":{"model":"keep"}}`)
	want := []byte(`{"stream":false,"model" : "llama-v2é","prompt":"` + letters(5, 3000) + `","max_tokens":7,"extra":{"model":"keep"}}`)
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{0, filterv3.ProcessingMode_BUFFERED} {
		t.Run(mode.String(), func(t *testing.T) {
			f, log := logged(t, fixtureOptions{rewrites: rw})
			x, err := f.gw.Open(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			r, err := x.SendRequest(envoy.Request{Headers: gatewayHeaders("POST", "/v1/completions"), Body: body, Mode: mode})
			if err != nil || r.Immediate != nil {
				t.Fatalf("err %v, immediate %v", err, r.Immediate)
			}
			if !bytes.Equal(r.Body, want) {
				t.Errorf("body sent on:\n %s\nwant\n %s", r.Body, want)
			}
			answer := r.HeadersAnswer
			if mode == filterv3.ProcessingMode_BUFFERED {
				answer = r.BodyAnswer
			}
			if cl, _ := envoy.HeaderValue(answer, "content-length"); cl != strconv.Itoa(len(want)) {
				t.Errorf("content-length %q, want %d", cl, len(want))
			}
			if got := log.last(t).Model; got != "llama-v2é" {
				t.Errorf("the picker scored model %q, want the target llama-v2é", got)
			}
			if err := x.Respond(okResponse); err != nil {
				t.Fatal(err)
			}
			if got := f.counter(t, "inference_extension_model_rewrite_decisions_total",
				map[string]string{"model_rewrite_name": "canary", "model_name": "llama", "target_model": "llama-v2é"}); got != 1 {
				t.Errorf("rewrite decisions = %v, want 1", got)
			}
			if got := f.counter(t, "inference_objective_request_total",
				map[string]string{"model_name": "llama", "target_model_name": "llama-v2é", "priority": "0"}); got != 1 {
				t.Errorf("inference_objective_request_total{llama -> llama-v2é} = %v, want 1", got)
			}
		})
	}
	// A model no rule matches passes byte for byte.
	f, log := logged(t, fixtureOptions{rewrites: rw})
	other := completion("mistral", letters(6, 400))
	r, err := f.gw.roundTrip(t.Context(), other)
	if err != nil || !bytes.Equal(r.Body, other.Body) || log.last(t).Model != "mistral" {
		t.Errorf("an unmatched model: err %v, body changed %v, scored %q", err, !bytes.Equal(r.Body, other.Body), log.last(t).Model)
	}
}

// A gateway's x-gateway-model-name-rewrite header names the model a
// request is sent on as where no rule matches its model (the upstream
// picker's behaviour); a matching rule wins over it.
func TestTheModelNameRewriteHeaderAppliesWhereNoRuleMatches(t *testing.T) {
	rw := &rewrite.Table{}
	rw.ReplaceRewrites([]rewrite.Rule{{Name: "canary", Models: []string{"llama"},
		Targets: []rewrite.Target{{Model: "llama-v2", Weight: 1}}}})
	prompt := letters(7, 500)
	for _, tc := range []struct {
		name     string
		rewrites extproc.Rewrites
		model    string
		want     string
	}{
		{"no rules", nil, "mistral", "mistral-v3"},
		{"no rule for the model", rw, "mistral", "mistral-v3"},
		{"a rule for the model", rw, "llama", "llama-v2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, log := logged(t, fixtureOptions{rewrites: tc.rewrites})
			req := completion(tc.model, prompt)
			req.Headers = append(req.Headers, "x-gateway-model-name-rewrite", "mistral-v3")
			r, err := f.gw.roundTrip(t.Context(), req)
			if err != nil || r.Immediate != nil {
				t.Fatalf("err %v, immediate %v", err, r.Immediate)
			}
			want := completionBody(tc.want, prompt)
			if !bytes.Equal(r.Body, want) {
				t.Errorf("body sent on:\n %s\nwant\n %s", r.Body, want)
			}
			if cl, _ := envoy.HeaderValue(r.HeadersAnswer, "content-length"); cl != strconv.Itoa(len(want)) {
				t.Errorf("content-length %q, want %d", cl, len(want))
			}
			if got := log.last(t).Model; got != tc.want {
				t.Errorf("the picker scored model %q, want %q", got, tc.want)
			}
		})
	}
}

// A rewrite on a path whose body the picker does not read as an API
// (vLLM's /tokenize, /v1/messages, an upload) replaces the model the body
// names, and nothing else; a body that names none (not JSON) passes on
// untouched, whatever rule or header would rewrite it: nothing is written
// into it and no decision is counted.
func TestARewriteOnAnotherPathReplacesOnlyTheModelItNames(t *testing.T) {
	rw := &rewrite.Table{}
	rw.ReplaceRewrites([]rewrite.Rule{{Name: "everything", Targets: []rewrite.Target{{Model: "base-v2", Weight: 1}}}})
	tokenize := []byte(`{"prompt":"hi","model" : "base","extra":{"model":"keep"},"add_special_tokens":true}`)
	multipart := []byte("--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--b--\r\n")
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{0, filterv3.ProcessingMode_BUFFERED} {
		for _, tc := range []struct {
			name, path string
			header     string // x-gateway-model-name-rewrite, if any
			body, want []byte
			model      string // scored
			decisions  float64
		}{
			{"tokenize", "/tokenize", "", tokenize,
				[]byte(`{"prompt":"hi","model" : "base-v2","extra":{"model":"keep"},"add_special_tokens":true}`), "base-v2", 1},
			{"multipart upload", "/v1/audio/transcriptions", "", multipart, multipart, "", 0},
			{"multipart upload, rewrite header", "/v1/audio/transcriptions", "whisper-v2", multipart, multipart, "", 0},
		} {
			t.Run(mode.String()+"/"+tc.name, func(t *testing.T) {
				f, log := logged(t, fixtureOptions{rewrites: rw})
				x, err := f.gw.Open(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				req := envoy.Request{Headers: gatewayHeaders("POST", tc.path), Body: tc.body, Mode: mode}
				if tc.header != "" {
					req.Headers = append(req.Headers, "x-gateway-model-name-rewrite", tc.header)
				}
				r, err := x.SendRequest(req)
				if err != nil || r.Immediate != nil {
					t.Fatalf("err %v, immediate %v", err, r.Immediate)
				}
				if mode == filterv3.ProcessingMode_BUFFERED && bytes.Equal(tc.want, tc.body) {
					if mutation := r.BodyAnswer.GetBodyMutation(); mutation != nil {
						t.Errorf("a body with no model to rewrite was answered with a mutation: %v", mutation)
					}
				} else if !bytes.Equal(r.Body, tc.want) {
					t.Errorf("body sent on:\n %q\nwant\n %q", r.Body, tc.want)
				}
				answer := r.HeadersAnswer
				if mode == filterv3.ProcessingMode_BUFFERED {
					answer = r.BodyAnswer
				}
				if cl, ok := envoy.HeaderValue(answer, "content-length"); ok && cl != strconv.Itoa(len(tc.want)) {
					t.Errorf("content-length %q, want %d", cl, len(tc.want))
				}
				if got := log.last(t).Model; got != tc.model {
					t.Errorf("the picker scored model %q, want %q", got, tc.model)
				}
				if err := x.Respond(okResponse); err != nil {
					t.Fatal(err)
				}
				if got := f.counter(t, "inference_extension_model_rewrite_decisions_total",
					map[string]string{"model_rewrite_name": "everything", "model_name": "base", "target_model": "base-v2"}); got != tc.decisions {
					t.Errorf("rewrite decisions = %v, want %v", got, tc.decisions)
				}
			})
		}
	}
}

// Of a repeated x-gateway-model-name-rewrite (a client's, then one the
// route appends), the last is applied, as the upstream picker reads it.
func TestTheLastOfARepeatedRewriteHeaderApplies(t *testing.T) {
	f, log := logged(t, fixtureOptions{})
	prompt := letters(9, 500)
	req := completion("mistral", prompt)
	req.Headers = append(req.Headers, "x-gateway-model-name-rewrite", "from-the-client", "x-gateway-model-name-rewrite", "from-the-route")
	r, err := f.gw.roundTrip(t.Context(), req)
	if err != nil || r.Immediate != nil {
		t.Fatalf("err %v, immediate %v", err, r.Immediate)
	}
	if want := completionBody("from-the-route", prompt); !bytes.Equal(r.Body, want) {
		t.Errorf("body sent on:\n %s\nwant\n %s", r.Body, want)
	}
	if got := log.last(t).Model; got != "from-the-route" {
		t.Errorf("the picker scored model %q, want from-the-route", got)
	}
}

// After a rewrite, the response says the model the client asked for, as
// with the upstream picker: each "model" field naming the target, compact
// or spaced, in every chunk streamed back; the content-length goes when
// the names' lengths differ. Other mentions of the target stay.
func TestTheResponseNamesTheClientsModel(t *testing.T) {
	for _, mode := range []struct {
		name               string
		request, response  filterv3.ProcessingMode_BodySendMode
		wholeBodyMutations bool // not streamed back: chunks replaced whole
	}{
		{"FULL_DUPLEX_STREAMED", filterv3.ProcessingMode_NONE, filterv3.ProcessingMode_NONE, false},
		{"BUFFERED", filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED, true},
		{"request FULL_DUPLEX_STREAMED, response STREAMED", filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_STREAMED, true},
	} {
		for _, tc := range []struct {
			name, model, target string
		}{
			{"longer target", "llama", "llama-v2-canary"},
			{"target of the same length", "llama", "llamb"},
			{"no rewrite", "mistral", "mistral"},
		} {
			t.Run(mode.name+"/"+tc.name, func(t *testing.T) {
				rw := &rewrite.Table{}
				rw.ReplaceRewrites([]rewrite.Rule{{Name: "canary", Models: []string{"llama"},
					Targets: []rewrite.Target{{Model: tc.target, Weight: 1}}}})
				f := newFixture(t, fixtureOptions{rewrites: rw})
				x, err := f.gw.Open(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				defer x.Cancel()
				req := completion(tc.model, letters(8, 300))
				req.Mode, req.ResponseMode = mode.request, mode.response
				if r, err := x.SendRequest(req); err != nil || r.Immediate != nil {
					t.Fatalf("err %v, immediate %v", err, r.Immediate)
				}
				headers := x.ResponseHeadersMessage(response(200, "x"))
				if err := x.Send(headers); err != nil {
					t.Fatal(err)
				}
				answer, err := x.Recv()
				if err != nil {
					t.Fatal(err)
				}
				removed := answer.GetResponseHeaders().GetResponse().GetHeaderMutation().GetRemoveHeaders()
				if want := len(tc.model) != len(tc.target); slices.Contains(removed, "content-length") != want {
					t.Errorf("removed headers %q; want content-length removed: %v", removed, want)
				}
				chunks := []string{
					`data: {"id":"c1","model":"` + tc.target + `","choices":[{"text":"` + tc.target + `"}]}` + "\n\n",
					`{"id": "c2", "model": "` + tc.target + `", "object": "text_completion"}`,
					`data: [DONE]` + "\n\n",
				}
				want := []string{
					`data: {"id":"c1","model":"` + tc.model + `","choices":[{"text":"` + tc.target + `"}]}` + "\n\n",
					`{"id": "c2", "model": "` + tc.model + `", "object": "text_completion"}`,
					`data: [DONE]` + "\n\n",
				}
				for i, c := range chunks {
					if err := x.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
						ResponseBody: &extprocv3.HttpBody{Body: []byte(c), EndOfStream: i == len(chunks)-1}}}); err != nil {
						t.Fatal(err)
					}
					answer, err := x.Recv()
					if err != nil {
						t.Fatal(err)
					}
					mutation := answer.GetResponseBody().GetResponse().GetBodyMutation()
					got := string(mutation.GetStreamedResponse().GetBody())
					if mode.wholeBodyMutations {
						// Left alone when nothing changes, replaced whole
						// when the model is put back.
						got = c
						if mutation != nil {
							got = string(mutation.GetBody())
						}
						if changes := c != want[i]; changes != (mutation != nil) {
							t.Errorf("chunk %d answered with mutation %v; want one: %v", i, mutation, changes)
						}
					}
					if got != want[i] {
						t.Errorf("chunk %d came back as\n %s\nwant\n %s", i, got, want[i])
					}
				}
			})
		}
	}
}

// A gateway that sends no pseudo-headers (NGINX Gateway Fabric's shim)
// takes only the destination from the answer and sends the body on as the
// client wrote it: a rewrite cannot reach the model server, so the request
// is routed as the model it names, the rewrite is counted unapplied (not
// as a decision), and the picker says so once.
func TestARewriteAShimCannotApplyIsCountedNotScored(t *testing.T) {
	rw := &rewrite.Table{}
	rw.ReplaceRewrites([]rewrite.Rule{{Name: "canary", Models: []string{"llama"},
		Targets: []rewrite.Target{{Model: "llama-v2", Weight: 1}}}})
	var lines logLines
	logger := lines.logger()
	var log *requestLog
	f := newFixture(t, fixtureOptions{rewrites: rw, log: &logger, wrap: func(p extproc.Picker) extproc.Picker {
		log = &requestLog{Picker: p}
		return log
	}})
	for i, tc := range []struct {
		model, header string
	}{{"llama", ""}, {"mistral", "mistral-v3"}, {"llama", ""}} {
		x, err := f.gw.Open(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		var extra []string
		if tc.header != "" {
			extra = []string{"x-gateway-model-name-rewrite", tc.header}
		}
		for _, m := range msgs(shimHeaders(extra...), envoy.BodyChunk(completionBody(tc.model, letters(uint64(40+i), 300)), true)) {
			if err := x.Send(m); err != nil {
				t.Fatal(err)
			}
		}
		if err := x.CloseSend(); err != nil {
			t.Fatal(err)
		}
		routed := ""
		for {
			resp, err := x.Recv()
			if err != nil {
				break
			}
			if d := destination(resp.GetRequestHeaders().GetResponse()); d != "" {
				routed = d
			}
		}
		if routed == "" {
			t.Fatalf("request %d was not routed", i)
		}
		if got := log.last(t).Model; got != tc.model {
			t.Errorf("request %d: the picker scored %q, want the model the server receives, %q", i, got, tc.model)
		}
	}
	if got := f.counter(t, "tally_model_rewrites_unapplied_total", nil); got != 3 {
		t.Errorf("tally_model_rewrites_unapplied_total = %v, want 3", got)
	}
	if got := f.counter(t, "inference_extension_model_rewrite_decisions_total",
		map[string]string{"model_rewrite_name": "canary", "model_name": "llama", "target_model": "llama-v2"}); got != 0 {
		t.Errorf("rewrite decisions = %v, want none: none was applied", got)
	}
	if n := lines.count("takes only the destination"); n != 1 {
		t.Errorf("the warning was logged %d times, want once:\n%s", n, strings.Join(lines.lines, "\n"))
	}
}
