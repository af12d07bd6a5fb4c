package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker/debugledger"
)

const (
	completionsPath = "/v1/completions"
	// warmSettle is the pause after warming a prefix: the upstream picker
	// records prefixes after the pick and scrapes every 50 ms, so it gets
	// time to see the warm request as a real engine would have it.
	warmSettle = 300 * time.Millisecond
	// loadSystemTokens is the system prompt every request of a load run
	// shares (then a unique remainder), as in picker/extproc's benchmark.
	loadSystemTokens = 1_000
	// ledgerEmptyTimeout is how long churn waits for the ledger to empty:
	// a picker releases a reservation when it sees its stream end.
	ledgerEmptyTimeout = 10 * time.Second
	// openLoopInFlight bounds the requests an open-loop load has in
	// flight: past it the picker is far behind the rate, and arrivals are
	// dropped (counted as failures) rather than pile up without end.
	openLoopInFlight = 10_000
	// failureBackoff is a load client's pause after a failed request.
	failureBackoff = 10 * time.Millisecond
)

// target is a picker the scenarios drive.
type target struct {
	name    string
	client  *client
	prompts *prompts
	// pods is nil when the tool does not serve the pool's pods.
	pods *pods
	// metricsURLs are the pickers' metrics servers, in the client's
	// address order (empty when not known).
	metricsURLs []string
	// pids are the picker's processes (one per replica) for CPU and
	// memory; none measures nothing.
	pids []int
	// ledger reads the picker's in-flight ledger; nil skips the churn check
	// (the upstream picker has none).
	ledger func(context.Context) (debugledger.Ledger, error)
	// endpoints lists the pool in order, for placement tables; nil orders
	// endpoints as first seen.
	endpoints []string
	log       io.Writer
	// echo is where the echo process answers: load times bare round
	// trips to it beside the picks (zero: not measured).
	echo echoAddrs
	// gateway is the gateway the requests of bursts (and their warm
	// requests) come through: gatewayEnvoy ("" too) or gatewayNGF.
	gateway string
	// roles are the labelled endpoints' prefill/decode roles (nil: none
	// labelled), and nonCachedTokens the picker's
	// disaggregation.nonCachedTokens (0: off, or not known).
	roles           map[string]string
	nonCachedTokens int
}

// ngf says requests go through NGINX Gateway Fabric's shim: no response
// phase, so nothing to answer on the stream.
func (t *target) ngf() bool { return t.gateway == gatewayNGF }

// send plays req's request path as t's gateway does.
func (t *target) send(x *stream, req request) (placed, error) {
	var p placed
	var err error
	if t.ngf() {
		p, err = sendNGF(x.Stream, req, x.addr)
	} else {
		p, err = sendRequest(x.Stream, req)
	}
	p.via = x.addr
	return p, err
}

func (t *target) logf(format string, args ...any) {
	if t.log != nil {
		fmt.Fprintf(t.log, "[extproc-load] %s: "+format+"\n", append([]any{t.name}, args...)...)
	}
}

// errorsSeen counts failed requests and keeps the first failure.
type errorsSeen struct {
	n     atomic.Int64
	mu    sync.Mutex
	first error
}

func (e *errorsSeen) add(err error) {
	if e.n.Add(1) == 1 {
		e.mu.Lock()
		e.first = err
		e.mu.Unlock()
	}
}

func (e *errorsSeen) summary() (int, string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.first == nil {
		return int(e.n.Load()), ""
	}
	return int(e.n.Load()), e.first.Error()
}

// prefillTime is how long one vLLM engine takes to prefill tokens uncached
// prompt tokens alone (the simulated engine's latency model, internal/modelsim/engine: a step of 6.5 ms + 0.0198 ms per prefill
// token, 8,192 tokens a step): about 0.66 s for 32,000 tokens.
func prefillTime(tokens int) time.Duration {
	const stepBudget = 8_192
	steps := (tokens + stepBudget - 1) / stepBudget
	return time.Duration(steps)*6500*time.Microsecond + time.Duration(tokens)*19800*time.Nanosecond
}

// cycle plays one complete request: routed, answered 200, ended.
func (t *target) cycle(ctx context.Context, req request) (placed, error) {
	return t.cycleAfter(ctx, req, 0)
}

