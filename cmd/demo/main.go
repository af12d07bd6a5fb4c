// Command demo runs Tally end to end on this machine and compares it with
// round-robin routing: `make demo`.
//
// It starts a real kube-apiserver and etcd, creates namespace "demo" with
// InferencePool "demo-pool" and --pods Ready pods whose IPs are 127.0.0.2,
// 127.0.0.3, ..., serves a simulated vLLM engine on each pod IP at port 8000,
// and runs the picker (bin/epp) and the dev gateway (bin/devgateway, on
// localhost:8080) as processes. Then, for each policy, with fresh simulators
// (empty prefix caches), it replays two workloads and measures them client
// side:
//   - burst: --burst concurrent requests sharing a system prompt of
//     --system-tokens tokens, each with its own user turn;
//   - mooncake: the Mooncake trace sample (test/data), its arrivals
//     compressed by --time-scale;
//   - lora (with --adapters, 8 by default): the simulators serve that many
//     LoRA adapters, --max-loras at once, and the first --adapter-requests
//     requests of the trace are each for an adapter drawn from a Zipf mix;
//     a table adds the adapter swaps the simulators counted (lora.go).
//
// Policy "tally" sends the requests through the gateway; "round-robin" sends
// the same requests straight to the pods in rotation. With --flow (the
// default), "tally-flow" replays the trace through a second picker with
// flow control on (flowControl: {enabled: true}) and a gateway of its own:
// a request that finds every pod saturated waits in that picker, its stream
// open, until a pod frees, and a refused one is answered 429 (counted in the
// table's 429 column, not as a failure). The simulators run --time-scale
// times faster than real time, so every time in the table is the measured
// wall time multiplied back by --time-scale; the flow control picker's
// times (its saturation threshold and reordering bound) are divided by it,
// so that they mean in simulated time what the defaults mean in real time.
//
// With --pd (the default), "tally-pd" replays the trace over a
// prefill/decode pool of its own, started for its row and stopped after
// it: an API server, as many pods as --pods on the loopback IPs after the
// pool's, the first half labelled prefill and the rest decode (each decode
// pod's simulator behind the P/D sidecar, internal/pdsidecar), its picker
// with splitting on (disaggregation) and its gateway. A table adds how
// many requests were split and the prefill legs each prefill pod ran
// (pd.go).
//
// With --upstream-bin (make demo passes bin/upstream-epp, which `make
// upstream-epp` builds), "upstream" replays every workload through the
// upstream picker (gateway-api-inference-extension v1.5.0's cmd/epp) and a
// gateway of its own: its default scorers, plus its lora-affinity-scorer
// when the simulators serve adapters (upstream.go).
//
// With --keep the stack stays up after the table until Ctrl-C. Whatever
// happens, everything the demo started is stopped before it exits; a failure
// (including any failed request) exits with status 1, a bad flag with status 2.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/modelsim/server"
	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/internal/testenv"
	"github.com/tallyepp/tally/picker/debugledger"
)

const (
	exitOK       = 0
	exitFailure  = 1
	exitBadUsage = 2
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "demo: %v\n", err)
		return exitBadUsage
	}
	if err := demo(ctx, opts, stdout, stderr); err != nil {
		fmt.Fprintf(stderr, "demo: %v\n", err)
		return exitFailure
	}
	return exitOK
}

