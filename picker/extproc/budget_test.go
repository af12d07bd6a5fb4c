package extproc_test

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker/extproc"
)

// TestBufferBudgetHoldsUnderAFloodOfSlowStreams opens many streams at once,
// each sending its body slowly, 1 KiB at a time, far more than the budget
// can hold. The streams that fit are held open, their bodies complete but for
// the end; those that do not fit must be answered 503 at once (none ever
// sent end_of_stream), without a pick. The gauge is sampled all along and
// must never pass the budget. Then the held streams end their bodies and are
// routed, and the server is back to normal: a fresh request is routed and
// nothing stays buffered.
func TestBufferBudgetHoldsUnderAFloodOfSlowStreams(t *testing.T) {
	const (
		streams    = 200
		chunkBytes = 1024
		budget     = 256 << 10
	)
	var picks *counting
	f := newFixture(t, fixtureOptions{quiet: true, maxBufferedRequestBytes: budget, wrap: func(p extproc.Picker) extproc.Picker {
		picks = &counting{Picker: p}
		return picks
	}})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()

	var maxSeen atomic.Int64
	sampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			if n := int64(f.gauge("tally_buffered_request_bytes")); n > maxSeen.Load() {
				maxSeen.Store(n)
			}
			select {
			case <-sampling:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()

	type slow struct {
		x    *envoy.Stream
		body []byte
		// first is the stream's first answer, read as it comes: a 503 for
		// a refused stream, the routed headers answer for a held one.
		first   chan *extprocv3.ProcessingResponse
		refused *extprocv3.ImmediateResponse
		err     error
	}
	flood := make([]*slow, streams)
	var wg sync.WaitGroup
	for i := range flood {
		o := &slow{body: completionBody("m", letters(uint64(1_000+i), 16<<10)), first: make(chan *extprocv3.ProcessingResponse, 1)}
		flood[i] = o
		wg.Go(func() {
			if o.x, o.err = f.gw.Open(ctx); o.err != nil {
				return
			}
			go func() {
				resp, _ := o.x.Recv()
				o.first <- resp // nil if the stream failed
			}()
			if o.err = o.x.Send(headersMessage("/v1/completions", o.body, fullDuplexMode, true)); o.err != nil {
				return
			}
			// Every byte but not the end of the body: nothing is owed to a
			// stream that fits, so any answer here is a refusal.
			for off := 0; off < len(o.body); off += chunkBytes {
				if err := o.x.Send(envoy.BodyChunk(o.body[off:min(off+chunkBytes, len(o.body))], false)); err != nil {
					return // refused and ended: the answer is waiting in first
				}
				time.Sleep(2 * time.Millisecond)
			}
		})
	}
	wg.Wait()

	// Sort the streams into held and refused once the server has caught
	// up: it then holds exactly the bodies of the streams not refused.
	var held []*slow
	eventually(t, "the server holds exactly the bodies of the streams it has not refused", func() (bool, string) {
		held = held[:0]
		heldBytes := 0
		for i, o := range flood {
			if o.err != nil {
				t.Fatalf("stream %d: %v", i, o.err)
			}
			if o.refused == nil {
				select {
				case resp := <-o.first:
					if o.refused = resp.GetImmediateResponse(); o.refused == nil {
						t.Fatalf("stream %d answered %v before its body ended", i, resp)
					}
				default:
				}
			}
			if o.refused == nil {
				held = append(held, o)
				heldBytes += len(o.body)
			}
		}
		n := f.gauge("tally_buffered_request_bytes")
		return n == float64(heldBytes), fmt.Sprintf("tally_buffered_request_bytes = %v, the %d held streams sent %d", n, len(held), heldBytes)
	})
	refused := streams - len(held)
	for i, o := range flood {
		if o.refused != nil && (o.refused.GetStatus().GetCode() != 503 || !strings.Contains(string(o.refused.GetBody()), "budget "+strconv.Itoa(budget)+" bytes")) {
			t.Errorf("stream %d refused with %v %s, want a 503 naming the budget", i, o.refused.GetStatus().GetCode(), o.refused.GetBody())
		}
	}
	t.Logf("%d streams held, %d refused with 503 while still sending; the gauge peaked at %d of %d bytes", len(held), refused, maxSeen.Load(), budget)
	if len(held) == 0 || refused == 0 {
		t.Fatalf("%d held, %d refused: want both (the flood is %d bytes against a budget of %d)", len(held), refused, streams*len(flood[0].body), budget)
	}
	if got := picks.ok.Load(); got != 0 {
		t.Errorf("%d picks before any body ended, want none", got)
	}
	if got := f.counter(t, "tally_buffer_budget_rejections_total", nil); got != float64(refused) {
		t.Errorf("tally_buffer_budget_rejections_total = %v, want %d", got, refused)
	}
	if got := f.counter(t, "tally_requests_total", map[string]string{"code": "503"}); got != float64(refused) {
		t.Errorf("tally_requests_total{code=503} = %v, want %d", got, refused)
	}

	// The held streams end their bodies (an empty last chunk: no new bytes)
	// and are routed and answered.
	for i, o := range held {
		if err := o.x.Send(envoy.BodyChunk(nil, true)); err != nil {
			t.Fatalf("held stream %d: %v", i, err)
		}
	}
	for i, o := range held {
		if d := destination((<-o.first).GetRequestHeaders().GetResponse()); d == "" {
			t.Fatalf("held stream %d: not routed", i)
		}
		for {
			resp, err := o.x.Recv()
			if err != nil {
				t.Fatalf("held stream %d: %v", i, err)
			}
			if resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream() {
				break
			}
		}
	}
	// Routed and passed on: their bodies are no longer held, though their
	// responses have not even begun.
	eventually(t, "the routed streams gave their bytes back", func() (bool, string) {
		n := f.gauge("tally_buffered_request_bytes")
		return n == 0, fmt.Sprintf("tally_buffered_request_bytes = %v", n)
	})
	for i, o := range held {
		if err := o.x.Respond(okResponse); err != nil {
			t.Fatalf("held stream %d: %v", i, err)
		}
	}
	close(sampling)
	<-sampled
	if maxSeen.Load() > budget {
		t.Errorf("tally_buffered_request_bytes reached %d, over the budget of %d", maxSeen.Load(), budget)
	}

	if r, err := f.gw.roundTrip(t.Context(), completion("m", letters(2_000, 8_000))); err != nil || r.Destination == "" {
		t.Fatalf("a request after the flood: %+v, %v", r, err)
	}
	cancel()
	eventually(t, "nothing reserved, buffered or open", func() (bool, string) {
		ok, state := ledgerEmpty(f.picker)
		b, open := f.gauge("tally_buffered_request_bytes"), f.counter(t, "tally_streams_active", nil)
		return ok && b == 0 && open == 0, fmt.Sprintf("%s buffered %v, streams %v", state, b, open)
	})
	if got := f.counter(t, "tally_stream_panics_total", nil); got != 0 {
		t.Errorf("tally_stream_panics_total = %v", got)
	}
}

// TestDeclaredLengthDoesNotGrowTheHeap opens 1,000 streams that each declare
// a 32 MiB body and send one byte. Memory must follow the bytes received,
// not the bytes promised: buffers sized by content-length would take 32 GiB.
func TestDeclaredLengthDoesNotGrowTheHeap(t *testing.T) {
	const (
		streams       = 1_000
		batch         = 10 // checked after each batch, so a regression fails before it exhausts the machine
		declaredBytes = 32 << 20
		boundBytes    = 64 << 20
	)
	f := newFixture(t, fixtureOptions{quiet: true, maxRequestBytes: declaredBytes})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	headers := headersDeclaring("/v1/completions", declaredBytes, fullDuplexMode, true)

	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	before := heap()
	var xs []*envoy.Stream
	for n := batch; n <= streams; n += batch {
		for range batch {
			x, err := f.gw.Open(ctx)
			if err != nil {
				t.Fatal(err)
			}
			xs = append(xs, x)
			if err := x.Send(headers); err != nil {
				t.Fatal(err)
			}
			if err := x.Send(envoy.BodyChunk([]byte("{"), false)); err != nil {
				t.Fatal(err)
			}
		}
		eventually(t, "the server holds every byte sent", func() (bool, string) {
			got := f.gauge("tally_buffered_request_bytes")
			return got == float64(n), fmt.Sprintf("tally_buffered_request_bytes = %v, want %d", got, n)
		})
		if grown := int64(heap()) - int64(before); grown > boundBytes {
			t.Fatalf("with %d streams open: the heap grew %d MiB, over %d MiB", n, grown>>20, boundBytes>>20)
		}
	}
	grown := int64(heap()) - int64(before)
	runtime.KeepAlive(xs)
	t.Logf("%d streams of 1 byte each (content-length %d): the heap grew %.1f MiB (client and server; %d bytes a stream)",
		streams, declaredBytes, float64(grown)/(1<<20), grown/streams)
	cancel()
	eventually(t, "every stream has ended and given its byte back", func() (bool, string) {
		b, open := f.gauge("tally_buffered_request_bytes"), f.counter(t, "tally_streams_active", nil)
		return b == 0 && open == 0, fmt.Sprintf("buffered %v, streams %v", b, open)
	})
}
