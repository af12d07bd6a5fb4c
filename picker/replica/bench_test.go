package replica

import (
	"context"
	"testing"
	"time"

	"github.com/tallyepp/tally/picker"
)

// BenchmarkPick places and ends one 8,000-token request at a time on the
// leader's own ledger, and through a follower, whose pick crosses the peer
// stream (loopback, TLS) to the leader and back, and whose end follows it.
func BenchmarkPick(b *testing.B) {
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
			x := c.reps[via.i]
			n := 0
			for b.Loop() {
				r, err := x.Admit(context.Background(), reqs[n%len(reqs)])
				if err != nil {
					b.Fatal(err)
				}
				x.End(r, picker.Outcome{})
				n++
			}
			b.StopTimer()
			// Let the ends reach the leader before the next run.
			time.Sleep(100 * time.Millisecond)
		})
	}
}
