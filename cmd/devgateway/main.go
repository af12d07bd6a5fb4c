// Command devgateway is a small stand-in for Envoy in front of an endpoint
// picker, for demos and end-to-end tests. It is not a production gateway.
//
// For each HTTP request it opens one ext_proc stream to the picker and plays
// Envoy's side of the endpoint picker protocol: request headers (the first
// message carries protocol_config with both body modes FULL_DUPLEX_STREAMED),
// the body in 16 KiB chunks, then it waits for the picker's deferred headers
// response. An ImmediateResponse is returned to the client as it is.
// Otherwise the request, with the picker's header mutation and the body
// chunks the picker streamed back, goes to the first endpoint of
// x-gateway-destination-endpoint ("ip:port[,ip:port...]"), falling back to
// the next one only when a connection cannot be opened. On the response path
// the response headers go to the picker with
// metadata_context.filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"]
// naming the endpoint that served, and the body is streamed through the
// picker to the client chunk by chunk, flushed as it arrives (SSE streams).
//
// --picker-addr may list several pickers (the replicas of one picker, as the
// ready endpoints behind its Service): the streams go to each in turn,
// skipping those whose gRPC health check of the ext_proc service, every
// 500 ms on the ext_proc port, does not say SERVING (starting or draining
// pickers, with --health-checking; one that serves no health there counts
// as healthy), as Envoy's health checking of the ext_proc cluster does. A
// stream that fails before its picker answered anything (connection
// refused, the picker died with the request) is retried once on the next
// address, the body sent again whole, as a gateway's retry policy on the
// ext_proc service would; a stream the picker has answered is never moved.
//
// When the picker is unreachable or its stream fails before a decision (the
// retry too), the pool's failure mode applies: FailOpen sends the request
// to a pool endpoint chosen at random, FailClose answers 503. After the
// pick the picker is best effort: if its stream breaks while the response
// streams, the rest of the response reaches the client without it.
//
// The invariant: every request's ext_proc stream ends when the request does,
// half-closed after a complete exchange and cancelled on any failure or
// client disconnect. The picker releases its reservation on that signal; a
// stream left open would hold load on a pod forever.
//
// Flags:
//
//	--listen ADDR          HTTP listen address (default localhost:8080; port 0 picks one)
//	--picker-addr LIST     ext_proc address of the picker, or a comma-separated list
//	                       of its replicas' addresses: streams go to each in turn, a
//	                       stream that fails before any answer is retried once on
//	                       the next (default localhost:9002)
//	--picker-tls BOOL      TLS to the picker, certificate not verified since the
//	                       picker serves a self-signed one (default true)
//	--picker-timeout DUR   longest wait from the start of a request to the picker's
//	                       decision, and for its response-headers answer (default 10s)
//	--kubeconfig PATH      kubeconfig for --pool-name (default $KUBECONFIG, else in-cluster)
//	--pool-name NAME       InferencePool to poll (every 500ms) for its failure mode
//	                       (spec.endpointPickerRef.failureMode, default FailClose)
//	                       and its Ready endpoints
//	--pool-namespace NS    namespace of the pool (default $NAMESPACE; required with --pool-name)
//	--failure-mode MODE    FailOpen or FailClose: overrides the pool's
//	--endpoints LIST       comma-separated ip:port list: overrides the pool's endpoints
//	-v N                   log verbosity; 1 logs every request
//
// Once it listens it prints one line on stderr: "devgateway listening on ADDR".
// A bad flag exits with status 2 and names the flag; SIGTERM or SIGINT stop
// it cleanly (in-flight requests get 10 s to finish), with status 0.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/controllers"
	"github.com/tallyepp/tally/internal/envoy"
)

// Exit codes: 2 for bad flags (as the flag package does), 1 for anything
// that stops the gateway after its flags were accepted.
const (
	exitOK       = 0
	exitFailure  = 1
	exitBadUsage = 2
)

const (
	shutdownGrace       = 10 * time.Second
	pickerMaxBackoff    = time.Second
	firstPollTimeout    = 5 * time.Second
	readHeaderTimeout   = 10 * time.Second
	defaultListenAddr   = "localhost:8080"
	defaultPickerAddr   = "localhost:9002"
	listeningLinePrefix = "devgateway listening on "
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stderr)
	stop()
	os.Exit(code)
}

type options struct {
	listen        string
	pickerAddrs   []string
	pickerTLS     bool
	pickerTimeout time.Duration
	kubeconfig    string
	poolName      string
	poolNamespace string
	overrides     poolOverrides
	verbosity     int
}

