package stack

import (
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Percentile returns the p-th percentile (0 < p <= 100) of ds by the
// nearest-rank method: the smallest value with at least p% of the values at
// or below it. It returns 0 for no values. ds is not modified.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	sorted := slices.Clone(ds)
	slices.Sort(sorted)
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	rank = min(max(rank, 1), len(sorted))
	return sorted[rank-1]
}

// Summary is one row of the demo's table: one policy on one workload.
type Summary struct {
	Policy   string
	Workload string
	Requests int
	// Pods lists the pods in table order; Placement counts requests served
	// by each (requests that reached no pod are not counted).
	Pods      []string
	Placement map[string]int
	// PromptTokens and CachedTokens sum the usage of successful responses.
	PromptTokens int
	CachedTokens int
	// TTFT percentiles of successful requests, in simulated time.
	TTFTP50 time.Duration
	TTFTP90 time.Duration
	TTFTP99 time.Duration
	// Refused counts the requests answered 429 (flow control refused
	// them: a full queue, a shed request, a wait past its TTL); Errors
	// every other failure.
	Refused int
	Errors  int
	// FirstError is one error, to explain a non-zero Errors.
	FirstError error
	// Wall is how long the replay took, in simulated time.
	Wall time.Duration
	// TimeScale is the simulators' speed-up during the replay: measured
	// wall times were multiplied by it.
	TimeScale float64
}

// HitRate is the share of prompt tokens served from the prefix cache.
func (s Summary) HitRate() float64 {
	if s.PromptTokens == 0 {
		return 0
	}
	return float64(s.CachedTokens) / float64(s.PromptTokens)
}

// Summarize condenses a replay's results. servedBy maps a request id to the
// pod that served it ("" if none did); timeScale multiplies the measured
// wall times back into simulated time.
func Summarize(policy, workload string, results []Result, pods []string, servedBy func(id string) string, wall time.Duration, timeScale float64) Summary {
	s := Summary{
		Policy: policy, Workload: workload, Requests: len(results),
		Pods: pods, Placement: make(map[string]int, len(pods)),
		Wall: scale(wall, timeScale), TimeScale: timeScale,
	}
	var ttfts []time.Duration
	for _, r := range results {
		if pod := servedBy(r.ID); pod != "" {
			s.Placement[pod]++
		}
		if r.Status == http.StatusTooManyRequests {
			s.Refused++
			continue
		}
		if r.Err != nil {
			s.Errors++
			if s.FirstError == nil {
				s.FirstError = r.Err
			}
			continue
		}
		s.PromptTokens += r.PromptTokens
		s.CachedTokens += r.CachedTokens
		ttfts = append(ttfts, scale(r.TTFT, timeScale))
	}
	s.TTFTP50 = Percentile(ttfts, 50)
	s.TTFTP90 = Percentile(ttfts, 90)
	s.TTFTP99 = Percentile(ttfts, 99)
	return s
}

func scale(d time.Duration, timeScale float64) time.Duration {
	if timeScale <= 0 {
		return d
	}
	return time.Duration(float64(d) * timeScale)
}

// WriteTable prints summaries as an aligned table. Every time in it is
// simulated: the measured wall time multiplied by the row's time scale.
func WriteTable(w io.Writer, sums []Summary) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if _, err := fmt.Fprintln(w, "Times in simulated seconds: measured wall time x the row's time scale (how much faster than real time the simulators ran)."); err != nil {
		return err
	}
	fmt.Fprintln(tw, "policy\tworkload\ttime scale\trequests\tplacement\tcache hit\tTTFT p50\tTTFT p90\tTTFT p99\t429\terrors\tduration\t")
	for _, s := range sums {
		placement := make([]string, len(s.Pods))
		for i, p := range s.Pods {
			placement[i] = fmt.Sprint(s.Placement[p])
		}
		fmt.Fprintf(tw, "%s\t%s\tx%g\t%d\t%s\t%.1f%%\t%.3fs\t%.3fs\t%.3fs\t%d\t%d\t%.1fs\t\n",
			s.Policy, s.Workload, s.TimeScale, s.Requests, strings.Join(placement, "/"),
			100*s.HitRate(), s.TTFTP50.Seconds(), s.TTFTP90.Seconds(), s.TTFTP99.Seconds(), s.Refused, s.Errors, s.Wall.Seconds())
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(sums) > 0 {
		if _, err := fmt.Fprintf(w, "placement: requests served by %s\n", strings.Join(sums[0].Pods, "/")); err != nil {
			return err
		}
	}
	for _, s := range sums {
		if s.FirstError != nil {
			if _, err := fmt.Fprintf(w, "%s/%s: first error: %v\n", s.Policy, s.Workload, s.FirstError); err != nil {
				return err
			}
		}
	}
	return nil
}
