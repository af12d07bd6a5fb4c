// Command extproc-load drives an endpoint picker over real gRPC with the
// messages Envoy's ext_proc filter sends (FULL_DUPLEX_STREAMED request and
// response bodies: request headers with protocol_config, body chunks of at
// most 62,000 bytes, the last with end_of_stream, then the response headers,
// the response body and the end of the stream), and measures it. It plays
// both the gateway and the model servers: each routed request is answered
// on its stream with a short streamed completion.
//
// Usage:
//
//	extproc-load burst|load|churn|stagger|bench [flags]
//
// Scenarios:
//
//	burst   --n N requests of --tokens tokens sent at once, each held open at
//	        its endpoint until all are placed; --kind fresh (no shared
//	        prefix), cold (a 512-token prefix nobody holds), shared (a
//	        512-token prefix one pod holds: warmed first) or long (a
//	        30,000-token one). Prints the placement per endpoint. With
//	        --gateway ngf the requests (and the warm one) come as NGINX
//	        Gateway Fabric's shim sends them (internal/ngfshim): no response
//	        phase, so the picker detaches their reservations. With --pd
//	        (or --roles prefill,prefill,decode,decode, any mix) the pods
//	        carry llm-d.ai/role and the picker splits requests
//	        (disaggregation.nonCachedTokens: --non-cached-tokens): it
//	        prints per decode pod the requests and those split, per
//	        prefill pod the prefill legs its answers named
//	        (x-prefiller-host-port), the prefix holder's splits and the
//	        picker's split decisions.
//	load    --concurrency C clients doing complete cycles for --duration
//	        (after --warmup): requests/s, time to pick p50/p99/p999, and the
//	        picker's CPU time per request and peak RSS (/proc/<pid>/stat and
//	        VmHWM in /proc/<pid>/status) over the window.
//	churn   --n requests ending in turn complete, cancelled before the pick,
//	        cancelled after it, answered 503 upstream, reset mid-response;
//	        then reads Tally's /debug/ledger and reports whether it emptied
//	        (skipped for the upstream picker, which has no ledger); with
//	        --then-bursts K, then K bursts of 128 x 32,000 tokens of --kind
//	        (through --gateway; the churn itself is Envoy's).
//	stagger --n requests of --tokens tokens, one every --every, each held
//	        at its endpoint for --hold, then answered (through --gateway);
//	        prints the busiest endpoint's count over the even share at the
//	        most uneven moment once as many requests end as arrive.
//	bench   every scenario, for Tally and the upstream picker side by side
//	        in one run, at 3, 16, 128 and 1,000 endpoints; writes markdown
//	        tables with ratios into --out between marker comments (--quick:
//	        fewer scenarios, shorter windows).
//
// By default the tool starts everything itself: a real kube-apiserver and
// etcd (internal/stack; $KUBEBUILDER_ASSETS or hack/envtest-assets.sh), an
// InferencePool, --pods Ready pods on loopback IPs (each address serves a
// vLLM metrics page reporting the requests the tool holds there), and the
// picker process (--picker tally: --tally-bin; upstream: --upstream-bin), so
// it knows the picker's pid. With --replicas N it starts N peer replicas of
// the picker instead (leader election and --peer-selector, one ledger) and
// spreads the streams over their ext_proc ports in turn, as a gateway
// spreads them over the picker Service's endpoints; it reports each
// replica's forwarded and locally placed picks, load reports the pick
// latency through each address (leader or follower), and CPU and memory
// are the replicas' summed. With --addr (one address, or a comma-separated
// list of replicas') it drives pickers already running instead (--pid and
// --metrics-url, if given, for CPU, memory and the ledger, which is read
// from the replica that leads: a follower's is a copy of it).
//
// load runs --concurrency closed-loop clients, or with --rate R an open
// loop of R arrivals a second. With several replicas and --bare-rtt it
// also times bare round trips of 200 bytes to another process of its own,
// over TCP and over a gRPC stream, each as often as a follower forwards a
// pick: what a forwarded pick's round trip to the leader cannot cost less
// than on the machine, under the same load; and, with the leader known,
// the p99 of the leader's picks each plus one such round trip.
//
// Progress goes to stderr, results to stdout. Exit status 2 is a bad flag, 1
// a failed run.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/tallyepp/tally/internal/stack"
)

