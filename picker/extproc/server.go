// Package extproc is the picker's face to the gateway: an Envoy ext_proc v3
// server that buffers each request body, asks the picker for an endpoint,
// writes the choice into the destination header and metadata, passes the body
// on unchanged, and follows the response to release the request's reservation.
//
// The invariant not to break: every reservation a stream obtains, and every
// byte it charges to the server's buffer budget, is given back by that
// stream, whatever way the stream ends (response end, model server error, client
// disconnect, stream reset, protocol violation, panic). Process gives them
// back in a deferred call, so a new exit path cannot leak them; the picker
// makes repeated releases harmless, never the other way round.
package extproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc/internal/wire"
	"github.com/tallyepp/tally/picker/logging"
)

// Picker chooses an endpoint for a request and reserves its cost, waiting
// (with flow control) until one has room or ctx ends, and follows the
// reservation through its response; *picker.Picker implements it. Admit
// must not keep req.Prompt after it returns: the stream recycles the
// buffer as soon as the request is routed.
type Picker interface {
	Admit(ctx context.Context, req picker.Request) (*picker.Reservation, error)
	FirstByte(r *picker.Reservation)
	ServedBy(r *picker.Reservation, addr netip.AddrPort)
	End(r *picker.Reservation, o picker.Outcome)
}

// Objectives gives the priority of the InferenceObjective a request names;
// *objective.Priorities implements it.
type Objectives interface {
	Priority(name string) (priority int, ok bool)
}

// Options are the server's settings and collaborators.
type Options struct {
	// MaxRequestBytes bounds a request body (cfg.MaxRequestBytes); a larger
	// one is answered 413. Zero or less means no bound.
	MaxRequestBytes int64
	// MaxBufferedRequestBytes bounds the request body bytes buffered over
	// all streams at once; a chunk that would pass it is answered 503.
	// Zero or less means no bound (cmd/epp always sets one).
	MaxBufferedRequestBytes int64
	Log                     logr.Logger
	// Registerer receives the server's metrics; nil means no metrics.
	Registerer prometheus.Registerer
	// MaxModelNameLabels bounds the distinct model_name label values of the
	// inference_objective_* metrics; later models share "other". Zero or
	// less means DefaultMaxModelNameLabels.
	MaxModelNameLabels int
	// Commit and BuildRef label inference_extension_info: the commit and
	// the version the binary was built from (cmd/epp's, stamped by the
	// linker). Either empty is read from the binary's Go build info
	// (vcs.revision; the main module's version).
	Commit, BuildRef string
	// ConformanceTestHooks turns on what the Gateway API Inference
	// Extension conformance suite asks of a picker: the endpoints named by
	// a request's test-epp-endpoint-selection header are its only
	// candidates, and the endpoint that served it is copied into the
	// x-conformance-test-served-endpoint response header. Off in
	// production: the header lets a client choose its endpoint.
	ConformanceTestHooks bool
	// Objectives maps the objective header to a priority (flow control);
	// nil: every request has priority 0.
	Objectives Objectives
	// Rewrites rewrites the model of requests the pool's
	// InferenceModelRewrites match; nil: none.
	Rewrites Rewrites
	// Pool says why the pool offers no endpoint, for the answer to a
	// request refused for want of one; nil: the answer gives no cause.
	Pool Pool
}

// Pool tells why the pool offers no endpoint at all, in words a user can
// act on, or "" when it offers some; *controllers.PoolStatus implements it.
type Pool interface {
	NoEndpointReason() string
}

// Rewrites draws the model a request for model is sent to; *rewrite.Table
// implements it.
type Rewrites interface {
	Rewrite(model string, draw func(n int) int) (target, rewrite string, ok bool)
}