// cycleAfter is cycle with the model server's first byte delay after the
// pick. A picker that learns engines' speed from the time to the first
// byte (Tally does) would learn an impossible one from an instant answer.
func (t *target) cycleAfter(ctx context.Context, req request, delay time.Duration) (placed, error) {
	x, err := t.client.Open(ctx)
	if err != nil {
		return placed{}, err
	}
	defer x.Cancel()
	p, err := t.send(x, req)
	if err != nil || p.status != 0 {
		return p, err
	}
	release := t.pods.hold(p.endpoint)
	defer release()
	// A split request's prefill leg runs on its prefill pod meanwhile.
	releasePrefill := t.pods.hold(p.prefiller)
	defer releasePrefill()
	sleepCtx(ctx, delay)
	if t.ngf() {
		// NGINX proxies the request itself: the stream has ended.
		return p, nil
	}
	return p, x.Respond(okResponse(p.endpoint, len(req.body)/bytesPerToken))
}

// placement counts requests per endpoint, in pool order.
type placement struct {
	endpoints []string
	counts    map[string]int
}

func newPlacement(pool []string) *placement {
	return &placement{endpoints: slices.Clone(pool), counts: map[string]int{}}
}

func (p *placement) add(endpoint string) {
	if _, ok := p.counts[endpoint]; !ok && !slices.Contains(p.endpoints, endpoint) {
		p.endpoints = append(p.endpoints, endpoint)
	}
	p.counts[endpoint]++
}

func (p *placement) total() int {
	n := 0
	for _, c := range p.counts {
		n += c
	}
	return n
}

// spread is the counts in pool order, "a / b / c".
func (p *placement) spread() string {
	parts := make([]string, len(p.endpoints))
	for i, e := range p.endpoints {
		parts[i] = fmt.Sprint(p.counts[e])
	}
	return strings.Join(parts, " / ")
}

// busiest is the largest count and its endpoint.
func (p *placement) busiest() (string, int) {
	best, n := "", -1
	for _, e := range p.endpoints {
		if p.counts[e] > n {
			best, n = e, p.counts[e]
		}
	}
	return best, n
}

// burstResult is where a burst went while all of it was in flight.
type burstResult struct {
	kind           string
	n, tokens      int
	warm           string // the endpoint that holds the prefix ("" if none)
	placement      *placement
	refused        int
	errors         int
	firstError     string
	pickP50        time.Duration
	pickP99        time.Duration
	placedInWindow time.Duration // from the first request to the last placed
	// With prefill/decode roles (prefill not nil): the prefill legs per
	// prefill pod (from each answer's x-prefiller-host-port), the split
	// requests in all and per destination, the prefill pod of the warm
	// request, and the picker's nonCachedTokens.
	prefill         *placement
	split           int
	splitAt         map[string]int
	warmPrefiller   string
	nonCachedTokens int
	// decisions are the picker's split decisions on the burst, by
	// decision (its metrics; nil when not read).
	decisions map[string]int
}

