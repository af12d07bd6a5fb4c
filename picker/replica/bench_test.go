package replica

import (
	"context"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/tallyepp/tally/picker"
)

// BenchmarkPick places and ends one 8,000-token request at a time on the
// leader's own ledger, and through a follower, whose pick crosses the peer
// stream (loopback, TLS) to the leader and back, and whose end follows it.
// Besides the wall time of a pick, which on a shared machine moves with
// its load, it reports the process's CPU time (cpu-ns/op: the work of
// both replicas, the stream's included) and voluntary context switches
// (ctxsw/op: the threads that went to sleep waiting on a wake-up) per pick.
func BenchmarkPick(b *testing.B) {
	benchVia(b, func(b *testing.B, x *Replica, reqs []picker.Request) int {
		n := 0
		for b.Loop() {
			r, err := x.Admit(context.Background(), reqs[n%len(reqs)])
			if err != nil {
				b.Fatal(err)
			}
			x.End(r, picker.Outcome{})
			n++
		}
		return n
	})
}

// BenchmarkPickPaced picks as the open-loop load does, one every 2.5 ms
// (400 a second), so that every pick finds the replicas' threads asleep:
// the wake-ups, and gRPC's work for a lone message, that back-to-back
// picks share. It reports the pick's latency (p50-ns, p99-ns), and the
// process's CPU time and voluntary context switches per pick.
func BenchmarkPickPaced(b *testing.B) {
	const every = 2500 * time.Microsecond
	benchVia(b, func(b *testing.B, x *Replica, reqs []picker.Request) int {
		var took []time.Duration
		next := time.Now()
		for b.Loop() {
			time.Sleep(time.Until(next))
			next = next.Add(every)
			start := time.Now()
			r, err := x.Admit(context.Background(), reqs[len(took)%len(reqs)])
			took = append(took, time.Since(start))
			if err != nil {
				b.Fatal(err)
			}
			x.End(r, picker.Outcome{})
		}
		slices.Sort(took)
		b.ReportMetric(float64(took[len(took)/2]), "p50-ns")
		b.ReportMetric(float64(took[len(took)*99/100]), "p99-ns")
		return len(took)
	})
}

// benchVia runs picks, which makes b.Loop's picks on x and says how many,
// on the leader of two replicas and then on the follower, each with 64
// requests of 8,000 tokens. It reports the process's CPU time and
// voluntary context switches per pick, and fails if the follower placed a
// pick itself (the benchmark would not have measured forwarding).
func benchVia(b *testing.B, picks func(b *testing.B, x *Replica, reqs []picker.Request) int) {
	c := newCluster(b, 2, writeCredentials(b), Options{PickTimeout: time.Minute})
	c.lead(0, 1)
	reqs := make([]picker.Request, 64)
	for i := range reqs {
		reqs[i] = picker.Request{Model: "m", Prompt: prompt("", i, 8_000), Stream: true}
	}
	for _, via := range []struct {
		name string
		i    int
	}{{"leader", 0}, {"follower", 1}} {
		b.Run(via.name, func(b *testing.B) {
			// A leader's burst of changes may have cut the follower's
			// stream (too far behind): measure the forwarded path only.
			c.lead(0, 1)
			local := c.local(1, reasonNoLeader) + c.local(1, reasonTimeout)
			before := usage(b)
			n := float64(picks(b, c.reps[via.i], reqs))
			after := usage(b)
			b.StopTimer()
			b.ReportMetric(float64(after.cpu-before.cpu)/n, "cpu-ns/op")
			b.ReportMetric(float64(after.ctxsw-before.ctxsw)/n, "ctxsw/op")
			if got := c.local(1, reasonNoLeader) + c.local(1, reasonTimeout) - local; got > 0 {
				b.Fatalf("the follower placed %v picks itself: the benchmark did not measure forwarding", got)
			}
			// Let the ends reach every copy before the next run.
			c.eventually("every copy idle", func() bool { return sum(c.inFlight(0)) == 0 && sum(c.inFlight(1)) == 0 })
		})
	}
}

type rusage struct{ cpu, ctxsw int64 }

// usage is the process's CPU time (ns) and voluntary context switches.
func usage(b *testing.B) rusage {
	var u syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &u); err != nil {
		b.Fatal(err)
	}
	return rusage{cpu: u.Utime.Nano() + u.Stime.Nano(), ctxsw: u.Nvcsw}
}