func demo(ctx context.Context, opts options, stdout, stderr io.Writer) (err error) {
	// envtest logs through controller-runtime's logger; the demo reports
	// failures as errors instead.
	logf.SetLogger(logr.Discard())
	if err := opts.resolvePaths(); err != nil {
		return err
	}
	trace, err := stack.LoadTraceFile(opts.tracePath)
	if err != nil {
		return fmt.Errorf("flag --trace: %w", err)
	}
	if opts.traceRequests > 0 && opts.traceRequests < len(trace) {
		trace = trace[:opts.traceRequests]
	}
	adapters := adapterNames(opts.adapters)
	workloads := []workload{
		// The burst runs in real time: through the gateway it pays for the
		// gateway's and the picker's real work, which a time scale would
		// multiply along with the simulated engine time.
		{name: "burst", timeScale: 1, requests: stack.Burst{
			Requests: opts.burst, SystemTokens: opts.systemTokens, UserTokens: opts.userTokens,
			MaxTokens: opts.burstMaxTokens, Model: stack.DefaultModel,
		}.Workload()},
		{name: "mooncake", timeScale: opts.timeScale, requests: withNonStreaming(trace, stack.TraceWorkload(trace, stack.DefaultModel, opts.timeScale), opts.nonStreaming)},
	}
	pickerArgs := opts.pickerArgs
	var maxLoRAs int
	if len(adapters) > 0 {
		workloads = append(workloads, workload{name: loraWorkload, timeScale: opts.timeScale,
			requests: adapterWorkload(trace[:min(opts.adapterRequests, len(trace))], adapters, opts.adapterZipf, opts.timeScale)})
		pickerArgs = append(loraPickerArgs(opts.timeScale, opts.pickerArgs), opts.pickerArgs...)
		maxLoRAs = opts.maxLoRAs
	}

	started := time.Now()
	fmt.Fprintf(stdout, "Starting the API server, %d pods with simulators (trace time scale %g), the picker and the gateway...\n", opts.pods, opts.timeScale)
	var procOut io.Writer
	if opts.verbose {
		procOut = stderr
	}
	s, err := stack.Start(ctx, stack.Options{
		BinDir:        opts.binDir,
		Pods:          opts.pods,
		TimeScale:     opts.timeScale,
		GatewayListen: opts.gatewayListen,
		FirstPodIP:    opts.firstPodIP,
		Output:        procOut,
		PickerArgs:    pickerArgs,
		LoRAAdapters:  adapters,
		MaxLoRAs:      maxLoRAs,

		LateFirstByteFraction: opts.lateFirstBytes,
	})
	if err != nil {
		return err
	}
	defer func() {
		fmt.Fprintln(stdout, "Stopping the stack...")
		if stopErr := s.Stop(); stopErr != nil {
			err = errors.Join(err, fmt.Errorf("stopping the stack: %w", stopErr))
		}
	}()
	fmt.Fprintf(stdout, "Stack up in %.1fs: API server %s, gateway %s, pods %v\n",
		time.Since(started).Seconds(), s.APIServerURL(), s.GatewayURL(), s.PodNames())

	pols := []policy{tallyPolicy(s), roundRobinPolicy(s)}
	if opts.flow {
		cfg := flowPickerConfig(opts.timeScale)
		r, err := s.StartReplica(ctx, "--config-text="+cfg)
		if err != nil {
			return fmt.Errorf("starting the flow control picker: %w", err)
		}
		fmt.Fprintf(stdout, "Flow control picker %s up, gateway %s, config %s\n", r.Name(), r.GatewayURL(), cfg)
		pols = slices.Insert(pols, 1, flowPolicy(r))
	}
	var pd *pdPool
	if opts.pd {
		pd = newPDPool(opts, procOut, stdout)
		// Stopped after its row; this stops it when the demo ends sooner.
		defer func() { err = errors.Join(err, pd.stop()) }()
		pols = slices.Insert(pols, len(pols)-1, pdPolicy(pd))
	}
	if opts.upstreamBin != "" {
		pols = slices.Insert(pols, len(pols)-1, upstreamPolicy(s, opts.upstreamBin, len(adapters) > 0, stdout))
	}

	runs, err := runPolicies(ctx, s, pols, workloads, opts, stdout)
	if err != nil {
		return err
	}
	summaries := make([]stack.Summary, len(runs))
	for i, r := range runs {
		summaries[i] = r.summary
	}
	fmt.Fprintln(stdout)
	if err := stack.WriteTable(stdout, summaries); err != nil {
		return err
	}
	fmt.Fprintln(stdout, "tally: through the dev gateway and the picker; round-robin: the same requests straight to the pods in turn.")
	if opts.upstreamBin != "" {
		fmt.Fprintln(stdout, "upstream: through the upstream picker (v1.5.0) and a gateway of its own.")
	}
	if opts.flow {
		fmt.Fprintln(stdout, "tally-flow: through a second picker with flow control on (and its gateway), the mooncake trace only; 429: requests it refused.")
	}
	if opts.pd {
		fmt.Fprintf(stdout, "%s: through a picker of a prefill/decode pool of its own (and its gateway), the mooncake trace only (below).\n", pdPolicyName)
		fmt.Fprintln(stdout)
		if err := writePDTable(stdout, pd, runs); err != nil {
			return err
		}
	}
	if len(adapters) > 0 {
		fmt.Fprintln(stdout)
		if err := writeLoRATable(stdout, opts, runs); err != nil {
			return err
		}
	}
	if opts.nonStreaming > 0 {
		fmt.Fprintln(stdout)
		writeStreamingTable(stdout, runs)
	}
	if opts.lateFirstBytes > 0 {
		fmt.Fprintln(stdout)
		writeLateTable(stdout, runs)
	}
	fmt.Fprintf(stdout, "Demo took %.0fs of wall time.\n", time.Since(started).Seconds())
	failed := 0
	for _, sum := range summaries {
		failed += sum.Errors
	}
	if opts.keep {
		printKeepInstructions(stdout, s)
		<-ctx.Done()
	}
	if failed > 0 {
		// The table shows them; a demo with failed requests is still a failure.
		return fmt.Errorf("%d requests failed (first errors above)", failed)
	}
	return nil
}

