package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"
)

// options are the picker's command-line settings. Names, defaults and
// meanings follow the upstream endpoint picker so that gateway charts that
// pass its flags work unchanged.
type options struct {
	poolName        string
	poolNamespace   string
	poolGroup       string
	grpcPort        int
	grpcHealthPort  int
	metricsPort     int
	secureServing   bool
	certPath        string
	leaderElection  bool
	configFile      string
	configText      string
	kubeconfig      string
	verbosity       int
	maxRequestBytes int64
	// maxBufferedRequestBytes is the flag's value; the budget in force is
	// bufferBudget's.
	maxBufferedRequestBytes int64
	maxRequestLifetime      time.Duration
}

const inferencePoolGroup = "inference.networking.k8s.io"

// upstreamOnlyFlags are flags of the upstream picker that gateway charts pass
// but that have no meaning for Tally (it has no metrics scraper and its own
// configuration format). They are accepted and ignored with a log line, so a
// chart written for the upstream picker keeps working.
var upstreamOnlyFlags = []string{
	"refresh-metrics-interval",
	"refresh-prometheus-metrics-interval",
	"metrics-staleness-threshold",
	"total-queued-requests-metric",
	"total-running-requests-metric",
	"kv-cache-usage-percentage-metric",
	"lora-info-metric",
	"cache-info-metric",
	"zap-encoder",
	"zap-log-level",
	"zap-stacktrace-level",
	"zap-time-encoding",
}

var upstreamOnlyBoolFlags = []string{
	"metrics-endpoint-auth",
	"health-checking",
	"enable-cert-reload",
	"zap-devel",
	"enable-pprof",
}

// parseFlags parses args (without the program name). getenv supplies the
// environment so tests need not touch the process's. The returned ignored
// list names upstream-only flags that were set.
func parseFlags(args []string, getenv func(string) string, stderr io.Writer) (options, []string, error) {
	o := options{}
	fs := flag.NewFlagSet("epp", flag.ContinueOnError)
	fs.SetOutput(stderr)
	defaultNamespace := getenv("NAMESPACE")
	if defaultNamespace == "" {
		defaultNamespace = "default"
	}
	fs.StringVar(&o.poolName, "pool-name", "", "name of the InferencePool this picker serves (required)")
	fs.StringVar(&o.poolNamespace, "pool-namespace", defaultNamespace, "namespace of the InferencePool (default: $NAMESPACE, else \"default\")")
	fs.StringVar(&o.poolGroup, "pool-group", inferencePoolGroup, "API group of the pool; only "+inferencePoolGroup+" is supported")
	fs.IntVar(&o.grpcPort, "grpc-port", 9002, "port of the ext_proc gRPC service")
	fs.IntVar(&o.grpcHealthPort, "grpc-health-port", 9003, "port of the gRPC health service")
	fs.IntVar(&o.metricsPort, "metrics-port", 9090, "port of the Prometheus metrics and debug endpoints")
	fs.BoolVar(&o.secureServing, "secure-serving", true, "serve ext_proc over TLS")
	fs.StringVar(&o.certPath, "cert-path", "", "directory holding tls.crt and tls.key; a self-signed certificate is generated when empty")
	fs.BoolVar(&o.leaderElection, "ha-enable-leader-election", false, "elect one leader among replicas; only the leader reports ready")
	fs.StringVar(&o.configFile, "config-file", "", "path of a PickerConfig file")
	fs.StringVar(&o.configText, "config-text", "", "a PickerConfig given inline (instead of --config-file)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, else in-cluster)")
	fs.IntVar(&o.verbosity, "v", 0, "log verbosity (0 is info, higher is more)")
	fs.Int64Var(&o.maxRequestBytes, "max-request-bytes", 0, "largest request body accepted, in bytes; larger bodies get 413 (default: the config's maxRequestBytes, 32 MiB)")
	fs.Int64Var(&o.maxBufferedRequestBytes, "max-buffered-request-bytes", 0, "request body bytes buffered over all streams at once; a request that would pass it gets 503 "+
		"(default: the config's maxBufferedRequestBytes, else half of GOMEMLIMIT, else 1 GiB; never less than the largest request body)")
	fs.DurationVar(&o.maxRequestLifetime, "max-request-lifetime", 30*time.Minute, "a reservation older than this is released by the sweeper (a backstop for lost streams)")
	ignoredValues := make(map[string]*string, len(upstreamOnlyFlags))
	for _, name := range upstreamOnlyFlags {
		ignoredValues[name] = fs.String(name, "", "accepted for compatibility with the upstream picker; ignored")
	}
	for _, name := range upstreamOnlyBoolFlags {
		fs.Bool(name, false, "accepted for compatibility with the upstream picker; ignored")
	}

	if err := fs.Parse(args); err != nil {
		return options{}, nil, err
	}
	if fs.NArg() > 0 {
		return options{}, nil, fmt.Errorf("unexpected argument %q: epp takes flags only", fs.Arg(0))
	}
	var ignored []string
	fs.Visit(func(f *flag.Flag) {
		if _, ok := ignoredValues[f.Name]; ok {
			ignored = append(ignored, f.Name)
		}
		for _, name := range upstreamOnlyBoolFlags {
			if f.Name == name {
				ignored = append(ignored, f.Name)
			}
		}
	})
	if o.kubeconfig == "" {
		o.kubeconfig = getenv("KUBECONFIG")
	}
	return o, ignored, o.validate()
}

