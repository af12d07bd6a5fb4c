package e2e

import (
	"context"
	"fmt"
	"maps"
	"math"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/tallyepp/tally/internal/stack"
)

// prefillFirstPodIP keeps this pool's pods off the other specs' addresses.
var prefillFirstPodIP = netip.MustParseAddr("127.0.44.2")

// The workload: closed-loop clients, half streaming and half not, each
// sending prompts that share no prefix (so the picker's uncached estimate is
// the engine's), with short outputs. Run in virtual time beforehand (package
// engine), 12 such clients keep each of 3 engines about three quarters busy
// with prefill, most of a prompt queued on average: the queues are real but
// drain, and a non-streaming request spends most of its life decoding, after
// its prefill is done. At 8,000 tokens a prompt takes about 170 ms to
// prefill, so the milliseconds the gateway adds to each request (more on a
// busy machine) stay small beside it.
const (
	prefillClients      = 12
	prefillPromptTokens = 8000
	prefillOutputTokens = 32
	// prefillWarmUp is left out of the averages: the picker starts from a
	// guessed prefill rate (prefillTokensPerSecond) until streamed first
	// bytes have taught it the engines' rate.
	prefillWarmUp   = 3 * time.Second
	prefillMeasured = 20 * time.Second
	prefillSampling = 50 * time.Millisecond
	// prefillTolerance is how far the ledger's average may be from the
	// engine's. The engine's figure is exact; the picker models it from the
	// outside, and sees each request a few milliseconds before the engine
	// does (the gateway forwards it) and each first byte a few after. A
	// ledger that holds a non-streamed request's prefill until its response
	// (its first bytes come when generation ends) measured about 3 times
	// the engine's.
	prefillTolerance = 0.25
	// prefillMinQueued is the least average queue per engine for the
	// comparison to mean something: an eighth of a prompt.
	prefillMinQueued = prefillPromptTokens / 8
)

// distinctRequest is a completion of prefillPromptTokens tokens whose first
// block is its own.
func distinctRequest(stream bool) stack.Request {
	head := fmt.Sprintf("prefill %08d: ", requestSeq.Add(1))
	const unit = "a question about queues "
	text := head + strings.Repeat(unit, prefillPromptTokens*4/len(unit)+1)
	return stack.Completion(stack.DefaultModel, text[:prefillPromptTokens*4], prefillOutputTokens, stream)
}

// prefillAverages accumulates, per pod, the ledger's prefill and the
// engine's queued prefill, sampled together.
type prefillAverages struct {
	samples        int
	ledger, engine map[string]float64
}

func (a *prefillAverages) sample(ctx context.Context, s *stack.Stack) error {
	l, err := s.Ledger(ctx)
	if err != nil {
		return err
	}
	for _, p := range s.Pods() {
		st, ok := p.Stats()
		if !ok {
			return fmt.Errorf("pod %s has no simulator", p.Name)
		}
		for _, row := range rowsAt(l, p.Addr) {
			a.ledger[p.Name] += float64(row.PrefillTokens)
		}
		a.engine[p.Name] += float64(st.QueuedPrefillTokens)
	}
	a.samples++
	return nil
}

func (a *prefillAverages) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d samples, %v apart; average prefill tokens per pod:", a.samples, prefillSampling)
	for _, name := range slices.Sorted(maps.Keys(a.engine)) {
		l, e := a.ledger[name]/float64(a.samples), a.engine[name]/float64(a.samples)
		fmt.Fprintf(&b, " %s ledger %.0f engine %.0f (ledger/engine %.2f);", name, l, e, l/e)
	}
	return b.String()
}

// lateFirstPodIP keeps the late first bytes spec's pods off the others'.
var lateFirstPodIP = netip.MustParseAddr("127.0.50.2")

