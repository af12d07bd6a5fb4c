package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
	"github.com/tallyepp/tally/picker/replica"
	"github.com/tallyepp/tally/picker/scrape"
)

// options are the picker's command-line settings. Names, defaults and
// meanings follow the upstream endpoint picker so that gateway charts that
// pass its flags work unchanged.
type options struct {
	poolName       string
	poolNamespace  string
	poolGroup      string
	grpcPort       int
	grpcHealthPort int
	metricsPort    int
	secureServing  bool
	certPath       string
	leaderElection bool
	// The lease: a crashed leader is replaced within about leaseDuration
	// plus two retry periods; renewDeadline is how long a leader keeps
	// trying to renew before it steps down.
	leaseDuration, renewDeadline, retryPeriod time.Duration
	configFile                                string
	configText                                string
	kubeconfig                                string
	verbosity                                 int
	maxRequestBytes                           int64
	// maxBufferedRequestBytes is the flag's value; the budget in force is
	// bufferBudget's.
	maxBufferedRequestBytes int64
	maxRequestLifetime      time.Duration
	// maxModelNameLabels caps the model_name values of the
	// inference_objective_* metrics.
	maxModelNameLabels int

	// zap holds the --zap-* flags (controller-runtime's); zapLevelSet says
	// --zap-log-level was given and wins over -v.
	zap         zap.Options
	zapLevelSet bool
	// healthChecking also serves gRPC health on the ext_proc port.
	healthChecking bool

	// Metrics and debug endpoints.
	metricsBindAddress   string
	metricsEndpointAuth  bool
	metricsSecureServing bool
	metricsCertPath      string
	enablePprof          bool
	// enableCertReload watches --cert-path and serves a rotated certificate
	// without a restart.
	enableCertReload bool

	// Drain on SIGTERM: readiness off at once, new streams still taken for
	// shutdownDelay, then open streams get up to shutdownGrace to finish.
	shutdownDelay time.Duration
	shutdownGrace time.Duration

	// The upstream picker's standalone mode (no InferencePool); refused.
	endpointSelector    string
	endpointTargetPorts string

	// conformanceTestHooks turns on extproc.Options.ConformanceTestHooks.
	conformanceTestHooks bool
	// lenientConfig runs the picker with an EndpointPickerConfig whose
	// unsupported settings (upstreamconfig.Note.Unsupported) are left out,
	// each logged as a warning, instead of refusing to start.
	lenientConfig bool

	// Engine metrics scrapes (picker/scrape), named as the upstream
	// picker's flags are.
	scrapeInterval         time.Duration
	scrapeTimeout          time.Duration
	scrapeFailureThreshold int
	scrapeScheme           string
	scrapePath             string
	// The upstream picker's metric-name flags: the names vLLM engines
	// (and engines of unknown types) are read by.
	metricNames    scrape.MetricNames
	scrapePort     int
	scrapeInsecure bool

	// Peers (picker/replica): with leader election and a peer selector,
	// every replica serves and the leader places every pick. podName and
	// podIP name this replica among them (POD_NAME, POD_IP).
	peerSelector    string
	peerPort        int
	peerCertPath    string
	peerPickTimeout time.Duration
	podName, podIP  string
}

// peering says the replicas share one ledger (picker/replica).
func (o options) peering() bool { return o.leaderElection && o.peerSelector != "" }

const inferencePoolGroup = "inference.networking.k8s.io"

// lenientConfigFlag is Tally's own: the upstream picker has no such flag
// (it refuses a plugin type it does not know, and reads its metric specs).
const lenientConfigFlag = "--lenient-config"

// errPrintVersion is what parseFlags returns for --version, as it returns
// flag.ErrHelp for -h: the caller prints the build and exits 0.
var errPrintVersion = errors.New("flag --version given: print the build and exit")

