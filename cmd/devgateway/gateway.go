package main

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker/protocol"
)

// requestIDHeader is the header Envoy gives each request a UUID in.
const requestIDHeader = "x-request-id"

const (
	defaultBodyChunkBytes     = 16 << 10
	defaultPickerTimeout      = 10 * time.Second
	defaultStreamCloseTimeout = 5 * time.Second
	upstreamDialTimeout       = 5 * time.Second
)

// PoolView is what the gateway knows of the InferencePool, used only when the
// picker cannot decide.
type PoolView struct {
	FailureMode infv1.EndpointPickerFailureMode
	// Endpoints are "ip:port" strings, the pool's Ready endpoints.
	Endpoints []string
}

// Gateway is an http.Handler that routes each request the way Envoy does
// with the endpoint picker as its ext_proc filter: one ext_proc stream per
// request, request and response bodies in FULL_DUPLEX_STREAMED mode, the
// destination taken from the picker's header mutation.
//
// Like httputil.ReverseProxy, it is a plain struct: set Picker and Pool, and
// optionally the other fields. A Gateway must not be copied after first use.
type Gateway struct {
	// Picker is the ext_proc client of the endpoint picker
	// (envoy.NewClient over its connection). Required unless Pickers is set.
	Picker *envoy.Client
	// Pickers, when set, replaces Picker with the clients of several picker
	// replicas (the ready endpoints behind the picker's Service): each
	// request's stream goes to the next in turn, and a stream that fails
	// before the picker answered anything is retried once on the one after.
	Pickers []*envoy.Client
	// Healthy, when set, reports whether picker i of Pickers passed its
	// last health check: a new stream goes to the next healthy one in
	// turn (to the next in turn when none is), as a gateway sends streams
	// only to ready endpoints.
	Healthy func(i int) bool
	// Pool reports the pool's failure mode and endpoints. It is called only
	// when the picker is unreachable or its stream fails before a decision.
	// Nil means FailClose.
	Pool func() PoolView
	// Transport sends requests to model servers. Nil means a transport with a
	// dial timeout that leaves Accept-Encoding and bodies untouched.
	Transport http.RoundTripper
	// BodyChunkBytes is the largest request or response body message sent to
	// the picker. Zero means 16 KiB.
	BodyChunkBytes int
	// PickerTimeout bounds the time from the start of a request to the
	// picker's decision, and the wait for its response-headers reply. Zero
	// means 10 s.
	PickerTimeout time.Duration
	// StreamCloseTimeout bounds how long a finished stream, half-closed by the
	// gateway, waits for the picker to end it before it is cancelled. Zero
	// means 5 s.
	StreamCloseTimeout time.Duration
	// Log receives one line per request at debug level and failures at warn.
	// Nil discards.
	Log *slog.Logger
	// Choose returns a number in [0, n): the first endpoint tried under
	// FailOpen. Nil means math/rand/v2.IntN.
	Choose func(n int) int

	nextPick         atomic.Uint64
	transportOnce    sync.Once
	defaultTransport http.RoundTripper
	closing          sync.WaitGroup
}

// Wait blocks until the requests being served have returned and the
// streams the gateway is still closing have ended (each one within
// StreamCloseTimeout). Call it after the HTTP server shut down.
func (g *Gateway) Wait() { g.closing.Wait() }

func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// Counted, so that a stream's close (closeStream) is counted while the
	// count is above zero: a Wait after the server's Close, with a handler
	// still returning, does not race with it.
	g.closing.Add(1)
	defer g.closing.Done()
	// Only the picker names the destination; a client cannot choose the pod.
	r.Header.Del(protocol.DestinationHeader)
	if r.Header.Get(requestIDHeader) == "" {
		r.Header.Set(requestIDHeader, uuid.NewString())
	}
	// The stream outlives the handler by a short, bounded close (see
	// closeStream), so it does not hang off r.Context, which ends when the
	// handler returns; a client disconnect still cancels it at once.
	streamCtx, cancelStream := context.WithCancel(context.WithoutCancel(r.Context()))
	stopDisconnectWatch := context.AfterFunc(r.Context(), cancelStream)
	ex := &exchange{
		g:            g,
		w:            w,
		r:            r,
		streamCtx:    streamCtx,
		cancelStream: cancelStream,
		log:          g.logger().With("request_id", r.Header.Get(requestIDHeader), "method", r.Method, "path", r.URL.RequestURI()),
	}
	clean := false
	defer func() {
		stopDisconnectWatch()
		if clean {
			g.closeStream(ex.stream, cancelStream)
		} else {
			cancelStream()
		}
	}()
	clean = ex.run()
}

func (g *Gateway) logger() *slog.Logger {
	if g.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return g.Log
}

func (g *Gateway) chunkBytes() int {
	if g.BodyChunkBytes > 0 {
		return g.BodyChunkBytes
	}
	return defaultBodyChunkBytes
}

func (g *Gateway) pickerTimeout() time.Duration {
	if g.PickerTimeout > 0 {
		return g.PickerTimeout
	}
	return defaultPickerTimeout
}

func (g *Gateway) transport() http.RoundTripper {
	if g.Transport != nil {
		return g.Transport
	}
	g.transportOnce.Do(func() {
		g.defaultTransport = &http.Transport{
			DialContext:         (&net.Dialer{Timeout: upstreamDialTimeout}).DialContext,
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     90 * time.Second,
			// A gateway passes Accept-Encoding and bodies through as they are.
			DisableCompression: true,
		}
	})
	return g.defaultTransport
}

func (g *Gateway) pickers() []*envoy.Client {
	if len(g.Pickers) > 0 {
		return g.Pickers
	}
	return []*envoy.Client{g.Picker}
}

// nextPicker is the index, among n pickers, of the one a new request's
// stream goes to: each in turn, as a gateway spreads its streams over the
// endpoints of the picker's Service.
func (g *Gateway) nextPicker(n int) int {
	if n == 1 {
		return 0
	}
	turn := g.nextPick.Add(1) - 1
	if g.Healthy != nil {
		// In turn among the healthy ones, as a balancer over the ready
		// endpoints.
		var healthy [16]int
		k := 0
		for i := 0; i < n && k < len(healthy); i++ {
			if g.Healthy(i) {
				healthy[k] = i
				k++
			}
		}
		if k > 0 {
			return healthy[turn%uint64(k)]
		}
	}
	return int(turn % uint64(n))
}

// healthyFrom is the first healthy picker from i on, in turn; i when none
// is (or no health is checked).
func (g *Gateway) healthyFrom(i, n int) int {
	if g.Healthy == nil {
		return i
	}
	for k := range n {
		if j := (i + k) % n; g.Healthy(j) {
			return j
		}
	}
	return i
}

func (g *Gateway) pool() PoolView {
	if g.Pool == nil {
		return PoolView{FailureMode: infv1.EndpointPickerFailClose}
	}
	return g.Pool()
}

// closeStream ends a stream whose exchange completed the way Envoy does:
// half-close, let the picker finish, cancel if it has not within
// StreamCloseTimeout.
func (g *Gateway) closeStream(stream *envoy.Stream, cancel context.CancelFunc) {
	if stream == nil {
		cancel()
		return
	}
	timeout := g.StreamCloseTimeout
	if timeout <= 0 {
		timeout = defaultStreamCloseTimeout
	}
	g.closing.Add(1)
	go func() {
		defer g.closing.Done()
		defer cancel()
		t := time.AfterFunc(timeout, stream.Cancel)
		defer t.Stop()
		// How the picker ends the stream is its own to report.
		_ = stream.Finish()
	}()
}