func (o options) validate() error {
	var errs []error
	if o.poolName == "" {
		errs = append(errs, errors.New("flag --pool-name is required: the name of the InferencePool to serve"))
	}
	if o.poolGroup != inferencePoolGroup {
		errs = append(errs, fmt.Errorf("flag --pool-group: %q is not supported: only %q", o.poolGroup, inferencePoolGroup))
	}
	for _, p := range []struct {
		name string
		port int
	}{{"grpc-port", o.grpcPort}, {"grpc-health-port", o.grpcHealthPort}, {"metrics-port", o.metricsPort}} {
		if p.port < 1 || p.port > 65535 {
			errs = append(errs, fmt.Errorf("flag --%s: %d is not a port: must be from 1 to 65535", p.name, p.port))
		}
	}
	if o.grpcPort == o.grpcHealthPort || o.grpcPort == o.metricsPort || o.grpcHealthPort == o.metricsPort {
		errs = append(errs, fmt.Errorf("flags --grpc-port (%d), --grpc-health-port (%d) and --metrics-port (%d) must differ", o.grpcPort, o.grpcHealthPort, o.metricsPort))
	}
	if o.configFile != "" && o.configText != "" {
		errs = append(errs, errors.New("flags --config-file and --config-text are exclusive: give one"))
	}
	if o.maxRequestBytes < 0 {
		errs = append(errs, fmt.Errorf("flag --max-request-bytes: %d is invalid: must be 0 (use the config) or more", o.maxRequestBytes))
	}
	if o.maxBufferedRequestBytes < 0 {
		errs = append(errs, fmt.Errorf("flag --max-buffered-request-bytes: %d is invalid: must be 0 (use the config) or more", o.maxBufferedRequestBytes))
	}
	if o.maxRequestLifetime < time.Second {
		errs = append(errs, fmt.Errorf("flag --max-request-lifetime: %s is invalid: must be at least 1s", o.maxRequestLifetime))
	}
	if o.verbosity < 0 {
		errs = append(errs, fmt.Errorf("flag -v: %d is invalid: must be 0 or more", o.verbosity))
	}
	return errors.Join(errs...)
}

// readConfig returns the picker configuration text named by the flags, or
// nil when neither flag is given (the defaults apply).
func (o options) readConfig() ([]byte, error) {
	switch {
	case o.configText != "":
		return []byte(o.configText), nil
	case o.configFile != "":
		data, err := os.ReadFile(o.configFile)
		if err != nil {
			return nil, fmt.Errorf("flag --config-file: %w", err)
		}
		return data, nil
	}
	return nil, nil
}
