// Command epp is Tally's endpoint picker: an Envoy ext_proc server that
// chooses, for each LLM request, the pod of an InferencePool that serves it.
//
// It watches one InferencePool and its pods (controllers), keeps the live
// in-flight ledger and prefix index (picker), and serves:
//   - ext_proc on --grpc-port (TLS unless --secure-serving=false),
//   - gRPC health on --grpc-health-port ("liveness", "readiness", the ext_proc
//     service name and ""), SERVING once the endpoint set is synced and, with
//     --ha-enable-leader-election, this replica leads,
//   - Prometheus metrics at /metrics and the ledger as JSON at /debug/ledger
//     on --metrics-port.
//
// Flags follow the upstream endpoint picker; run with -h for the list.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/controllers"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
)

// Exit codes: 2 for bad flags (as the flag package does), 1 for anything
// that stops the picker after its flags were accepted.
const (
	exitOK       = 0
	exitFailure  = 1
	exitBadUsage = 2
)

const (
	readinessPollInterval = 100 * time.Millisecond
	shutdownGrace         = 10 * time.Second
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) int {
	opts, ignored, err := parseFlags(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "epp: %v\n", err)
		return exitBadUsage
	}
	log := zap.New(zap.WriteTo(stderr), zap.Level(zapcore.Level(-opts.verbosity)))
	ctrl.SetLogger(log)
	for _, name := range ignored {
		log.Info("ignoring a flag of the upstream picker that Tally does not use", "flag", "--"+name)
	}
	cfg, err := loadConfig(opts)
	if err != nil {
		fmt.Fprintf(stderr, "epp: %v\n", err)
		return exitFailure
	}
	if err := serve(ctx, opts, cfg, log); err != nil {
		log.Error(err, "epp stopped")
		return exitFailure
	}
	return exitOK
}

func loadConfig(opts options) (v1alpha1.PickerConfig, error) {
	data, err := opts.readConfig()
	if err != nil {
		return v1alpha1.PickerConfig{}, err
	}
	cfg := v1alpha1.Default()
	if data != nil {
		if cfg, err = v1alpha1.Load(data); err != nil {
			return v1alpha1.PickerConfig{}, err
		}
	}
	for _, f := range []struct {
		name  string
		value int64
		field *int64
	}{
		{"max-request-bytes", opts.maxRequestBytes, &cfg.MaxRequestBytes},
		{"max-buffered-request-bytes", opts.maxBufferedRequestBytes, &cfg.MaxBufferedRequestBytes},
	} {
		if f.value > 0 {
			*f.field = f.value
			if err := cfg.Validate(); err != nil {
				return v1alpha1.PickerConfig{}, fmt.Errorf("flag --%s: %w", f.name, err)
			}
		}
	}
	return cfg, nil
}

// Without a memory limit to derive the buffer budget from, it is this.
const defaultBufferBudgetBytes int64 = 1 << 30

// bufferBudget returns the request bytes the ext_proc server may buffer over
// all streams, and where that number comes from. memoryLimit is the Go
// runtime's (debug.SetMemoryLimit(-1): GOMEMLIMIT, math.MaxInt64 when
// unset). Half of it, because the bytes counted are only the bodies as
// received: append slack, parsed prompts and everything else the picker
// holds come on top. Never below maxRequestBytes, or the largest request
// accepted could never be buffered.
func bufferBudget(cfg v1alpha1.PickerConfig, memoryLimit int64) (int64, string) {
	if cfg.MaxBufferedRequestBytes > 0 {
		return cfg.MaxBufferedRequestBytes, "maxBufferedRequestBytes"
	}
	budget, source := defaultBufferBudgetBytes, "default (no GOMEMLIMIT)"
	if memoryLimit > 0 && memoryLimit != math.MaxInt64 {
		budget, source = memoryLimit/2, "half of GOMEMLIMIT"
	}
	if budget < cfg.MaxRequestBytes {
		return cfg.MaxRequestBytes, source + ", raised to maxRequestBytes"
	}
	return budget, source
}