// runBurst sends n requests of tokens tokens at once, each held open at its
// endpoint until all n are placed, then answers them all. For the shared
// and long kinds one request warms the prefix first. Through NGF there is
// nothing to answer: the pods' hold ends when all are placed.
func runBurst(ctx context.Context, t *target, kind string, n, tokens int) (burstResult, error) {
	if !slices.Contains(burstKinds, kind) {
		return burstResult{}, fmt.Errorf("burst prompt kind %q is invalid: want one of %s", kind, strings.Join(burstKinds, ", "))
	}
	if prefixTokens(kind) >= tokens {
		return burstResult{}, fmt.Errorf("burst of kind %s: %d tokens do not exceed its %d-token shared prefix", kind, tokens, prefixTokens(kind))
	}
	res := burstResult{kind: kind, n: n, tokens: tokens, placement: newPlacement(t.endpoints)}
	if t.disaggregated() {
		// Only decode-capable pods are destinations: a prefill pod
		// named as one would show up in the placement all the same.
		res.placement = newPlacement(t.endpointsWhere(decodeCapable))
		res.prefill = newPlacement(t.endpointsWhere(prefillCapable))
		res.splitAt = map[string]int{}
		res.nonCachedTokens = t.nonCachedTokens
	}
	nonce := t.prompts.newNonce()
	prefix := t.prompts.prefix(nonce, prefixTokens(kind))
	if kind == kindShared || kind == kindLong {
		warm := request{id: fmt.Sprintf("warm-%d", nonce), path: completionsPath, body: t.prompts.body(nonce, prefix, -1, tokens)}
		p, err := t.cycleAfter(ctx, warm, prefillTime(tokens))
		if err == nil && p.status != 0 {
			err = fmt.Errorf("answered HTTP %d", p.status)
		}
		if err != nil {
			return res, fmt.Errorf("warming the %s prefix: %w", kind, err)
		}
		res.warm, res.warmPrefiller = p.endpoint, p.prefiller
		time.Sleep(warmSettle)
	}
	bodies := make([][]byte, n)
	for i := range bodies {
		bodies[i] = t.prompts.body(nonce, prefix, i, tokens)
	}
	var decisionsBefore map[string]int
	if res.pd() {
		var err error
		if decisionsBefore, err = t.splitDecisions(ctx); err != nil {
			return res, fmt.Errorf("reading the picker's split decisions: %w", err)
		}
	}

	var (
		errs     errorsSeen
		mu       sync.Mutex
		picks    []time.Duration
		placedWG sync.WaitGroup
		doneWG   sync.WaitGroup
		go1      = make(chan struct{})
		answer   = make(chan struct{})
	)
	placedWG.Add(n)
	for i := range n {
		doneWG.Go(func() {
			<-go1
			placedOnce := sync.OnceFunc(placedWG.Done)
			defer placedOnce()
			x, err := t.client.Open(ctx)
			if err != nil {
				errs.add(err)
				return
			}
			defer x.Cancel()
			p, err := t.send(x, request{id: fmt.Sprintf("burst-%d-%d", nonce, i), path: completionsPath, body: bodies[i]})
			if err != nil {
				errs.add(err)
				return
			}
			mu.Lock()
			if p.status != 0 {
				res.refused++
			} else {
				res.placement.add(p.endpoint)
				picks = append(picks, p.pick)
				if p.prefiller != "" && res.pd() {
					res.prefill.add(p.prefiller)
					res.split++
					res.splitAt[p.endpoint]++
				}
			}
			mu.Unlock()
			if p.status != 0 {
				return
			}
			release := t.pods.hold(p.endpoint)
			defer release()
			// Until the answer, the split request's prefill leg is held
			// on its prefill pod too (its engine reports it waiting, as
			// the picker's ledger holds it there), and the request on its
			// decode pod, waiting for its KV.
			releasePrefill := t.pods.hold(p.prefiller)
			defer releasePrefill()
			placedOnce()
			select {
			case <-answer:
			case <-ctx.Done():
				return
			}
			if t.ngf() {
				// The request finishes at the engine, where the picker
				// does not see it: its reservation was detached.
				return
			}
			if err := x.Respond(okResponse(p.endpoint, tokens)); err != nil {
				errs.add(err)
			}
		})
	}
	start := time.Now()
	close(go1)
	placedWG.Wait()
	res.placedInWindow = time.Since(start)
	close(answer)
	doneWG.Wait()
	if decisionsBefore != nil {
		after, err := t.splitDecisions(ctx)
		if err != nil {
			return res, fmt.Errorf("reading the picker's split decisions: %w", err)
		}
		res.decisions = since(after, decisionsBefore)
	}
	res.errors, res.firstError = errs.summary()
	slices.Sort(picks)
	res.pickP50, res.pickP99 = percentile(picks, 0.50), percentile(picks, 0.99)
	return res, ctx.Err()
}

// loadResult is what C clients doing complete cycles measured.
type loadResult struct {
	concurrency, tokens int
	rate                float64 // requests/s of an open loop; 0: closed loop
	window              time.Duration
	byAddr              []addrPicks // per picker address, with several
	requests            int         // completed in the window
	refused, errors     int
	firstError          string
	rps                 float64
	pickP50, pickP99    time.Duration
	pickP999, routedP99 time.Duration
	use                 usage
	placement           *placement
	// clientCPU is this tool's own CPU time over the window: the clients
	// and the pods they answer for, on the cores the picker uses.
	clientCPU time.Duration
	// cpuPerReq and clientPerReq, when set, are cpuPerRequest's and
	// clientCPUPerRequest's answers: the medians of runs.
	cpuPerReq, clientPerReq time.Duration
	// bareRTT are the bare round trips to the echo process over the
	// window, over TCP then gRPC.
	bareRTT []rttResult
}

