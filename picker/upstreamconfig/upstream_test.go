package upstreamconfig

import (
	"reflect"
	"strings"
	"testing"

	"github.com/tallyepp/tally/api/v1alpha1"
)

// The configuration the upstream inferencepool chart (v1.5.0) mounts by default.
const upstreamChartDefault = `
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: "http"
    path: "/metrics"
    insecureSkipVerify: true
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
`

func notesByField(notes []Note) map[string]Note {
	out := map[string]Note{}
	for _, n := range notes {
		out[n.Field] = n
	}
	return out
}

func TestTheUpstreamChartsDefaultConfigIsTallysDefault(t *testing.T) {
	c, notes, err := LoadAny([]byte(upstreamChartDefault))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c, v1alpha1.Default()) {
		t.Errorf("got %+v, want the defaults", c)
	}
	byField := notesByField(notes)
	for _, f := range []string{"plugins[0](queue-scorer)", "plugins[3](metrics-data-source)", "schedulingProfiles"} {
		if n, ok := byField[f]; !ok || n.Mapped != "" || n.Reason == "" {
			t.Errorf("note for %s = %+v, want ignored with a reason (notes: %v)", f, n, notes)
		}
	}
	for _, n := range notes {
		if n.Mapped != "" {
			t.Errorf("nothing should be mapped from the defaults, got %v", n)
		}
	}
}

func TestUpstreamSettingsWithATallyMeaningAreMapped(t *testing.T) {
	c, notes, err := LoadAny([]byte(`
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: prefix-cache-scorer
  parameters:
    blockSizeTokens: 64
    lruCapacityPerServer: 31250
    maxPrefixBlocksToMatch: 256
    autoTune: false
    somethingNew: 1
- name: picker
  type: max-score-picker
  parameters:
    maxNumOfEndpoints: 2
- name: limit
  type: concurrency-detector
  parameters:
    maxConcurrency: 40
    headroom: 0.5
saturationDetector:
  pluginRef: limit
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
  - pluginRef: picker
`))
	if err != nil {
		t.Fatal(err)
	}
	want := v1alpha1.Default()
	want.BlockSizeChars = 256      // 64 tokens x 4
	want.LRUCapacityBlocks = 31250 // same block size: same count
	want.MaxPromptBlocks = 256
	want.FallbackEndpoints = 2
	want.Saturation.MaxInFlightRequests = 60
	want.FlowControl.Enabled = true
	if !reflect.DeepEqual(c, want) {
		t.Errorf("got %+v\nwant %+v", c, want)
	}
	byField := notesByField(notes)
	for field, to := range map[string]string{
		"plugins[0](prefix-cache-scorer).parameters.blockSizeTokens":        "blockSizeChars",
		"plugins[0](prefix-cache-scorer).parameters.lruCapacityPerServer":   "lruCapacityBlocks",
		"plugins[0](prefix-cache-scorer).parameters.maxPrefixBlocksToMatch": "maxPromptBlocks",
		"plugins[1](picker).parameters.maxNumOfEndpoints":                   "fallbackEndpoints",
		"plugins[2](limit).parameters.maxConcurrency":                       "saturation.maxInFlightRequests",
		"plugins[0](prefix-cache-scorer).parameters.autoTune":               "",
		"plugins[0](prefix-cache-scorer).parameters.somethingNew":           "",
		"featureGates[0](flowControl)":                                      "flowControl.enabled",
	} {
		n, ok := byField[field]
		if !ok || n.Mapped != to {
			t.Errorf("note for %s = %+v (found %v), want mapped to %q (notes: %v)", field, n, ok, to, notes)
		}
	}
}

