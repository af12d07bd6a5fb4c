package e2e

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"sort"
	"strings"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/internal/stack"
)

// flowPickerConfig holds every request but one: a pod takes one request at a
// time (saturation.maxInFlightRequests), and with flow control on the rest
// wait in the picker, unplaced, until its response ends. The band of
// priority 5 holds one request; a wait lasts flowTTL at most, which must
// leave the specs time to fill the queue on a loaded machine (every request
// they queue waits from its arrival).
const flowPickerConfig = `
saturation:
  maxInFlightRequests: 1
flowControl:
  enabled: true
  ordering: fcfs
  requestTTLSeconds: 5
  bands:
  - priority: 5
    maxRequests: 1
`

// flowTTL is flowPickerConfig's requestTTLSeconds.
const flowTTL = 5 * time.Second

// flowFirstPodIP keeps this pool's pods off the other specs' addresses.
var flowFirstPodIP = netip.MustParseAddr("127.0.48.2")

// flowRequest is a small streamed completion with the flow control headers.
func flowRequest(what string, headers map[string]string) stack.Request {
	r := completion(what, true)
	r.Headers = headers
	return r
}

// flowRun is requests sent through the gateway, with the order in which
// they were served. With one slot a held request is placed only once the
// one before it has ended, so its first byte comes after that one's whole
// response: first bytes order them. (The order in which the clients saw
// their responses end does not: a client may read its last bytes after the
// next request's response is done.) A request that got no first byte (an
// error, a refusal) is ordered by when its response ended.
type flowRun struct {
	s       *stack.Stack
	mu      sync.Mutex
	at      map[string]time.Time
	results map[string]stack.Result
	wg      sync.WaitGroup
}

func (f *flowRun) send(ctx context.Context, name string, req stack.Request) {
	f.wg.Go(func() {
		start := time.Now()
		res := stack.Send(ctx, f.s.HTTPClient(), f.s.GatewayURL(), nextID(name), req)
		at := time.Now()
		if res.Err == nil && res.TTFT > 0 {
			at = start.Add(res.TTFT)
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.at == nil {
			f.at = map[string]time.Time{}
		}
		f.at[name] = at
		f.results[name] = res
	})
}

// order is the requests by when they were served (see flowRun).
func (f *flowRun) order() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	names := make([]string, 0, len(f.at))
	for n := range f.at {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool { return f.at[names[i]].Before(f.at[names[j]]) })
	return names
}

// waiting is the picker's flow control queue, from its metrics.
func waiting(ctx context.Context, s *stack.Stack) func(g Gomega) int {
	return func(g Gomega) int {
		m, err := s.PickerMetrics(ctx)
		g.Expect(err).NotTo(HaveOccurred())
		return int(m.Sum("inference_extension_flow_control_queue_size"))
	}
}