type workload struct {
	name      string
	timeScale float64 // the simulators' speed-up while it runs
	requests  []stack.Request
}

type policy struct {
	name string
	// baseURL says where request i goes.
	baseURL func(i int) string
	// ledger reads the picker's ledger; nil for no picker.
	ledger func(ctx context.Context) (debugledger.Ledger, error)
	// traceOnly: the policy replays the mooncake trace alone.
	traceOnly bool
	// start and done, when set, run before the policy's first workload
	// and after its last.
	start func(context.Context) error
	done  func() error
	// pool, when set, is the stack whose pods serve the policy (once
	// start ran), in place of the demo's: the P/D row's (pd.go).
	pool func() *stack.Stack
}

func tallyPolicy(s *stack.Stack) policy {
	return policy{name: "tally", baseURL: func(int) string { return s.GatewayURL() }, ledger: s.Ledger}
}

func roundRobinPolicy(s *stack.Stack) policy {
	pods := s.Pods()
	return policy{name: "round-robin", baseURL: func(i int) string { return pods[i%len(pods)].URL() }}
}

// flowPolicy sends the trace through r, a picker with flow control on.
func flowPolicy(r *stack.Replica) policy {
	return policy{name: "tally-flow", baseURL: func(int) string { return r.GatewayURL() }, ledger: r.Ledger, traceOnly: true}
}

// flowPickerConfig is the flow control picker's configuration: flow control
// on, its times divided by the time scale, so that the hold threshold and
// the reordering bound are the defaults in simulated time. Its TTL is the
// default in real time: longer in simulated time, so the trace sees no
// 429 that a real-time run would not.
func flowPickerConfig(timeScale float64) string {
	scaled := func(ms int) int { return max(int(math.Round(float64(ms)/timeScale)), 1) }
	return fmt.Sprintf("{flowControl: {enabled: true, holdPrefillMilliseconds: %d, maxReorderMilliseconds: %d}}",
		scaled(v1alpha1.DefaultHoldPrefillMilliseconds), scaled(v1alpha1.DefaultMaxReorderMilliseconds))
}

// ledgerIdleTimeout bounds the wait for the picker's ledger to drain after
// a workload through the gateway: every release happens as the last
// response bytes pass, so it is at zero almost at once.
const ledgerIdleTimeout = 10 * time.Second

// replayed is one policy's replay of one workload: its table row, its
// times split by streaming, the adapter swaps the simulators counted, and
// the prefill legs each prefill pod ran (none but in the P/D row).
type replayed struct {
	summary stack.Summary
	times   streamingTimes
	swaps   int64
	legs    map[string]int
}

