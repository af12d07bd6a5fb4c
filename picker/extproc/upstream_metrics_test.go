package extproc_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
)

// The upstream picker's buckets (gateway-api-inference-extension v1.5.0,
// pkg/epp/metrics), written out here rather than read from the code under
// test, so that a drift from upstream fails.
var (
	upstreamLatencyBuckets = []float64{0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6,
		8, 10, 15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600}
	upstreamPromptTokenBuckets = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778,
		65536, 131072, 262144, 524288, 1048576}
	upstreamOutputTokenBuckets = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192}
)

// newUpstreamFixture is newFixture with a named pool and a model-name cap.
func newUpstreamFixture(t *testing.T, maxModels int) *fixture {
	t.Helper()
	log := testr.New(t)
	reg := prometheus.NewPedanticRegistry()
	frozen := time.Now()
	p := picker.New(v1alpha1.Default(), picker.Options{Rand: rand.New(rand.NewPCG(1, 2)), Log: log, Registerer: reg,
		Clock: nowClock(func() time.Time { return frozen }), PoolName: "pool-a"})
	p.Replace(endpoints(epA, epB, epC))
	srv := extproc.NewServer(p, extproc.Options{
		MaxRequestBytes:    v1alpha1.Default().MaxRequestBytes,
		Log:                log,
		Registerer:         reg,
		MaxModelNameLabels: maxModels,
	})
	g := grpc.NewServer(grpc.WaitForHandlers(true))
	srv.Register(g)
	return &fixture{picker: p, reg: reg, gw: serve(t, g, grpc.WithTransportCredentials(insecure.NewCredentials()))}
}

// play sends req and answers it with resp, failing the test on any error.
func play(t *testing.T, f *fixture, req envoy.Request, resp envoy.Response) envoy.Routed {
	t.Helper()
	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer x.Cancel()
	r, err := x.SendRequest(req)
	if err != nil {
		t.Fatal(err)
	}
	if r.Immediate != nil {
		if err := x.Finish(); err != nil {
			t.Fatal(err)
		}
		return r
	}
	if err := x.Respond(resp); err != nil {
		t.Fatal(err)
	}
	return r
}

// chunked cuts s into pieces of n bytes, as a model server's writes may be.
func chunked(s string, n int) []string {
	var out []string
	for len(s) > n {
		out = append(out, s[:n])
		s = s[n:]
	}
	return append(out, s)
}