func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) int {
	opts, err := parseFlags(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "devgateway: %v\n", err)
		return exitBadUsage
	}
	level := slog.LevelInfo
	if opts.verbosity > 0 {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	if err := serve(ctx, opts, log, stderr); err != nil {
		log.Error("devgateway stopped", "err", err)
		return exitFailure
	}
	return exitOK
}

func parseFlags(args []string, getenv func(string) string, stderr io.Writer) (options, error) {
	o := options{}
	fs := flag.NewFlagSet("devgateway", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var failureMode, endpoints, pickerAddrs string
	fs.StringVar(&o.listen, "listen", defaultListenAddr, "HTTP listen address (port 0 picks a free port)")
	fs.StringVar(&pickerAddrs, "picker-addr", defaultPickerAddr, "ext_proc address of the endpoint picker, or a comma-separated list of its replicas' addresses: "+
		"streams go to each healthy one in turn (gRPC health of the ext_proc service on its port, as the picker serves with --health-checking); a stream that fails before the picker answered anything (refused, the picker died) is retried once on the next address")
	fs.BoolVar(&o.pickerTLS, "picker-tls", true, "use TLS to the picker without verifying its (self-signed) certificate")
	fs.DurationVar(&o.pickerTimeout, "picker-timeout", defaultPickerTimeout, "longest wait from a request's start to the picker's decision")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig used with --pool-name (default: $KUBECONFIG, else in-cluster)")
	fs.StringVar(&o.poolName, "pool-name", "", "InferencePool whose failure mode and Ready endpoints are polled")
	fs.StringVar(&o.poolNamespace, "pool-namespace", getenv("NAMESPACE"), "namespace of the InferencePool (default: $NAMESPACE)")
	fs.StringVar(&failureMode, "failure-mode", "", "FailOpen or FailClose; overrides the pool's failure mode")
	fs.StringVar(&endpoints, "endpoints", "", "comma-separated ip:port endpoints; override the pool's")
	fs.IntVar(&o.verbosity, "v", 0, "log verbosity (1 logs every request)")
	if err := fs.Parse(args); err != nil {
		return options{}, err
	}
	if fs.NArg() > 0 {
		return options{}, fmt.Errorf("unexpected argument %q: devgateway takes flags only", fs.Arg(0))
	}
	if o.kubeconfig == "" {
		o.kubeconfig = getenv("KUBECONFIG")
	}

	var errs []error
	if err := checkHostPort(o.listen, true); err != nil {
		errs = append(errs, fmt.Errorf("flag --listen %q: %w", o.listen, err))
	}
	for _, addr := range strings.Split(pickerAddrs, ",") {
		addr = strings.TrimSpace(addr)
		if err := checkHostPort(addr, false); err != nil {
			errs = append(errs, fmt.Errorf("flag --picker-addr: %q of %q: %w (want host:port, or a comma-separated list of them)", addr, pickerAddrs, err))
			continue
		}
		o.pickerAddrs = append(o.pickerAddrs, addr)
	}
	if o.pickerTimeout <= 0 {
		errs = append(errs, fmt.Errorf("flag --picker-timeout: %s is invalid: must be more than 0", o.pickerTimeout))
	}
	switch m := infv1.EndpointPickerFailureMode(failureMode); m {
	case "":
	case infv1.EndpointPickerFailOpen, infv1.EndpointPickerFailClose:
		o.overrides.failureMode = &m
	default:
		errs = append(errs, fmt.Errorf("flag --failure-mode: %q is invalid: must be %s or %s", failureMode, infv1.EndpointPickerFailOpen, infv1.EndpointPickerFailClose))
	}
	if endpoints != "" {
		eps, err := parseEndpointsFlag(endpoints)
		if err != nil {
			errs = append(errs, fmt.Errorf("flag --endpoints: %w", err))
		}
		o.overrides.endpoints = eps
	}
	if o.poolName != "" && o.poolNamespace == "" {
		errs = append(errs, errors.New("flag --pool-namespace is required with --pool-name (or set $NAMESPACE)"))
	}
	if o.poolName == "" {
		fs.Visit(func(f *flag.Flag) {
			if f.Name == "pool-namespace" || f.Name == "kubeconfig" {
				errs = append(errs, fmt.Errorf("flag --%s is used only with --pool-name: give --pool-name too, or drop it", f.Name))
			}
		})
	}
	if o.verbosity < 0 {
		errs = append(errs, fmt.Errorf("flag -v: %d is invalid: must be 0 or more", o.verbosity))
	}
	return o, errors.Join(errs...)
}

// checkHostPort accepts "host:port" with a numeric port (0 only if zeroOK).
func checkHostPort(addr string, zeroOK bool) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("must be host:port: %w", err)
	}
	n, err := strconv.Atoi(port)
	low := 1
	if zeroOK {
		low = 0
	}
	if err != nil || n < low || n > 65535 {
		return fmt.Errorf("port %q must be a number from %d to 65535", port, low)
	}
	return nil
}