// runPrefillWorkload runs prefillClients closed-loop clients (client c
// streams when stream(c)) through ps for the warm-up and the measured
// time, samples the ledger's and the engines' queued prefill meanwhile, and
// checks what holds whatever the responses' timing: every request served,
// at least 250 of them, the learned rates of the identical engines within
// 15% of each other, and each engine's queue tracked by the ledger within
// prefillTolerance. It returns how many requests were sent, and of them
// streamed.
func runPrefillWorkload(ctx context.Context, ps *stack.Stack, stream func(client int) bool) (requests, streamed int) {
	run, stop := context.WithCancel(ctx)
	defer stop()
	var (
		mu      sync.Mutex
		results []stack.Result
		streams int
		wg      sync.WaitGroup
	)
	for c := range prefillClients {
		stream := stream(c)
		wg.Go(func() {
			for run.Err() == nil {
				r := stack.Send(run, ps.HTTPClient(), ps.GatewayURL(), nextID("prefill"), distinctRequest(stream))
				if run.Err() != nil {
					return // cut by the end of the run
				}
				mu.Lock()
				results = append(results, r)
				if stream {
					streams++
				}
				mu.Unlock()
			}
		})
	}

	avg := &prefillAverages{ledger: map[string]float64{}, engine: map[string]float64{}}
	start := time.Now()
	tick := time.NewTicker(prefillSampling)
	for time.Since(start) < prefillWarmUp+prefillMeasured {
		<-tick.C
		if time.Since(start) >= prefillWarmUp {
			Expect(avg.sample(ctx, ps)).To(Succeed())
		}
	}
	tick.Stop()
	stop()
	wg.Wait()
	expectLedgerDrains(ctx, ps)
	l, err := ps.Ledger(ctx)
	Expect(err).NotTo(HaveOccurred())
	lo, hi := math.Inf(1), 0.0
	var learned strings.Builder
	for _, e := range l.Endpoints {
		fmt.Fprintf(&learned, "%s %.0f; ", e.Pod, e.PrefillTokensPerSecond)
		lo, hi = min(lo, e.PrefillTokensPerSecond), max(hi, e.PrefillTokensPerSecond)
	}
	AddReportEntry("learned prefill rates", fmt.Sprintf("%stokens/s, %.3fx apart", learned.String(), hi/lo))

	AddReportEntry("prefill averages", avg.String())
	fmt.Fprintf(GinkgoWriter, "%d requests (%d streamed) in %v: %s\n", len(results), streams, prefillWarmUp+prefillMeasured, avg)
	for _, r := range results {
		Expect(r.Err).NotTo(HaveOccurred())
		Expect(r.Status).To(Equal(http.StatusOK))
	}
	Expect(streams).To(BeNumerically(">", 0))
	// Identical simulators: identical learned rates, within 15%.
	Expect(len(results)).To(BeNumerically(">=", 250), "a run of at least 250 requests")
	Expect(hi/lo).To(BeNumerically("<=", 1.15), "learned rates of identical engines: %+v", l.Endpoints)
	for _, p := range ps.Pods() {
		engine := avg.engine[p.Name] / float64(avg.samples)
		ledger := avg.ledger[p.Name] / float64(avg.samples)
		Expect(engine).To(BeNumerically(">=", prefillMinQueued), "the load kept %s's queue non-trivial: %s", p.Name, avg)
		Expect(ledger).To(BeNumerically("~", engine, prefillTolerance*engine), "%s: the ledger's prefill against the engine's: %s", p.Name, avg)
	}
	return len(results), streams
}

var _ = Describe("The ledger's prefill under a non-streaming workload", Ordered, func() {
	var ps *stack.Stack

	BeforeAll(func(ctx SpecContext) {
		// Real time: a prompt takes tens of milliseconds to prefill, so the
		// gateway's few milliseconds per request are small beside it.
		ps = startStack(ctx, stack.Options{
			Namespace:  "e2e-prefill",
			PoolName:   "prefill-pool",
			Pods:       3,
			FirstPodIP: prefillFirstPodIP,
			TimeScale:  1,
		})
	}, NodeTimeout(2*time.Minute))

	It("tracks each engine's queued prefill within 25% over a mix of streaming and non-streaming requests", func(ctx SpecContext) {
		requests, streamed := runPrefillWorkload(ctx, ps, func(c int) bool { return c%2 == 0 })
		Expect(requests - streamed).To(BeNumerically(">", 0))
	}, SpecTimeout(2*time.Minute))
})

var _ = Describe("The ledger's prefill when half the streamed first bytes come late", Ordered, func() {
	var ps *stack.Stack

	BeforeAll(func(ctx SpecContext) {
		// The simulators hold half the responses back whole until their
		// last token, as a buffering proxy would: their first bytes say
		// nothing of prefill.
		ps = startStack(ctx, stack.Options{
			Namespace:             "e2e-late",
			PoolName:              "late-pool",
			Pods:                  3,
			FirstPodIP:            lateFirstPodIP,
			TimeScale:             1,
			LateFirstByteFraction: 0.5,
		})
	}, NodeTimeout(2*time.Minute))

	It("learns the same rates, tracks each engine's queued prefill within 25%, and learns nothing from the late first bytes", func(ctx SpecContext) {
		runPrefillWorkload(ctx, ps, func(int) bool { return true })
		m, err := ps.PickerMetrics(ctx)
		Expect(err).NotTo(HaveOccurred())
		const name = "tally_prefill_rate_samples_total"
		learned, _ := m.Value(name, "result", "learned")
		late, _ := m.Value(name, "result", "late")
		outlier, _ := m.Value(name, "result", "outlier")
		fmt.Fprintf(GinkgoWriter, "first bytes offered to the rate: %.0f learned, %.0f late, %.0f outliers\n", learned, late, outlier)
		// About half of the responses were held back; each is refused as
		// late (or as an outlier), and the rest taught the rate.
		offered := learned + late + outlier
		Expect(learned).To(BeNumerically(">", 0.35*offered), "first bytes learned: %.0f of %.0f", learned, offered)
		Expect(late+outlier).To(BeNumerically(">", 0.35*offered), "first bytes refused as late: %.0f of %.0f", late+outlier, offered)
	}, SpecTimeout(2*time.Minute))
})