// serve runs every part of the picker until ctx ends or one part fails.
func serve(ctx context.Context, opts options, cfg v1alpha1.PickerConfig, log logr.Logger) error {
	kube, err := controllers.RESTConfig(opts.kubeconfig)
	if err != nil {
		return err
	}
	// The picker's own metrics; the Go and process collectors are already on
	// controller-runtime's registry, served beside this one.
	reg := prometheus.NewRegistry()

	pick := picker.New(cfg, picker.Options{
		Registerer:         reg,
		MaxRequestLifetime: opts.maxRequestLifetime,
		Log:                log.WithName("picker"),
	})

	mgr, err := ctrl.NewManager(kube, ctrl.Options{
		Scheme: controllers.Scheme(),
		Cache:  controllers.CacheOptions(opts.poolNamespace),
		// Metrics are served below, with the picker's, on one port.
		Metrics:                 metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress:  "0",
		LeaderElection:          opts.leaderElection,
		LeaderElectionID:        "tally-epp-" + opts.poolName,
		LeaderElectionNamespace: opts.poolNamespace,
		// Stop leading at once on shutdown so a standby takes over quickly.
		LeaderElectionReleaseOnCancel: true,
	})
	if err != nil {
		return fmt.Errorf("creating the controller manager: %w", err)
	}
	pool := types.NamespacedName{Namespace: opts.poolNamespace, Name: opts.poolName}
	if err := controllers.Setup(mgr, pool, pick); err != nil {
		return fmt.Errorf("setting up the controllers: %w", err)
	}

	budget, budgetSource := bufferBudget(cfg, debug.SetMemoryLimit(-1))
	log.Info("request buffering", "maxBufferedRequestBytes", budget, "from", budgetSource, "maxRequestBytes", cfg.MaxRequestBytes)

	grpcOpts := extproc.GRPCServerOptions(cfg.MaxRequestBytes)
	if opts.secureServing {
		tlsConfig, err := extproc.ServerTLS(opts.certPath)
		if err != nil {
			return fmt.Errorf("flag --cert-path %q: %w", opts.certPath, err)
		}
		grpcOpts = append(grpcOpts, grpc.Creds(credentials.NewTLS(tlsConfig)))
	}
	extprocServer := grpc.NewServer(grpcOpts...)
	extproc.NewServer(pick, extproc.Options{
		MaxRequestBytes:         cfg.MaxRequestBytes,
		MaxBufferedRequestBytes: budget,
		Log:                     log.WithName("extproc"),
		Registerer:              reg,
	}).Register(extprocServer)
	health := extproc.NewHealth()
	healthServer := grpc.NewServer()
	health.Register(healthServer)

	extprocLis, err := listen("grpc-port", opts.grpcPort)
	if err != nil {
		return err
	}
	healthLis, err := listen("grpc-health-port", opts.grpcHealthPort)
	if err != nil {
		return err
	}
	metricsLis, err := listen("metrics-port", opts.metricsPort)
	if err != nil {
		return err
	}
	metricsHTTP := &http.Server{
		Handler:           metricsMux(reg, pick),
		ReadHeaderTimeout: 10 * time.Second,
	}

	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return mgr.Start(ctx) })
	g.Go(func() error { pick.Run(ctx); return nil })
	g.Go(func() error { return extprocServer.Serve(extprocLis) })
	g.Go(func() error { return healthServer.Serve(healthLis) })
	g.Go(func() error {
		if err := metricsHTTP.Serve(metricsLis); !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	})
	g.Go(func() error {
		awaitReady(ctx, pick, mgr.Elected(), opts.leaderElection)
		if ctx.Err() == nil {
			health.SetReady(true)
			log.Info("ready", "pool", pool.String(), "grpcPort", opts.grpcPort)
		}
		return nil
	})
	g.Go(func() error {
		<-ctx.Done()
		health.SetReady(false)
		log.Info("shutting down")
		stopGRPC(extprocServer)
		healthServer.Stop()
		shutdownCtx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		return metricsHTTP.Shutdown(shutdownCtx)
	})
	return g.Wait()
}

func listen(flagName string, port int) (net.Listener, error) {
	lis, err := net.Listen("tcp", ":"+strconv.Itoa(port))
	if err != nil {
		return nil, fmt.Errorf("flag --%s: %w", flagName, err)
	}
	return lis, nil
}

// awaitReady returns once the endpoint set is synced and, with leader
// election, this replica leads (or ctx ends).
func awaitReady(ctx context.Context, pick *picker.Picker, elected <-chan struct{}, leaderElection bool) {
	if leaderElection {
		select {
		case <-elected:
		case <-ctx.Done():
			return
		}
	}
	t := time.NewTicker(readinessPollInterval)
	defer t.Stop()
	for !pick.Synced() {
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// stopGRPC lets in-flight streams finish for a grace period, then cuts them
// (each stream's reservation is released when its context ends).
func stopGRPC(s *grpc.Server) {
	done := make(chan struct{})
	go func() { s.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(shutdownGrace):
		s.Stop()
	}
}

func metricsMux(reg *prometheus.Registry, pick *picker.Picker) *http.ServeMux {
	mux := http.NewServeMux()
	gatherers := prometheus.Gatherers{reg, ctrlmetrics.Registry}
	mux.Handle("GET /metrics", promhttp.HandlerFor(gatherers, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /debug/ledger", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(ledgerJSON(pick.Snapshot()))
	})
	return mux
}

// ledgerRow is one endpoint in /debug/ledger.
type ledgerRow struct {
	Pod                    string  `json:"pod"`
	UID                    string  `json:"uid,omitempty"`
	Endpoint               string  `json:"endpoint"`
	InFlight               int     `json:"inFlight"`
	PrefillTokens          int     `json:"prefillTokens"`
	Decoding               int     `json:"decoding"`
	PrefillTokensPerSecond float64 `json:"prefillTokensPerSecond"`
}

// ledger is /debug/ledger: one snapshot of the picker's ledger, its totals
// and rows read under one hold of its lock.
type ledger struct {
	InFlight      int         `json:"inFlight"`
	PrefillTokens int         `json:"prefillTokens"`
	Endpoints     []ledgerRow `json:"endpoints"`
	// Retained are endpoints that left the set and keep their row.
	Retained []ledgerRow `json:"retained"`
}

func ledgerJSON(l picker.Ledger) ledger {
	rows := func(stats []picker.EndpointStats) []ledgerRow {
		out := make([]ledgerRow, 0, len(stats))
		for _, s := range stats {
			out = append(out, ledgerRow{
				Pod: s.Endpoint.Pod, UID: s.Endpoint.UID, Endpoint: s.Endpoint.Address.String(),
				InFlight: s.InFlight, PrefillTokens: s.PrefillTokens, Decoding: s.Decoding,
				PrefillTokensPerSecond: s.PrefillTokensPerSecond,
			})
		}
		return out
	}
	return ledger{InFlight: l.InFlight, PrefillTokens: l.PrefillTokens, Endpoints: rows(l.Endpoints), Retained: rows(l.Retained)}
}
