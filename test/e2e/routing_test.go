package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/picker/debugledger"
)

// firstPodIP keeps the suite's pods off the demo's 127.0.0.x addresses, so
// both can run on one machine at once.
var firstPodIP = netip.MustParseAddr("127.0.42.2")

var requestSeq atomic.Int64

// nextID gives each request of the suite its own id.
func nextID(what string) string {
	return fmt.Sprintf("%s-%d", what, requestSeq.Add(1))
}

// completion is a small streaming request with a prompt of its own.
func completion(what string, stream bool) stack.Request {
	prompt := fmt.Sprintf("%s %d: %s", what, requestSeq.Add(1), strings.Repeat("tell me about routing ", 20))
	return stack.Completion(stack.DefaultModel, prompt, 8, stream)
}

func send(ctx context.Context, req stack.Request, what string) stack.Result {
	return stack.Send(ctx, st.HTTPClient(), st.GatewayURL(), nextID(what), req)
}

// sendAll sends reqs concurrently through the gateway.
func sendAll(ctx context.Context, reqs []stack.Request, what string) []stack.Result {
	results := make([]stack.Result, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Go(func() { results[i] = send(ctx, r, what) })
	}
	wg.Wait()
	return results
}

func expectAllOK(results []stack.Result) {
	GinkgoHelper()
	for _, r := range results {
		Expect(r.Err).NotTo(HaveOccurred())
		Expect(r.Status).To(Equal(http.StatusOK))
	}
}

// served snapshots how many completion requests each pod has received.
func served() map[string]int {
	out := map[string]int{}
	for _, p := range st.Pods() {
		out[p.Name] = p.Served()
	}
	return out
}

func delta(before, after map[string]int) map[string]int {
	d := map[string]int{}
	for name, n := range after {
		d[name] = n - before[name]
	}
	return d
}

func total(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func podByName(name string) *stack.Pod {
	GinkgoHelper()
	for _, p := range st.Pods() {
		if p.Name == name {
			return p
		}
	}
	Fail("no pod " + name)
	return nil
}

// rawPost posts body to the gateway and returns the status and body.
func rawPost(ctx context.Context, path string, body []byte, id string) (int, []byte) {
	GinkgoHelper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, st.GatewayURL()+path, bytes.NewReader(body))
	Expect(err).NotTo(HaveOccurred())
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(stack.RequestIDHeader, id)
	resp, err := st.HTTPClient().Do(req)
	Expect(err).NotTo(HaveOccurred())
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	Expect(err).NotTo(HaveOccurred())
	return resp.StatusCode, data
}

func rawPostTo(ctx context.Context, baseURL string, body []byte) (int, []byte) {
	GinkgoHelper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+stack.CompletionsPath, bytes.NewReader(body))
	Expect(err).NotTo(HaveOccurred())
	req.Header.Set("Content-Type", "application/json")
	resp, err := st.HTTPClient().Do(req)
	Expect(err).NotTo(HaveOccurred())
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	Expect(err).NotTo(HaveOccurred())
	return resp.StatusCode, data
}

