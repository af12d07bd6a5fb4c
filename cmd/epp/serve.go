package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"math"
	"net"
	"net/http"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/certwatcher"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/controllers"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
	"github.com/tallyepp/tally/picker/logging"
	"github.com/tallyepp/tally/picker/objective"
	"github.com/tallyepp/tally/picker/replica"
	"github.com/tallyepp/tally/picker/rewrite"
	"github.com/tallyepp/tally/picker/scrape"
)

const readinessPollInterval = 100 * time.Millisecond

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

// serve runs every part of the picker until ctx ends (SIGTERM), then drains,
// or until one part fails, then stops at once.
//
// Two lifetimes: the controller manager (watches, leader election) stops as
// soon as ctx ends, so that the lease is released and a standby can lead at
// once; everything that serves streams (ext_proc, health, metrics, the
// picker's ledger) lives until the drain is over.
func serve(ctx context.Context, opts options, cfg v1alpha1.PickerConfig, b build, log logr.Logger) error {
	kube, err := controllers.RESTConfig(opts.kubeconfig)
	if err != nil {
		return err
	}
	// The picker's own metrics. controller-runtime's metrics server serves
	// its global registry (with the Go and process collectors); the
	// picker's registry is added to it below, not registered globally.
	reg := prometheus.NewRegistry()

	pick := picker.New(cfg, picker.Options{
		Registerer:             reg,
		MaxRequestLifetime:     opts.maxRequestLifetime,
		Log:                    log.WithName("picker"),
		PoolName:               opts.poolName,
		ScrapeFailureThreshold: opts.scrapeFailureThreshold,
	})

	mgr, err := ctrl.NewManager(kube, ctrl.Options{
		Scheme: controllers.Scheme(),
		Cache:  controllers.CacheOptions(opts.poolNamespace),
		// The metrics server runs below, outliving the manager while
		// streams drain.
		Metrics:                 metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress:  "0",
		LeaderElection:          opts.leaderElection,
		LeaderElectionID:        "tally-epp-" + opts.poolName,
		LeaderElectionNamespace: opts.poolNamespace,
		LeaseDuration:           &opts.leaseDuration,
		RenewDeadline:           &opts.renewDeadline,
		RetryPeriod:             &opts.retryPeriod,
		// Stop leading at once on shutdown so a standby takes over quickly.
		LeaderElectionReleaseOnCancel: true,
	})
	if err != nil {
		return fmt.Errorf("creating the controller manager: %w", err)
	}
	pool := types.NamespacedName{Namespace: opts.poolNamespace, Name: opts.poolName}
	// What the controllers last saw of the pool: readiness waits for it to
	// exist, and a refused request's answer says why the pool offers no
	// endpoint.
	poolStatus := &controllers.PoolStatus{}
	if err := controllers.Setup(mgr, pool, pick, controllers.Options{
		Status: poolStatus,
		Events: mgr.GetEventRecorder("tally-epp"),
	}); err != nil {
		return fmt.Errorf("setting up the controllers: %w", err)
	}
	// The pool's InferenceObjectives: the priority a request's objective
	// header selects (flow control's bands).
	objectives := &objective.Priorities{}
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tally_inference_objectives",
		Help: "InferenceObjectives of the pool the picker knows: their priorities are flow control's bands.",
	}, func() float64 { return float64(objectives.Len()) }))
	if err := controllers.SetupObjectives(mgr, pool, objectives); err != nil {
		return fmt.Errorf("setting up the InferenceObjective controller: %w", err)
	}
	// The pool's InferenceModelRewrites: a matching request's model is
	// rewritten in the body sent on, and the picker scores the target.
	rewrites := &rewrite.Table{}
	if err := controllers.SetupRewrites(mgr, pool, rewrites); err != nil {
		return fmt.Errorf("setting up the InferenceModelRewrite controller: %w", err)
	}
	if cfg.FlowControl.Enabled {
		fc := cfg.FlowControl
		log.Info("flow control on: requests wait in the picker while every endpoint is saturated",
			"holdPrefillMilliseconds", fc.HoldPrefillMilliseconds, "maxDecodingRequests", fc.MaxDecodingRequests,
			"requestTTLSeconds", fc.RequestTTLSeconds, "ordering", fc.Ordering, "fairness", fc.Fairness)
	}

	budget, budgetSource := bufferBudget(cfg, debug.SetMemoryLimit(-1))
	log.Info("request buffering", "maxBufferedRequestBytes", budget, "from", budgetSource, "maxRequestBytes", cfg.MaxRequestBytes)

	// With peers, the ext_proc server places through the replica layer:
	// at the leader, or on this replica's own ledger when it leads.
	var front extproc.Picker = pick
	var peers *replica.Replica
	var peerServer *grpc.Server
	var peerLis net.Listener
	if opts.peering() {
		creds := replica.Credentials{Dir: opts.peerCertPath}
		if err := creds.Check(); err != nil {
			return fmt.Errorf("flag --peer-cert-path %q: %w", opts.peerCertPath, err)
		}
		peers = replica.New(pick, replica.Options{Self: opts.podName, PickTimeout: opts.peerPickTimeout,
			OrphanGrace: opts.leaseDuration, Dial: creds.Dial, Registerer: reg, Log: log.WithName("peers")})
		front = peers
		peerServer = grpc.NewServer(replica.ServerOptions(creds.Server())...)
		peers.Register(peerServer)
		if peerLis, err = net.Listen("tcp", net.JoinHostPort(opts.podIP, strconv.Itoa(opts.peerPort))); err != nil {
			return fmt.Errorf("flag --peer-port: %w", err)
		}
		log.Info("peers: every replica serves; the one holding the lease places every pick", "peerSelector", opts.peerSelector,
			"peerAddress", peerLis.Addr().String(), "self", opts.podName)
	}

	grpcOpts := extproc.GRPCServerOptions(cfg.MaxRequestBytes)
	var certs *certwatcher.CertWatcher
	if opts.secureServing {
		tlsConfig, err := extproc.ServerTLS(opts.certPath)
		if err != nil {
			return fmt.Errorf("flag --cert-path %q: %w", opts.certPath, err)
		}
		if opts.enableCertReload && opts.certPath != "" {
			certs, err = certwatcher.New(filepath.Join(opts.certPath, "tls.crt"), filepath.Join(opts.certPath, "tls.key"))
			if err != nil {
				return fmt.Errorf("flag --enable-cert-reload: watching --cert-path %q: %w", opts.certPath, err)
			}
			tlsConfig.Certificates = nil
			tlsConfig.GetCertificate = certs.GetCertificate
		}
		grpcOpts = append(grpcOpts, grpc.Creds(credentials.NewTLS(tlsConfig)))
	}
	extprocServer := grpc.NewServer(grpcOpts...)
	extproc.NewServer(front, extproc.Options{
		MaxRequestBytes:         cfg.MaxRequestBytes,
		MaxBufferedRequestBytes: budget,
		Log:                     log.WithName("extproc"),
		Registerer:              reg,
		MaxModelNameLabels:      opts.maxModelNameLabels,
		Commit:                  b.Commit,
		BuildRef:                b.Version,
		ConformanceTestHooks:    opts.conformanceTestHooks,
		Objectives:              objectives,
		Rewrites:                rewrites,
		Pool:                    poolStatus,
	}).Register(extprocServer)
	health := extproc.NewHealth()
	healthServer := grpc.NewServer()
	health.Register(healthServer)
	if opts.healthChecking {
		health.Register(extprocServer)
	}

	metrics, detach, err := newMetricsServer(opts, kube, reg, pick, peers)
	if err != nil {
		return err
	}
	defer detach()

	extprocLis, err := listen("grpc-port", opts.grpcPort)
	if err != nil {
		return err
	}
	healthLis, err := listen("grpc-health-port", opts.grpcHealthPort)
	if err != nil {
		return err
	}

	g, failed := errgroup.WithContext(context.Background())
	serving, stopServing := context.WithCancel(failed)
	defer stopServing()
	managing, stopManaging := context.WithCancel(serving)
	defer stopManaging()
	context.AfterFunc(ctx, stopManaging)

	g.Go(func() error {
		if err := mgr.Start(managing); err != nil {
			return fmt.Errorf("running the controllers: %w", err)
		}
		return nil
	})
	g.Go(func() error { pick.Run(serving); return nil })
	if opts.scrapeInterval > 0 {
		// Every replica scrapes, the standbys too: a new leader starts
		// with the engines' load and cache sizes already known.
		scraper := scrape.New(pick, scrapeOptions(opts, reg, log.WithName("scrape")))
		g.Go(func() error { scraper.Run(serving); return nil })
	}
	g.Go(func() error { return extprocServer.Serve(extprocLis) })
	g.Go(func() error { return healthServer.Serve(healthLis) })
	if metrics != nil {
		g.Go(func() error {
			if err := metrics.Start(serving); err != nil {
				return fmt.Errorf("serving metrics on --metrics-bind-address %s: %w", opts.metricsBindAddress, err)
			}
			return nil
		})
	}
	if certs != nil {
		g.Go(func() error { return certs.Start(serving) })
	}
	elected := mgr.Elected()
	if peers != nil {
		g.Go(func() error { return peerServer.Serve(peerLis) })
		g.Go(func() error { peers.Run(serving); return nil })
		g.Go(func() error {
			followPeers(managing, mgr.GetClient(), opts, peers.SetPeers, log.WithName("peers"))
			return nil
		})
		g.Go(func() error {
			select {
			case <-elected:
			case <-managing.Done():
				return nil
			}
			// Lead once the endpoint set is read: a leader without it
			// would refuse every pick its followers forward (a replica
			// that restarts may take the lease at once). Until then the
			// followers place on their own copies.
			t := time.NewTicker(readinessPollInterval)
			defer t.Stop()
			for !pick.Synced() || !poolStatus.Load().Found {
				select {
				case <-t.C:
				case <-managing.Done():
					return nil
				}
			}
			peers.Lead()
			return nil
		})
	}
	g.Go(func() error {
		followReadiness(managing, readinessPollInterval, func() (bool, string) {
			// With peers every replica serves; without, only the leader.
			return readiness(pick.Synced(), poolStatus.Load(), opts.leaderElection && peers == nil, isClosed(elected))
		}, health.SetReady, log.WithValues("pool", pool.String(), "grpcPort", opts.grpcPort))
		return nil
	})
	g.Go(func() error {
		select {
		case <-ctx.Done():
		case <-failed.Done():
			// A part failed: stop everything now; g.Wait reports why.
			extprocServer.Stop()
			healthServer.Stop()
			if peerServer != nil {
				peerServer.Stop()
			}
			return nil
		}
		health.Drain()
		if peers != nil {
			// The manager has released the lease: the next leader places.
			peers.StepDown()
		}
		log.Info("shutting down: not ready; still taking new streams for --shutdown-delay, then letting open ones finish for --shutdown-grace",
			"shutdownDelay", opts.shutdownDelay, "shutdownGrace", opts.shutdownGrace)
		select {
		case <-time.After(opts.shutdownDelay):
		case <-failed.Done():
		}
		// No new streams come now: requests still waiting for capacity
		// are answered 503, for the gateway to retry elsewhere.
		if n := pick.CloseQueue(); n > 0 {
			log.Info("shutting down: answered the requests waiting in the flow control queue 503", "requests", n)
		}
		if !stopGRPC(extprocServer, opts.shutdownGrace, failed) {
			log.Info("open streams were cut at the end of --shutdown-grace", "shutdownGrace", opts.shutdownGrace)
		}
		log.Info("drained")
		stopServing()
		healthServer.Stop()
		if peerServer != nil {
			peerServer.Stop()
		}
		return nil
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

// readiness says whether the picker is ready, and if not why: the endpoint
// set is synced, the pool exists (a picker for a pool that does not exist
// would answer every request 503) and, with leader election, this replica
// leads.
func readiness(synced bool, pool controllers.PoolState, leaderElection, leads bool) (bool, string) {
	switch {
	case leaderElection && !leads:
		return false, "another replica leads"
	case !synced || !pool.Seen:
		return false, "the pool has not been read yet"
	case !pool.Found:
		_, why := pool.Problem()
		return false, why
	}
	return true, ""
}

// followReadiness sets the readiness services from ready every interval
// until ctx ends, and logs each change: ready goes back to false when the
// pool is deleted, and to true when it comes back.
func followReadiness(ctx context.Context, interval time.Duration, ready func() (bool, string), set func(bool), log logr.Logger) {
	t := time.NewTicker(interval)
	defer t.Stop()
	was, first := false, true
	for {
		now, why := ready()
		if now != was || first {
			switch {
			case now:
				log.Info("ready")
			case !first:
				logging.Warn(log, "not ready: "+why)
			}
			set(now)
			was, first = now, false
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// isClosed reports whether ch is closed.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// stopGRPC refuses new streams and lets open ones finish for up to grace
// (or until failed ends), then cuts them; each stream's reservation is
// released when its context ends. It reports whether every stream finished.
func stopGRPC(s *grpc.Server, grace time.Duration, failed context.Context) bool {
	done := make(chan struct{})
	go func() { s.GracefulStop(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(grace):
	case <-failed.Done():
	}
	s.Stop()
	<-done
	return false
}

// scrapeOptions are the engine scraper's settings from the flags.
func scrapeOptions(opts options, reg prometheus.Registerer, log logr.Logger) scrape.Options {
	var tlsConfig *tls.Config
	if opts.scrapeScheme == "https" {
		tlsConfig = &tls.Config{InsecureSkipVerify: opts.scrapeInsecure} //nolint:gosec // as the upstream flag asks
	}
	return scrape.Options{
		Interval: opts.scrapeInterval,
		Timeout:  opts.scrapeTimeout,
		Path:     opts.scrapePath,
		Port:     uint16(opts.scrapePort),
		Scheme:   opts.scrapeScheme,
		Client:   &http.Client{Transport: scrape.NewTransport(tlsConfig)},
		Log:      log,
		VLLM:     &opts.metricNames,
		// The scraper's metrics are served with the picker's.
		Registerer: reg,
	}
}