func TestUpstreamRequestMetrics(t *testing.T) {
	f := newUpstreamFixture(t, 0)

	// A streamed chat completion whose client asked for usage: the final
	// data event carries it, cut across two of the server's writes.
	streamed := post("/v1/chat/completions", []byte(
		`{"model":"llama-stream","stream":true,"stream_options":{"include_usage":true},`+
			`"messages":[{"role":"user","content":"`+letters(1, 3000)+`"}]}`))
	events := `data: {"choices":[{"delta":{"content":"hel"}}],"usage":null}` + "\n\n" +
		`data: {"choices":[{"delta":{"content":"lo"}}],"usage":null}` + "\n\n" +
		`data: {"choices":[],"usage":{"prompt_tokens":700,"completion_tokens":20,"total_tokens":720,"prompt_tokens_details":{"cached_tokens":512}}}` + "\n\n" +
		"data: [DONE]\n\n"
	play(t, f, streamed, response(200, chunked(events, 90)...))

	// A non-streamed completion: usage at the end of a body larger than what
	// the picker keeps of it, in writes of 3000 bytes.
	plain := completion("llama-json", letters(2, 2000))
	body := `{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"` + letters(3, 20_000) +
		`","finish_reason":"length"}],"usage":{"prompt_tokens":30,"total_tokens":330,"completion_tokens":300},"kv_transfer_params":null}`
	play(t, f, plain, response(200, chunked(body, 3000)...))

	// A streamed response without usage (the client did not ask): counted,
	// timed, no tokens.
	play(t, f, completion("llama-json", letters(4, 2000)), okResponse)

	// Errors: one the picker answers (no model known: the body is not
	// JSON), one the model server answers.
	if r := play(t, f, post("/v1/completions", []byte("not json")), envoy.Response{}); r.Immediate == nil {
		t.Fatal("a body that is not JSON was routed")
	}
	play(t, f, completion("llama-json", letters(5, 2000)), response(500, `{"error":"engine died"}`))

	want := `# HELP inference_objective_request_total Requests routed to an endpoint, by model (target_model_name: the model an InferenceModelRewrite sent it to, else the same) and priority (its InferenceObjective's).
# TYPE inference_objective_request_total counter
inference_objective_request_total{model_name="",priority="0",target_model_name=""} 0
inference_objective_request_total{model_name="llama-json",priority="0",target_model_name="llama-json"} 3
inference_objective_request_total{model_name="llama-stream",priority="0",target_model_name="llama-stream"} 1
# HELP inference_objective_request_error_total Requests answered with an error by the picker (BadRequest, ResourceExhausted, ServiceUnavailable, Internal) or by the model server (ModelServerError: a status other than 200).
# TYPE inference_objective_request_error_total counter
inference_objective_request_error_total{error_code="BadRequest",model_name="",target_model_name=""} 1
inference_objective_request_error_total{error_code="ModelServerError",model_name="llama-json",target_model_name="llama-json"} 1
# HELP inference_objective_running_requests Requests routed and not yet ended, by model.
# TYPE inference_objective_running_requests gauge
inference_objective_running_requests{model_name=""} 0
inference_objective_running_requests{model_name="llama-json"} 0
inference_objective_running_requests{model_name="llama-stream"} 0
# HELP inference_pool_ready_pods Endpoints in the pool's endpoint set (a target port on a Ready pod), as tally_endpoints.
# TYPE inference_pool_ready_pods gauge
inference_pool_ready_pods{name="pool-a"} 3
`
	if err := testutil.GatherAndCompare(f.reg, strings.NewReader(want),
		"inference_objective_request_total", "inference_objective_request_error_total",
		"inference_objective_running_requests", "inference_pool_ready_pods"); err != nil {
		t.Error(err)
	}

	stream, json := map[string]string{"model_name": "llama-stream", "target_model_name": "llama-stream"},
		map[string]string{"model_name": "llama-json", "target_model_name": "llama-json"}
	for _, c := range []struct {
		name    string
		labels  map[string]string
		count   uint64
		sum     float64 // NaN: not checked (times)
		buckets []float64
	}{
		{"inference_objective_input_tokens", stream, 1, 700, upstreamPromptTokenBuckets},
		{"inference_objective_output_tokens", stream, 1, 20, upstreamOutputTokenBuckets},
		{"inference_objective_prompt_cached_tokens", stream, 1, 512, upstreamPromptTokenBuckets},
		{"inference_objective_input_tokens", json, 1, 30, upstreamPromptTokenBuckets},
		{"inference_objective_output_tokens", json, 1, 300, upstreamOutputTokenBuckets},
		// No prompt_tokens_details in the non-streamed usage: not observed.
		{"inference_objective_prompt_cached_tokens", json, 0, 0, upstreamPromptTokenBuckets},
		// Every routed response seen to its end is timed, error ones too.
		{"inference_objective_request_duration_seconds", stream, 1, math.NaN(), upstreamLatencyBuckets},
		{"inference_objective_request_duration_seconds", json, 3, math.NaN(), upstreamLatencyBuckets},
		{"inference_objective_request_ttft_seconds", stream, 1, math.NaN(), upstreamLatencyBuckets},
		{"inference_objective_request_ttft_seconds", json, 3, math.NaN(), upstreamLatencyBuckets},
		{"inference_objective_response_sizes", stream, 1, float64(len(events)), nil},
		{"inference_objective_request_sizes", stream, 1, float64(len(streamed.Body)), nil},
		{"inference_objective_normalized_time_per_output_token_seconds", json, 1, math.NaN(), nil},
		{"inference_extension_scheduler_e2e_duration_seconds", nil, 4, math.NaN(),
			[]float64{0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1}},
		{"inference_extension_prefix_indexer_hit_ratio", nil, 4, 0, // four distinct prompts: no hits
			[]float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1}},
	} {
		h := histogramOf(t, f.reg, c.name, c.labels)
		if h.GetSampleCount() != c.count || !math.IsNaN(c.sum) && h.GetSampleSum() != c.sum {
			t.Errorf("%s%v: %d samples summing to %g, want %d summing to %g", c.name, c.labels,
				h.GetSampleCount(), h.GetSampleSum(), c.count, c.sum)
		}
		if c.buckets != nil {
			var got []float64
			for _, b := range h.GetBucket() {
				got = append(got, b.GetUpperBound())
			}
			if !slices.Equal(got, c.buckets) {
				t.Errorf("%s: buckets %v, want upstream's %v", c.name, got, c.buckets)
			}
		}
	}

	info := familyOf(t, f.reg, "inference_extension_info")
	if len(info.GetMetric()) != 1 || info.GetMetric()[0].GetGauge().GetValue() != 1 {
		t.Fatalf("inference_extension_info: %v, want one series of value 1", info.GetMetric())
	}
	var names []string
	for _, l := range info.GetMetric()[0].GetLabel() {
		names = append(names, l.GetName())
	}
	if !slices.Equal(names, []string{"build_ref", "commit"}) {
		t.Errorf("inference_extension_info labels %v, want build_ref and commit", names)
	}
}