// medianLoad is each measure's median over runs of one load (errors and
// refusals are summed, the first failure kept).
func medianLoad(runs []loadResult) loadResult {
	m := runs[len(runs)/2]
	med := func(f func(loadResult) time.Duration) time.Duration {
		v := make([]time.Duration, len(runs))
		for i, r := range runs {
			v[i] = f(r)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	m.pickP50 = med(func(r loadResult) time.Duration { return r.pickP50 })
	m.pickP99 = med(func(r loadResult) time.Duration { return r.pickP99 })
	m.pickP999 = med(func(r loadResult) time.Duration { return r.pickP999 })
	m.routedP99 = med(func(r loadResult) time.Duration { return r.routedP99 })
	m.cpuPerReq = med(func(r loadResult) time.Duration { return r.cpuPerRequest() })
	m.clientPerReq = med(func(r loadResult) time.Duration { return r.clientCPUPerRequest() })
	m.use.peak = int64(med(func(r loadResult) time.Duration { return time.Duration(r.use.peak) }))
	rps := make([]float64, len(runs))
	m.errors, m.refused, m.firstError = 0, 0, ""
	for i, r := range runs {
		rps[i] = r.rps
		m.errors += r.errors
		m.refused += r.refused
		if m.firstError == "" {
			m.firstError = r.firstError
		}
	}
	slices.Sort(rps)
	m.rps = rps[len(rps)/2]
	return m
}

// cpuPerRequest is the picker's CPU time per request completed in the window.
func (r loadResult) cpuPerRequest() time.Duration {
	if r.cpuPerReq != 0 {
		return r.cpuPerReq
	}
	if r.requests == 0 {
		return 0
	}
	return r.use.cpu / time.Duration(r.requests)
}

// clientCPUPerRequest is the load tool's CPU time per request completed in
// the window.
func (r loadResult) clientCPUPerRequest() time.Duration {
	if r.clientPerReq != 0 {
		return r.clientPerReq
	}
	if r.requests == 0 {
		return 0
	}
	return r.clientCPU / time.Duration(r.requests)
}

// runLoad runs concurrency clients, each doing complete request cycles
// back to back (prompts of tokens tokens: a shared 1,000-token system
// prompt and a unique remainder), for warmup and then the measured window.
// Latencies are of requests that started in the window; requests/s and
// CPU count what completed in it.
//
// With rate above 0 the load is an open loop instead: a request arrives
// every 1/rate seconds, each its own client, whether or not the earlier
// ones have finished (as a gateway's users do), at most openLoopInFlight
// at once.
func runLoad(ctx context.Context, t *target, concurrency int, rate float64, tokens int, warmup, window time.Duration) (loadResult, error) {
	res := loadResult{concurrency: concurrency, rate: rate, tokens: tokens, window: window, placement: newPlacement(t.endpoints)}
	nonce := t.prompts.newNonce()
	system := t.prompts.prefix(nonce, min(loadSystemTokens, tokens/2))
	type sample struct {
		start, end   time.Time
		pick, routed time.Duration
		endpoint     string
		via          string
		refused      bool
	}
	var (
		errs    errorsSeen
		next    atomic.Int64
		stop    atomic.Bool
		wg      sync.WaitGroup
		samples = make([][]sample, concurrency)
	)
	if rate > 0 {
		// One list of samples, shared by the arrivals under a lock.
		samples = make([][]sample, 1)
		var mu sync.Mutex
		var inFlight atomic.Int64
		interval := time.Duration(float64(time.Second) / rate)
		wg.Go(func() {
			start := time.Now()
			for i := 0; !stop.Load() && ctx.Err() == nil; i++ {
				// Arrivals keep to the schedule even if one tick was late.
				sleepCtx(ctx, time.Until(start.Add(time.Duration(i)*interval)))
				if inFlight.Load() >= openLoopInFlight {
					errs.add(fmt.Errorf("over %d requests in flight: the open loop dropped an arrival", openLoopInFlight))
					continue
				}
				inFlight.Add(1)
				n := int(next.Add(1))
				wg.Go(func() {
					defer inFlight.Add(-1)
					req := request{id: fmt.Sprintf("load-%d-%d", nonce, n), path: completionsPath, body: t.prompts.body(nonce, system, n, tokens)}
					began := time.Now()
					p, err := t.cycle(ctx, req)
					if err != nil {
						if ctx.Err() == nil {
							errs.add(err)
						}
						return
					}
					mu.Lock()
					samples[0] = append(samples[0], sample{start: began, end: time.Now(), pick: p.pick, routed: p.routed, endpoint: p.endpoint, via: p.via, refused: p.status != 0})
					mu.Unlock()
				})
			}
		})
	}
	for c := range concurrency * boolInt(rate == 0) {
		wg.Go(func() {
			for !stop.Load() && ctx.Err() == nil {
				i := int(next.Add(1))
				req := request{id: fmt.Sprintf("load-%d-%d", nonce, i), path: completionsPath, body: t.prompts.body(nonce, system, i, tokens)}
				began := time.Now()
				p, err := t.cycle(ctx, req)
				if err != nil {
					if ctx.Err() == nil {
						errs.add(err)
					}
					// A picker that is not there fails at once: do not spin.
					sleepCtx(ctx, failureBackoff)
					continue
				}
				samples[c] = append(samples[c], sample{start: began, end: time.Now(), pick: p.pick, routed: p.routed, endpoint: p.endpoint, via: p.via, refused: p.status != 0})
			}
		})
	}
	sleepCtx(ctx, warmup)
	m, err := startMeter(t.pids...)
	var client0, client1 time.Duration
	if err == nil {
		client0, err = procCPU(os.Getpid())
	}
	var probes []*rttProbe
	if err == nil && t.echo != (echoAddrs{}) {
		every := 10 * time.Millisecond
		if rate > 0 && t.client != nil {
			// As often as each follower forwards a pick.
			every = time.Duration(float64(time.Second) * float64(len(t.client.pickers)) / rate)
		}
		probes, err = startProbes(t.echo, every)
		for _, name := range rttNames {
			res.bareRTT = append(res.bareRTT, rttResult{name: name, every: every})
		}
	}
	if err != nil {
		stop.Store(true)
		wg.Wait()
		return res, err
	}
	from := time.Now()
	sleepCtx(ctx, window)
	until := time.Now()
	res.use, err = m.stop()
	if err == nil {
		client1, err = procCPU(os.Getpid())
	}
	rtts := make([][]time.Duration, len(probes))
	for i, p := range probes {
		var perr error
		rtts[i], perr = p.end(from, until)
		err = errors.Join(err, perr)
		b := &res.bareRTT[i]
		b.n, b.p50, b.p99 = len(rtts[i]), percentile(rtts[i], 0.50), percentile(rtts[i], 0.99)
	}
	stop.Store(true)
	wg.Wait()
	if err != nil {
		return res, err
	}
	res.clientCPU = client1 - client0
	res.window = until.Sub(from)
	var picks, routed []time.Duration
	byAddr := map[string][]time.Duration{}
	for _, ss := range samples {
		for _, s := range ss {
			if s.end.After(from) && !s.end.After(until) {
				res.requests++
			}
			if s.start.Before(from) || s.start.After(until) {
				continue
			}
			if s.refused {
				res.refused++
				continue
			}
			res.placement.add(s.endpoint)
			picks = append(picks, s.pick)
			routed = append(routed, s.routed)
			byAddr[s.via] = append(byAddr[s.via], s.pick)
		}
	}
	res.errors, res.firstError = errs.summary()
	res.rps = float64(res.requests) / res.window.Seconds()
	slices.Sort(picks)
	slices.Sort(routed)
	res.pickP50, res.pickP99, res.pickP999 = percentile(picks, 0.50), percentile(picks, 0.99), percentile(picks, 0.999)
	res.routedP99 = percentile(routed, 0.99)
	if t.client != nil && len(t.client.pickers) > 1 {
		leader := leaderIndex(ctx, t.metricsURLs)
		for i, addr := range t.client.addrs() {
			p := byAddr[addr]
			slices.Sort(p)
			role := "role unknown"
			switch {
			case i == leader:
				role = "leader"
				for j := range res.bareRTT {
					res.bareRTT[j].leaderPlusP99 = sumPercentile(p, rtts[j], 0.99)
				}
			case leader >= 0:
				role = "follower"
			}
			res.byAddr = append(res.byAddr, addrPicks{addr: addr, role: role, n: len(p), p50: percentile(p, 0.50), p99: percentile(p, 0.99)})
		}
	}
	return res, ctx.Err()
}

// addrPicks is the pick latency of the streams one picker address served.
type addrPicks struct {
	addr     string
	role     string // leader, follower, or unknown without metrics URLs
	n        int
	p50, p99 time.Duration
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Ways a request ends in a churn run.
const (
	churnComplete         = "complete"
	churnCancelBeforePick = "cancel before pick"
	churnCancelAfterPick  = "cancel after pick"
	churnUpstream5xx      = "upstream 503"
	churnResetMidResponse = "reset mid-response"
)

var churnKinds = []string{churnComplete, churnCancelBeforePick, churnCancelAfterPick, churnUpstream5xx, churnResetMidResponse}

// churnResult is how a churn run ended.
type churnResult struct {
	requests   int
	byKind     map[string]int
	errors     int
	firstError string
	// checked says a ledger was read; empty whether it emptied within
	// ledgerEmptyTimeout, after emptyAfter; state describes it if not.
	checked    bool
	empty      bool
	emptyAfter time.Duration
	state      string
}

// runChurn sends n requests from concurrency clients, each ending one of
// the churn ways in turn: complete, cancelled before the pick (mid-body),
// cancelled after it, answered 503 by the upstream, reset mid-response.
// Then it waits for the picker's ledger to be empty, if it can read one.
func runChurn(ctx context.Context, t *target, n, concurrency, tokens int) (churnResult, error) {
	res := churnResult{requests: n, byKind: map[string]int{}}
	nonce := t.prompts.newNonce()
	var (
		errs errorsSeen
		next atomic.Int64
		mu   sync.Mutex
		wg   sync.WaitGroup
	)
	for range concurrency {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				kind := churnKinds[i%len(churnKinds)]
				req := request{id: fmt.Sprintf("churn-%d-%d", nonce, i), path: completionsPath, body: t.prompts.body(nonce, nil, i, tokens)}
				if err := t.churnOne(ctx, kind, req); err != nil {
					errs.add(fmt.Errorf("%s: %w", kind, err))
				}
				mu.Lock()
				res.byKind[kind]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	res.errors, res.firstError = errs.summary()
	if t.ledger == nil {
		return res, ctx.Err()
	}
	res.checked = true
	start := time.Now()
	for {
		l, err := t.ledger(ctx)
		if err == nil && l.Idle() {
			res.empty, res.emptyAfter = true, time.Since(start)
			return res, nil
		}
		if err != nil {
			res.state = err.Error()
		} else {
			res.state = fmt.Sprintf("%d in flight, %d prefill tokens", l.InFlight, l.PrefillTokens)
		}
		if time.Since(start) > ledgerEmptyTimeout || ctx.Err() != nil {
			return res, ctx.Err()
		}
		time.Sleep(pollInterval)
	}
}

func (t *target) churnOne(ctx context.Context, kind string, req request) error {
	x, err := t.client.Open(ctx)
	if err != nil {
		return err
	}
	defer x.Cancel()
	if kind == churnCancelBeforePick {
		// The client goes away while its body is still arriving.
		if err := x.Send(x.HeadersMessage(envoyRequest(req))); err != nil {
			return err
		}
		if err := x.Send(envoy.BodyChunk(req.body[:min(maxChunkBytes, len(req.body)-1)], false)); err != nil && !errors.Is(err, io.EOF) {
			return err
		}
		return nil
	}
	p, err := sendRequest(x.Stream, req)
	if err != nil || p.status != 0 {
		return err
	}
	release := t.pods.hold(p.endpoint)
	defer release()
	if kind == churnComplete || kind == churnResetMidResponse {
		// Their first bytes come after the prefill, as an engine's would:
		// instant ones teach the picker an impossible prefill rate (it
		// learned its bound, 1,000,000 tokens/s), and the reservations of
		// a gateway that ends the stream at the pick (NGF) then drain at
		// once in its model.
		sleepCtx(ctx, prefillTime(len(req.body)/bytesPerToken))
	}
	switch kind {
	case churnCancelAfterPick:
		return nil
	case churnUpstream5xx:
		return x.Respond(envoy.Response{Status: 503, ContentType: "application/json", ServedBy: p.endpoint, Chunks: [][]byte{[]byte(`{"error":"overloaded"}`)}})
	case churnResetMidResponse:
		ok := okResponse(p.endpoint, len(req.body)/bytesPerToken)
		if err := x.SendResponseHeaders(ok); err != nil {
			return err
		}
		return x.SendResponseChunk(ok.Chunks[0], false, true)
	}
	return x.Respond(okResponse(p.endpoint, len(req.body)/bytesPerToken))
}

// percentile of sorted durations (nearest rank); 0 if empty.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[int(q*float64(len(sorted)-1)+0.5)]
}

func sleepCtx(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}