// parseEndpointsFlag parses "ip:port,ip:port" (IPv6 as "[addr]:port") into
// the strings the picker protocol uses.
func parseEndpointsFlag(s string) ([]string, error) {
	var out []string
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		ap, err := netip.ParseAddrPort(part)
		if err != nil || ap.Port() == 0 {
			return nil, fmt.Errorf("%q is not an endpoint: want ip:port or [ipv6]:port with a port from 1 to 65535, comma-separated", part)
		}
		out = append(out, ap.String())
	}
	return out, nil
}

func dialPicker(opts options, addr string) (*grpc.ClientConn, error) {
	creds := insecure.NewCredentials()
	if opts.pickerTLS {
		// The picker serves a self-signed certificate by default (as the
		// upstream picker does); Envoy's configuration for it skips
		// verification too.
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}) //nolint:gosec // see above
	}
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(creds),
		// A picker restarted during a demo is found again within about a
		// second, not after gRPC's default backoff of up to two minutes.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: pickerMaxBackoff},
			MinConnectTimeout: 5 * time.Second,
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("flag --picker-addr %q: %w", addr, err)
	}
	return conn, nil
}

// serve runs the gateway until ctx ends, then shuts it down.
func serve(ctx context.Context, opts options, log *slog.Logger, stderr io.Writer) error {
	// One connection per address: each replica is its own picker, with
	// its own HTTP/2 connection, as Envoy holds one per cluster endpoint.
	var pickers []*envoy.Client
	var conns []grpc.ClientConnInterface
	for _, addr := range opts.pickerAddrs {
		conn, err := dialPicker(opts, addr)
		if err != nil {
			return err
		}
		defer conn.Close()
		pickers = append(pickers, envoy.NewClient(envoy.Options{}, conn))
		conns = append(conns, conn)
	}

	state := newPoolState(opts.overrides.apply(PoolView{FailureMode: infv1.EndpointPickerFailClose}))
	var background sync.WaitGroup
	defer background.Wait()
	pollCtx, stopPolling := context.WithCancel(ctx)
	defer stopPolling()
	if opts.poolName != "" {
		kube, err := controllers.RESTConfig(opts.kubeconfig)
		if err != nil {
			return err
		}
		c, err := client.New(kube, client.Options{Scheme: controllers.Scheme()})
		if err != nil {
			return fmt.Errorf("creating the Kubernetes client: %w", err)
		}
		p := &poolPoller{
			reader:    c,
			pool:      types.NamespacedName{Namespace: opts.poolNamespace, Name: opts.poolName},
			overrides: opts.overrides,
			state:     state,
			log:       log,
		}
		// Know the failure mode before the first request if the API server
		// answers; serve anyway if it does not.
		firstCtx, cancel := context.WithTimeout(ctx, firstPollTimeout)
		p.poll(firstCtx)
		cancel()
		background.Go(func() { p.run(pollCtx, poolPollInterval) })
	}

	gw := &Gateway{
		Pickers:       pickers,
		Pool:          state.View,
		PickerTimeout: opts.pickerTimeout,
		Log:           log,
	}
	if len(conns) > 1 {
		// Several replicas: new streams go only to those whose health
		// check passes (ready), as a gateway's do.
		health := newHealthChecks(len(conns))
		gw.Healthy = health.ok
		background.Go(func() { health.run(pollCtx, conns) })
	}
	ln, err := net.Listen("tcp", opts.listen)
	if err != nil {
		return fmt.Errorf("flag --listen %q: %w", opts.listen, err)
	}
	srv := &http.Server{
		Handler:           gw,
		ReadHeaderTimeout: readHeaderTimeout,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	fmt.Fprintf(stderr, "%s%s\n", listeningLinePrefix, ln.Addr())
	log.Info("routing through the endpoint picker", "picker", strings.Join(opts.pickerAddrs, ","), "tls", opts.pickerTLS, "pool", opts.poolName, "failure_mode", state.View().FailureMode)

	select {
	case err := <-serveErr:
		return fmt.Errorf("serving HTTP: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down")
	stopPolling()
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownGrace)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		// Streams still running after the grace period are cut.
		_ = srv.Close()
	}
	gw.Wait()
	return nil
}
