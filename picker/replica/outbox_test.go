package replica

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"
)

// sink records what drainOutbox sends.
type sink struct {
	mu   sync.Mutex
	sent []int
}

func (s *sink) send(m int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sent = append(s.sent, m)
	return nil
}

func (s *sink) got() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.sent)
}

// waitFor polls until s has sent want, or fails after 5 s.
func (s *sink) waitFor(t *testing.T, want []int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !slices.Equal(s.got(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("sent %v, want %v", s.got(), want)
		}
		time.Sleep(time.Millisecond)
	}
}

func negative(m int) bool { return m < 0 }

func TestAnOutboxHoldsChangesForTheWindowAndSendsAPickAtOnceAfterThem(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := make(chan int, 16)
	var s sink
	done := make(chan error, 1)
	go func() { done <- drainOutbox(ctx, out, time.Hour, negative, s.send) }()
	for m := range 3 {
		out <- m
	}
	time.Sleep(20 * time.Millisecond)
	if got := s.got(); len(got) != 0 {
		t.Fatalf("changes were sent one by one within the window: %v", got)
	}
	out <- -1 // a pick: it goes now, behind what waited, in order
	s.waitFor(t, []int{0, 1, 2, -1})
	out <- -2 // alone, at once
	s.waitFor(t, []int{0, 1, 2, -1, -2})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("an outbox whose stream ended says %v", err)
	}
}

func TestAnOutboxSendsChangesWhenTheWindowEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := make(chan int, 16)
	var s sink
	go func() { _ = drainOutbox(ctx, out, 5*time.Millisecond, negative, s.send) }()
	out <- 7
	out <- 8
	s.waitFor(t, []int{7, 8})
	out <- 9
	s.waitFor(t, []int{7, 8, 9})
}

func TestAFullBatchGoesWithoutWaiting(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := make(chan int, maxBatch+1)
	var s sink
	go func() { _ = drainOutbox(ctx, out, time.Hour, negative, s.send) }()
	want := make([]int, maxBatch)
	for i := range want {
		want[i] = i
		out <- i
	}
	s.waitFor(t, want)
}

func TestAnOutboxStopsAtAFailedSend(t *testing.T) {
	out := make(chan int, 4)
	broken := errors.New("stream broke")
	calls := 0
	out <- -1
	out <- -2
	err := drainOutbox(context.Background(), out, time.Hour, negative, func(int) error { calls++; return broken })
	if !errors.Is(err, broken) || calls != 1 {
		t.Fatalf("after a failed send: %v, %d sends; want the send's error after one", err, calls)
	}
}