// The gateways whose exchange --gateway plays.
const (
	gatewayEnvoy = "envoy"
	gatewayNGF   = "ngf"
)

type options struct {
	// Where the picker is.
	addrs       []string
	metricsURLs []string
	pid         int
	replicas    int
	rate        float64
	bareRTT     bool
	firstPodIP  netip.Addr
	picker      string
	tallyBin    string
	upstreamBin string
	pods        int
	useTLS      bool
	conns       int
	pickerArgs  stringList
	keepLogs    bool
	gateway     string
	// roles are the first pods' prefill/decode roles (--roles, --pd);
	// with a prefill-capable one the started picker splits requests
	// whose destination lacks nonCachedTokens of the prompt.
	roles           []string
	nonCachedTokens int
	// Scenario settings.
	n           int
	kind        string
	tokens      int
	concurrency int
	thenBursts  int
	duration    time.Duration
	warmup      time.Duration
	every, hold time.Duration
	// bench.
	quick bool
	out   string
	only  string
	runs  int
}

type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, " ") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

func parseFlags(args []string, stderr io.Writer) (string, options, error) {
	var o options
	fs := flag.NewFlagSet("extproc-load", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var addrs, metricsURLs string
	fs.StringVar(&addrs, "addr", "", "ext_proc address of a picker already running (host:port), or a comma-separated list of its replicas' (streams go to each in turn); empty starts the API server, pool, pods and picker")
	fs.StringVar(&metricsURLs, "metrics-url", "", "with --addr: the picker's metrics server (for /debug/ledger), e.g. http://127.0.0.1:9090, or a comma-separated list in --addr's order: the ledger is read from the replica that leads")
	fs.IntVar(&o.replicas, "replicas", 0, "without --addr: start this many peer replicas of the picker (leader election, --peer-selector) and spread the streams over them in turn; 0 starts one picker without the peer layer")
	firstPodIP := fs.String("first-pod-ip", defaultFirstPodIP.String(), "without --addr: the first pod's loopback IP (the others count up from it); another one lets two runs share a machine")
	fs.BoolVar(&o.bareRTT, "bare-rtt", false, "load with several replicas: also time bare round trips of 200 bytes to another process of this tool, over TCP and over a gRPC stream, as often as a follower forwards a pick, and the leader's picks each plus one")
	fs.Float64Var(&o.rate, "rate", 0, "load: open loop at this many requests per second (each arrival its own client, whatever the others wait for) instead of --concurrency closed-loop clients")
	fs.IntVar(&o.pid, "pid", 0, "with --addr: the picker's process id, for its CPU time and peak RSS")
	fs.StringVar(&o.picker, "picker", pickerTally, "picker to start: tally or upstream")
	fs.StringVar(&o.tallyBin, "tally-bin", "bin/epp", "Tally's picker binary")
	fs.StringVar(&o.upstreamBin, "upstream-bin", "bin/upstream-epp", "the upstream picker's binary (make upstream-epp)")
	fs.IntVar(&o.pods, "pods", 3, "Ready pods in the pool")
	fs.BoolVar(&o.useTLS, "tls", false, "speak TLS to the picker (certificate not verified); a started picker serves TLS then")
	fs.IntVar(&o.conns, "conns", 2, "gRPC connections to the picker (Envoy opens one per worker thread)")
	fs.BoolVar(&o.keepLogs, "keep-logs", false, "leave the started pickers' logs in their temporary directory")
	fs.StringVar(&o.gateway, "gateway", gatewayEnvoy, "burst, stagger and churn's --then-bursts: the gateway whose ext_proc exchange the bursts play: envoy, or ngf (NGINX Gateway Fabric's shim: no pseudo-headers, the body in one message, a half-close, no response phase)")
	fs.Var(&o.pickerArgs, "picker-arg", "extra flag for a started picker (repeatable)")
	roles := fs.String("roles", "", "burst: comma-separated prefill/decode role of the first pods, as the pod label llm-d.ai/role: prefill, decode, prefill-decode, or empty (unlabelled); --pods defaults to their number, and with a prefill pod the picker runs with disaggregation on (--non-cached-tokens)")
	pd := fs.Bool("pd", false, "burst: the same as --roles "+strings.Join(pdRoles, ","))
	fs.IntVar(&o.nonCachedTokens, "non-cached-tokens", 16, "with --roles or --pd: the picker's disaggregation.nonCachedTokens (a request is split when at least this many of its prompt tokens are not cached on its decode pod)")
	fs.IntVar(&o.n, "n", 0, "burst and churn: requests (default 128 for burst, 500 for churn)")
	fs.StringVar(&o.kind, "kind", kindShared, "burst: prompt kind: "+strings.Join(burstKinds, ", "))
	fs.IntVar(&o.tokens, "tokens", 0, "prompt tokens (default 32,000 for burst, 8,000 for load and churn)")
	fs.IntVar(&o.concurrency, "concurrency", 16, "load and churn: concurrent clients")
	fs.IntVar(&o.thenBursts, "then-bursts", 0, "churn: once the ledger is empty, this many bursts of 128 × 32,000 tokens of --kind, each placement printed")
	fs.DurationVar(&o.duration, "duration", 10*time.Second, "load: the measured window")
	fs.DurationVar(&o.every, "every", 20*time.Millisecond, "stagger: the interval between requests")
	fs.DurationVar(&o.hold, "hold", 2*time.Second, "stagger: how long each request is held at its endpoint")
	fs.DurationVar(&o.warmup, "warmup", 2*time.Second, "load: run this long before the window")
	fs.IntVar(&o.runs, "runs", 1, "bench: runs of the loads at 3 endpoints, alternating between the pickers; the tables give medians")
	fs.BoolVar(&o.quick, "quick", false, "bench: the short version (about 90 seconds on 2 cores)")
	fs.StringVar(&o.out, "out", "", "bench: markdown file whose generated section is replaced (empty: print the tables)")
	fs.StringVar(&o.only, "pickers", pickerTally+","+pickerUpstream, "bench: pickers to run, comma-separated")
	// Flags may come before the scenario and after it.
	if err := fs.Parse(args); err != nil {
		return "", o, err
	}
	if fs.NArg() == 0 {
		return "", o, errors.New("want a scenario: burst, load, churn, stagger or bench")
	}
	cmd := fs.Arg(0)
	if err := fs.Parse(fs.Args()[1:]); err != nil {
		return "", o, err
	}
	if fs.NArg() != 0 {
		return "", o, fmt.Errorf("want one scenario, got %q and then %q", cmd, fs.Args())
	}
	defaults := map[string][2]int{"burst": {128, 32_000}, "load": {0, 8_000}, "churn": {500, 8_000}, "stagger": {500, 8_000}, "bench": {0, 0}}
	d, ok := defaults[cmd]
	if !ok {
		return "", o, fmt.Errorf("scenario %q is invalid: want burst, load, churn, stagger or bench", cmd)
	}
	if o.n == 0 {
		o.n = d[0]
	}
	if ip, err := netip.ParseAddr(*firstPodIP); err != nil || !ip.IsLoopback() || !ip.Is4() {
		return "", o, fmt.Errorf("flag --first-pod-ip: %q is invalid: want an IPv4 loopback address such as 127.0.70.1", *firstPodIP)
	} else {
		o.firstPodIP = ip
	}
	if addrs != "" {
		o.addrs = strings.Split(addrs, ",")
		for i, a := range o.addrs {
			o.addrs[i] = strings.TrimSpace(a)
			if _, _, err := net.SplitHostPort(o.addrs[i]); err != nil {
				return "", o, fmt.Errorf("flag --addr: %q of %q is not host:port: want host:port or a comma-separated list of them", o.addrs[i], addrs)
			}
		}
	}
	if metricsURLs != "" {
		for _, u := range strings.Split(metricsURLs, ",") {
			o.metricsURLs = append(o.metricsURLs, strings.TrimSuffix(strings.TrimSpace(u), "/"))
		}
	}
	if o.tokens == 0 {
		o.tokens = d[1]
	}
	podsSet := false
	fs.Visit(func(f *flag.Flag) { podsSet = podsSet || f.Name == "pods" })
	if err := o.setRoles(cmd, *roles, *pd, podsSet); err != nil {
		return "", o, err
	}
	switch {
	case o.gateway != gatewayEnvoy && o.gateway != gatewayNGF:
		return "", o, fmt.Errorf("flag --gateway: %q is invalid: want %s or %s", o.gateway, gatewayEnvoy, gatewayNGF)
	case o.gateway == gatewayNGF && (cmd == "load" || cmd == "bench"):
		return "", o, fmt.Errorf("flag --gateway: %s plays only burst, stagger and churn's --then-bursts, not %s", o.gateway, cmd)
	case o.picker != pickerTally && o.picker != pickerUpstream:
		return "", o, fmt.Errorf("flag --picker: %q is invalid: want tally or upstream", o.picker)
	case o.pods < 1:
		return "", o, fmt.Errorf("flag --pods: %d is invalid: want 1 or more", o.pods)
	case o.n < 0:
		return "", o, fmt.Errorf("flag --n: %d is invalid: want 1 or more", o.n)
	case o.concurrency < 1:
		return "", o, fmt.Errorf("flag --concurrency: %d is invalid: want 1 or more", o.concurrency)
	case o.every <= 0:
		return "", o, fmt.Errorf("flag --every: %v is invalid: want more than 0", o.every)
	case o.hold <= 0:
		return "", o, fmt.Errorf("flag --hold: %v is invalid: want more than 0", o.hold)
	case o.duration <= 0:
		return "", o, fmt.Errorf("flag --duration: %v is invalid: want more than 0", o.duration)
	case o.warmup < 0:
		return "", o, fmt.Errorf("flag --warmup: %v is invalid: want 0 or more", o.warmup)
	case o.runs < 1:
		return "", o, fmt.Errorf("flag --runs: %d is invalid: want 1 or more", o.runs)
	case o.tokens < 0:
		return "", o, fmt.Errorf("flag --tokens: %d is invalid: want 1 or more", o.tokens)
	case cmd == "bench" && len(o.addrs) > 0:
		return "", o, errors.New("flag --addr: bench starts its own pickers; drop --addr")
	case o.replicas < 0:
		return "", o, fmt.Errorf("flag --replicas: %d is invalid: want 0 or more", o.replicas)
	case o.replicas > 0 && len(o.addrs) > 0:
		return "", o, errors.New("flag --replicas: starts the replicas itself; drop --addr, or --replicas to drive pickers already running")
	case o.replicas > 0 && (o.picker != pickerTally || cmd == "bench"):
		return "", o, errors.New("flag --replicas: only for a started Tally picker (--picker tally), not bench")
	case len(o.metricsURLs) > 0 && len(o.addrs) == 0:
		return "", o, errors.New("flag --metrics-url: only with --addr (a started picker's is known)")
	case len(o.metricsURLs) > 1 && len(o.metricsURLs) != len(o.addrs):
		return "", o, fmt.Errorf("flag --metrics-url: %d URLs for %d --addr addresses: give one, or one per address in the same order", len(o.metricsURLs), len(o.addrs))
	case o.rate < 0 || (o.rate > 0 && cmd != "load"):
		return "", o, fmt.Errorf("flag --rate: %v is invalid: want more than 0, for load only", o.rate)
	case o.bareRTT && (cmd != "load" || (o.replicas < 2 && len(o.addrs) < 2)):
		return "", o, errors.New("flag --bare-rtt: for load with several replicas only (--replicas 2 or more, or several --addr addresses)")
	}
	return cmd, o, nil
}

// pdRoles are --pd's roles: two prefill pods and two decode pods.
var pdRoles = []string{stack.RolePrefill, stack.RolePrefill, stack.RoleDecode, stack.RoleDecode}

// setRoles checks --roles (or --pd) and --non-cached-tokens into o. The
// roles are the labels of pods the tool starts, read by a Tally picker it
// starts with disaggregation on, and each answer's prefill pod is read
// from the header Envoy's exchange carries: only a burst through Envoy.
func (o *options) setRoles(cmd, roles string, pd, podsSet bool) error {
	switch {
	case pd && roles != "":
		return errors.New("flag --pd: it is --roles " + strings.Join(pdRoles, ",") + "; give one of --pd and --roles")
	case pd:
		o.roles = slices.Clone(pdRoles)
	case roles != "":
		o.roles = strings.Split(roles, ",")
	}
	for i, r := range o.roles {
		o.roles[i] = strings.TrimSpace(r)
		switch o.roles[i] {
		case "", stack.RolePrefill, stack.RoleDecode, stack.RolePrefillDecode:
		default:
			return fmt.Errorf("flag --roles: role %q of %q is invalid: want %s, %s, %s or empty (unlabelled)", o.roles[i], roles, stack.RolePrefill, stack.RoleDecode, stack.RolePrefillDecode)
		}
	}
	if o.nonCachedTokens < 1 {
		return fmt.Errorf("flag --non-cached-tokens: %d is invalid: want 1 or more (disaggregation is off without --roles)", o.nonCachedTokens)
	}
	if len(o.roles) == 0 {
		return nil
	}
	if !podsSet {
		o.pods = len(o.roles)
	}
	var configured bool
	for _, a := range o.pickerArgs {
		configured = configured || strings.HasPrefix(a, "--config-")
	}
	switch {
	case cmd != "burst":
		return fmt.Errorf("flag --roles: only for burst, not %s", cmd)
	case o.pods < len(o.roles):
		return fmt.Errorf("flag --roles: %d roles for --pods %d: at most one a pod", len(o.roles), o.pods)
	case len(o.addrs) > 0:
		return errors.New("flag --roles: labels the pods the tool starts; drop --addr")
	case o.picker != pickerTally || o.replicas > 0:
		return errors.New("flag --roles: only for one started Tally picker (--picker tally, no --replicas)")
	case o.gateway != gatewayEnvoy:
		return fmt.Errorf("flag --roles: only through --gateway %s, whose answers name the prefill pod", gatewayEnvoy)
	case configured:
		return errors.New("flag --roles: sets the picker's --config-text itself; drop --picker-arg --config-...")
	}
	return nil
}

// disaggregationArg is the started picker's configuration with
// disaggregation on: a request is split when at least nonCachedTokens of
// its prompt are not cached on its decode pod, whatever its length.
func disaggregationArg(nonCachedTokens int) string {
	return fmt.Sprintf("--config-text={disaggregation: {nonCachedTokens: %d}}", nonCachedTokens)
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 1 && args[0] == echoCommand {
		if err := runEcho(os.Stdin, stdout); err != nil {
			fmt.Fprintln(stderr, "extproc-load echo:", err)
			return 1
		}
		return 0
	}
	cmd, o, err := parseFlags(args, stderr)
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stderr, "extproc-load:", err)
		}
		return 2
	}
	if cmd == "bench" {
		err = runBench(ctx, o, stdout, stderr)
	} else {
		err = runOne(ctx, cmd, o, stdout, stderr)
	}
	if err != nil {
		fmt.Fprintln(stderr, "extproc-load:", err)
		return 1
	}
	return 0
}