// Server is the ext_proc service. It keeps no per-request state of its own:
// each stream's state lives in the goroutine that serves it.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	picker  Picker
	opts    Options
	metrics metrics
	// buffers recycles request body and prompt buffers (*[]byte) between
	// streams; large, those over maxPooledBufferBytes, by size.
	buffers sync.Pool
	large   [largeTiers]sync.Pool
	// tails recycles response usage tails (*[usageTailBytes]byte).
	tails sync.Pool
	// buffered is the request body bytes all streams hold right now; it
	// never exceeds opts.MaxBufferedRequestBytes (see charge).
	buffered atomic.Int64
	// loadOnlyWarned makes the body-mode warning a once-per-process line
	// rather than one per request.
	loadOnlyWarned atomic.Bool
	// unappliedRewriteWarned does the same for a model rewrite a gateway
	// without pseudo-headers would not apply.
	unappliedRewriteWarned atomic.Bool
	// unannouncedStreams: a gateway that announced no body mode has sent a
	// body before its headers were answered, so it streams
	// (FULL_DUPLEX_STREAMED); see unannouncedBodyWait.
	unannouncedStreams atomic.Bool
	// upstream are the request metrics under the upstream picker's names.
	upstream *objectiveMetrics
}

// NewServer returns a server that routes through p. It panics if
// opts.Registerer already holds metrics of the same names, as
// prometheus.MustRegister does.
func NewServer(p Picker, opts Options) *Server {
	s := &Server{picker: p, opts: opts}
	s.metrics = newMetrics(&s.buffered)
	s.upstream = newObjectiveMetrics(opts.MaxModelNameLabels, opts.Commit, opts.BuildRef)
	s.buffers.New = func() any { return new([]byte) }
	s.tails.New = func() any { return new([usageTailBytes]byte) }
	if opts.Registerer != nil {
		s.metrics.register(opts.Registerer)
		s.upstream.register(opts.Registerer)
	}
	if opts.ConformanceTestHooks {
		logging.Warn(opts.Log, "conformance test hooks are on: a request's "+testSelectionHeader+
			" header chooses its endpoint; turn them off outside the conformance suite")
	}
	return s
}

// Register adds the ext_proc service to g.
func (s *Server) Register(g *grpc.Server) {
	extprocv3.RegisterExternalProcessorServer(g, s)
}

// GRPCServerOptions are the options the gRPC server carrying this service
// needs: in BUFFERED mode the gateway sends the whole request body as one
// message, which must not be refused by gRPC's default 4 MiB receive limit
// before the server can answer 413 itself. Its codec receives request
// bodies without a fresh copy per message (see wire.Codec).
func GRPCServerOptions(maxRequestBytes int64) []grpc.ServerOption {
	const envelopeBytes = 1 << 20 // headers and metadata around the body
	limit := maxRequestBytes + envelopeBytes
	if maxRequestBytes <= 0 || limit > 1<<31-1 {
		limit = 1<<31 - 1
	}
	pool := &wire.DirtyPool{}
	return []grpc.ServerOption{grpc.MaxRecvMsgSize(int(limit)), grpc.ForceServerCodecV2(wire.NewCodec(pool)),
		experimental.BufferPool(pool),
		// Streams run on kept goroutines while one is free (past that, on
		// new ones, as without workers). A kept goroutine's stack has
		// already grown to what serving a stream takes; a new one grows it
		// by copying, each time: a tenth of a short request's CPU. In
		// interleaved runs of extproc-load at 16 clients, 12-20% less CPU
		// per request.
		grpc.NumStreamWorkers(streamWorkers),
		// A body chunk (up to 62,000 bytes) and its echo each fit one read
		// and one write; a gateway opens a few connections, so the buffers
		// cost little. About 5% less CPU per request in interleaved runs.
		grpc.ReadBufferSize(connBufferBytes), grpc.WriteBufferSize(connBufferBytes),
		// Flow-control windows the size gRPC's own estimate may grow them
		// to, from the start: with its 64 KB defaults every 16 KB of body
		// received cost a window update (a frame, usually its own write).
		// A stream's prompt now fits its window whole, and the connection
		// is updated every 4 MiB. In interleaved runs of extproc-load at 16
		// clients, a few per cent less CPU per request.
		grpc.InitialWindowSize(streamWindowBytes), grpc.InitialConnWindowSize(connWindowBytes),
		// A gateway may keep its connections alive with HTTP/2 pings
		// (Envoy's connection_keepalive). gRPC's default policy takes a
		// ping sooner than every 5 minutes for abuse and, after the
		// third, closes the connection with every request in flight on
		// it. Pings are permitted every gatewayPingMin, with or without
		// streams.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: gatewayPingMin, PermitWithoutStream: true})}
}

// gatewayPingMin is the shortest interval between a gateway's keepalive
// pings that the ext_proc server permits.
const gatewayPingMin = 5 * time.Second

// Process serves one HTTP request's ext_proc stream.
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) (err error) {
	s.metrics.streamsActive.Inc()
	defer s.metrics.streamsActive.Dec()

	st := s.newStream(srv)
	// Deferred first so it runs last: after a panic has been answered.
	defer st.close()
	defer func() {
		if r := recover(); r != nil {
			err = st.recovered(r)
		}
	}()

	// Received into one inbound per stream: each message's body aliases a
	// buffer reused by the next, and the buffers are the server's, reused
	// by later streams.
	var in wire.Inbound
	buf, wireBuf := s.getBuffer(), s.getBuffer()
	in.Buf, in.Wire = *buf, *wireBuf
	defer func() {
		*buf, *wireBuf = in.Buf, in.Wire
		s.putBuffer(buf)
		s.putBuffer(wireBuf)
	}()
	for {
		err := srv.RecvMsg(&in)
		if errors.Is(err, io.EOF) {
			st.halfClosed()
			return nil
		}
		if err != nil {
			if status.Code(err) == codes.Canceled {
				return nil // the gateway gave up on the request: nothing to report
			}
			return fmt.Errorf("receiving from the gateway: %w", err)
		}
		if err := st.handle(&in.ProcessingRequest); err != nil {
			if errors.Is(err, errAnswered) {
				return nil
			}
			return err
		}
	}
}

