package routesim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"
)

// Suite is one invocation: every policy over the trace, and over the burst
// scenario.
type Suite struct {
	Config   Config
	Policies []string
	// Burst, when set, runs the burst scenario too.
	Burst *Burst
	// Parallel bounds the runs at once (each is one goroutine); runs are
	// independent, so the numbers do not depend on it.
	Parallel int
	// Progress, when set, hears of each run as it ends (from any goroutine,
	// one call at a time).
	Progress func(msg string)
}

// Run prepares the workload and runs every policy over it (and the burst).
func (s Suite) Run(reqs []Request, source string) (*Report, error) {
	start := time.Now()
	if len(s.Policies) == 0 {
		s.Policies = Policies()
	}
	for _, p := range s.Policies {
		if !slices.Contains(KnownPolicies(), p) {
			return nil, fmt.Errorf("policy %q is unknown: accepted are %v", p, KnownPolicies())
		}
	}
	w, err := Prepare(reqs, s.Config)
	if err != nil {
		return nil, err
	}
	var bw *Workload
	if s.Burst != nil {
		if bw, err = PrepareBurst(*s.Burst, s.Config); err != nil {
			return nil, err
		}
	}
	s.progress(fmt.Sprintf("prepared %d requests in %.2f s", w.Len(), time.Since(start).Seconds()))

	type task struct {
		w      *Workload
		policy string
		res    *Result
		err    error
	}
	var tasks []*task
	for _, p := range s.Policies {
		tasks = append(tasks, &task{w: w, policy: p})
	}
	if bw != nil {
		for _, p := range s.Policies {
			tasks = append(tasks, &task{w: bw, policy: p})
		}
	}
	runParallel(len(tasks), s.Parallel, func(i int) {
		t := tasks[i]
		t.res, t.err = t.w.Run(t.policy)
	}, func(i int) {
		if t := tasks[i]; t.err == nil {
			what := "trace"
			if t.w == bw {
				what = "burst"
			}
			s.progress(fmt.Sprintf("%s %s: %d requests in %.2f s (%.0f requests/s)", what, t.policy,
				t.w.Len(), t.res.Wall.Seconds(), float64(t.w.Len())/t.res.Wall.Seconds()))
		}
	})

	r := &Report{Source: source, Config: s.Config, Bound: w.BoundSummary()}
	r.Describe(w)
	if bw != nil {
		r.Burst = &BurstReport{Burst: *s.Burst, BoundTTFT: bw.jobs[1].bound.TTFT, Adapter: bw.jobs[1].Adapter}
	}
	for _, t := range tasks {
		if t.err != nil {
			return nil, t.err
		}
		r.SimulatedRequests += t.w.Len()
		if t.w == w {
			r.Runs = append(r.Runs, Summarize(t.res))
		} else {
			r.Burst.Runs = append(r.Burst.Runs, SummarizeBurst(t.res))
		}
	}
	r.Wall = time.Since(start)
	return r, nil
}

func (s Suite) progress(msg string) {
	if s.Progress != nil {
		s.Progress(msg)
	}
}

// DefaultName is the name of the report's files unless told otherwise.
const DefaultName = "routesim"

// Files are the names of the files WriteDir writes.
type Files struct{ Report, JSON, TTFTChart, BurstChart string }

// FilesNamed are the files of the report called name: name.md, name.json,
// name-ttft-cdf.svg and name-burst-inflight.svg.
func FilesNamed(name string) Files {
	return Files{Report: name + ".md", JSON: name + ".json", TTFTChart: name + "-ttft-cdf.svg", BurstChart: name + "-burst-inflight.svg"}
}

// WriteDir writes the charts, the markdown report (which links them) and
// the report as JSON (durations in nanoseconds) into dir, creating it if
// needed, under the names FilesNamed(name).
func (r *Report) WriteDir(dir, name string) error {
	if err := r.WriteCharts(dir, name); err != nil {
		return err
	}
	files := FilesNamed(name)
	write := writer(dir)
	if err := write(files.JSON, func(b *bytes.Buffer) error {
		e := json.NewEncoder(b)
		e.SetIndent("", "  ")
		return e.Encode(r)
	}); err != nil {
		return err
	}
	return write(files.Report, func(b *bytes.Buffer) error { return r.WriteMarkdown(b) })
}

// writer writes files into dir, each drawn into a buffer first.
func writer(dir string) func(name string, draw func(*bytes.Buffer) error) error {
	return func(name string, draw func(*bytes.Buffer) error) error {
		var b bytes.Buffer
		if err := draw(&b); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, name), b.Bytes(), 0o644); err != nil {
			return fmt.Errorf("writing %s: %w", name, err)
		}
		return nil
	}
}

// WriteCharts writes the charts alone into dir, creating it if needed, and
// records their names (FilesNamed(name)) for WriteMarkdown to link.
func (r *Report) WriteCharts(dir, name string) error {
	files := FilesNamed(name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("creating the output directory: %w", err)
	}
	write := writer(dir)
	title := "TTFT, " + r.Title()
	if err := write(files.TTFTChart, func(b *bytes.Buffer) error { return WriteTTFTCDF(b, title, r.Bound, r.Runs) }); err != nil {
		return err
	}
	r.ChartTTFT = files.TTFTChart
	if r.Burst != nil {
		title := fmt.Sprintf("Burst of %d requests, %d engines", r.Burst.Burst.Requests, r.Config.Engines)
		if err := write(files.BurstChart, func(b *bytes.Buffer) error { return WriteInFlight(b, title, r.Burst.Runs) }); err != nil {
			return err
		}
		r.ChartInFlight = files.BurstChart
	}
	return nil
}

// runParallel runs run(i) for each i below n, at most parallel at once,
// and after each run done(i), one done at a time (progress lines).
func runParallel(n, parallel int, run, done func(i int)) {
	sem := make(chan struct{}, max(parallel, 1))
	var wg sync.WaitGroup
	var mu sync.Mutex
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			run(i)
			mu.Lock()
			done(i)
			mu.Unlock()
		})
	}
	wg.Wait()
}