func runPolicies(ctx context.Context, demoStack *stack.Stack, policies []policy, workloads []workload, opts options, stdout io.Writer) ([]replayed, error) {
	var runs []replayed
	for _, pol := range policies {
		if pol.start != nil {
			if err := pol.start(ctx); err != nil {
				return nil, err
			}
		}
		s := demoStack
		if pol.pool != nil {
			s = pol.pool()
		}
		pods := s.Pods()
		for _, w := range workloads {
			if pol.traceOnly && w.name != "mooncake" {
				continue
			}
			// Every policy and workload starts from cold simulators: empty
			// prefix caches, no adapter loaded.
			if err := s.ResetSimulators(w.timeScale); err != nil {
				return nil, err
			}
			if err := warmUp(ctx, s, pol.baseURL, len(pods)); err != nil {
				return nil, fmt.Errorf("warming up %s: %w", pol.name, err)
			}
			label := pol.name + "/" + w.name
			fmt.Fprintf(stdout, "%s: replaying %d requests\n", label, len(w.requests))
			baseURL := pol.baseURL
			// --direct bypasses the demo's picker only: the P/D pool's
			// prefill pods are no destination.
			if pol.ledger != nil && pol.pool == nil && w.name != "burst" && opts.direct > 0 {
				baseURL = bypassing(baseURL, pods, opts.direct)
			}
			replay := &stack.Replayer{
				Client:   s.HTTPClient(),
				BaseURL:  baseURL,
				IDPrefix: label,
				Progress: func(done, total int) {
					fmt.Fprintf(stdout, "  %s: %d/%d requests done\n", label, done, total)
				},
			}
			begin := time.Now()
			results := replay.Run(ctx, w.requests)
			wall := time.Since(begin)
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("interrupted during %s: %w", label, err)
			}
			runs = append(runs, replayed{
				summary: stack.Summarize(pol.name, w.name, results, s.PodNames(), s.ServedBy, wall, w.timeScale),
				times:   splitByStreaming(w.requests, results, w.timeScale, opts.lateFirstBytes),
				swaps:   adapterLoads(s), // every request ended: nothing loads any more
				legs:    prefillLegs(results, s.PrefilledBy),
			})
			if pol.ledger != nil {
				if err := waitLedgerIdle(ctx, pol.ledger); err != nil {
					return nil, fmt.Errorf("after %s: %w", label, err)
				}
			}
		}
		if pol.done != nil {
			if err := pol.done(); err != nil {
				return nil, fmt.Errorf("after %s: %w", pol.name, err)
			}
		}
	}
	return runs, nil
}

// bypassing sends a deterministic fraction of the requests straight to the
// pods in turn instead of through base: request i does when the fractional
// part of i times sqrt(2)-1 is below fraction (independent of which requests
// withNonStreaming picks).
func bypassing(base func(int) string, pods []*stack.Pod, fraction float64) func(int) string {
	return func(i int) string {
		if _, frac := math.Modf(float64(i+1) * (math.Sqrt2 - 1)); frac < fraction {
			return pods[i%len(pods)].URL()
		}
		return base(i)
	}
}

// withNonStreaming makes a deterministic fraction of the trace's requests
// non-streaming ("stream": false): request i is, when the fractional part
// of i times the golden ratio is below fraction, which spreads them evenly
// over the trace.
func withNonStreaming(trace []stack.TraceRequest, reqs []stack.Request, fraction float64) []stack.Request {
	if fraction <= 0 {
		return reqs
	}
	for i := range reqs {
		if _, frac := math.Modf(float64(i+1) * 0.6180339887498949); frac < fraction {
			at, key := reqs[i].At, reqs[i].DrawKey
			reqs[i] = stack.Completion(stack.DefaultModel, trace[i].PromptText(), trace[i].OutputTokens, false)
			reqs[i].At, reqs[i].DrawKey = at, key
		}
	}
	return reqs
}