// inference_extension_info carries the build the binary was stamped with,
// and falls back to Go's build info only for what was not given.
func TestInfoCarriesTheGivenBuild(t *testing.T) {
	labels := func(opts extproc.Options) map[string]string {
		t.Helper()
		reg := prometheus.NewPedanticRegistry()
		opts.Registerer = reg
		opts.Log = testr.New(t)
		p := picker.New(v1alpha1.Default(), picker.Options{Log: opts.Log, Registerer: reg})
		extproc.NewServer(p, opts)
		info := familyOf(t, reg, "inference_extension_info")
		if len(info.GetMetric()) != 1 {
			t.Fatalf("inference_extension_info: %v, want one series", info.GetMetric())
		}
		got := map[string]string{}
		for _, l := range info.GetMetric()[0].GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		return got
	}
	got := labels(extproc.Options{Commit: "0123456789abcdef0123456789abcdef01234567", BuildRef: "v1.2.3-4-g0123456"})
	if got["commit"] != "0123456789abcdef0123456789abcdef01234567" || got["build_ref"] != "v1.2.3-4-g0123456" {
		t.Errorf("stamped build: labels %v, want the commit and build_ref given", got)
	}
	// A test binary has no VCS stamp: the fallback is "unknown", never
	// the value given to another server.
	got = labels(extproc.Options{BuildRef: "v9.9.9"})
	if got["build_ref"] != "v9.9.9" || got["commit"] == "" || got["commit"] == "0123456789abcdef0123456789abcdef01234567" {
		t.Errorf("build_ref only: labels %v, want build_ref v9.9.9 and the commit read from the build info", got)
	}
}

// In BUFFERED mode the response body comes as one message; a compressed body
// is not read for usage (the picker never decompresses).
func TestUpstreamUsageInOtherResponseShapes(t *testing.T) {
	f := newUpstreamFixture(t, 0)
	usage := `{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":40,"completion_tokens":4}}`

	buffered := completion("buffered", letters(1, 1000))
	buffered.Mode = filterv3.ProcessingMode_BUFFERED
	play(t, f, buffered, response(200, usage))

	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer x.Cancel()
	if r, err := x.SendRequest(completion("gzipped", letters(2, 1000))); err != nil || r.Immediate != nil {
		t.Fatalf("routing: %v %v", err, r.Immediate)
	}
	for _, m := range []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: envoy.HeaderMap(":status", "200", "content-type", "application/json", "content-encoding", "gzip"),
		}}},
		// Not really gzip: if the picker read it, it would find usage.
		{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte(usage), EndOfStream: true}}},
	} {
		if err := x.Send(m); err != nil {
			t.Fatal(err)
		}
		if _, err := x.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	if err := x.Finish(); err != nil {
		t.Fatal(err)
	}

	for model, want := range map[string]uint64{"buffered": 1, "gzipped": 0} {
		labels := map[string]string{"model_name": model, "target_model_name": model}
		if n := histogramOf(t, f.reg, "inference_objective_input_tokens", labels).GetSampleCount(); n != want {
			t.Errorf("%s: %d prompt token samples, want %d", model, n, want)
		}
		if n := histogramOf(t, f.reg, "inference_objective_request_duration_seconds", labels).GetSampleCount(); n != 1 {
			t.Errorf("%s: %d duration samples, want 1", model, n)
		}
	}
}

