package replica

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"
)

// sink records what an outbox sends.
type sink struct {
	mu   sync.Mutex
	sent []int
	fail error // once set, every send fails with it
	cuts int
}

func (s *sink) send(m int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return s.fail
	}
	s.sent = append(s.sent, m)
	return nil
}

func (s *sink) cut() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cuts++
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

// running starts o's goroutine with window; it ends with the test.
func running(t *testing.T, o *outbox[int], window time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- o.run(ctx, window) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("an outbox whose stream ended says %v", err)
		}
	})
}

func TestAnOutboxHoldsChangesForTheWindowAndAPickGoesAtOnceBehindThem(t *testing.T) {
	var s sink
	o := newOutbox(s.send, s.cut)
	running(t, o, time.Hour)
	for m := range 3 {
		if !o.hold(m) {
			t.Fatalf("an open outbox did not take %d", m)
		}
	}
	time.Sleep(20 * time.Millisecond)
	if got := s.got(); len(got) != 0 {
		t.Fatalf("changes were sent one by one within the window: %v", got)
	}
	// A pick: the caller sends it, behind what waited, in order.
	o.add(-1)
	if err := o.flush(); err != nil {
		t.Fatal(err)
	}
	if got, want := s.got(), []int{0, 1, 2, -1}; !slices.Equal(got, want) {
		t.Fatalf("a flush sent %v, want %v", got, want)
	}
	// An answer goes ahead of what is held.
	o.hold(3)
	if err := o.now(-2); err != nil {
		t.Fatal(err)
	}
	if got, want := s.got(), []int{0, 1, 2, -1, -2}; !slices.Equal(got, want) {
		t.Fatalf("now sent %v, want %v", got, want)
	}
}

func TestAnOutboxSendsChangesWhenTheWindowEnds(t *testing.T) {
	var s sink
	o := newOutbox(s.send, s.cut)
	running(t, o, 5*time.Millisecond)
	o.hold(7)
	o.hold(8)
	s.waitFor(t, []int{7, 8})
	o.hold(9)
	s.waitFor(t, []int{7, 8, 9})
	// A flush that took what the window waited for leaves it nothing.
	o.hold(10)
	if err := o.flush(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	s.waitFor(t, []int{7, 8, 9, 10})
}

func TestAFullBatchGoesWithoutWaiting(t *testing.T) {
	var s sink
	o := newOutbox(s.send, s.cut)
	running(t, o, time.Hour)
	want := make([]int, maxBatch)
	for i := range want {
		want[i] = i
		o.hold(i)
	}
	s.waitFor(t, want)
}

func TestMessagesFromManyGoroutinesGoInTheOrderTheyWereQueued(t *testing.T) {
	var s sink
	o := newOutbox(s.send, s.cut)
	running(t, o, 100*time.Microsecond)
	// As the replica does: queued under one lock, each sender then
	// flushes (a pick) or leaves it to the window (a change).
	var mu sync.Mutex
	next := 0
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for range 200 {
				mu.Lock()
				m := next
				next++
				if g%2 == 0 {
					o.add(m)
				} else {
					o.hold(m)
				}
				mu.Unlock()
				if g%2 == 0 {
					if err := o.flush(); err != nil {
						t.Error(err)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	want := make([]int, 8*200)
	for i := range want {
		want[i] = i
	}
	s.waitFor(t, want)
}

func TestAnOutboxStopsAtAFailedSendAndCutsTheStream(t *testing.T) {
	broken := errors.New("stream broke")
	s := sink{fail: broken}
	o := newOutbox(s.send, s.cut)
	o.add(-1)
	o.add(-2)
	if err := o.flush(); !errors.Is(err, broken) {
		t.Fatalf("a flush over a broken stream says %v", err)
	}
	if s.cuts != 1 {
		t.Fatalf("the stream was cut %d times, want once", s.cuts)
	}
	if o.hold(3) || o.add(4) {
		t.Fatal("an outbox whose stream broke took another message")
	}
	if err := o.now(5); !errors.Is(err, broken) {
		t.Fatalf("now over a broken stream says %v", err)
	}
}

func TestAFullOutboxCutsItsStream(t *testing.T) {
	var s sink
	o := newOutbox(s.send, s.cut)
	for i := range outboxSize {
		if !o.hold(i) {
			t.Fatalf("message %d of %d was refused", i, outboxSize)
		}
	}
	if o.hold(outboxSize) {
		t.Fatal("a full outbox took one more")
	}
	if s.cuts != 1 {
		t.Fatalf("a full outbox cut its stream %d times, want once", s.cuts)
	}
	if err := o.flush(); !errors.Is(err, errOutboxFull) {
		t.Fatalf("a flush after the outbox filled says %v", err)
	}
	if got := s.got(); len(got) != 0 {
		t.Fatalf("a cut outbox sent %d messages", len(got))
	}
}

func TestAClosedOutboxSendsNothing(t *testing.T) {
	var s sink
	o := newOutbox(s.send, s.cut)
	o.hold(1)
	o.close()
	if err := o.now(2); !errors.Is(err, errStreamDone) {
		t.Fatalf("now after close says %v", err)
	}
	if err := o.flush(); !errors.Is(err, errStreamDone) {
		t.Fatalf("flush after close says %v", err)
	}
	if got := s.got(); len(got) != 0 {
		t.Fatalf("a closed outbox sent %v", got)
	}
}
