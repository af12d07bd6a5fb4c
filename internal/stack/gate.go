package stack

import (
	"context"
	"io"
	"net/http"
	"sync"
)

// BodyGate sends a set of requests so that they reach the gateway at once:
// each request's headers and all of its body but the last byte go out as
// soon as it is sent, the last bytes only when Open is called. A burst sent
// from many goroutines otherwise arrives spread over the time its
// connections take to open, which on a loaded machine can be longer than
// the picker's model takes to drain the first requests' prefill.
type BodyGate struct {
	client  *http.Client
	open    chan struct{}
	once    sync.Once
	mu      sync.Mutex
	waiting int
	all     chan struct{}
	n       int
}

// NewBodyGate returns a gate for n requests.
func NewBodyGate(n int) *BodyGate {
	g := &BodyGate{open: make(chan struct{}), all: make(chan struct{}), n: n}
	// One connection per request, closed after it.
	g.client = &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}
	if n == 0 {
		close(g.all)
	}
	return g
}

// Waiting is closed once all n requests have sent everything but their
// last byte and wait at the gate.
func (g *BodyGate) Waiting() <-chan struct{} { return g.all }

// Open lets every request send the rest of its body. It is idempotent.
func (g *BodyGate) Open() { g.once.Do(func() { close(g.open) }) }

// Send is Send, on a connection of its own, with req's last body byte held
// until the gate opens. A request with an empty body is not held (it counts
// as waiting at once).
func (g *BodyGate) Send(ctx context.Context, baseURL, id string, req Request) Result {
	body := &gatedBody{g: g, data: req.Body}
	if len(req.Body) == 0 {
		g.arrived()
	}
	return sendBody(ctx, g.client, baseURL, id, req, body, int64(len(req.Body)))
}

func (g *BodyGate) arrived() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.waiting++
	if g.waiting == g.n {
		close(g.all)
	}
}

// gatedBody reads data, stopping before its last byte until the gate opens.
type gatedBody struct {
	g       *BodyGate
	data    []byte
	off     int
	arrived bool
}

func (b *gatedBody) Read(p []byte) (int, error) {
	if b.off == len(b.data) {
		return 0, io.EOF
	}
	if b.off == len(b.data)-1 {
		if !b.arrived {
			b.arrived = true
			b.g.arrived()
		}
		<-b.g.open
	}
	end := len(b.data)
	if b.off < len(b.data)-1 {
		end = len(b.data) - 1
	}
	n := copy(p, b.data[b.off:end])
	b.off += n
	return n, nil
}
