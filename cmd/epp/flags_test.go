package main

import (
	"bytes"
	"context"
	"github.com/tallyepp/tally/picker/scrape"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
)

func env(vars map[string]string) func(string) string {
	return func(k string) string { return vars[k] }
}

func TestMissingPoolNameExitsTwoNamingTheFlag(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), nil, build{}, env(nil), &stdout, &stderr)
	if code != exitBadUsage {
		t.Fatalf("exit code = %d, want %d", code, exitBadUsage)
	}
	out := strings.TrimSpace(stderr.String())
	if strings.Count(out, "\n") != 0 || !strings.Contains(out, "--pool-name") {
		t.Fatalf("want one line naming --pool-name, got %q", out)
	}
}

func TestUnknownFlagIsAnError(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"--pool-name=p", "--no-such-flag"}, build{}, env(nil), &stdout, &stderr)
	if code != exitBadUsage || !strings.Contains(stderr.String(), "no-such-flag") {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
}

func TestDefaultsFollowTheUpstreamPicker(t *testing.T) {
	o, _, err := parseFlags([]string{"--pool-name", "p"}, env(nil), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.poolNamespace != "default" || o.grpcPort != 9002 || o.grpcHealthPort != 9003 || o.metricsPort != 9090 ||
		!o.secureServing || o.leaderElection || o.maxRequestLifetime != 30*time.Minute ||
		o.leaseDuration != 15*time.Second || o.renewDeadline != 10*time.Second || o.retryPeriod != 2*time.Second {
		t.Fatalf("unexpected defaults: %+v", o)
	}
}

func TestNamespaceAndKubeconfigComeFromTheEnvironment(t *testing.T) {
	o, _, err := parseFlags([]string{"--pool-name", "p"}, env(map[string]string{"NAMESPACE": "ns1", "KUBECONFIG": "/k"}), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.poolNamespace != "ns1" || o.kubeconfig != "/k" {
		t.Fatalf("namespace %q kubeconfig %q", o.poolNamespace, o.kubeconfig)
	}
	o, _, err = parseFlags([]string{"--pool-name", "p", "--pool-namespace", "ns2", "--kubeconfig", "/x"}, env(map[string]string{"NAMESPACE": "ns1", "KUBECONFIG": "/k"}), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.poolNamespace != "ns2" || o.kubeconfig != "/x" {
		t.Fatalf("flags must win over the environment: %+v", o)
	}
}

func TestInvalidFlagValuesNameTheFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--grpc-port", "0"}, "--grpc-port"},
		{[]string{"--metrics-port", "9002"}, "must differ"},
		{[]string{"--pool-group", "x.io"}, "--pool-group"},
		{[]string{"--config-file", "a", "--config-text", "b"}, "exclusive"},
		{[]string{"--max-request-lifetime", "1ms"}, "--max-request-lifetime"},
		{[]string{"--max-request-bytes", "-1"}, "--max-request-bytes"},
		{[]string{"--max-buffered-request-bytes", "-1"}, "--max-buffered-request-bytes"},
		{[]string{"--grpc-port", "abc"}, "grpc-port"},
		{[]string{"extra"}, "unexpected argument"},
		{[]string{"--endpoint-selector", "app=vllm"}, "--endpoint-selector"},
		{[]string{"--shutdown-grace", "-1s"}, "--shutdown-grace"},
		{[]string{"--metrics-cert-path", "/x"}, "--metrics-secure-serving"},
		{[]string{"--refresh-metrics-interval", "-1s"}, "--refresh-metrics-interval"},
		{[]string{"--model-server-metrics-scheme", "ftp"}, "--model-server-metrics-scheme"},
		{[]string{"--model-server-metrics-port", "70000"}, "--model-server-metrics-port"},
		{[]string{"--model-server-metrics-path", "metrics"}, "--model-server-metrics-path"},
		{[]string{"--total-running-requests-metric", "running{model"}, "--total-running-requests-metric"},
		{[]string{"--model-server-metrics-failure-threshold", "0"}, "--model-server-metrics-failure-threshold"},
		{[]string{"--ha-lease-duration", "10s"}, "--ha-lease-duration"},
		{[]string{"--ha-renew-deadline", "2400ms"}, "--ha-renew-deadline"},
		{[]string{"--ha-retry-period", "0s"}, "--ha-retry-period"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), append([]string{"--pool-name", "p"}, tc.args...), build{}, env(nil), &stdout, &stderr)
		if code != exitBadUsage || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, stderr %q, want it to mention %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

func TestUpstreamOnlyFlagsAreAcceptedAndReported(t *testing.T) {
	o, ignored, err := parseFlags([]string{"--pool-name", "p", "--zap-encoder=json", "--tracing=false",
		"--total-queued-requests-metric", `"sglang:num_queue_reqs"`, "--lora-info-metric", "",
		"--kv-cache-usage-percentage-metric", `my:kv{model="x"}`, "--metrics-endpoint-auth=false"}, env(nil), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	// The metric specs are honoured: quotes dropped, label filters kept,
	// an empty one not read.
	want := scrape.MetricNames{Waiting: scrape.MetricSpec{Name: "sglang:num_queue_reqs"}, Running: scrape.MetricSpec{Name: "vllm:num_requests_running"},
		KVCacheUsage: scrape.MetricSpec{Name: "my:kv", Labels: []scrape.Label{{Name: "model", Value: "x"}}}, CacheInfo: scrape.MetricSpec{Name: "vllm:cache_config_info"}}
	if !reflect.DeepEqual(o.metricNames, want) {
		t.Errorf("metric names %+v, want %+v", o.metricNames, want)
	}
	var names []string
	for _, s := range ignored {
		if s.reason == "" {
			t.Errorf("%s is ignored without a reason", s.flag)
		}
		names = append(names, s.flag)
	}
	// --zap-encoder and --metrics-endpoint-auth are honoured, not ignored.
	if strings.Join(names, ",") != "--tracing" {
		t.Fatalf("ignored = %v", ignored)
	}
}

// The upstream chart passes its flags map as two arguments per flag, and
// pflag-style `--flag value` for booleans means the value.
func TestBooleanFlagsTakeTheirValueAsTheNextArgument(t *testing.T) {
	o, _, err := parseFlags([]string{"--pool-name", "p", "--enable-pprof", "false", "--metrics-endpoint-auth", "False", "--secure-serving", "-v", "2"}, env(nil), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.enablePprof || o.metricsEndpointAuth || !o.secureServing || o.verbosity != 2 {
		t.Fatalf("got pprof %v auth %v secure %v -v %d", o.enablePprof, o.metricsEndpointAuth, o.secureServing, o.verbosity)
	}
}

func TestSecurityFlagsDefaultAsUpstream(t *testing.T) {
	o, _, err := parseFlags([]string{"--pool-name", "p", "--metrics-port", "9191"}, env(nil), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if !o.metricsEndpointAuth || !o.enablePprof || o.enableCertReload || o.metricsSecureServing || o.metricsBindAddress != ":9191" {
		t.Fatalf("got %+v", o)
	}
	if o.shutdownDelay != 5*time.Second || o.shutdownGrace != 10*time.Minute {
		t.Fatalf("drain defaults: delay %s grace %s", o.shutdownDelay, o.shutdownGrace)
	}
	_, ignored, err := parseFlags([]string{"--pool-name", "p", "--enable-cert-reload"}, env(nil), &bytes.Buffer{})
	if err != nil || len(ignored) != 1 || ignored[0].flag != "--enable-cert-reload" {
		t.Fatalf("--enable-cert-reload without --cert-path: ignored %v, err %v; want it reported as ignored", ignored, err)
	}
}

// Peer flags without --peer-selector do nothing: each is reported.
func TestPeerFlagsWithoutAPeerSelectorAreReportedIgnored(t *testing.T) {
	_, ignored, err := parseFlags([]string{"--pool-name", "p", "--ha-enable-leader-election", "--peer-port", "9100", "--peer-cert-path", "/certs"}, env(nil), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, s := range ignored {
		got = append(got, s.flag+"="+s.value)
	}
	if want := []string{"--peer-cert-path=/certs", "--peer-port=9100"}; !slices.Equal(got, want) {
		t.Errorf("ignored %v, want %v", got, want)
	}
	_, ignored, err = parseFlags([]string{"--pool-name", "p", "--ha-enable-leader-election", "--peer-selector", "app=t", "--peer-port", "9100", "--peer-cert-path", "/certs"}, env(map[string]string{"POD_NAME": "t-0", "POD_IP": "10.0.0.1"}), &bytes.Buffer{})
	if err != nil || len(ignored) != 0 {
		t.Errorf("with --peer-selector: ignored %v, err %v; want none", ignored, err)
	}
}

func TestBadConfigStopsStartupNamingTheField(t *testing.T) {
	for _, tc := range []struct{ text, want string }{
		{"apiVersion: tally.tallyepp.io/v1alpha1\nkind: PickerConfig\nblockSize: 64\n", `unknown field "blockSize"`},
		{"apiVersion: tally.tallyepp.io/v1alpha1\nkind: PickerConfig\nblockSizeChars: 2\n", "blockSizeChars"},
		{"kind: EndpointPickerConfig\n", "apiVersion"},
		{"kind: Other\n", "kind"},
		{"apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 0}\n", "maxNumOfEndpoints"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), []string{"--pool-name", "p", "--config-text", tc.text}, build{}, env(nil), &stdout, &stderr)
		if code != exitFailure || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("config %q: exit %d, stderr %q, want it to mention %q", tc.text, code, stderr.String(), tc.want)
		}
	}
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"--pool-name", "p", "--config-file", "/does/not/exist"}, build{}, env(nil), &stdout, &stderr)
	if code != exitFailure || !strings.Contains(stderr.String(), "--config-file") {
		t.Errorf("missing config file: exit %d, stderr %q", code, stderr.String())
	}
}

func TestBufferBudgetFlagIsCheckedAgainstTheConfig(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		// Below the largest body accepted: that body could never be buffered.
		{[]string{"--max-buffered-request-bytes", "1048576"}, "--max-buffered-request-bytes"},
		{[]string{"--max-request-bytes", "67108864", "--max-buffered-request-bytes", "33554432"}, "maxBufferedRequestBytes"},
		{[]string{"--max-buffered-request-bytes", "2199023255552"}, "--max-buffered-request-bytes"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), append([]string{"--pool-name", "p"}, tc.args...), build{}, env(nil), &stdout, &stderr)
		if code != exitFailure || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, stderr %q, want it to mention %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

func TestBufferBudget(t *testing.T) {
	const (
		mib = int64(1) << 20
		gib = int64(1) << 30
	)
	for _, tc := range []struct {
		name        string
		args        []string
		config      string
		memoryLimit int64
		want        int64
		wantFrom    string
	}{
		{name: "no GOMEMLIMIT", memoryLimit: math.MaxInt64, want: gib, wantFrom: "default"},
		{name: "half of GOMEMLIMIT", memoryLimit: 3 * gib, want: 3 * gib / 2, wantFrom: "GOMEMLIMIT"},
		{name: "GOMEMLIMIT too small for one request", memoryLimit: 48 * mib, want: 32 * mib, wantFrom: "raised to maxRequestBytes"},
		{name: "GOMEMLIMIT small, bodies smaller", args: []string{"--max-request-bytes", "1048576"}, memoryLimit: 48 * mib, want: 24 * mib, wantFrom: "GOMEMLIMIT"},
		{name: "config", config: "maxBufferedRequestBytes: 268435456", memoryLimit: 3 * gib, want: 256 * mib, wantFrom: "maxBufferedRequestBytes"},
		{name: "flag over config", args: []string{"--max-buffered-request-bytes", "134217728"}, config: "maxBufferedRequestBytes: 268435456",
			memoryLimit: 3 * gib, want: 128 * mib, wantFrom: "maxBufferedRequestBytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--pool-name", "p"}, tc.args...)
			if tc.config != "" {
				args = append(args, "--config-text", "apiVersion: "+v1alpha1.GroupVersion+"\nkind: PickerConfig\n"+tc.config+"\n")
			}
			o, _, err := parseFlags(args, env(nil), &bytes.Buffer{})
			if err != nil {
				t.Fatal(err)
			}
			cfg, _, err := loadConfig(o)
			if err != nil {
				t.Fatal(err)
			}
			got, from := bufferBudget(cfg, tc.memoryLimit)
			if got != tc.want || !strings.Contains(from, tc.wantFrom) {
				t.Errorf("budget %d from %q, want %d from something mentioning %q", got, from, tc.want, tc.wantFrom)
			}
		})
	}
}

func TestJoinBoolValuesLeavesOtherArgumentsAlone(t *testing.T) {
	o, _, err := parseFlags([]string{"--pool-name", "true", "--tracing", "true", "--health-checking=false", "-secure-serving", "false"}, env(nil), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.poolName != "true" || o.healthChecking || o.secureServing {
		t.Fatalf("pool %q, health-checking %v, secure-serving %v", o.poolName, o.healthChecking, o.secureServing)
	}
	if _, _, err := parseFlags([]string{"--pool-name", "p", "--", "--enable-pprof", "false"}, env(nil), &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "unexpected argument") {
		t.Fatalf("arguments after -- are not flags: %v", err)
	}
}

func TestQuotedMetricsPathAsTheUpstreamChartPassesIt(t *testing.T) {
	o, _, err := parseFlags([]string{"--pool-name", "p", `--model-server-metrics-path="/prometheus/metrics"`}, env(nil), &bytes.Buffer{})
	if err != nil || o.scrapePath != "/prometheus/metrics" {
		t.Errorf("path %q, err %v; want /prometheus/metrics", o.scrapePath, err)
	}
}
