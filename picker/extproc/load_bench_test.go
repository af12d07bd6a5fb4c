package extproc_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
)

// BenchmarkRequestCycles measures whole request cycles through the real gRPC
// server on loopback, the load docs/benchmarks.md reports for the upstream picker: 16
// concurrent clients, 8,000-token prompts (a shared 1,000-token system prompt
// then a unique remainder), each request routed, answered with a short
// streamed response and ended. It reports requests/s and the percentiles of
// the routing time: from the first request message to the routed body being
// back at the gateway. Client and server share the machine's cores.
//
// flow=on runs it with flow control on and a threshold no request reaches:
// what the hold costs when nothing waits.
func BenchmarkRequestCycles(b *testing.B) {
	for _, flow := range []bool{false, true} {
		name := "flow=off"
		if flow {
			name = "flow=on"
		}
		b.Run(name, func(b *testing.B) { requestCycles(b, flow) })
	}
}

func requestCycles(b *testing.B, flow bool) {
	const (
		clients      = 16
		promptTokens = 8_000
		systemTokens = 1_000
	)
	cfg := v1alpha1.Default()
	cfg.FlowControl.Enabled = flow
	cfg.FlowControl.HoldPrefillMilliseconds = 600_000
	f := newFixture(b, fixtureOptions{quiet: true, cfg: &cfg})
	system := strings.Repeat("You are a helpful assistant. ", systemTokens*4/29+1)[:systemTokens*4]
	prompt := func(i int) string {
		unique := fmt.Sprintf("request %d: ", i)
		return system + unique + strings.Repeat("x", promptTokens*4-len(system)-len(unique))
	}

	var (
		mu    sync.Mutex
		times []time.Duration
		next  int
	)
	b.SetParallelism((clients + 1) / 2) // GOMAXPROCS 2 on the reference machine: 16 clients
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			mu.Lock()
			i := next
			next++
			mu.Unlock()
			x, err := f.gw.Open(context.Background())
			if err != nil {
				b.Error(err)
				return
			}
			began := time.Now()
			r, err := x.SendRequest(completion("m", prompt(i)))
			routedIn := time.Since(began)
			if err == nil && r.Immediate != nil {
				err = fmt.Errorf("answered %v", r.Immediate.GetStatus())
			}
			if err == nil {
				err = x.Respond(okResponse)
			}
			x.Cancel()
			if err != nil {
				b.Error(err)
				return
			}
			mu.Lock()
			times = append(times, routedIn)
			mu.Unlock()
		}
	})
	elapsed := time.Since(start)
	b.StopTimer()
	if len(times) == 0 {
		return
	}
	slices.Sort(times)
	pct := func(p float64) float64 { return float64(times[int(p*float64(len(times)-1))].Microseconds()) / 1000 }
	b.ReportMetric(float64(len(times))/elapsed.Seconds(), "req/s")
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	if l := f.picker.Snapshot(); l.InFlight != 0 || l.PrefillTokens != 0 {
		b.Fatalf("ledger holds %d requests and %d prefill tokens after the run", l.InFlight, l.PrefillTokens)
	}
}

// BenchmarkSmallBesideHugePrompts measures the routing time of small
// requests (1,000-token prompts, one client at a time) through the real
// gRPC server, alone and while another client sends 8 MiB prompts one after
// another: with the prompt block cap a huge prompt holds the picker's lock
// no longer than a 32,000-token one, so the small requests' p99 should stay
// within a few times its value alone (the huge bodies' parsing still takes
// CPU on the shared cores).
func BenchmarkSmallBesideHugePrompts(b *testing.B) {
	for _, beside := range []bool{false, true} {
		name := "alone"
		if beside {
			name = "beside-8MiB-prompts"
		}
		b.Run(name, func(b *testing.B) {
			cfg := v1alpha1.Default()
			cfg.MaxRequestBytes = 64 << 20
			f := newFixture(b, fixtureOptions{quiet: true, cfg: &cfg})
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			if beside {
				// Built once, its echo dropped: the gateway shares the
				// picker's process here, and its own garbage must not be
				// what the small requests wait for.
				huge := completion("m", strings.Repeat("y", 8<<20))
				huge.DropEcho = true
				wg.Go(func() {
					for ctx.Err() == nil {
						x, err := f.gw.Open(ctx)
						if err != nil {
							return
						}
						if _, err := x.SendRequest(huge); err == nil {
							_ = x.Respond(okResponse)
						}
						x.Cancel()
					}
				})
			}
			var times []time.Duration
			for i := 0; b.Loop(); i++ {
				x, err := f.gw.Open(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				began := time.Now()
				r, err := x.SendRequest(completion("m", fmt.Sprintf("small %d %s", i, strings.Repeat("z", 4000))))
				times = append(times, time.Since(began))
				if err != nil || r.Immediate != nil {
					b.Fatalf("small request: %v %v", err, r.Immediate)
				}
				_ = x.Respond(okResponse)
				x.Cancel()
			}
			cancel()
			wg.Wait()
			slices.Sort(times)
			b.ReportMetric(float64(times[len(times)/2].Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(times[len(times)*99/100].Microseconds())/1000, "p99-ms")
		})
	}
}