func TestUpstreamPrefixCapacityKeepsItsTokens(t *testing.T) {
	// Upstream blocks of 16 tokens (the default) are an eighth of Tally's
	// 512-character blocks: the capacity in tokens is kept.
	c, _, err := LoadAny([]byte(`
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
  parameters: {lruCapacityPerServer: 31250, maxPrefixTokensToMatch: 32000}
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.BlockSizeChars != v1alpha1.DefaultBlockSizeChars || c.LRUCapacityBlocks != 3907 || c.MaxPromptBlocks != 250 {
		t.Errorf("got block %d, capacity %d, prompt blocks %d; want 512, 3907 (500,000 tokens), 250 (32,000 tokens)",
			c.BlockSizeChars, c.LRUCapacityBlocks, c.MaxPromptBlocks)
	}
}

func TestAConcurrencyDetectorNotInUseIsIgnored(t *testing.T) {
	c, notes, err := LoadAny([]byte(`
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: concurrency-detector
  parameters: {maxConcurrency: 4}
- type: utilization-detector
  parameters: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8}
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Saturation != (v1alpha1.Saturation{}) {
		t.Errorf("saturation = %+v, want off: the utilization detector is the default in use", c.Saturation)
	}
	if n := notesByField(notes)["plugins[1](utilization-detector)"]; !strings.Contains(n.Reason, "saturation") {
		t.Errorf("utilization-detector note = %+v, want a reason naming Tally's saturation limits", n)
	}
}

func TestUpstreamConfigErrorsNameTheUpstreamField(t *testing.T) {
	head := "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
	for _, tc := range []struct{ doc, want string }{
		{"kind: EndpointPickerConfig\napiVersion: v1\n", `apiVersion: "v1" is invalid`},
		{"kind: Something\n", `kind: "Something" is invalid`},
		{head + "plugins:\n- type: prefix-cache-scorer\n  parameters: {blockSizeTokens: many}\n", "plugins[0](prefix-cache-scorer).parameters.blockSizeTokens"},
		{head + "plugins:\n- type: prefix-cache-scorer\n  parameters: {blockSizeTokens: 5000}\n", "blockSizeTokens must be from 1 to 1024"},
		{head + "plugins:\n- type: prefix-cache-scorer\n  parameters: {lruCapacityPerServer: 0}\n", "lruCapacityPerServer: 0 is invalid"},
		{head + "plugins:\n- name: p\n  type: random-picker\n  parameters: {maxNumOfEndpoints: 0}\n", "plugins[0](p).parameters.maxNumOfEndpoints: 0 is invalid"},
		{head + "plugins:\n- name: c\n  type: concurrency-detector\n  parameters: {concurrencyMode: bytes}\nsaturationDetector: {pluginRef: c}\n", "concurrencyMode"},
		{head + "plugins:\n- parameters: {}\n", "plugins[0]().type is required"},
		{head + "plugins: 3\n", "plugins"},
	} {
		_, _, err := LoadAny([]byte(tc.doc))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want it to contain %q", tc.doc, err, tc.want)
		}
	}
}

func TestLoadAnyReadsTallysOwnKind(t *testing.T) {
	c, notes, err := LoadAny([]byte("apiVersion: tally.tallyepp.io/v1alpha1\nkind: PickerConfig\nfallbackEndpoints: 2\n"))
	if err != nil || notes != nil || c.FallbackEndpoints != 2 {
		t.Fatalf("got %+v, %v, %v", c, notes, err)
	}
	if _, _, err := LoadAny([]byte("apiVersion: tally.tallyepp.io/v1alpha1\nkind: PickerConfig\nplugins: []\n")); err == nil || !strings.Contains(err.Error(), `unknown field "plugins"`) {
		t.Errorf("a PickerConfig stays strict: error %v", err)
	}
	if c, _, err := LoadAny(nil); err != nil || !reflect.DeepEqual(c, v1alpha1.Default()) {
		t.Errorf("empty document: %+v, %v", c, err)
	}
}

