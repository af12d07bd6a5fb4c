package replica

import (
	"context"
	"fmt"
	"time"
)

// A peer stream's messages are mostly changes that no pick waits for: the
// leader's copies of each placement, first byte and end for every
// follower, and a follower's first bytes and ends for the leader. Sent one
// by one at 400 requests a second, each is a write on one side and a read
// and a thread's wake-up on the other, most of the CPU the replicas spend
// on one another. An outbox holds such a change up to peerCoalesce for
// those that follow it, and gRPC writes what it is handed at once in one
// system call. What a pick waits for (a follower's pick, the leader's
// answer) goes at once, with what waits before it, in order: a Claim
// queued before a pick must reach the leader first, or the leader would
// end the pick's placement as one the follower no longer claims.
const (
	peerCoalesce = 2 * time.Millisecond
	// maxBatch bounds the messages one write gathers.
	maxBatch = 256
)

// errOutboxFull cuts the stream of a peer too far behind: it resyncs when
// it reconnects.
var errOutboxFull = fmt.Errorf("peer stream cut: %d messages wait unsent, the peer reads too slowly", outboxSize)

// drainOutbox sends what comes on out until ctx ends or a send fails (its
// error): each message, and what comes within window of it unless it or
// one after it is urgent, in one batch of sends, in order.
func drainOutbox[M any](ctx context.Context, out <-chan M, window time.Duration, urgent func(M) bool, send func(M) error) error {
	batch := make([]M, 0, maxBatch)
	t := time.NewTimer(time.Hour)
	t.Stop()
	for {
		select {
		case m := <-out:
			batch = append(batch[:0], m)
			if !urgent(m) {
				t.Reset(window)
				gather(ctx, out, t.C, urgent, &batch)
				t.Stop()
			}
		case <-ctx.Done():
			return nil
		}
		for _, m := range batch {
			if err := send(m); err != nil {
				return err
			}
		}
		clear(batch)
	}
}

// gather appends to batch what comes on out until timeout fires, an urgent
// message comes, ctx ends or batch is full.
func gather[M any](ctx context.Context, out <-chan M, timeout <-chan time.Time, urgent func(M) bool, batch *[]M) {
	for len(*batch) < maxBatch {
		select {
		case m := <-out:
			*batch = append(*batch, m)
			if urgent(m) {
				return
			}
		case <-timeout:
			return
		case <-ctx.Done():
			return
		}
	}
}