// runOne runs one scenario against a picker it starts or is pointed at.
func runOne(ctx context.Context, cmd string, o options, stdout, stderr io.Writer) (err error) {
	t := &target{prompts: newPrompts(1), log: stderr, name: strings.Join(o.addrs, ",")}
	if len(o.addrs) > 0 {
		if t.client, err = dialAll(o.addrs, o.useTLS, o.conns); err != nil {
			return err
		}
		defer t.client.close()
		if o.pid != 0 {
			t.pids = []int{o.pid}
		}
		if len(o.metricsURLs) > 0 {
			t.metricsURLs = o.metricsURLs
			t.ledger = leaderLedger(o.metricsURLs)
		}
	} else {
		env, err := startEnv(ctx, o.pods, o.roles, o.firstPodIP, o.keepLogs, stderr)
		if err != nil {
			return err
		}
		defer func() { err = errors.Join(err, env.stop()) }()
		bin := o.tallyBin
		if o.picker == pickerUpstream {
			bin = o.upstreamBin
		}
		args := o.pickerArgs
		if o.disaggregated() {
			args = append(slices.Clone(args), disaggregationArg(o.nonCachedTokens))
		}
		pt, err := env.startTarget(ctx, o.picker, bin, o.useTLS, o.conns, o.replicas, args)
		if err != nil {
			return err
		}
		defer func() { err = errors.Join(err, pt.stop()) }()
		t = pt.target
		if o.disaggregated() {
			t.nonCachedTokens = o.nonCachedTokens
		}
	}
	t.gateway = o.gateway
	if len(t.metricsURLs) > 1 {
		defer func() {
			for _, line := range replicaReport(ctx, t.metricsURLs) {
				fmt.Fprintf(stdout, "replica %s\n", line)
			}
		}()
	}
	switch cmd {
	case "burst":
		r, err := runBurst(ctx, t, o.kind, o.n, o.tokens)
		if err != nil {
			return err
		}
		printBurst(stdout, r)
	case "load":
		if o.bareRTT {
			addrs, stop, err := startEcho(ctx)
			if err != nil {
				return err
			}
			defer stop()
			t.echo = addrs
		}
		r, err := runLoad(ctx, t, o.concurrency, o.rate, o.tokens, o.warmup, o.duration)
		if err != nil {
			return err
		}
		printLoad(stdout, r)
	case "stagger":
		r, err := runStagger(ctx, t, o.n, o.tokens, o.every, o.hold)
		if err != nil {
			return err
		}
		printStagger(stdout, r)
	case "churn":
		r, err := runChurn(ctx, t, o.n, o.concurrency, o.tokens)
		if err != nil {
			return err
		}
		printChurn(stdout, r)
		if r.checked && !r.empty {
			return fmt.Errorf("the ledger did not empty within %v after churn: %s", ledgerEmptyTimeout, r.state)
		}
		for range o.thenBursts {
			if t.ledger != nil {
				if l, err := t.ledger(ctx); err == nil {
					for _, e := range l.Endpoints {
						fmt.Fprintf(stderr, "before the burst: %s rate %.0f tokens/s, in flight %d, engine %v\n", e.Endpoint, e.PrefillTokensPerSecond, e.InFlight, e.Engine)
					}
				}
			}
			b, err := runBurst(ctx, t, o.kind, 128, 32_000)
			if err != nil {
				return err
			}
			printBurst(stdout, b)
		}
	}
	return nil
}