// streamingTimes are a replay's successful requests split by streaming: a
// streamed request's TTFT is when its first token arrives; a non-streamed
// one's client sees nothing before the whole response, so only its latency
// is shown. With --late-first-byte-fraction, firstToken has each streamed
// request's time to its first token as a streaming response would have
// shown it: a held-back response's TTFT less the time the simulator held it
// (stack.Result.HeldBack), which says how well the requests were placed
// whatever the responses' fate.
type streamingTimes struct {
	streamedTTFT, nonStreamedLatency []time.Duration
	firstToken                       []time.Duration
	onTime, heldBack                 int
}

func splitByStreaming(reqs []stack.Request, results []stack.Result, timeScale, lateFraction float64) streamingTimes {
	var t streamingTimes
	for i, r := range results {
		if r.Err != nil {
			continue
		}
		if !reqs[i].Stream {
			t.nonStreamedLatency = append(t.nonStreamedLatency, time.Duration(float64(r.Latency)*timeScale))
			continue
		}
		t.streamedTTFT = append(t.streamedTTFT, time.Duration(float64(r.TTFT)*timeScale))
		t.firstToken = append(t.firstToken, time.Duration(float64(r.TTFT-r.HeldBack)*timeScale))
		if server.HoldsBack(lateFraction, reqs[i].DrawKeyOf(r.ID)) {
			t.heldBack++
		} else {
			t.onTime++
		}
	}
	return t
}

// writeLateTable shows each replay's streamed TTFTs: as the clients saw
// them (a held-back response's at its end), and to the first token, as
// if every response had streamed.
func writeLateTable(w io.Writer, runs []replayed) {
	fmt.Fprintln(w, "With late first bytes (simulated seconds; held back: responses the simulators sent whole at their end; first token: each response's first token as streaming would have shown it):")
	fmt.Fprintf(w, "%-12s %-9s %9s %9s %9s   %11s %11s %11s   %8s %9s\n", "policy", "workload",
		"TTFT p50", "TTFT p90", "TTFT p99", "1st tok p50", "1st tok p90", "1st tok p99", "on time", "held back")
	for _, r := range runs {
		sum, t := r.summary, r.times
		if len(t.streamedTTFT) == 0 {
			continue
		}
		fmt.Fprintf(w, "%-12s %-9s %8.3fs %8.3fs %8.3fs   %10.3fs %10.3fs %10.3fs   %8d %9d\n", sum.Policy, sum.Workload,
			stack.Percentile(t.streamedTTFT, 50).Seconds(), stack.Percentile(t.streamedTTFT, 90).Seconds(),
			stack.Percentile(t.streamedTTFT, 99).Seconds(),
			stack.Percentile(t.firstToken, 50).Seconds(), stack.Percentile(t.firstToken, 90).Seconds(),
			stack.Percentile(t.firstToken, 99).Seconds(), t.onTime, t.heldBack)
	}
}

func writeStreamingTable(w io.Writer, runs []replayed) {
	fmt.Fprintln(w, "With non-streaming clients (simulated seconds):")
	fmt.Fprintf(w, "%-12s %-9s %9s %9s %9s %9s   %12s %9s %9s %9s\n", "policy", "workload",
		"streamed", "TTFT p50", "TTFT p90", "TTFT p99", "non-streamed", "lat p50", "lat p90", "lat p99")
	for _, r := range runs {
		sum, t := r.summary, r.times
		fmt.Fprintf(w, "%-12s %-9s %9d %8.3fs %8.3fs %8.3fs   %12d %8.3fs %8.3fs %8.3fs\n", sum.Policy, sum.Workload,
			len(t.streamedTTFT), stack.Percentile(t.streamedTTFT, 50).Seconds(), stack.Percentile(t.streamedTTFT, 90).Seconds(),
			stack.Percentile(t.streamedTTFT, 99).Seconds(), len(t.nonStreamedLatency),
			stack.Percentile(t.nonStreamedLatency, 50).Seconds(), stack.Percentile(t.nonStreamedLatency, 90).Seconds(),
			stack.Percentile(t.nonStreamedLatency, 99).Seconds())
	}
}