var _ = Describe("Flow control", Ordered, func() {
	var fs *stack.Stack

	BeforeAll(func(ctx SpecContext) {
		fs = startStack(ctx, stack.Options{
			Namespace:  "e2e-flow",
			FirstPodIP: flowFirstPodIP,
			Pods:       1,
			PickerArgs: []string{"--config-text=" + flowPickerConfig, "--shutdown-delay=500ms", "--shutdown-grace=2s"},
		})
		for name, prio := range map[string]int{"critical": 10, "batch": 0, "limited": 5} {
			Expect(fs.Client().Create(ctx, &v1alpha2.InferenceObjective{
				ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: fs.Options().Namespace},
				Spec: v1alpha2.InferenceObjectiveSpec{Priority: &prio,
					PoolRef: v1alpha2.PoolObjectReference{Name: v1alpha2.ObjectName(fs.Options().PoolName)}},
			})).To(Succeed())
		}
		eventually(ctx, func(g Gomega) float64 {
			m, err := fs.PickerMetrics(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			return m.Sum("tally_inference_objectives")
		}).WithTimeout(30 * time.Second).Should(Equal(3.0))
	})

	// start holds the pod and sends the request that takes its one slot.
	start := func(ctx context.Context) (*flowRun, func()) {
		GinkgoHelper()
		f := &flowRun{s: fs, results: map[string]stack.Result{}}
		before := fs.Pods()[0].Served()
		release := fs.Hold()
		f.send(ctx, "first", flowRequest("first", nil))
		eventually(ctx, func() int { return fs.Pods()[0].Served() - before }).WithTimeout(30 * time.Second).Should(Equal(1))
		return f, release
	}
	queueIs := func(ctx context.Context, n int) {
		GinkgoHelper()
		eventually(ctx, waiting(ctx, fs)).WithTimeout(30*time.Second).Should(Equal(n), "requests waiting in the picker")
	}

	It("dispatches held streams by priority when the engine frees", func(ctx SpecContext) {
		f, release := start(ctx)
		defer release()
		for i, objective := range []string{"batch", "batch", "critical", "critical"} {
			name := fmt.Sprintf("%s-%d", objective, i)
			f.send(ctx, name, flowRequest(name, map[string]string{"x-gateway-inference-objective": objective}))
			queueIs(ctx, i+1)
		}
		release()
		f.wg.Wait()
		for name, r := range f.results {
			Expect(r.Err).NotTo(HaveOccurred(), name)
		}
		Expect(f.order()).To(Equal([]string{"first", "critical-2", "critical-3", "batch-0", "batch-1"}))
		expectLedgerDrains(ctx, fs)
	})

	It("gives two tenants of one band turns, however much each sends", func(ctx SpecContext) {
		f, release := start(ctx)
		defer release()
		var names []string
		for i := range 12 {
			tenant := "heavy"
			if i >= 8 {
				tenant = "light"
			}
			if i == 8 {
				queueIs(ctx, 8) // light's arrive after all of heavy's
			}
			name := fmt.Sprintf("%s-%d", tenant, i)
			names = append(names, name)
			f.send(ctx, name, flowRequest(name, map[string]string{"x-gateway-inference-fairness-id": tenant}))
		}
		queueIs(ctx, 12)
		release()
		f.wg.Wait()
		order := f.order()
		light := 0
		for _, name := range order[1:9] { // the first 8 dispatched
			if strings.HasPrefix(name, "light") {
				light++
			}
		}
		Expect(light).To(BeNumerically(">=", 4), "dispatch order %v", order)
		Expect(order[0]).To(Equal("first"))
		Expect(order[1:]).To(ConsistOf(names))
		expectLedgerDrains(ctx, fs)
	})

	It("answers a full band and an expired wait 429 with retry-after", func(ctx SpecContext) {
		f, release := start(ctx)
		defer release()
		f.send(ctx, "limited-waits", flowRequest("limited", map[string]string{"x-gateway-inference-objective": "limited"}))
		queueIs(ctx, 1)
		full := stack.Send(ctx, fs.HTTPClient(), fs.GatewayURL(), nextID("limited-full"),
			flowRequest("limited-full", map[string]string{"x-gateway-inference-objective": "limited"}))
		Expect(full.Status).To(Equal(http.StatusTooManyRequests), "%v", full.Err)
		Expect(full.RetryAfter).NotTo(BeEmpty())

		began := time.Now()
		eventually(ctx, func() bool {
			f.mu.Lock()
			defer f.mu.Unlock()
			_, ok := f.results["limited-waits"]
			return ok
		}).WithTimeout(10 * time.Second).Should(BeTrue())
		f.mu.Lock()
		expired := f.results["limited-waits"]
		f.mu.Unlock()
		Expect(expired.Status).To(Equal(http.StatusTooManyRequests), "%v", expired.Err)
		Expect(expired.RetryAfter).NotTo(BeEmpty())
		Expect(time.Since(began)).To(BeNumerically("<", flowTTL+500*time.Millisecond), "the TTL")
		queueIs(ctx, 0)
		release()
		f.wg.Wait()
		Expect(f.results["first"].Err).NotTo(HaveOccurred())
		expectLedgerDrains(ctx, fs)
	})

	It("leaves nothing behind when a waiting client disconnects", func(ctx SpecContext) {
		f, release := start(ctx)
		defer release()
		gone, cancel := context.WithCancel(ctx)
		f.send(gone, "gone", flowRequest("gone", nil))
		queueIs(ctx, 1)
		cancel()
		queueIs(ctx, 0)
		f.send(ctx, "next", flowRequest("next", nil))
		queueIs(ctx, 1)
		release()
		f.wg.Wait()
		Expect(f.results["gone"].Err).To(HaveOccurred())
		Expect(f.results["next"].Err).NotTo(HaveOccurred())
		Expect(f.order()).To(Equal([]string{"gone", "first", "next"}))
		expectLedgerDrains(ctx, fs)
		m, err := fs.PickerMetrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		v, _ := m.Value("tally_flow_control_requests_total", "outcome", "EvictedContextCancelled")
		Expect(v).To(BeNumerically(">=", 1))
	})

	// Last: it stops the picker.
	It("answers waiting requests 503 when the picker shuts down", func(ctx SpecContext) {
		f, release := start(ctx)
		defer release()
		f.send(ctx, "waits", flowRequest("waits", nil))
		queueIs(ctx, 1)
		stopped := make(chan error, 1)
		go func() { stopped <- fs.Picker().Stop() }()
		eventually(ctx, func() bool {
			f.mu.Lock()
			defer f.mu.Unlock()
			_, ok := f.results["waits"]
			return ok
		}).WithTimeout(10 * time.Second).Should(BeTrue())
		f.mu.Lock()
		r := f.results["waits"]
		f.mu.Unlock()
		Expect(r.Status).To(Equal(http.StatusServiceUnavailable), "%v", r.Err)
		release()
		f.wg.Wait()
		Eventually(stopped).WithTimeout(15 * time.Second).Should(Receive(Succeed()))
		Expect(fs.StartPicker(ctx)).To(Succeed())
	})
})