func TestUpstreamFlowControlIsMapped(t *testing.T) {
	c, notes, err := LoadAny([]byte(`
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl, somethingElse]
plugins:
- name: strict
  type: global-strict-fairness-policy
- name: order
  type: edf-ordering-policy
flowControl:
  maxBytes: 2Gi
  maxRequests: 1k
  defaultRequestTTL: 30500ms
  usageLimitPolicyPluginRef: limits
  defaultPriorityBand:
    maxRequests: 100
    fairnessPolicyRef: strict
  priorityBands:
  - priority: 10
    maxBytes: 500M
    orderingPolicyRef: order
  - priority: -1
    maxRequests: 7
    fairnessPolicyRef: round-robin-fairness-policy
  somethingNew: 1
`))
	if err != nil {
		t.Fatal(err)
	}
	got := c.FlowControl
	want := v1alpha1.Default().FlowControl
	want.Enabled = true
	want.MaxBytes, want.MaxRequests = 2<<30, 1000
	want.RequestTTLSeconds = 31
	want.DefaultBand = v1alpha1.Band{MaxRequests: 100, MaxBytes: v1alpha1.DefaultBandMaxBytes}
	want.Bands = []v1alpha1.Band{{Priority: 10, MaxBytes: 500_000_000}, {Priority: -1, MaxRequests: 7}}
	want.Fairness, want.Ordering = v1alpha1.FairnessGlobalStrict, v1alpha1.OrderingFCFS
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v\nwant %+v", got, want)
	}
	if b := got.BandFor(10); b.MaxRequests != 100 || b.MaxBytes != 500_000_000 {
		t.Errorf("band 10 = %+v, want 100 requests (defaultBand's) and 500M bytes", b)
	}
	byField := notesByField(notes)
	for field, to := range map[string]string{
		"featureGates[1](somethingElse)":                    "",
		"flowControl.usageLimitPolicyPluginRef":             "",
		"flowControl.somethingNew":                          "",
		"flowControl.priorityBands[1].fairnessPolicyRef":    "",
		"flowControl.defaultPriorityBand.fairnessPolicyRef": "flowControl.fairness",
		"flowControl.priorityBands[0].orderingPolicyRef":    "flowControl.ordering",
		"flowControl.defaultRequestTTL":                     "flowControl.requestTTLSeconds",
	} {
		n, ok := byField[field]
		if !ok || n.Mapped != to {
			t.Errorf("note for %s = %+v (found %v), want mapped to %q", field, n, ok, to)
		}
	}
}

func TestUpstreamFlowControlErrorsNameTheField(t *testing.T) {
	for doc, field := range map[string]string{
		"featureGates: [flowControl]\nflowControl:\n  maxRequests: 1.5":                                  "flowControl.maxRequests",
		"featureGates: [flowControl]\nflowControl:\n  defaultRequestTTL: soon":                           "flowControl.defaultRequestTTL",
		"featureGates: [flowControl]\nflowControl:\n  priorityBands:\n  - priority: 1\n    maxBytes: -1": "flowControl.priorityBands[0].maxBytes",
		"featureGates: flowControl": "featureGates",
	} {
		_, _, err := LoadAny([]byte("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n" + doc))
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%q: error %v, want one naming %s", doc, err, field)
		}
	}
	// Without the gate the section changes nothing, as upstream.
	c, _, err := LoadAny([]byte("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nflowControl:\n  maxRequests: 10\n"))
	if err != nil || c.FlowControl.Enabled || c.FlowControl.MaxRequests != 0 {
		t.Errorf("flowControl without its gate: %+v, %v; want flow control off and unchanged", c.FlowControl, err)
	}
}