func TestUpstreamRunningRequestsWhileTheResponseStreams(t *testing.T) {
	f := newUpstreamFixture(t, 0)
	x, err := f.gw.Open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer x.Cancel()
	if r, err := x.SendRequest(completion("m", letters(1, 1000))); err != nil || r.Immediate != nil {
		t.Fatalf("routing: %v %v", err, r.Immediate)
	}
	running := func() float64 {
		return f.counter(t, "inference_objective_running_requests", map[string]string{"model_name": "m"})
	}
	if got := running(); got != 1 {
		t.Fatalf("running while the response is awaited: %g, want 1", got)
	}
	// The client goes away mid-response: no longer running, and not timed
	// (the response was not seen to its end).
	if err := x.SendResponseHeaders(response(200, "x")); err != nil {
		t.Fatal(err)
	}
	x.Cancel()
	eventually(t, "the stream has ended", func() (bool, string) {
		return running() == 0, fmt.Sprintf("running %g", running())
	})
	labels := map[string]string{"model_name": "m", "target_model_name": "m"}
	if n := histogramOf(t, f.reg, "inference_objective_request_duration_seconds", labels).GetSampleCount(); n != 0 {
		t.Errorf("a cut response was timed (%d samples)", n)
	}
}

func TestModelNameLabelsAreCapped(t *testing.T) {
	f := newUpstreamFixture(t, 2)
	for _, model := range []string{"a", "b", "c", "d", "a", "c"} {
		play(t, f, completion(model, letters(uint64(len(model)), 1000)), okResponse)
	}
	want := `# HELP inference_objective_request_total Requests routed to an endpoint, by model (target_model_name: the model an InferenceModelRewrite sent it to, else the same) and priority (its InferenceObjective's).
# TYPE inference_objective_request_total counter
inference_objective_request_total{model_name="a",priority="0",target_model_name="a"} 2
inference_objective_request_total{model_name="b",priority="0",target_model_name="b"} 1
inference_objective_request_total{model_name="other",priority="0",target_model_name="other"} 3
`
	if err := testutil.GatherAndCompare(f.reg, strings.NewReader(want), "inference_objective_request_total"); err != nil {
		t.Error(err)
	}
	for _, name := range []string{"inference_objective_request_duration_seconds", "inference_objective_request_ttft_seconds"} {
		if n := len(familyOf(t, f.reg, name).GetMetric()); n != 3 {
			t.Errorf("%s has %d series, want 3 (a, b, other)", name, n)
		}
	}
}

func familyOf(t *testing.T, g prometheus.Gatherer, name string) *dto.MetricFamily {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, fam := range families {
		if fam.GetName() == name {
			return fam
		}
	}
	t.Fatalf("%s was not gathered", name)
	return nil
}

// histogramOf returns the series of histogram name whose labels are exactly
// labels.
func histogramOf(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) *dto.Histogram {
	t.Helper()
	fam := familyOf(t, g, name)
	if fam.GetType() != dto.MetricType_HISTOGRAM {
		t.Fatalf("%s is a %v, want a histogram", name, fam.GetType())
	}
series:
	for _, m := range fam.GetMetric() {
		if len(m.GetLabel()) != len(labels) {
			continue
		}
		for _, lp := range m.GetLabel() {
			if v, ok := labels[lp.GetName()]; !ok || v != lp.GetValue() {
				continue series
			}
		}
		return m.GetHistogram()
	}
	t.Fatalf("%s has no series %v", name, labels)
	return nil
}