type completionResponse struct {
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

// parseSSE checks the stream's framing and returns its events (without the
// final [DONE]).
func parseSSE(body []byte) []completionResponse {
	GinkgoHelper()
	events := strings.Split(string(body), "\n\n")
	Expect(events[len(events)-1]).To(BeEmpty(), "the stream ends with a blank line")
	events = events[:len(events)-1]
	Expect(events).NotTo(BeEmpty())
	Expect(events[len(events)-1]).To(Equal("data: [DONE]"), "the stream ends with data: [DONE]")
	var out []completionResponse
	for _, e := range events[:len(events)-1] {
		payload, ok := strings.CutPrefix(e, "data: ")
		Expect(ok).To(BeTrue(), "event %q is a data line", e)
		var c completionResponse
		Expect(json.Unmarshal([]byte(payload), &c)).To(Succeed(), "event %q is JSON", payload)
		out = append(out, c)
	}
	return out
}

// heldBurst sends reqs through the gateway while the pods hold every
// request, waits until all have reached a pod, and returns where they went
// and the picker's ledger at that moment; then it lets them finish.
func heldBurst(ctx context.Context, reqs []stack.Request, what string) (map[string]int, debugledger.Ledger, []stack.Result) {
	GinkgoHelper()
	return heldBurstVia(ctx, st, st.GatewayURL(), reqs, what)
}

// heldBurstVia is heldBurst on stack s, sent to baseURL: s's gateway, or
// another front of s's picker (such as NGINX).
//
// The burst arrives at once: every request sends its headers and all of its
// body but the last byte, and only when all have (and, through s's own
// gateway, all their ext_proc streams are open at the picker) do the last
// bytes go. Sent from goroutines as they start, a burst on a loaded machine
// arrives over a time in which the picker's model drains the first
// requests' prefill, and a burst spread over time may rightly be placed
// unevenly: the first pods reached have less left to compute.
func heldBurstVia(ctx context.Context, s *stack.Stack, baseURL string, reqs []stack.Request, what string) (map[string]int, debugledger.Ledger, []stack.Result) {
	GinkgoHelper()
	// Earlier traffic has left the ledger and the engines: none of it
	// weighs on where the burst goes.
	expectLedgerDrains(ctx, s)
	before := servedOn(s)
	release := s.Hold()
	defer release()
	gate := stack.NewBodyGate(len(reqs))
	defer gate.Open()
	results := make([]stack.Result, len(reqs))
	finished := make(chan int, len(reqs))
	for i, r := range reqs {
		go func() {
			results[i] = gate.Send(ctx, baseURL, nextID(what), r)
			finished <- i
		}()
	}
	collect := func(n int) {
		for range n {
			<-finished
		}
	}
	// While held, a request can only finish by failing: stop at once.
	failed := func(i int) string {
		return fmt.Sprintf("request %d finished while the pods held every request: status %d, %v", i, results[i].Status, results[i].Err)
	}
	select {
	case <-gate.Waiting():
	case i := <-finished:
		Fail(failed(i))
	case <-time.After(30 * time.Second):
		Fail("the burst's requests did not all reach the gate in 30 s")
	}
	if baseURL == s.GatewayURL() {
		// The dev gateway opens a request's stream on its headers.
		eventually(ctx, func(g Gomega) int {
			m, err := s.PickerMetrics(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			return int(m.Sum("tally_streams_active"))
		}).WithTimeout(30*time.Second).Should(BeNumerically(">=", len(reqs)), "ext_proc streams open at the picker")
	}
	gate.Open()
	eventually(ctx, func() int {
		select {
		case i := <-finished:
			// The deferred release lets the others finish.
			StopTrying(failed(i)).Now()
		default:
		}
		return total(delta(before, servedOn(s)))
	}).WithTimeout(30*time.Second).Should(Equal(len(reqs)), "requests that reached a pod")
	placed := delta(before, servedOn(s))
	ledger, err := s.Ledger(ctx)
	Expect(err).NotTo(HaveOccurred())
	release()
	collect(len(reqs))
	return placed, ledger, results
}

var _ = Describe("Tally end to end", Ordered, ContinueOnFailure, func() {
	// notReady is never Ready; newPod is Ready for one spec only.
	var notReady, newPod *stack.Pod

	It("sends traffic only to Ready pods", func(ctx SpecContext) {
		var err error
		notReady, err = st.AddPod(ctx, false)
		Expect(err).NotTo(HaveOccurred())
		Expect(st.WaitForEndpoints(ctx, "sim-0", "sim-1", "sim-2", "sim-3")).To(Succeed())

		// Held at the pods, 40 requests are all in flight at once, so the
		// picker spreads them: the NotReady pod is the only one left out.
		reqs := make([]stack.Request, 40)
		for i := range reqs {
			reqs[i] = completion("ready", true)
		}
		got, _, results := heldBurst(ctx, reqs, "ready")
		expectAllOK(results)
		Expect(got).To(HaveKeyWithValue(notReady.Name, 0))
		for _, name := range []string{"sim-0", "sim-1", "sim-2", "sim-3"} {
			Expect(got[name]).To(BeNumerically(">", 0), "Ready pod %s gets a share of 40 concurrent requests: %v", name, got)
		}
	}, SpecTimeout(time.Minute))

	It("sends no new requests to a pod turned NotReady", func(ctx SpecContext) {
		pod := podByName("sim-3")
		Expect(st.SetReady(ctx, pod, false)).To(Succeed())
		DeferCleanup(func(ctx SpecContext) {
			Expect(st.SetReady(ctx, pod, true)).To(Succeed())
			Expect(st.WaitForEndpoints(ctx, "sim-0", "sim-1", "sim-2", "sim-3")).To(Succeed())
		})
		Expect(st.WaitForEndpoints(ctx, "sim-0", "sim-1", "sim-2")).To(Succeed())

		reqs := make([]stack.Request, 30)
		for i := range reqs {
			reqs[i] = completion("notready", true)
		}
		before := served()
		expectAllOK(sendAll(ctx, reqs, "notready"))
		got := delta(before, served())
		Expect(got).To(HaveKeyWithValue("sim-3", 0))
		Expect(got).To(HaveKeyWithValue(notReady.Name, 0))
		Expect(total(got)).To(Equal(len(reqs)))
	}, SpecTimeout(time.Minute))

	It("spreads a held burst of 64 requests sharing a system prompt within one of even over 4 pods", func(ctx SpecContext) {
		// Each request's own 1,024 tokens outweigh what the pods' drain can
		// differ by while the burst arrives (learned rates of identical
		// engines agree within 15%, tens of milliseconds at some 20,000
		// tokens/s): with 64-token requests, 200 tokens of difference were
		// three requests, and placement was even in cost but not in count.
		reqs := stack.Burst{Requests: 64, SystemTokens: 2048, UserTokens: 1024, MaxTokens: 4, Model: stack.DefaultModel, Seed: 7}.Workload()
		placed, ledger, results := heldBurst(ctx, reqs, "burst")
		expectAllOK(results)
		By(fmt.Sprintf("placement %v", placed))
		for _, name := range []string{"sim-0", "sim-1", "sim-2", "sim-3"} {
			// The ledger shows the learned prefill rates: a pod the picker
			// believes slower drains its held prefill slower.
			Expect(placed[name]).To(BeNumerically("~", 16, 1), "placement %v; ledger %+v", placed, ledger.Endpoints)
		}
		// The ledger agrees with the pods while all 64 are in flight.
		Expect(ledger.InFlight).To(Equal(64))
		for _, e := range ledger.Endpoints {
			Expect(e.InFlight).To(Equal(placed[e.Pod]), "ledger row %+v, placement %v", e, placed)
		}
	}, SpecTimeout(time.Minute))

	It("sends traffic to a new Ready pod within 2 s", func(ctx SpecContext) {
		pod, err := st.AddPod(ctx, true)
		Expect(err).NotTo(HaveOccurred())
		newPod = pod
		added := time.Now()
		DeferCleanup(func(ctx SpecContext) {
			// Leave four Ready pods for the specs that follow.
			Expect(st.SetReady(ctx, pod, false)).To(Succeed())
			Expect(st.WaitForEndpoints(ctx, "sim-0", "sim-1", "sim-2", "sim-3")).To(Succeed())
		})
		// Five held requests over five idle pods: a picker that knows the
		// new pod gives it one.
		eventually(ctx, func(g Gomega) {
			reqs := make([]stack.Request, 5)
			for i := range reqs {
				reqs[i] = completion("newpod", true)
			}
			placed, _, results := heldBurst(ctx, reqs, "newpod")
			for _, r := range results {
				g.Expect(r.Err).NotTo(HaveOccurred())
			}
			g.Expect(placed).To(HaveKeyWithValue(pod.Name, BeNumerically(">", 0)))
		}).WithTimeout(2 * time.Second).Should(Succeed())
		By(fmt.Sprintf("the new pod served its first request %v after it was created", time.Since(added)))
	}, SpecTimeout(time.Minute))

	It("passes non-streaming and streaming responses through intact", func(ctx SpecContext) {
		const maxTokens = 20
		// A prompt of 300,000 characters crosses the picker in several
		// 62,000-byte chunks; the prompt token count the simulator reports
		// shows it arrived whole.
		prompt := strings.Repeat("0123456789abcdef", 300_000/16)
		want := len(prompt) / 4

		plain := stack.Completion(stack.DefaultModel, prompt, maxTokens, false)
		id := nextID("intact")
		status, body := rawPost(ctx, plain.Path, plain.Body, id)
		Expect(status).To(Equal(http.StatusOK), "body: %s", body)
		var viaGateway completionResponse
		Expect(json.Unmarshal(body, &viaGateway)).To(Succeed())
		Expect(viaGateway.Object).To(Equal("text_completion"))
		Expect(viaGateway.Usage).NotTo(BeNil())
		Expect(viaGateway.Usage.PromptTokens).To(Equal(want))
		Expect(viaGateway.Usage.CompletionTokens).To(Equal(maxTokens))
		Expect(viaGateway.Choices).To(HaveLen(1))

		// The same request straight to the pod that served it: the same text.
		servedBy := st.ServedBy(id)
		Expect(servedBy).NotTo(BeEmpty())
		status, body = rawPostTo(ctx, podByName(servedBy).URL(), plain.Body)
		Expect(status).To(Equal(http.StatusOK))
		var direct completionResponse
		Expect(json.Unmarshal(body, &direct)).To(Succeed())
		Expect(viaGateway.Choices[0].Text).To(Equal(direct.Choices[0].Text))

		streamed := stack.Completion(stack.DefaultModel, prompt, maxTokens, true)
		status, body = rawPost(ctx, streamed.Path, streamed.Body, nextID("intact-stream"))
		Expect(status).To(Equal(http.StatusOK), "body: %s", body)
		events := parseSSE(body)
		var text strings.Builder
		tokens := 0
		for _, e := range events[:len(events)-1] {
			Expect(e.Choices).To(HaveLen(1))
			text.WriteString(e.Choices[0].Text)
			tokens++
		}
		Expect(tokens).To(Equal(maxTokens), "one event per generated token")
		Expect(text.String()).To(Equal(direct.Choices[0].Text), "the streamed text is the non-streamed text")
		last := events[len(events)-1]
		Expect(last.Usage).NotTo(BeNil(), "the last event before [DONE] carries usage")
		Expect(last.Usage.PromptTokens).To(Equal(want))
		Expect(last.Usage.CompletionTokens).To(Equal(maxTokens))
	}, SpecTimeout(time.Minute))

	It("answers malformed JSON with 400 without reaching a pod", func(ctx SpecContext) {
		before := served()
		status, body := rawPost(ctx, stack.CompletionsPath, []byte(`{"model": "sim-model", "prompt": "unterminated`), nextID("bad"))
		Expect(status).To(Equal(http.StatusBadRequest), "body: %s", body)
		Expect(json.Valid(body)).To(BeTrue(), "the error body is JSON: %s", body)
		Expect(total(delta(before, served()))).To(BeZero())
	}, SpecTimeout(30*time.Second))

	It("has released every reservation once the traffic is over", func(ctx SpecContext) {
		eventually(ctx, func(g Gomega) {
			l, err := st.Ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(l.Idle()).To(BeTrue(), "ledger %+v", l)
		}).WithTimeout(10 * time.Second).Should(Succeed())
		Expect(inflightGauge(ctx)).To(BeZero())
	}, SpecTimeout(30*time.Second))

	It("fails open or closed as the pool says when the picker dies", func(ctx SpecContext) {
		DeferCleanup(func(ctx SpecContext) {
			Expect(st.SetFailureMode(ctx, infv1.EndpointPickerFailClose)).To(Succeed())
			Expect(st.StartPicker(ctx)).To(Succeed())
			Expect(st.WaitForEndpoints(ctx, "sim-0", "sim-1", "sim-2", "sim-3")).To(Succeed())
		})
		st.KillPicker()

		By("FailClose: 503")
		eventually(ctx, func() int { return send(ctx, completion("failclose", true), "failclose").Status }).
			WithTimeout(15 * time.Second).Should(Equal(http.StatusServiceUnavailable))

		By("FailOpen: served by a Ready pod")
		Expect(st.SetFailureMode(ctx, infv1.EndpointPickerFailOpen)).To(Succeed())
		before := served()
		eventually(ctx, func() int { return send(ctx, completion("failopen", true), "failopen").Status }).
			WithTimeout(15 * time.Second).Should(Equal(http.StatusOK))
		// Once open, it stays open: every request is served.
		reqs := make([]stack.Request, 10)
		for i := range reqs {
			reqs[i] = completion("failopen", true)
		}
		expectAllOK(sendAll(ctx, reqs, "failopen"))
		got := delta(before, served())
		Expect(got).To(HaveKeyWithValue(notReady.Name, 0))
		Expect(got).To(HaveKeyWithValue(newPod.Name, 0))
		Expect(total(got)).To(BeNumerically(">=", len(reqs)))

		By("FailClose again: 503")
		Expect(st.SetFailureMode(ctx, infv1.EndpointPickerFailClose)).To(Succeed())
		eventually(ctx, func() int { return send(ctx, completion("failclose", true), "failclose").Status }).
			WithTimeout(15 * time.Second).Should(Equal(http.StatusServiceUnavailable))
	}, SpecTimeout(2*time.Minute))

	It("routes again once the picker is back, and drains its ledger", func(ctx SpecContext) {
		eventually(ctx, func() int { return send(ctx, completion("back", true), "back").Status }).
			WithTimeout(30 * time.Second).Should(Equal(http.StatusOK))
		reqs := make([]stack.Request, 20)
		for i := range reqs {
			reqs[i] = completion("back", true)
		}
		expectAllOK(sendAll(ctx, reqs, "back"))
		eventually(ctx, func(g Gomega) {
			l, err := st.Ledger(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(l.Idle()).To(BeTrue(), "ledger %+v", l)
		}).WithTimeout(10 * time.Second).Should(Succeed())
		Expect(inflightGauge(ctx)).To(BeZero())
		Expect(notReady.Served()).To(BeZero(), "the pod that was never Ready never received a request")
	}, SpecTimeout(time.Minute))
})

// inflightGauge reads tally_inflight_requests from the picker's /metrics.
func inflightGauge(ctx context.Context) float64 {
	GinkgoHelper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, st.PickerMetricsURL()+"/metrics", nil)
	Expect(err).NotTo(HaveOccurred())
	resp, err := st.HTTPClient().Do(req)
	Expect(err).NotTo(HaveOccurred())
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	Expect(err).NotTo(HaveOccurred())
	Expect(resp.StatusCode).To(Equal(http.StatusOK), "GET %s/metrics answered:\n%.600s", st.PickerMetricsURL(), body)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	Expect(err).NotTo(HaveOccurred())
	f, ok := families["tally_inflight_requests"]
	Expect(ok).To(BeTrue(), "the picker exports tally_inflight_requests")
	Expect(f.GetMetric()).To(HaveLen(1))
	return f.GetMetric()[0].GetGauge().GetValue()
}
