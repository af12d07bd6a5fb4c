package main

import (
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/internal/stack"
)

// The LoRA section (--adapters): every simulator serves --adapters LoRA
// adapters besides the base model, runs --max-loras of them at once and
// pays engine.DefaultLoRALoadTime for each swap; the "lora" workload
// replays the first --adapter-requests requests of the trace, each for an
// adapter drawn from a Zipf mix, through the picker (which sees the
// adapters in each pod's vllm:lora_requests_info, its real scrapes) and
// round-robin. The swaps are read from the simulators.

// adapterNames names the adapters, as routesim does: lora-0, lora-1...
func adapterNames(n int) []string {
	names := make([]string, n)
	for k := range names {
		names[k] = "lora-" + strconv.Itoa(k)
	}
	return names
}

// adapterWorkload turns the trace's rows into streaming completions, each
// for the adapter of rank k (0 first) drawn with weight 1/(k+1)^zipf,
// from a fixed seed: the same adapters on every run and for every policy.
func adapterWorkload(trace []stack.TraceRequest, adapters []string, zipf, timeScale float64) []stack.Request {
	cdf := make([]float64, len(adapters))
	sum := 0.0
	for k := range cdf {
		sum += math.Pow(float64(k+1), -zipf)
		cdf[k] = sum
	}
	rng := rand.New(rand.NewPCG(1, 0x6c6f7261)) // "lora"
	reqs := stack.TraceWorkload(trace, stack.DefaultModel, timeScale)
	for i := range reqs {
		k, _ := slices.BinarySearch(cdf, rng.Float64()*sum)
		at := reqs[i].At
		reqs[i] = stack.Completion(adapters[min(k, len(adapters)-1)], trace[i].PromptText(), trace[i].OutputTokens, true)
		reqs[i].At = at
	}
	return reqs
}

// loraPickerArgs gives the picker the load cost of an adapter in the
// simulators' time: it learns prefill rates in wall time, timeScale times
// the simulated ones, so the default (200 ms, the simulators' load time)
// is divided by the scale, as the flow control picker's times are. None
// when the picker args give a configuration of their own.
func loraPickerArgs(timeScale float64, pickerArgs []string) []string {
	for _, a := range pickerArgs {
		if hasFlag(a, "config-text") || hasFlag(a, "config-file") {
			return nil
		}
	}
	ms := max(int(math.Round(v1alpha1.DefaultLoRALoadMilliseconds/timeScale)), 1)
	return []string{fmt.Sprintf("--config-text={loraLoadMilliseconds: %d}", ms)}
}

// hasFlag reports whether arg is the flag name, given as -name or --name,
// with its value or without.
func hasFlag(arg, name string) bool {
	flag, _, _ := strings.Cut(strings.TrimPrefix(arg, "-"), "=")
	return strings.TrimPrefix(flag, "-") == name
}

// adapterLoads sums the swaps of every pod's simulator since its reset.
func adapterLoads(s *stack.Stack) int64 {
	var n int64
	for _, p := range s.Pods() {
		if st, ok := p.Stats(); ok {
			n += st.AdapterLoads
		}
	}
	return n
}

// writeLoRATable writes the lora rows' TTFT beside their swaps.
func writeLoRATable(w io.Writer, opts options, runs []replayed) error {
	fmt.Fprintf(w, "LoRA adapters (lora rows): %d adapters drawn Zipf %g by rank, each pod runs %d at once and loads one in %s s (simulated); the first %d trace requests, each for an adapter. The picker sees them in each pod's vllm:lora_requests_info; swaps are the simulators' adapter loads.\n",
		opts.adapters, opts.adapterZipf, opts.maxLoRAs, strconv.FormatFloat(engine.DefaultLoRALoadTime.Seconds(), 'f', -1, 64), opts.adapterRequests)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "policy\trequests\tTTFT p50\tTTFT p99\tswaps\tper 1,000 requests\terrors\t")
	for _, r := range runs {
		s := r.summary
		if s.Workload != loraWorkload {
			continue
		}
		per := 0.0
		if s.Requests > 0 {
			per = 1000 * float64(r.swaps) / float64(s.Requests)
		}
		fmt.Fprintf(tw, "%s\t%d\t%.3fs\t%.3fs\t%d\t%.1f\t%d\t\n", s.Policy, s.Requests, s.TTFTP50.Seconds(), s.TTFTP99.Seconds(), r.swaps, per, s.Errors)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if line := loraP99Ratio(runs); line != "" {
		fmt.Fprintln(w, line)
	}
	return nil
}

// loraP99Ratio says how Tally's lora TTFT p99 compares with the best of
// the baselines (every other policy's lora row): "" without both.
func loraP99Ratio(runs []replayed) string {
	var tally, best *stack.Summary
	for i := range runs {
		s := &runs[i].summary
		switch {
		case s.Workload != loraWorkload || s.TTFTP99 <= 0:
		case s.Policy == "tally":
			tally = s
		case best == nil || s.TTFTP99 < best.TTFTP99:
			best = s
		}
	}
	if tally == nil || best == nil {
		return ""
	}
	return fmt.Sprintf("tally's TTFT p99 is %.2fx the best baseline's (%s, %.3fs).", tally.TTFTP99.Seconds()/best.TTFTP99.Seconds(), best.Policy, best.TTFTP99.Seconds())
}

// loraWorkload names the workload of the LoRA section.
const loraWorkload = "lora"

// maxAdapters bounds --adapters: names in a lora_requests_info label, and
// slots a demo pod holds.
const maxAdapters = 64