// parseFlags parses args (without the program name). getenv supplies the
// environment so tests need not touch the process's. The returned ignored
// list names the upstream picker's flags that were set but that Tally does
// not apply.
func parseFlags(args []string, getenv func(string) string, stderr io.Writer) (options, []ignoredSetting, error) {
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
	fs.DurationVar(&o.leaseDuration, "ha-lease-duration", 15*time.Second, "with leader election: how long a standby waits after the leader's last renewal it saw before taking the lease")
	fs.DurationVar(&o.renewDeadline, "ha-renew-deadline", 10*time.Second, "with leader election: how long the leader keeps trying to renew its lease before it stops leading (less than --ha-lease-duration)")
	fs.DurationVar(&o.retryPeriod, "ha-retry-period", 2*time.Second, "with leader election: how often the leader renews and a standby tries to take the lease")
	fs.StringVar(&o.configFile, "config-file", "", "path of a PickerConfig file")
	fs.StringVar(&o.configText, "config-text", "", "a PickerConfig given inline (instead of --config-file)")
	fs.BoolVar(&o.lenientConfig, lenientConfigFlag[2:], false, "start with an upstream EndpointPickerConfig that has settings Tally cannot honour (plugin types it does not know, metric specs in the file), leaving them out with a warning each, instead of refusing to start")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, else in-cluster)")
	fs.IntVar(&o.verbosity, "v", 0, "log verbosity (0 is info, higher is more)")
	fs.Int64Var(&o.maxRequestBytes, "max-request-bytes", 0, "largest request body accepted, in bytes; larger bodies get 413 (default: the config's maxRequestBytes, "+fmt.Sprint(v1alpha1.DefaultMaxRequestBytes>>20)+" MiB)")
	fs.Int64Var(&o.maxBufferedRequestBytes, "max-buffered-request-bytes", 0, "request body bytes buffered over all streams at once; a request that would pass it gets 503 "+
		"(default: the config's maxBufferedRequestBytes, else half of GOMEMLIMIT, else 1 GiB; never less than the largest request body)")
	fs.DurationVar(&o.maxRequestLifetime, "max-request-lifetime", picker.DefaultMaxRequestLifetime, "a reservation older than this is released by the sweeper (a backstop for lost streams)")
	fs.DurationVar(&o.scrapeInterval, "refresh-metrics-interval", scrape.DefaultInterval, "how often each endpoint's model-server metrics are scraped (0 turns scraping off)")
	fs.DurationVar(&o.scrapeTimeout, "model-server-metrics-timeout", scrape.DefaultTimeout, "timeout of one model-server metrics scrape")
	fs.IntVar(&o.scrapeFailureThreshold, "model-server-metrics-failure-threshold", picker.DefaultScrapeFailureThreshold, "failed scrapes in a row after which an endpoint is not picked until one succeeds")
	fs.StringVar(&o.scrapeScheme, "model-server-metrics-scheme", scrape.DefaultScheme, "scheme of the model servers' metrics: http or https")
	fs.StringVar(&o.scrapePath, "model-server-metrics-path", scrape.DefaultPath, "path of the model servers' metrics")
	metricFlags := []struct {
		name, def string
		spec      string
		into      *scrape.MetricSpec
	}{
		{name: "total-queued-requests-metric", def: "vllm:num_requests_waiting", into: &o.metricNames.Waiting},
		{name: "total-running-requests-metric", def: "vllm:num_requests_running", into: &o.metricNames.Running},
		{name: "kv-cache-usage-percentage-metric", def: "vllm:kv_cache_usage_perc", into: &o.metricNames.KVCacheUsage},
		{name: "lora-info-metric", def: "vllm:lora_requests_info", into: &o.metricNames.LoRAInfo},
		{name: "cache-info-metric", def: "vllm:cache_config_info", into: &o.metricNames.CacheInfo},
	}
	for i := range metricFlags {
		m := &metricFlags[i]
		fs.StringVar(&m.spec, m.name, m.def, "the metric vLLM engines (and engines of a type the picker does not know) are read by, as the upstream picker's flag: name or name{label=value,...}, whose series with those labels are read (empty: not read)")
	}
	fs.IntVar(&o.scrapePort, "model-server-metrics-port", 0, "port of the model servers' metrics (0: the endpoint's target port)")
	fs.BoolVar(&o.scrapeInsecure, "model-server-metrics-https-insecure-skip-verify", true, "skip verifying the model servers' certificates over https")
	fs.IntVar(&o.maxModelNameLabels, "max-model-name-labels", extproc.DefaultMaxModelNameLabels, "distinct model_name label values of the inference_objective_* metrics; later models share the value \"other\"")
	fs.BoolVar(&o.healthChecking, "health-checking", false, "also serve gRPC health (the same services) on the ext_proc port")
	fs.StringVar(&o.metricsBindAddress, "metrics-bind-address", "", "address of the metrics and debug endpoints, e.g. 127.0.0.1:9090; \"0\" turns them off (default: \":<--metrics-port>\")")
	fs.BoolVar(&o.metricsEndpointAuth, "metrics-endpoint-auth", true, "require a bearer token allowed, by a TokenReview and a SubjectAccessReview, to get the path (/metrics, /debug/ledger, /debug/pprof/...)")
	fs.BoolVar(&o.metricsSecureServing, "metrics-secure-serving", false, "serve the metrics and debug endpoints over HTTPS (self-signed unless --metrics-cert-path)")
	fs.StringVar(&o.metricsCertPath, "metrics-cert-path", "", "directory holding tls.crt and tls.key for --metrics-secure-serving; reloaded when they change")
	fs.BoolVar(&o.enablePprof, "enable-pprof", true, "serve pprof at /debug/pprof/ on the metrics port (behind --metrics-endpoint-auth)")
	fs.BoolVar(&o.enableCertReload, "enable-cert-reload", false, "reload the ext_proc certificate in --cert-path when it changes")
	fs.DurationVar(&o.shutdownDelay, "shutdown-delay", 5*time.Second, "on SIGTERM, report not ready at once but keep taking new streams this long, while gateways stop sending")
	fs.DurationVar(&o.shutdownGrace, "shutdown-grace", 10*time.Minute, "then let open streams finish for up to this long before cutting them")
	fs.StringVar(&o.endpointSelector, "endpoint-selector", "", "the upstream picker's standalone mode; not supported: Tally serves an InferencePool (--pool-name)")
	fs.StringVar(&o.endpointTargetPorts, "endpoint-target-ports", "", "the upstream picker's standalone mode; not supported: Tally serves an InferencePool (--pool-name)")
	fs.BoolVar(&o.conformanceTestHooks, "conformance-test-hooks", false, "for running the Gateway API Inference Extension conformance suite only: "+
		"honour the test-epp-endpoint-selection request header (it lets a client choose its endpoint) and answer x-conformance-test-served-endpoint")
	fs.StringVar(&o.peerSelector, "peer-selector", "", "with --ha-enable-leader-election: label selector of this picker's own pods (in --pool-namespace), e.g. app=tally; every replica then serves, the leader places every pick and the others forward theirs to it. Empty: only the leader serves (warm standbys)")
	fs.IntVar(&o.peerPort, "peer-port", 9004, "with --peer-selector: port of the peer protocol, served on $POD_IP")
	fs.StringVar(&o.peerCertPath, "peer-cert-path", "", "with --peer-selector: directory holding ca.crt, tls.crt and tls.key; peers must present a certificate signed by ca.crt (for the name "+replica.ServerName+"); read again on each new connection")
	fs.DurationVar(&o.peerPickTimeout, "peer-pick-timeout", replica.DefaultPickTimeout, "with --peer-selector: how long a follower waits for the leader's answer to a pick before placing it itself")
	printVersion := fs.Bool("version", false, "print the version, the commit and the Go version the binary was built with, and exit")
	o.zap.BindFlags(fs)
	ignoredSet := addIgnoredUpstreamFlags(fs)

	if err := fs.Parse(joinBoolValues(fs, args)); err != nil {
		return options{}, nil, err
	}
	if *printVersion {
		// Before validation: --version needs no --pool-name.
		return options{}, nil, errPrintVersion
	}
	if fs.NArg() > 0 {
		return options{}, nil, fmt.Errorf("unexpected argument %q: epp takes flags only", fs.Arg(0))
	}
	var peerFlags []*flag.Flag // set without --peer-selector: ignored
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "zap-log-level":
			o.zapLevelSet = true
		case "peer-port", "peer-cert-path", "peer-pick-timeout":
			peerFlags = append(peerFlags, f)
		}
	})
	if o.metricsBindAddress == "" {
		o.metricsBindAddress = ":" + strconv.Itoa(o.metricsPort)
	}
	ignored := ignoredSet()
	if o.enableCertReload && (o.certPath == "" || !o.secureServing) {
		// As upstream: without a certificate from --cert-path there is
		// nothing to reload.
		ignored = append(ignored, ignoredSetting{flag: "--enable-cert-reload", value: "true", reason: "no --cert-path certificate is served to reload"})
	}
	if o.peerSelector == "" {
		for _, f := range peerFlags {
			ignored = append(ignored, ignoredSetting{flag: "--" + f.Name, value: f.Value.String(), reason: "no --peer-selector: the replicas do not peer (only the one holding the lease serves)"})
		}
	}
	if o.kubeconfig == "" {
		o.kubeconfig = getenv("KUBECONFIG")
	}
	o.podName, o.podIP = getenv("POD_NAME"), getenv("POD_IP")
	// The upstream chart passes trtllm-serve's path with its quotes:
	// --model-server-metrics-path="/prometheus/metrics".
	o.scrapePath = strings.Trim(o.scrapePath, `"'`)
	var metricErrs []error
	for _, m := range metricFlags {
		spec, err := scrape.ParseMetricSpec(strings.Trim(m.spec, `"'`))
		if err != nil {
			metricErrs = append(metricErrs, fmt.Errorf("flag --%s: %w", m.name, err))
		}
		*m.into = spec // empty: not read, as upstream
	}
	if err := errors.Join(append(metricErrs, o.validate())...); err != nil {
		return o, ignored, err
	}
	return o, ignored, nil
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
	if o.endpointSelector != "" || o.endpointTargetPorts != "" {
		errs = append(errs, errors.New("flags --endpoint-selector and --endpoint-target-ports (the upstream picker's standalone mode) are not supported: Tally serves an InferencePool, give --pool-name"))
	}
	if o.shutdownDelay < 0 {
		errs = append(errs, fmt.Errorf("flag --shutdown-delay: %s is invalid: must be 0 or more", o.shutdownDelay))
	}
	if o.shutdownGrace < 0 {
		errs = append(errs, fmt.Errorf("flag --shutdown-grace: %s is invalid: must be 0 or more", o.shutdownGrace))
	}
	// client-go's rule: the lease outlasts the renew deadline, which
	// outlasts a jittered retry (1.2 retry periods).
	if o.retryPeriod <= 0 {
		errs = append(errs, fmt.Errorf("flag --ha-retry-period: %s is invalid: must be more than 0", o.retryPeriod))
	} else if o.renewDeadline*10 <= o.retryPeriod*12 {
		errs = append(errs, fmt.Errorf("flag --ha-renew-deadline: %s is invalid: must be more than 1.2 times --ha-retry-period (%s)", o.renewDeadline, o.retryPeriod))
	}
	if o.leaseDuration <= o.renewDeadline {
		errs = append(errs, fmt.Errorf("flag --ha-lease-duration: %s is invalid: must be more than --ha-renew-deadline (%s)", o.leaseDuration, o.renewDeadline))
	}
	if o.metricsCertPath != "" && !o.metricsSecureServing {
		errs = append(errs, errors.New("flag --metrics-cert-path needs --metrics-secure-serving"))
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
	if o.scrapeInterval < 0 {
		errs = append(errs, fmt.Errorf("flag --refresh-metrics-interval: %v is invalid: must be 0 (off) or more", o.scrapeInterval))
	}
	if o.scrapeTimeout <= 0 {
		errs = append(errs, fmt.Errorf("flag --model-server-metrics-timeout: %v is invalid: must be more than 0", o.scrapeTimeout))
	}
	if o.scrapeFailureThreshold < 1 {
		errs = append(errs, fmt.Errorf("flag --model-server-metrics-failure-threshold: %d is invalid: must be 1 or more", o.scrapeFailureThreshold))
	}
	if !strings.HasPrefix(o.scrapePath, "/") {
		errs = append(errs, fmt.Errorf("flag --model-server-metrics-path: %q is invalid: must start with /", o.scrapePath))
	}
	if o.scrapeScheme != "http" && o.scrapeScheme != "https" {
		errs = append(errs, fmt.Errorf("flag --model-server-metrics-scheme: %q is invalid: must be http or https", o.scrapeScheme))
	}
	if o.scrapePort < 0 || o.scrapePort > 65535 {
		errs = append(errs, fmt.Errorf("flag --model-server-metrics-port: %d is invalid: must be from 0 to 65535", o.scrapePort))
	}
	if o.maxModelNameLabels < 1 {
		errs = append(errs, fmt.Errorf("flag --max-model-name-labels: %d is invalid: must be 1 or more", o.maxModelNameLabels))
	}
	if o.verbosity < 0 {
		errs = append(errs, fmt.Errorf("flag -v: %d is invalid: must be 0 or more", o.verbosity))
	}
	return errors.Join(append(errs, o.validatePeers())...)
}