// warmUp sends n small requests the policy's way, one at a time, so the
// measured workloads find connections open (client to gateway, gateway to
// picker and pods), as they would be in a running system. Their prompts
// share nothing with the workloads'. Each is tried twice: the gateway may
// still pool a connection to a simulator that ResetSimulators replaced, and
// the first request on it fails; that is what warming up clears.
func warmUp(ctx context.Context, s *stack.Stack, baseURL func(int) string, n int) error {
	for i := range n {
		req := stack.Completion(stack.DefaultModel, fmt.Sprintf("warm-up request %d", i), 1, true)
		var res stack.Result
		for try := range 2 {
			if res = stack.Send(ctx, s.HTTPClient(), baseURL(i), fmt.Sprintf("warmup-%d-%d", i, try), req); res.Err == nil {
				break
			}
		}
		if res.Err != nil {
			return res.Err
		}
	}
	return nil
}

// waitLedgerIdle checks that the picker released every reservation.
func waitLedgerIdle(ctx context.Context, ledger func(context.Context) (debugledger.Ledger, error)) error {
	deadline := time.Now().Add(ledgerIdleTimeout)
	for {
		l, err := ledger(ctx)
		if err == nil && l.Idle() {
			return nil
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("the picker's ledger: %w", err)
			}
			return fmt.Errorf("the picker's ledger still holds %d requests and %d prefill tokens %v after the workload ended", l.InFlight, l.PrefillTokens, ledgerIdleTimeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func printKeepInstructions(w io.Writer, s *stack.Stack) {
	fmt.Fprintf(w, `
The stack keeps running until Ctrl-C.
  API server:  %s (kubeconfig: %s)
  picker:      %s/metrics and %s/debug/ledger
  try:
    curl -s %s/v1/completions -H 'Content-Type: application/json' \
      -d '{"model":"%s","prompt":"Hello, Tally","max_tokens":8}'
    kubectl --kubeconfig %s -n %s get inferencepools,pods -o wide
`, s.APIServerURL(), s.Kubeconfig(), s.PickerMetricsURL(), s.PickerMetricsURL(),
		s.GatewayURL(), stack.DefaultModel, s.Kubeconfig(), s.Options().Namespace)
}

type options struct {
	pods           int
	timeScale      float64
	keep           bool
	verbose        bool
	binDir         string
	tracePath      string
	traceRequests  int
	nonStreaming   float64
	lateFirstBytes float64
	direct         float64
	flow           bool
	pd             bool
	pickerArgs     []string
	burst          int
	systemTokens   int
	userTokens     int
	burstMaxTokens int
	gatewayListen  string
	firstPodIP     netip.Addr
	upstreamBin    string
	// The LoRA section (lora.go); adapters 0 leaves it out.
	adapters        int
	adapterRequests int
	adapterZipf     float64
	maxLoRAs        int
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	o := options{}
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.pods, "pods", stack.DefaultPods, "number of pods (simulated model servers) in the pool")
	fs.Float64Var(&o.timeScale, "time-scale", defaultTimeScale, "how many times faster than real time the simulators run during the trace replay (the burst runs in real time)")
	fs.BoolVar(&o.keep, "keep", false, "leave the stack running after the table until Ctrl-C")
	fs.BoolVar(&o.verbose, "v", false, "copy the picker's and the gateway's logs to stderr")
	fs.StringVar(&o.binDir, "bin-dir", "", "directory holding the epp and devgateway binaries (default: beside this binary, else <repo>/bin)")
	fs.StringVar(&o.tracePath, "trace", "", "Mooncake-format trace to replay (default: <repo>/test/data/mooncake_sample.jsonl)")
	fs.IntVar(&o.traceRequests, "trace-requests", 0, "replay only the first N requests of the trace (0: all)")
	fs.Float64Var(&o.direct, "direct", 0, "fraction (0 to 1) of the trace's requests the tally policy sends straight to the pods, round robin, bypassing the picker (as a second gateway or a batch job would)")
	fs.BoolVar(&o.flow, "flow", true, "also replay the trace through a second picker with flow control on (row tally-flow); it gets the --picker-arg flags too, then its own --config-text")
	fs.BoolVar(&o.pd, "pd", true, "also replay the trace over a prefill/decode pool of its own (row "+pdPolicyName+"): as many pods as --pods, the first half prefill pods and the rest decode pods behind the P/D sidecar, on the IPs after the pool's, through a picker with splitting on; it gets the --picker-arg flags too, then its own --config-text")
	fs.Func("picker-arg", "an extra flag for the picker, e.g. --picker-arg=--refresh-metrics-interval=0 (repeatable)", func(v string) error {
		o.pickerArgs = append(o.pickerArgs, v)
		return nil
	})
	fs.Float64Var(&o.nonStreaming, "non-streaming", 0, "fraction (0 to 1) of the trace's requests sent with \"stream\": false")
	fs.Float64Var(&o.lateFirstBytes, "late-first-byte-fraction", 0, "fraction (0 to 1) of streamed responses the simulators hold back whole until their last token, as a buffering proxy would")
	fs.IntVar(&o.burst, "burst", 64, "requests in the burst")
	fs.IntVar(&o.systemTokens, "system-tokens", 4096, "tokens of the burst's shared system prompt")
	fs.IntVar(&o.userTokens, "user-tokens", 256, "tokens of each burst request's own user turn")
	fs.IntVar(&o.burstMaxTokens, "burst-max-tokens", 64, "tokens each burst request generates")
	fs.StringVar(&o.gatewayListen, "gateway-listen", "localhost:8080", "the gateway's listen address")
	o.firstPodIP = stack.DefaultFirstPodIP
	fs.Func("first-pod-ip", "the first pod's IP, an IPv4 loopback address; the next pods count up from it, each simulator listening on its pod's IP, port 8000 (default "+stack.DefaultFirstPodIP.String()+")", func(v string) error {
		ip, err := netip.ParseAddr(v)
		if err != nil || !ip.Is4() || !ip.IsLoopback() {
			return fmt.Errorf("%q is not an IPv4 loopback address (127.x.y.z)", v)
		}
		o.firstPodIP = ip
		return nil
	})
	fs.StringVar(&o.upstreamBin, "upstream-bin", "", "the upstream picker's binary (make upstream-epp builds bin/upstream-epp); given, row upstream replays every workload through it (make demo passes it)")
	fs.IntVar(&o.adapters, "adapters", 8, "LoRA adapters each simulator serves besides the base model, for the lora rows (0: no LoRA section)")
	fs.IntVar(&o.adapterRequests, "adapter-requests", 100, "with --adapters: the lora rows replay the first N requests of the trace, each for an adapter")
	fs.Float64Var(&o.adapterZipf, "adapter-zipf", 1.1, "with --adapters: the adapter of rank k is drawn with weight 1/k^s (0: every adapter alike)")
	fs.IntVar(&o.maxLoRAs, "max-loras", 2, "with --adapters: adapters each simulator runs at once (vLLM's --max-loras)")
	if err := fs.Parse(args); err != nil {
		return options{}, err
	}
	if fs.NArg() > 0 {
		return options{}, fmt.Errorf("unexpected argument %q: demo takes flags only", fs.Arg(0))
	}
	return o, o.validate()
}

// defaultTimeScale runs the simulators five times faster than real time: the
// demo takes about a minute once built (76 s on two cores with --pd=false;
// 66 s with --adapters=0 too, 50 s or so with --flow=false as well), 30 s
// more with the upstream rows and 30 s more with the P/D row (make demo's,
// both: 139 s in one run). The gateway and the picker run in real time, so their own
// cost per request (about a millisecond of CPU on this path) is multiplied
// by the scale in the table's simulated times; a larger scale is faster but
// inflates the "tally" rows' times by that much.
const defaultTimeScale = 5

// maxPods keeps pod IPs within 127.0.0.0/8 and the demo within what two
// cores can simulate.
const maxPods = 64

func (o options) validate() error {
	var errs []error
	positive := func(name string, v, maxV int) {
		if v < 1 || v > maxV {
			errs = append(errs, fmt.Errorf("flag --%s: %d is invalid: must be from 1 to %d", name, v, maxV))
		}
	}
	positive("pods", o.pods, maxPods)
	// With --pd the P/D pool's pods take the IPs after the pool's.
	ips, pdIPs := o.pods, ""
	if o.pd {
		ips, pdIPs = 2*o.pods, fmt.Sprintf(" and --pd (the P/D pool's %d pods follow; --pd=false leaves them out)", o.pods)
	}
	if last := o.firstPodIP.As4(); o.pods >= 1 && int(last[3])+ips-1 > 254 {
		errs = append(errs, fmt.Errorf("flag --first-pod-ip: %s is invalid with --pods %d%s: the last pod's IP would pass %d.%d.%d.254", o.firstPodIP, o.pods, pdIPs, last[0], last[1], last[2]))
	}
	if o.pd && o.pods == 1 {
		errs = append(errs, errors.New("flag --pd: needs --pods of 2 or more, one prefill and one decode pod (--pods is 1); --pd=false leaves the P/D row out"))
	}
	positive("burst", o.burst, 4096)
	positive("system-tokens", o.systemTokens, 1<<20)
	positive("user-tokens", o.userTokens, 1<<20)
	positive("burst-max-tokens", o.burstMaxTokens, 1<<16)
	if !(o.timeScale >= 1 && o.timeScale <= 100) {
		errs = append(errs, fmt.Errorf("flag --time-scale: %g is invalid: must be from 1 to 100", o.timeScale))
	}
	if !(o.direct >= 0 && o.direct <= 1) {
		errs = append(errs, fmt.Errorf("flag --direct: %g is invalid: must be from 0 to 1", o.direct))
	}
	if !(o.lateFirstBytes >= 0 && o.lateFirstBytes <= 1) {
		errs = append(errs, fmt.Errorf("flag --late-first-byte-fraction: %g is invalid: must be from 0 to 1", o.lateFirstBytes))
	}
	if !(o.nonStreaming >= 0 && o.nonStreaming <= 1) {
		errs = append(errs, fmt.Errorf("flag --non-streaming: %g is invalid: must be from 0 to 1", o.nonStreaming))
	}
	if o.traceRequests < 0 {
		errs = append(errs, fmt.Errorf("flag --trace-requests: %d is invalid: must be 0 (all) or more", o.traceRequests))
	}
	if o.upstreamBin != "" {
		if st, err := os.Stat(o.upstreamBin); err != nil {
			errs = append(errs, fmt.Errorf("flag --upstream-bin: %w (make upstream-epp builds bin/upstream-epp)", err))
		} else if st.IsDir() {
			errs = append(errs, fmt.Errorf("flag --upstream-bin: %s is a directory, not the upstream picker's binary", o.upstreamBin))
		}
	}
	if o.adapters < 0 || o.adapters > maxAdapters {
		errs = append(errs, fmt.Errorf("flag --adapters: %d is invalid: must be from 0 (no LoRA section) to %d", o.adapters, maxAdapters))
	}
	if o.adapters > 0 {
		positive("adapter-requests", o.adapterRequests, 1<<20)
		positive("max-loras", o.maxLoRAs, maxAdapters)
		if !(o.adapterZipf >= 0 && o.adapterZipf <= 10) {
			errs = append(errs, fmt.Errorf("flag --adapter-zipf: %g is invalid: must be from 0 (every adapter alike) to 10", o.adapterZipf))
		}
	}
	return errors.Join(errs...)
}

// resolvePaths fills in the default binary directory and trace.
func (o *options) resolvePaths() error {
	if o.binDir == "" {
		if exe, err := os.Executable(); err == nil {
			if _, err := os.Stat(filepath.Join(filepath.Dir(exe), "epp")); err == nil {
				o.binDir = filepath.Dir(exe)
			}
		}
	}
	if o.binDir != "" && o.tracePath != "" {
		return nil
	}
	root, err := testenv.RepoRoot()
	if err != nil {
		return fmt.Errorf("finding the repository (needed for the defaults of --bin-dir and --trace): %w", err)
	}
	if o.binDir == "" {
		o.binDir = filepath.Join(root, "bin")
	}
	if o.tracePath == "" {
		o.tracePath = filepath.Join(root, "test", "data", "mooncake_sample.jsonl")
	}
	return nil
}
