package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/picker/debugledger"
)

// The P/D row (--pd): the mooncake trace over a pool of its own, half its
// pods (--pods/2) labelled prefill and the rest decode, each decode pod's
// simulator behind the prefill/decode sidecar (internal/pdsidecar), as
// llm-d runs them, through a picker with splitting on and a gateway of its
// own. The pool runs beside the demo's (its own API server, its pods on
// the loopback IPs after the demo's pods) and only while its row replays,
// so the other rows run as they would without it. A split request's
// prefill leg is counted on the prefill pod that ran it (Stack.PrefilledBy);
// its destination, the decode pod, in the placement column.

// pdPolicyName names the P/D row.
const pdPolicyName = "tally-pd"

// pdNonCachedTokens and pdPromptTokens are the P/D picker's splitting
// thresholds, the values docs/install.md shows: a request is split when at
// least this many of its prompt tokens are not cached on its decode pod
// (and the picker finds the prefill pod's queue no costlier than
// prefilling on the decode pod); any prompt length may be.
const (
	pdNonCachedTokens = 16
	pdPromptTokens    = 0
)

// pdPickerConfig is the P/D picker's configuration: splitting on.
func pdPickerConfig() string {
	return fmt.Sprintf("{disaggregation: {nonCachedTokens: %d, promptTokens: %d}}", pdNonCachedTokens, pdPromptTokens)
}

// pdRoles are the P/D pool's roles for a pool of pods pods: the first half
// (rounded down) prefill, the rest decode, so the row has as many pods as
// the others.
func pdRoles(pods int) []string {
	roles := make([]string, pods)
	for i := range roles {
		if i < pods/2 {
			roles[i] = stack.RolePrefill
		} else {
			roles[i] = stack.RoleDecode
		}
	}
	return roles
}

// pdFirstPodIP is the P/D pool's first pod IP: the one after the demo's
// last pod's, so both pools' simulators listen at once.
func pdFirstPodIP(first netip.Addr, pods int) netip.Addr {
	ip := first
	for range pods {
		ip = ip.Next()
	}
	return ip
}

// pdPool is the P/D row's stack, started before its replay and stopped
// after it; stop is safe to call again (the demo calls it on its way out
// whatever happened).
type pdPool struct {
	opts   stack.Options
	s      *stack.Stack
	stdout io.Writer
	// prefill and decode name the pool's pods of each role.
	prefill, decode []string
}

func newPDPool(opts options, procOut, stdout io.Writer) *pdPool {
	return &pdPool{
		stdout: stdout,
		opts: stack.Options{
			BinDir:     opts.binDir,
			Namespace:  "demo-pd",
			PoolName:   "demo-pd-pool",
			Pods:       opts.pods,
			Roles:      pdRoles(opts.pods),
			FirstPodIP: pdFirstPodIP(opts.firstPodIP, opts.pods),
			TimeScale:  opts.timeScale,
			Output:     procOut,
			// The picker flags the demo's picker has, then the split on:
			// a configuration given with --picker-arg gives way to it.
			PickerArgs: append(append([]string(nil), opts.pickerArgs...), "--config-text="+pdPickerConfig()),

			LateFirstByteFraction: opts.lateFirstBytes,
		},
	}
}

func (p *pdPool) start(ctx context.Context) error {
	started := time.Now()
	fmt.Fprintf(p.stdout, "Starting the P/D pool: an API server of its own, %s, its picker (config %s) and gateway...\n", p.describe(), pdPickerConfig())
	s, err := stack.Start(ctx, p.opts)
	if err != nil {
		return fmt.Errorf("starting the P/D pool (flag --pd): %w", err)
	}
	p.s = s
	p.prefill, p.decode = nil, nil
	for _, pod := range s.Pods() {
		if pod.Role == stack.RolePrefill {
			p.prefill = append(p.prefill, pod.Name)
		} else {
			p.decode = append(p.decode, pod.Name)
		}
	}
	fmt.Fprintf(p.stdout, "P/D pool up in %.1fs: gateway %s, prefill pods %v, decode pods %v\n",
		time.Since(started).Seconds(), s.GatewayURL(), p.prefill, p.decode)
	return nil
}

func (p *pdPool) stop() error {
	if p.s == nil {
		return nil
	}
	if err := p.s.Stop(); err != nil {
		return fmt.Errorf("stopping the P/D pool: %w", err)
	}
	return nil
}

// describe says what the pool is, from its options.
func (p *pdPool) describe() string {
	prefill := 0
	for _, r := range p.opts.Roles {
		if r == stack.RolePrefill {
			prefill++
		}
	}
	first := p.opts.FirstPodIP
	last := pdFirstPodIP(first, p.opts.Pods-1)
	return fmt.Sprintf("%d prefill + %d decode pods (%s to %s, each decode pod's simulator behind the P/D sidecar)",
		prefill, p.opts.Pods-prefill, first, last)
}

// pdPolicy replays the mooncake trace through the P/D pool's gateway.
func pdPolicy(p *pdPool) policy {
	return policy{
		name:      pdPolicyName,
		baseURL:   func(int) string { return p.s.GatewayURL() },
		ledger:    func(ctx context.Context) (debugledger.Ledger, error) { return p.s.Ledger(ctx) },
		traceOnly: true,
		pool:      func() *stack.Stack { return p.s },
		start:     p.start,
		done:      p.stop,
	}
}

// prefillLegs counts, per prefill pod, the requests of results whose
// prefill leg it ran: the requests split.
func prefillLegs(results []stack.Result, prefilledBy func(id string) string) map[string]int {
	legs := map[string]int{}
	for _, r := range results {
		if pod := prefilledBy(r.ID); pod != "" {
			legs[pod]++
		}
	}
	return legs
}

// writePDTable writes the P/D rows' splits: how many requests were split,
// the prefill legs each prefill pod ran and the requests each decode pod
// decoded.
func writePDTable(w io.Writer, p *pdPool, runs []replayed) error {
	fmt.Fprintf(w, "Prefill/decode (row %s): the mooncake trace over a pool of its own, %s, through a picker that splits a request with at least %d tokens not cached on its decode pod (disaggregation: {nonCachedTokens: %d, promptTokens: %d}). Its placement column counts destinations: the decode pods; the prefill pods run prefill legs only.\n",
		pdPolicyName, p.describe(), pdNonCachedTokens, pdNonCachedTokens, pdPromptTokens)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "policy\trequests\tsplit\tprefill legs (%s)\tdecoded (%s)\tTTFT p50\tTTFT p99\terrors\t\n",
		strings.Join(p.prefill, "/"), strings.Join(p.decode, "/"))
	for _, r := range runs {
		s := r.summary
		if s.Policy != pdPolicyName {
			continue
		}
		split := 0
		legs := make([]string, len(p.prefill))
		for i, name := range p.prefill {
			legs[i] = fmt.Sprint(r.legs[name])
			split += r.legs[name]
		}
		decoded := make([]string, len(p.decode))
		for i, name := range p.decode {
			decoded[i] = fmt.Sprint(s.Placement[name])
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%.3fs\t%.3fs\t%d\t\n", s.Policy, s.Requests, split,
			strings.Join(legs, "/"), strings.Join(decoded, "/"), s.TTFTP50.Seconds(), s.TTFTP99.Seconds(), s.Errors)
	}
	return tw.Flush()
}