// validatePeers checks the peer flags, when peering is asked for.
func (o options) validatePeers() error {
	if o.peerSelector == "" {
		return nil
	}
	var errs []error
	if !o.leaderElection {
		errs = append(errs, errors.New("flag --peer-selector needs --ha-enable-leader-election: the replica holding the lease places the picks"))
	}
	if _, err := labels.Parse(o.peerSelector); err != nil {
		errs = append(errs, fmt.Errorf("flag --peer-selector: %q: %w", o.peerSelector, err))
	}
	if o.peerPort < 1 || o.peerPort > 65535 {
		errs = append(errs, fmt.Errorf("flag --peer-port: %d is not a port: must be from 1 to 65535", o.peerPort))
	} else if o.peerPort == o.grpcPort || o.peerPort == o.grpcHealthPort || o.peerPort == o.metricsPort {
		errs = append(errs, fmt.Errorf("flag --peer-port: %d is already --grpc-port, --grpc-health-port or --metrics-port", o.peerPort))
	}
	if o.peerCertPath == "" {
		errs = append(errs, errors.New("flag --peer-cert-path is required with --peer-selector: only replicas holding the pool's peer certificate may reach the peer port"))
	}
	if o.peerPickTimeout <= 0 {
		errs = append(errs, fmt.Errorf("flag --peer-pick-timeout: %s is invalid: must be more than 0", o.peerPickTimeout))
	}
	if o.podName == "" {
		errs = append(errs, errors.New("flag --peer-selector needs the environment variable POD_NAME (the pod's name, from the downward API): it names this replica to its peers"))
	}
	if _, err := netip.ParseAddr(o.podIP); err != nil {
		errs = append(errs, fmt.Errorf("flag --peer-selector needs the environment variable POD_IP (status.podIP, from the downward API): %q is not an IP address", o.podIP))
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
