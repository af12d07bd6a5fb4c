package stack

import (
	"context"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"
)

// A gated burst reaches the server's handlers with its headers at once and
// its bodies' last bytes only when the gate opens.
func TestBodyGateHoldsEveryLastByteUntilOpen(t *testing.T) {
	var started, read atomic.Int64
	url := serveLoopback(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started.Add(1)
		body, err := io.ReadAll(r.Body)
		if err != nil || len(body) != int(r.ContentLength) {
			http.Error(w, "short body", http.StatusBadRequest)
			return
		}
		read.Add(1)
		io.WriteString(w, `{"choices":[{"text":"ok"}]}`)
	}))
	const n = 5
	g := NewBodyGate(n)
	results := make(chan Result, n)
	for i := range n {
		go func() {
			results <- g.Send(context.Background(), url, "gated-"+string(rune('a'+i)), Completion(DefaultModel, "a prompt of a few words", 2, false))
		}()
	}
	select {
	case <-g.Waiting():
	case <-time.After(10 * time.Second):
		t.Fatal("the requests never all reached the gate")
	}
	deadline := time.Now().Add(10 * time.Second)
	for started.Load() < n && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if got := started.Load(); got != n {
		t.Fatalf("%d of %d handlers started while the gate was closed: the headers were held too", got, n)
	}
	if got := read.Load(); got != 0 {
		t.Fatalf("%d bodies were read whole before the gate opened", got)
	}
	g.Open()
	for range n {
		if r := <-results; r.Err != nil || r.Status != http.StatusOK {
			t.Fatalf("after the gate opened: %+v", r)
		}
	}
	if got := read.Load(); got != n {
		t.Errorf("%d of %d bodies read whole", got, n)
	}
}
