// Command epp is Tally's endpoint picker: an Envoy ext_proc server that
// chooses, for each LLM request, the pod of an InferencePool that serves it.
//
// It watches one InferencePool and its pods (controllers), keeps the live
// in-flight ledger and prefix index (picker), and serves:
//   - ext_proc on --grpc-port (TLS unless --secure-serving=false),
//   - gRPC health on --grpc-health-port ("liveness", "readiness", the ext_proc
//     service name, "inference-extension" and ""), SERVING once the endpoint
//     set is synced and, with --ha-enable-leader-election, this replica leads,
//   - through controller-runtime's metrics server on --metrics-port:
//     Prometheus metrics at /metrics, the ledger as JSON at /debug/ledger and
//     pprof at /debug/pprof/, each behind a TokenReview and a
//     SubjectAccessReview unless --metrics-endpoint-auth=false.
//
// On SIGTERM it drains: not ready at once, new streams still taken for
// --shutdown-delay, open ones given --shutdown-grace to finish.
//
// Flags follow the upstream endpoint picker (gateway-api-inference-extension
// v1.5.0), whose chart runs this binary unchanged: the ones Tally cannot
// apply are accepted and logged once as ignored (upstream.go), and its
// EndpointPickerConfig is read besides Tally's PickerConfig. Run with -h for
// the list.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/go-logr/logr"
	uberzap "go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	// Mozilla's TLS roots, used only where the system has none: the image
	// (internal/ociimage) ships no CA bundle, and --model-server-metrics-
	// https-insecure-skip-verify=false must still verify model servers.
	_ "golang.org/x/crypto/x509roots/fallback"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker/logging"
	"github.com/tallyepp/tally/picker/upstreamconfig"
)

// Exit codes: 2 for bad flags (as the flag package does), 1 for anything
// that stops the picker after its flags were accepted.
const (
	exitOK       = 0
	exitFailure  = 1
	exitBadUsage = 2
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], binaryBuild(), os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the whole command: b is the binary's build, stdout receives only
// what --version prints, stderr the usage and the log.
func run(ctx context.Context, args []string, b build, getenv func(string) string, stdout, stderr io.Writer) int {
	opts, ignored, err := parseFlags(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if errors.Is(err, errPrintVersion) {
		fmt.Fprint(stdout, b)
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "epp: %v\n", err)
		return exitBadUsage
	}
	log := newLogger(opts, stderr)
	ctrl.SetLogger(log)
	log.Info("starting epp", "version", b.Version, "commit", b.Commit, "go", b.GoVersion)
	for _, s := range ignored {
		log.Info("ignoring a flag that does nothing here", "flag", s.flag, "value", s.value, "reason", s.reason)
	}
	cfg, notes, err := loadConfig(opts)
	if err != nil {
		fmt.Fprintf(stderr, "epp: %v\n", err)
		return exitFailure
	}
	if err := upstreamconfig.Unsupported(notes, lenientConfigFlag); err != nil && !opts.lenientConfig {
		fmt.Fprintf(stderr, "epp: %v\n", err)
		return exitFailure
	}
	for _, n := range notes {
		switch {
		case n.Mapped != "":
			log.Info("EndpointPickerConfig setting mapped", "field", n.Field, "to", n.Mapped, "how", n.Reason)
		case n.Unsupported:
			logging.Warn(log, "running without an EndpointPickerConfig setting that Tally cannot honour ("+lenientConfigFlag+")", "field", n.Field, "reason", n.Reason)
		default:
			log.Info("ignoring an EndpointPickerConfig setting that Tally does not apply", "field", n.Field, "reason", n.Reason)
		}
	}
	if err := serve(ctx, opts, cfg, b, log); err != nil {
		log.Error(err, "epp stopped")
		return exitFailure
	}
	return exitOK
}

// newLogger builds the logger from the --zap-* flags (controller-runtime's,
// as the upstream picker takes them) and -v, which --zap-log-level overrides.
//
// Warnings: logr has no warn level, and the picker logs through logr, so a
// warning is logged with logging.Warn (an info line at V(0) marked
// "warning"=true) and logging.WarnLevel writes it as zap's warn level
// ("level":"warn" in JSON, WARN on the console). The alternatives were
// worse: Error(nil, ...) reads as a failure and carries a stack trace in
// development mode, and a bare "WARNING:" prefix in the message cannot be
// filtered on by level.
func newLogger(opts options, stderr io.Writer) logr.Logger {
	z := opts.zap
	if !opts.zapLevelSet {
		z.Level = zapcore.Level(-opts.verbosity)
	}
	// UseFlagOptions first: it replaces the options wholesale. WarnLevel is
	// the innermost core, inside the sampler that production mode adds.
	return zap.New(zap.UseFlagOptions(&z), zap.WriteTo(stderr),
		zap.RawZapOpts(uberzap.WrapCore(logging.WarnLevel)))
}

// loadConfig reads the configuration file of either kind (a PickerConfig, or
// the upstream EndpointPickerConfig with notes on what each setting became)
// and applies the flags that override it.
func loadConfig(opts options) (v1alpha1.PickerConfig, []upstreamconfig.Note, error) {
	data, err := opts.readConfig()
	if err != nil {
		return v1alpha1.PickerConfig{}, nil, err
	}
	cfg := v1alpha1.Default()
	var notes []upstreamconfig.Note
	if data != nil {
		if cfg, notes, err = upstreamconfig.LoadAny(data); err != nil {
			return v1alpha1.PickerConfig{}, nil, err
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
				return v1alpha1.PickerConfig{}, nil, fmt.Errorf("flag --%s: %w", f.name, err)
			}
		}
	}
	return cfg, notes, nil
}