// streamWorkers is how many goroutines the gRPC server keeps for streams:
// more than the streams a short burst of small requests holds open at once
// on a few cores, few enough that idle ones cost little (a few MiB).
const streamWorkers = 64

// connBufferBytes sizes each gateway connection's read and write buffers.
const connBufferBytes = 128 << 10

// The gRPC flow-control windows: a stream's (a prompt of up to 250,000
// tokens fits it whole) and a connection's.
const (
	streamWindowBytes = 1 << 20
	connWindowBytes   = 16 << 20
)

// Buffers up to maxPooledBufferBytes share one pool, whatever their size;
// larger ones go to the large pools, one per power of two, so that a huge
// request takes a buffer of its size, and a small one never pins a huge
// one. A body that grows past maxPooledBufferBytes grows into the large
// pools, doubling, rather than by append's fresh buffers. Recycling the
// large ones matters: fresh buffers for a stream of huge prompts run the
// garbage collector often enough that its assists slow the small picks
// beside them (BenchmarkSmallBesideHugePrompts; docs/benchmarks.md). A
// pool holds nothing across two collections, so idle memory still goes
// back.
const maxPooledBufferBytes = 1 << 20

// largeTiers are the large pools: tier t holds buffers whose capacity is
// at least 1<<(t+largeTierMin).
const (
	largeTierMin = 20 // 1 MiB: maxPooledBufferBytes
	largeTiers   = 31 - largeTierMin + 1
)

func (s *Server) getBuffer() *[]byte {
	return s.buffers.Get().(*[]byte)
}

// getLarge returns an empty buffer of capacity at least n: from a large
// pool, else new.
func (s *Server) getLarge(n int) *[]byte {
	t := bits.Len(uint(n-1)) - largeTierMin // a power of two at least n
	if t < 0 {
		t = 0
	}
	if t < largeTiers {
		if b, ok := s.large[t].Get().(*[]byte); ok {
			return b
		}
		b := make([]byte, 0, 1<<(t+largeTierMin))
		return &b
	}
	b := make([]byte, 0, n)
	return &b
}