func printBurst(w io.Writer, r burstResult) {
	fmt.Fprintf(w, "burst %s: %d requests of %d tokens", r.kind, r.n, r.tokens)
	if r.warm != "" {
		fmt.Fprintf(w, ", prefix warmed on %s", r.warm)
	}
	if r.warmPrefiller != "" {
		fmt.Fprintf(w, " (prefilled on %s)", r.warmPrefiller)
	}
	fmt.Fprintf(w, "\nplaced in %v: %s (pick p50 %s, p99 %s)\n", r.placedInWindow.Round(time.Millisecond), r.placement.spread(), ms(r.pickP50), ms(r.pickP99))
	for _, e := range r.placement.endpoints {
		if r.pd() {
			fmt.Fprintf(w, "  %-22s %d, %d split\n", e, r.placement.counts[e], r.splitAt[e])
			continue
		}
		fmt.Fprintf(w, "  %-22s %d\n", e, r.placement.counts[e])
	}
	if r.pd() {
		printPD(w, r)
	}
	fmt.Fprintf(w, "placed %d, refused %d, failed %d\n", r.placement.total(), r.refused, r.errors)
	if r.firstError != "" {
		fmt.Fprintf(w, "first failure: %s\n", r.firstError)
	}
}

func printLoad(w io.Writer, r loadResult) {
	if r.rate > 0 {
		fmt.Fprintf(w, "load: open loop at %.0f requests/s, %d-token prompts, %v window\n", r.rate, r.tokens, r.window.Round(time.Millisecond))
	} else {
		fmt.Fprintf(w, "load: %d clients, %d-token prompts, %v window\n", r.concurrency, r.tokens, r.window.Round(time.Millisecond))
	}
	fmt.Fprintf(w, "requests %d (%.0f/s), refused %d, failed %d\n", r.requests, r.rps, r.refused, r.errors)
	fmt.Fprintf(w, "time to pick p50 %s, p99 %s, p999 %s ms; routed body back p99 %s ms\n", ms(r.pickP50), ms(r.pickP99), ms(r.pickP999), ms(r.routedP99))
	if r.use.cpu > 0 || r.use.peak > 0 {
		fmt.Fprintf(w, "picker CPU %s ms per request, peak RSS %s MB\n", ms(r.cpuPerRequest()), mb(r.use.peak))
	}
	fmt.Fprintf(w, "load tool CPU %s ms per request (the clients and the pods' servers)\n", ms(r.clientCPUPerRequest()))
	for _, a := range r.byAddr {
		fmt.Fprintf(w, "  via %-21s (%s): %d picks, p50 %s, p99 %s ms\n", a.addr, a.role, a.n, ms(a.p50), ms(a.p99))
	}
	for _, b := range r.bareRTT {
		fmt.Fprintf(w, "  bare %s round trip to another process, %d bytes every %v: %d, p50 %s, p99 %s ms", b.name, rttMessageBytes, b.every, b.n, ms(b.p50), ms(b.p99))
		if b.leaderPlusP99 > 0 {
			fmt.Fprintf(w, "; the leader's picks each plus one (every pair): p99 %s ms", ms(b.leaderPlusP99))
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "placement: %s\n", r.placement.spread())
	if r.firstError != "" {
		fmt.Fprintf(w, "first failure: %s\n", r.firstError)
	}
}

func printChurn(w io.Writer, r churnResult) {
	fmt.Fprintf(w, "churn: %d requests:", r.requests)
	for _, k := range churnKinds {
		fmt.Fprintf(w, " %s %d;", k, r.byKind[k])
	}
	fmt.Fprintf(w, " failed %d\n", r.errors)
	if r.firstError != "" {
		fmt.Fprintf(w, "first failure: %s\n", r.firstError)
	}
	switch {
	case !r.checked:
		fmt.Fprintln(w, "ledger: not checked (no ledger to read)")
	case r.empty:
		fmt.Fprintf(w, "ledger: empty (after %v)\n", r.emptyAfter.Round(time.Millisecond))
	default:
		fmt.Fprintf(w, "ledger: NOT empty after %v: %s\n", ledgerEmptyTimeout, r.state)
	}
}

func ms(d time.Duration) string {
	v := float64(d) / float64(time.Millisecond)
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func mb(b int64) string { return fmt.Sprintf("%.0f", float64(b)/(1<<20)) }
