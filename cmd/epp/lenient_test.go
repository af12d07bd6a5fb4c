package main

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"
)

// An EndpointPickerConfig with settings Tally cannot honour: a plugin type
// it does not know, and metric specs (Triton's) in the file.
const unsupportedConfig = `apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- name: my-scorer
  type: session-affinity-scorer
- type: core-metrics-extractor
  parameters:
    engineConfigs:
    - name: triton
      queuedRequestsSpec: "nv_trt_llm_request_metrics{request_type=waiting}"
`

func TestUnsupportedUpstreamConfigStopsStartupNamingTheFields(t *testing.T) {
	var stderr bytes.Buffer
	code := run(context.Background(), []string{"--pool-name", "p", "--config-text", unsupportedConfig}, build{}, env(nil), io.Discard, &stderr)
	out := stderr.String()
	if code != exitFailure {
		t.Fatalf("exit %d, want %d; stderr %q", code, exitFailure, out)
	}
	for _, want := range []string{
		`plugins[1](my-scorer) cannot be honoured: plugin type "session-affinity-scorer" is not one Tally knows`,
		"plugins[2](core-metrics-extractor).parameters.engineConfigs cannot be honoured",
		"--total-queued-requests-metric",
		"--lenient-config",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stderr does not say %q:\n%s", want, out)
		}
	}
}

func TestLenientConfigRunsWithoutUnsupportedSettingsWarningOfEach(t *testing.T) {
	var stderr bytes.Buffer
	// No API server to reach: the picker stops there, after the config.
	code := run(context.Background(), []string{"--pool-name", "p", "--config-text", unsupportedConfig, "--lenient-config",
		"--kubeconfig", "/does/not/exist"}, build{}, env(nil), io.Discard, &stderr)
	out := stderr.String()
	if code != exitFailure || !strings.Contains(out, "--kubeconfig") {
		t.Fatalf("exit %d, stderr %q; want it to get past the config and stop at --kubeconfig", code, out)
	}
	var warned []string
	for _, l := range logLines(t, strings.TrimSpace(strings.Split(out, "epp: ")[0])) {
		if l["level"] == "warn" {
			warned = append(warned, l["field"].(string))
		}
	}
	want := []string{"plugins[1](my-scorer)", "plugins[2](core-metrics-extractor).parameters.engineConfigs"}
	if strings.Join(warned, " ") != strings.Join(want, " ") {
		t.Errorf("warned of %q, want %q:\n%s", warned, want, out)
	}
}