func TestTokensModeNotesItsMaxConcurrency(t *testing.T) {
	c, notes, err := LoadAny([]byte(`
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- name: limit
  type: concurrency-detector
  parameters:
    concurrencyMode: tokens
    maxConcurrency: 40
    maxTokenConcurrency: 100000
saturationDetector:
  pluginRef: limit
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Saturation.MaxInFlightRequests != 0 {
		t.Errorf("saturation.maxInFlightRequests = %d, want 0: upstream does not limit requests in tokens mode", c.Saturation.MaxInFlightRequests)
	}
	n, ok := notesByField(notes)["plugins[0](limit).parameters.maxConcurrency"]
	if !ok || n.Mapped != "" || n.Reason == "" {
		t.Errorf("maxConcurrency in tokens mode: note %+v (found %v), want it noted as ignored with a reason", n, ok)
	}
}

func TestSettingsTallyCannotHonourAreUnsupported(t *testing.T) {
	_, notes, err := LoadAny([]byte(`
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: no-such-scorer
- type: core-metrics-extractor
- type: core-metrics-extractor
  name: triton-metrics
  parameters:
    engineConfigs:
    - name: triton
      kvUsageSpec: "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"
`))
	if err != nil {
		t.Fatal(err)
	}
	var unsupported []string
	for _, n := range notes {
		if n.Unsupported {
			unsupported = append(unsupported, n.Field)
		}
	}
	// A known plugin Tally does without, and the extractor without
	// parameters (the upstream chart's), are ignored, not unsupported.
	want := []string{"plugins[1](no-such-scorer)", "plugins[3](triton-metrics).parameters.engineConfigs"}
	if !reflect.DeepEqual(unsupported, want) {
		t.Fatalf("unsupported %q, want %q (notes: %v)", unsupported, want, notes)
	}
	err = Unsupported(notes, "--lenient-config")
	for _, w := range append(want, "--lenient-config", `"no-such-scorer" is not one Tally knows`) {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("Unsupported error %v does not say %q", err, w)
		}
	}
	if err := Unsupported(notesOf(t, upstreamChartDefault), "--lenient-config"); err != nil {
		t.Errorf("the upstream chart's default config: %v", err)
	}
}

func notesOf(t *testing.T, doc string) []Note {
	t.Helper()
	_, notes, err := LoadAny([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return notes
}

// An llm-d prefill/decode configuration: the decider's thresholds become
// disaggregation, the handler and role filters are noted as what Tally does
// itself.
const llmdDisaggregated = `
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefill-filter
- type: decode-filter
- type: prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
- name: pd-decider
  type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: 16
    promptTokens: 64
    unknownParameter: 3
- type: disagg-profile-handler
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: prefix-cache-scorer
  - pluginRef: max-score-picker
`

func TestTheLlmdPrefillDecodeDeciderMapsOntoDisaggregation(t *testing.T) {
	c, notes, err := LoadAny([]byte(llmdDisaggregated))
	if err != nil {
		t.Fatal(err)
	}
	if d := c.Disaggregation; d.NonCachedTokens != 16 || d.PromptTokens != 64 {
		t.Errorf("disaggregation = %+v, want nonCachedTokens 16, promptTokens 64", d)
	}
	if err := Unsupported(notes, "--lenient"); err != nil {
		t.Errorf("an llm-d P/D configuration has settings Tally cannot honour: %v", err)
	}
	by := notesByField(notes)
	for field, want := range map[string]string{
		"plugins[5](pd-decider).parameters.nonCachedTokens": "disaggregation.nonCachedTokens",
		"plugins[5](pd-decider).parameters.promptTokens":    "disaggregation.promptTokens",
	} {
		if by[field].Mapped != want {
			t.Errorf("%s: note %+v, want it mapped to %s", field, by[field], want)
		}
	}
	for field, reason := range map[string]string{
		"plugins[0](prefill-filter)":                         "llm-d.ai/role",
		"plugins[1](decode-filter)":                          "llm-d.ai/role",
		"plugins[6](disagg-profile-handler)":                 "one critical section",
		"plugins[5](pd-decider).parameters.unknownParameter": "does not know",
	} {
		if n := by[field]; n.Mapped != "" || !strings.Contains(n.Reason, reason) {
			t.Errorf("%s: note %+v, want it ignored with a reason naming %q", field, n, reason)
		}
	}

	off, _, err := LoadAny([]byte(strings.Replace(llmdDisaggregated, "nonCachedTokens: 16", "nonCachedTokens: 0", 1)))
	if err != nil {
		t.Fatal(err)
	}
	if off.Disaggregation.Enabled() {
		t.Errorf("nonCachedTokens 0 gives %+v, want disaggregation off (llm-d's default)", off.Disaggregation)
	}
	_, _, err = LoadAny([]byte(strings.Replace(llmdDisaggregated, "nonCachedTokens: 16", "nonCachedTokens: -2", 1)))
	if err == nil || !strings.Contains(err.Error(), "plugins[5](pd-decider).parameters.nonCachedTokens: -2 is invalid") {
		t.Errorf("nonCachedTokens -2: error %v, want one naming the field", err)
	}
}
