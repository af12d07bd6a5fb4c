package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"

	"github.com/tallyepp/tally/internal/stack"
)

// Prefill/decode disaggregation in a burst: the pool's roles, what each
// answer says of its split, and the picker's own count of why it split or
// not.

// splitDecisionsMetric counts a Tally picker's placed requests by whether
// they were split, or why not (picker/split.go's decisions).
const splitDecisionsMetric = "tally_split_decisions_total"

// disaggregated says whether the pool has a pod that prefills for others.
func (o options) disaggregated() bool {
	return slices.ContainsFunc(o.roles, prefillCapable)
}

// prefillCapable says whether a pod of role prefills for others.
func prefillCapable(role string) bool {
	return role == stack.RolePrefill || role == stack.RolePrefillDecode
}

// decodeCapable says whether a pod of role takes client traffic.
func decodeCapable(role string) bool {
	return role == "" || role == stack.RoleDecode || role == stack.RolePrefillDecode
}

// disaggregated says whether some endpoint of t's pool prefills for others.
func (t *target) disaggregated() bool {
	for _, r := range t.roles {
		if prefillCapable(r) {
			return true
		}
	}
	return false
}

// endpointsWhere are t's endpoints, in order, whose role has keep.
func (t *target) endpointsWhere(keep func(role string) bool) []string {
	var out []string
	for _, e := range t.endpoints {
		if keep(t.roles[e]) {
			out = append(out, e)
		}
	}
	return out
}

// splitDecisions reads the picker's split decisions so far, by decision;
// nil when its metrics are not known (or, with replicas, not one place).
func (t *target) splitDecisions(ctx context.Context) (map[string]int, error) {
	if len(t.metricsURLs) != 1 {
		return nil, nil
	}
	m, err := stack.ReadMetrics(ctx, http.DefaultClient, t.metricsURLs[0])
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, s := range m[splitDecisionsMetric].GetMetric() {
		for _, l := range s.GetLabel() {
			if l.GetName() == "decision" {
				out[l.GetValue()] = int(s.GetCounter().GetValue())
			}
		}
	}
	return out, nil
}

// since is the decisions taken between before and d.
func since(d, before map[string]int) map[string]int {
	if d == nil || before == nil {
		return nil
	}
	out := map[string]int{}
	for k, v := range d {
		if n := v - before[k]; n != 0 {
			out[k] = n
		}
	}
	return out
}

// pd says whether the burst ran on a pool with prefill/decode roles.
func (r burstResult) pd() bool { return r.prefill != nil }

// worstSpread is, over the endpoints of p, the largest distance of a
// count from the even share of total (total / len(endpoints)): 1 for
// 63 / 65 of 128, 0.5 for 21 / 22 of 43.
func worstSpread(p *placement, total int) float64 {
	if len(p.endpoints) == 0 {
		return 0
	}
	even := float64(total) / float64(len(p.endpoints))
	worst := 0.0
	for _, e := range p.endpoints {
		worst = max(worst, math.Abs(float64(p.counts[e])-even))
	}
	return worst
}

// printPD prints a burst's split: per decode pod its destinations and how
// many were split, per prefill pod its prefill legs, the counts, the
// prefix holder's share, and the picker's reasons.
func printPD(w io.Writer, r burstResult) {
	placed := r.placement.total()
	fmt.Fprintf(w, "prefill legs: %s\n", r.prefill.spread())
	for _, e := range r.prefill.endpoints {
		fmt.Fprintf(w, "  %-22s %d\n", e, r.prefill.counts[e])
	}
	fmt.Fprintf(w, "split %d, not split %d (nonCachedTokens %d); destinations at most %.1f from the even share, prefill legs %.1f\n",
		r.split, placed-r.split, r.nonCachedTokens, worstSpread(r.placement, placed), worstSpread(r.prefill, r.split))
	if r.warm != "" {
		n, k := r.placement.counts[r.warm], r.splitAt[r.warm]
		fmt.Fprintf(w, "prefix holder %s: %d placed, %d split, %d not split; elsewhere %d placed, %d split\n", r.warm, n, k, n-k, placed-n, r.split-k)
	}
	if r.decisions != nil {
		keys := make([]string, 0, len(r.decisions))
		for k := range r.decisions {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		fmt.Fprintf(w, "the picker's split decisions (%s):", splitDecisionsMetric)
		for _, k := range keys {
			fmt.Fprintf(w, " %s %d", k, r.decisions[k])
		}
		fmt.Fprintln(w)
	}
}