func (s *Server) putBuffer(b *[]byte) {
	if b == nil {
		return
	}
	*b = (*b)[:0]
	if c := cap(*b); c > maxPooledBufferBytes {
		// The tier whose every buffer holds 1<<(t+largeTierMin): c's
		// power of two rounded down.
		if t := bits.Len(uint(c)) - 1 - largeTierMin; t >= 0 && t < largeTiers {
			s.large[t].Put(b)
		}
		return
	}
	s.buffers.Put(b)
}

// charge takes n bytes from the buffer budget, or reports that they would
// pass it. Compare-and-swap rather than add-then-undo, so the total never
// passes the budget even for an instant: the gauge shows what is really held.
func (s *Server) charge(n int64) bool {
	limit := s.opts.MaxBufferedRequestBytes
	for {
		held := s.buffered.Load()
		if limit > 0 && held+n > limit {
			return false
		}
		if s.buffered.CompareAndSwap(held, held+n) {
			return true
		}
	}
}

func (s *Server) uncharge(n int64) { s.buffered.Add(-n) }

type metrics struct {
	requests          *prometheus.CounterVec
	requestBytes      prometheus.Histogram
	bufferedBytes     prometheus.GaugeFunc
	budgetRejections  prometheus.Counter
	loadOnlyRoutes    *prometheus.CounterVec
	unappliedRewrites prometheus.Counter
	protocolErrors    prometheus.Counter
	streamsActive     prometheus.Gauge
	streamPanics      prometheus.Counter
	serverErrors      prometheus.Counter
}

// newMetrics builds the collectors unregistered: with no Registerer they still
// count, nobody reads them, and the code that updates them needs no nil checks.
func newMetrics(buffered *atomic.Int64) metrics {
	return metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_requests_total",
			Help: "Requests decided by the picker, by the HTTP status it decided (200: routed).",
		}, []string{"code"}),
		requestBytes: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tally_request_bytes",
			Help:    "Size of the request bodies the picker buffered.",
			Buckets: prometheus.ExponentialBuckets(1024, 4, 10), // 1 KiB .. 256 MiB
		}),
		bufferedBytes: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tally_buffered_request_bytes",
			Help: "Request body bytes buffered over all streams right now (bounded by maxBufferedRequestBytes).",
		}, func() float64 { return float64(buffered.Load()) }),
		budgetRejections: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_buffer_budget_rejections_total",
			Help: "Requests answered 503 because buffering their body would pass maxBufferedRequestBytes.",
		}),
		loadOnlyRoutes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_load_only_routes_total",
			Help: "Requests with a body routed on load alone, without prefix affinity, by reason " +
				"(request_body_mode: the gateway's request body mode is neither FULL_DUPLEX_STREAMED nor BUFFERED).",
		}, []string{"reason"}),
		unappliedRewrites: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_model_rewrites_unapplied_total",
			Help: "Requests whose model a rewrite (a rule, or x-gateway-model-name-rewrite) would change, from a gateway that sends no " +
				"pseudo-headers (NGINX Gateway Fabric's shim): it takes only the destination from the picker, so the model server " +
				"receives the model the client named, and the picker scores that one.",
		}),
		protocolErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_protocol_errors_total",
			Help: "ext_proc streams ended with InvalidArgument because the gateway broke the protocol.",
		}),
		streamsActive: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tally_streams_active",
			Help: "ext_proc streams currently open.",
		}),
		streamPanics: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_stream_panics_total",
			Help: "ext_proc streams ended by a recovered panic.",
		}),
		serverErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_model_server_errors_total",
			Help: "Responses from model servers with a status of 500 or more.",
		}),
	}
}

func (m metrics) register(r prometheus.Registerer) {
	r.MustRegister(m.requests, m.requestBytes, m.bufferedBytes, m.budgetRejections, m.loadOnlyRoutes,
		m.unappliedRewrites, m.protocolErrors, m.streamsActive, m.streamPanics, m.serverErrors)
}
