package upstreamconfig

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"sort"
	"strings"

	"github.com/tallyepp/tally/api/v1alpha1"

	"sigs.k8s.io/yaml"
)

// The upstream endpoint picker's configuration file (gateway-api-inference-
// extension v1.5.0, also read by llm-d-router): what its Helm chart mounts at
// --config-file.
const (
	UpstreamGroupVersion     = "inference.networking.x-k8s.io/v1alpha1"
	KindEndpointPickerConfig = "EndpointPickerConfig"
)

// Upstream defaults that the mapping needs to convert upstream units into
// Tally's: the upstream prefix index counts blocks of 16 tokens (vLLM's block)
// unless blockSizeTokens says otherwise.
const upstreamDefaultBlockSizeTokens = 16

// Note says what was done with one setting of an EndpointPickerConfig: mapped
// onto a PickerConfig field, or ignored and why. The picker logs each once at
// start.
type Note struct {
	// Field is the setting, as a path into the upstream file, e.g.
	// "plugins[2](prefix-cache-scorer).parameters.lruCapacityPerServer".
	Field string
	// Mapped is the PickerConfig field it set ("" when ignored).
	Mapped string
	// Reason says why it was ignored, or how it was converted.
	Reason string
	// Unsupported marks an ignored setting whose loss changes what the
	// file asks for in a way Tally cannot make up for (a plugin type it
	// does not know, metric specs it does not read): Unsupported turns
	// such notes into the error that stops the picker, unless the user
	// opts into running without them.
	Unsupported bool
}

func (n Note) String() string {
	switch {
	case n.Mapped != "":
		return fmt.Sprintf("%s -> %s (%s)", n.Field, n.Mapped, n.Reason)
	case n.Unsupported:
		return fmt.Sprintf("%s cannot be honoured: %s", n.Field, n.Reason)
	}
	return fmt.Sprintf("%s ignored: %s", n.Field, n.Reason)
}

// Unsupported returns an error naming every setting of notes that Tally
// cannot honour (Note.Unsupported), nil when there is none. lenientFlag is
// the flag that runs the picker without them, for the message.
func Unsupported(notes []Note, lenientFlag string) error {
	var errs []error
	for _, n := range notes {
		if n.Unsupported {
			errs = append(errs, fmt.Errorf("EndpointPickerConfig: %s cannot be honoured: %s", n.Field, n.Reason))
		}
	}
	if len(errs) == 0 {
		return nil
	}
	errs = append(errs, fmt.Errorf("remove these settings, or start with %s to run without them (each is then logged as a warning)", lenientFlag))
	return errors.Join(errs...)
}

// LoadAny reads a configuration file of either kind: Tally's PickerConfig
// (apiVersion tally.tallyepp.io/v1alpha1), or the upstream picker's
// EndpointPickerConfig (apiVersion inference.networking.x-k8s.io/v1alpha1),
// which is mapped onto a PickerConfig. The notes say, for an
// EndpointPickerConfig, what each of its settings became; a PickerConfig has
// none. An empty document is the default PickerConfig.
func LoadAny(data []byte) (v1alpha1.PickerConfig, []Note, error) {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	// Lenient here: the strict decoding of each kind comes after.
	if err := yaml.Unmarshal(data, &head); err != nil {
		return v1alpha1.PickerConfig{}, nil, fmt.Errorf("picker config: %s", strings.TrimPrefix(err.Error(), "error unmarshaling JSON: while decoding JSON: "))
	}
	switch {
	case head.Kind == KindEndpointPickerConfig:
		if head.APIVersion != UpstreamGroupVersion {
			return v1alpha1.PickerConfig{}, nil, fmt.Errorf("picker config: apiVersion: %q is invalid: kind %s must be %q", head.APIVersion, KindEndpointPickerConfig, UpstreamGroupVersion)
		}
		return FromEndpointPickerConfig(data)
	case head.Kind == "" || head.Kind == v1alpha1.KindPickerConfig:
		c, err := v1alpha1.Load(data)
		return c, nil, err
	}
	return v1alpha1.PickerConfig{}, nil, fmt.Errorf("picker config: kind: %q is invalid: must be %q (apiVersion %s) or %q (apiVersion %s)",
		head.Kind, v1alpha1.KindPickerConfig, v1alpha1.GroupVersion, KindEndpointPickerConfig, UpstreamGroupVersion)
}

// endpointPickerConfig is the part of the upstream file the mapping reads;
// every other top-level field is noted as ignored.
type endpointPickerConfig struct {
	Plugins            []upstreamPlugin  `json:"plugins"`
	SchedulingProfiles []json.RawMessage `json:"schedulingProfiles"`
	SaturationDetector *struct {
		PluginRef string `json:"pluginRef"`
	} `json:"saturationDetector"`
}

type upstreamPlugin struct {
	Name       string          `json:"name"`
	Type       string          `json:"type"`
	Parameters json.RawMessage `json:"parameters"`
}

func (p upstreamPlugin) ref() string {
	if p.Name != "" {
		return p.Name
	}
	return p.Type
}

// Why whole plugins are ignored, by type. A type missing here is unknown to
// Tally and ignored as such.
var ignoredPluginTypes = map[string]string{
	"queue-scorer":                         "Tally scores one cost in tokens, from its own ledger of requests in flight, instead of weighted scorers",
	"kv-cache-utilization-scorer":          "Tally scores one cost in tokens, from its own ledger of requests in flight, instead of weighted scorers",
	"running-requests-size-scorer":         "Tally scores one cost in tokens, from its own ledger of requests in flight, instead of weighted scorers",
	"token-load-scorer":                    "Tally scores one cost in tokens, from its own ledger of requests in flight, instead of weighted scorers",
	"lora-affinity-scorer":                 "Tally reads the engines' LoRA adapters itself and costs a load where an adapter is not loaded (loraLoadMilliseconds)",
	"metrics-data-source":                  "Tally's scrapes of the model servers are set by flags (--refresh-metrics-interval, --model-server-metrics-*)",
	"core-metrics-extractor":               "Tally reads the engine metrics it knows by engine type (the pod label inference.networking.k8s.io/engine-type)",
	"k8s-notification-source":              "Tally watches the pool and its pods itself",
	"endpoint-notification-source":         "Tally watches the pool and its pods itself",
	"single-profile-handler":               "Tally has one scheduling profile",
	"openai-parser":                        "Tally parses OpenAI requests itself",
	"passthrough-parser":                   "Tally parses OpenAI requests itself; other bodies are routed on load alone",
	"vllmgrpc-parser":                      "Tally parses OpenAI requests over HTTP; gRPC bodies are routed on load alone",
	"utilization-detector":                 "Tally's saturation limits are requests and prefill tokens in flight per endpoint (saturation in a PickerConfig); scraped queues and KV-cache use feed its cost instead",
	"inflight-load-producer":               "Tally's ledger of requests in flight is always on",
	"predicted-latency-producer":           "Tally's cost is its estimate of time to first token; it runs no latency predictor",
	"predicted-latency-scorer":             "Tally's cost is its estimate of time to first token; it runs no latency predictor",
	"latency-scorer":                       "Tally's cost is its estimate of time to first token; it runs no latency predictor",
	"latency-slo-admitter":                 "Tally does not admit on latency objectives",
	"slo-headroom-tier-filter":             "Tally does not admit on latency objectives",
	"prefix-cache-affinity-filter":         "Tally weighs prefix hits against queued prefill in its cost instead of filtering on affinity",
	"request-attribute-reporter":           "Tally reports no request attributes",
	"header-based-testing-filter":          "conformance test hooks are a flag in Tally (--conformance-test-hooks)",
	"static-usage-limit-policy":            "Tally's flow control saturates on queued prefill (flowControl.holdPrefillMilliseconds), from its ledger",
	"global-strict-fairness-policy":        "a policy: mapped where flowControl's bands refer to it (fairnessPolicyRef)",
	"round-robin-fairness-policy":          "a policy: mapped where flowControl's bands refer to it (fairnessPolicyRef)",
	"fcfs-ordering-policy":                 "a policy: mapped where flowControl's bands refer to it (orderingPolicyRef)",
	"edf-ordering-policy":                  "a policy: mapped where flowControl's bands refer to it (orderingPolicyRef)",
	"slo-deadline-ordering-policy":         "Tally does not order on latency objectives",
	"eviction-priority-then-time-ordering": "Tally's flow control never evicts a request it dispatched",
	"eviction-sheddable-filter":            "Tally's flow control never evicts a request it dispatched; sheddable requests are refused while saturated",
	"disagg-profile-handler":               "Tally chooses the decode pod, then the prefill pod, in one critical section of its own (disaggregation in a PickerConfig, set by prefix-based-pd-decider)",
	"decode-filter":                        "what Tally does anyway: only pods labelled llm-d.ai/role decode or prefill-decode, and unlabelled ones, are destinations",
	"prefill-filter":                       "what Tally does anyway: only pods labelled llm-d.ai/role prefill or prefill-decode prefill for another pod",
}

// pdDeciderType is llm-d's plugin that decides whether a request's prefill
// runs on a prefill pod: its parameters map onto disaggregation.
const pdDeciderType = "prefix-based-pd-decider"

// Pickers whose maxNumOfEndpoints sets how many endpoints the destination
// header lists.
var pickerTypes = map[string]bool{"max-score-picker": true, "random-picker": true, "weighted-random-picker": true}

// Prefix plugins whose parameters configure the prefix index (the scorer's
// are handed to the producer upstream).
var prefixTypes = map[string]bool{"prefix-cache-scorer": true, "approx-prefix-cache-producer": true}

// FromEndpointPickerConfig maps an upstream EndpointPickerConfig onto a
// PickerConfig: what has a meaning in Tally is converted (the prefix index's
// block size, capacity and match limit, a concurrency-detector's per-endpoint
// limit, a picker's maxNumOfEndpoints), everything else is noted as ignored.
// The result is defaulted and valid; an error names the upstream field at
// fault.
func FromEndpointPickerConfig(data []byte) (v1alpha1.PickerConfig, []Note, error) {
	var top map[string]json.RawMessage
	if err := yaml.Unmarshal(data, &top); err != nil {
		return v1alpha1.PickerConfig{}, nil, fmt.Errorf("EndpointPickerConfig: %w", err)
	}
	var epc endpointPickerConfig
	if err := yaml.Unmarshal(data, &epc); err != nil {
		return v1alpha1.PickerConfig{}, nil, fmt.Errorf("EndpointPickerConfig: %s", strings.TrimPrefix(err.Error(), "error unmarshaling JSON: while decoding JSON: "))
	}
	m := mapper{cfg: v1alpha1.PickerConfig{APIVersion: v1alpha1.GroupVersion, Kind: v1alpha1.KindPickerConfig}}

	var keys []string
	for k := range top {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		switch k {
		case "apiVersion", "kind", "plugins", "saturationDetector":
		case "schedulingProfiles":
			m.ignore(k, "Tally has one scheduling profile; scorer weights have no equivalent in its single cost")
		case "featureGates":
			if err := m.featureGates(top[k]); err != nil {
				return v1alpha1.PickerConfig{}, nil, err
			}
		case "dataLayer":
			m.ignore(k, "Tally's scrapes of the model servers are set by flags (--refresh-metrics-interval, --model-server-metrics-*)")
		case "flowControl": // after featureGates, which turns it on
		case "parser":
			m.ignore(k, "Tally parses OpenAI requests itself")
		default:
			m.ignore(k, "not a field Tally knows")
		}
	}

	if raw, ok := top["flowControl"]; ok {
		if err := m.flowControl(raw, epc.Plugins, m.cfg.FlowControl.Enabled); err != nil {
			return v1alpha1.PickerConfig{}, nil, err
		}
	}

	detector := "utilization-detector" // the upstream default
	if epc.SaturationDetector != nil && epc.SaturationDetector.PluginRef != "" {
		detector = epc.SaturationDetector.PluginRef
	}
	seen := map[string]bool{}
	for i, p := range epc.Plugins {
		path := fmt.Sprintf("plugins[%d](%s)", i, p.ref())
		switch {
		case p.Type == "":
			return v1alpha1.PickerConfig{}, nil, fmt.Errorf("EndpointPickerConfig: %s.type is required", path)
		case prefixTypes[p.Type] || pickerTypes[p.Type] || p.Type == "concurrency-detector" || p.Type == pdDeciderType:
			group := p.Type
			if prefixTypes[p.Type] {
				group = "prefix"
			}
			if pickerTypes[p.Type] {
				group = "picker"
			}
			if p.Type == "concurrency-detector" && p.ref() != detector {
				m.ignore(path, fmt.Sprintf("not the saturationDetector in use (%q)", detector))
				continue
			}
			if seen[group] {
				m.ignore(path, "Tally has one scheduling profile: only the first such plugin is used")
				continue
			}
			seen[group] = true
			if err := m.plugin(path, p); err != nil {
				return v1alpha1.PickerConfig{}, nil, err
			}
		case p.Type == "core-metrics-extractor" && hasParameters(p.Parameters):
			if err := m.metricsExtractor(path, p.Parameters); err != nil {
				return v1alpha1.PickerConfig{}, nil, err
			}
		default:
			reason, ok := ignoredPluginTypes[p.Type]
			if !ok {
				m.unsupported(path, fmt.Sprintf("plugin type %q is not one Tally knows: the picker would run without what it does", p.Type))
				continue
			}
			m.ignore(path, reason)
		}
	}
	m.cfg = v1alpha1.WithDefaults(m.cfg)
	m.finish()
	if err := m.cfg.Validate(); err != nil {
		return v1alpha1.PickerConfig{}, nil, fmt.Errorf("EndpointPickerConfig mapped to an invalid PickerConfig: %w", err)
	}
	return m.cfg, m.notes, nil
}

// mapper accumulates the PickerConfig and the notes. Prefix sizes are
// converted once the block size is known (finish).
type mapper struct {
	cfg   v1alpha1.PickerConfig
	notes []Note

	// The prefix plugin's settings, in upstream units, applied by finish.
	prefixPath           string
	upstreamBlockTokens  int // 0: not given
	lruCapacityPerServer int
	maxPrefixBlocks      int
	maxPrefixTokens      int
}

func (m *mapper) ignore(field, reason string) {
	m.notes = append(m.notes, Note{Field: field, Reason: reason})
}

func (m *mapper) unsupported(field, reason string) {
	m.notes = append(m.notes, Note{Field: field, Reason: reason, Unsupported: true})
}

// hasParameters reports whether a plugin's parameters are set at all.
func hasParameters(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s != "" && s != "null" && s != "{}"
}

// metricsExtractor notes a core-metrics-extractor's parameters: the metric
// specs of its engineConfigs (Triton's
// nv_trt_llm_request_metrics{request_type=waiting}, say) are not read from
// the file, so each parameter is unsupported, with the flags that do read
// such specs.
func (m *mapper) metricsExtractor(path string, raw json.RawMessage) error {
	var values map[string]json.RawMessage
	if err := json.Unmarshal(raw, &values); err != nil {
		return fmt.Errorf("EndpointPickerConfig: %s.parameters: must be an object: %w", path, err)
	}
	for _, k := range slices.Sorted(maps.Keys(values)) {
		m.unsupported(path+".parameters."+k, "Tally does not read metric specs from the file: it reads each engine type's metrics by their own names, "+
			"and vLLM's (and those of engine types it does not know) by the flags --total-queued-requests-metric, --total-running-requests-metric, "+
			"--kv-cache-usage-percentage-metric, --lora-info-metric and --cache-info-metric, which take name{label=value,...} specs")
	}
	return nil
}

func (m *mapper) mapped(field, to, how string) {
	m.notes = append(m.notes, Note{Field: field, Mapped: to, Reason: how})
}

// params decodes a plugin's parameters into named values; each key the
// handler does not consume is noted as ignored.
type params struct {
	path   string
	values map[string]json.RawMessage
	used   map[string]bool
}

func (p *params) int(key string) (int, bool, error) {
	f, ok, err := param(p, key, "an integer", func(f float64) bool { return f == math.Trunc(f) && math.Abs(f) <= 1e15 })
	return int(f), ok, err
}

func (p *params) float(key string) (float64, bool, error) {
	return param[float64](p, key, "a number", nil)
}

func (p *params) str(key string) (string, bool, error) {
	return param[string](p, key, "a string", nil)
}

// param decodes key's value, if there is one, and marks the key consumed.
// A value that does not decode into a T, or that valid (when not nil)
// refuses, is an error saying it must be want.
func param[T any](p *params, key, want string, valid func(T) bool) (T, bool, error) {
	var v T
	raw, ok := p.values[key]
	if !ok {
		return v, false, nil
	}
	p.used[key] = true
	if err := json.Unmarshal(raw, &v); err != nil || (valid != nil && !valid(v)) {
		var zero T
		return zero, false, fmt.Errorf("EndpointPickerConfig: %s.parameters.%s: %s is invalid: must be %s", p.path, key, raw, want)
	}
	return v, true, nil
}

func (m *mapper) plugin(path string, p upstreamPlugin) error {
	ps := &params{path: path, values: map[string]json.RawMessage{}, used: map[string]bool{}}
	if len(p.Parameters) > 0 && string(p.Parameters) != "null" {
		if err := json.Unmarshal(p.Parameters, &ps.values); err != nil {
			return fmt.Errorf("EndpointPickerConfig: %s.parameters: must be an object: %w", path, err)
		}
	}
	var err error
	switch {
	case prefixTypes[p.Type]:
		err = m.prefix(ps)
	case pickerTypes[p.Type]:
		err = m.picker(ps)
	case p.Type == pdDeciderType:
		err = m.pdDecider(ps)
	default:
		err = m.concurrency(ps)
	}
	if err != nil {
		return err
	}
	var rest []string
	for k := range ps.values {
		if !ps.used[k] {
			rest = append(rest, k)
		}
	}
	sort.Strings(rest)
	for _, k := range rest {
		m.ignore(path+".parameters."+k, "a parameter Tally does not know")
	}
	return nil
}

func (m *mapper) prefix(ps *params) error {
	m.prefixPath = ps.path
	tokens, okTokens, err := ps.int("blockSizeTokens")
	if err != nil {
		return err
	}
	chars, okChars, err := ps.int("blockSize")
	if err != nil {
		return err
	}
	switch {
	case okTokens && tokens > 0:
		m.upstreamBlockTokens = tokens
		m.cfg.BlockSizeChars = tokens * v1alpha1.DefaultCharsPerToken
		m.mapped(ps.path+".parameters.blockSizeTokens", "blockSizeChars", fmt.Sprintf("%d tokens x %d characters per token", tokens, v1alpha1.DefaultCharsPerToken))
		if okChars {
			m.ignore(ps.path+".parameters.blockSize", "blockSizeTokens is given and wins")
		}
	case okChars && chars > 0:
		m.cfg.BlockSizeChars = chars
		m.upstreamBlockTokens = (chars + v1alpha1.DefaultCharsPerToken - 1) / v1alpha1.DefaultCharsPerToken
		m.mapped(ps.path+".parameters.blockSize", "blockSizeChars", "the legacy block size, in characters")
	case okTokens || okChars:
		return fmt.Errorf("EndpointPickerConfig: %s.parameters.blockSizeTokens: must be more than 0", ps.path)
	}
	if c := m.cfg.BlockSizeChars; c != 0 && (c < 4 || c > 4096) {
		return fmt.Errorf("EndpointPickerConfig: %s.parameters: a block of %d characters is invalid: blockSizeTokens must be from 1 to 1024 (blockSize from 4 to 4096 characters)", ps.path, c)
	}
	if n, ok, err := ps.int("lruCapacityPerServer"); err != nil {
		return err
	} else if ok {
		if n < 1 {
			return fmt.Errorf("EndpointPickerConfig: %s.parameters.lruCapacityPerServer: %d is invalid: must be 1 or more", ps.path, n)
		}
		m.lruCapacityPerServer = n
	}
	if n, ok, err := ps.int("maxPrefixTokensToMatch"); err != nil {
		return err
	} else if ok && n > 0 {
		m.maxPrefixTokens = n
	}
	if n, ok, err := ps.int("maxPrefixBlocksToMatch"); err != nil {
		return err
	} else if ok && n > 0 {
		if m.maxPrefixTokens > 0 {
			m.ignore(ps.path+".parameters.maxPrefixBlocksToMatch", "maxPrefixTokensToMatch is given and wins")
		} else {
			m.maxPrefixBlocks = n
		}
	}
	if _, ok := ps.values["autoTune"]; ok {
		ps.used["autoTune"] = true
		m.ignore(ps.path+".parameters.autoTune", "Tally does not read the model servers' block size; its blocks are blockSizeChars characters")
	}
	return nil
}

// finish converts the prefix plugin's capacities, counted upstream in blocks
// of upstreamBlockTokens tokens, into Tally's blocks of blockSizeChars
// characters, keeping the number of tokens they stand for.
func (m *mapper) finish() {
	upstreamBlockTokens := m.upstreamBlockTokens
	if upstreamBlockTokens == 0 {
		upstreamBlockTokens = upstreamDefaultBlockSizeTokens
	}
	toBlocks := func(tokens int) int {
		chars := int64(tokens) * int64(m.cfg.CharsPerToken)
		return int(max(1, (chars+int64(m.cfg.BlockSizeChars)-1)/int64(m.cfg.BlockSizeChars)))
	}
	how := func(n int, unit string) string {
		return fmt.Sprintf("%d %s of %d tokens, as blocks of %d characters", n, unit, upstreamBlockTokens, m.cfg.BlockSizeChars)
	}
	if n := m.lruCapacityPerServer; n > 0 {
		m.cfg.LRUCapacityBlocks = toBlocks(n * upstreamBlockTokens)
		m.mapped(m.prefixPath+".parameters.lruCapacityPerServer", "lruCapacityBlocks", how(n, "blocks"))
	}
	switch {
	case m.maxPrefixTokens > 0:
		m.cfg.MaxPromptBlocks = toBlocks(m.maxPrefixTokens)
		m.mapped(m.prefixPath+".parameters.maxPrefixTokensToMatch", "maxPromptBlocks", fmt.Sprintf("%d tokens, as blocks of %d characters", m.maxPrefixTokens, m.cfg.BlockSizeChars))
	case m.maxPrefixBlocks > 0:
		m.cfg.MaxPromptBlocks = toBlocks(m.maxPrefixBlocks * upstreamBlockTokens)
		m.mapped(m.prefixPath+".parameters.maxPrefixBlocksToMatch", "maxPromptBlocks", how(m.maxPrefixBlocks, "blocks"))
	}
}

func (m *mapper) picker(ps *params) error {
	n, ok, err := ps.int("maxNumOfEndpoints")
	if err != nil || !ok {
		return err
	}
	const most = 16 // PickerConfig.Validate's bound
	switch {
	case n < 1:
		return fmt.Errorf("EndpointPickerConfig: %s.parameters.maxNumOfEndpoints: %d is invalid: must be 1 or more", ps.path, n)
	case n > most:
		m.cfg.FallbackEndpoints = most
		m.mapped(ps.path+".parameters.maxNumOfEndpoints", "fallbackEndpoints", fmt.Sprintf("%d is more than Tally lists; %d", n, most))
	default:
		m.cfg.FallbackEndpoints = n
		m.mapped(ps.path+".parameters.maxNumOfEndpoints", "fallbackEndpoints", "endpoints listed in the destination header, best first")
	}
	return nil
}

// concurrency maps the concurrency-detector in use: upstream filters out an
// endpoint holding maxConcurrency x (1 + headroom) requests; Tally skips an
// endpoint at saturation.maxInFlightRequests (and answers 429 when every
// endpoint is over it).
func (m *mapper) concurrency(ps *params) error {
	mode, _, err := ps.str("concurrencyMode")
	if err != nil {
		return err
	}
	headroom, _, err := ps.float("headroom")
	if err != nil {
		return err
	}
	if headroom < 0 {
		return fmt.Errorf("EndpointPickerConfig: %s.parameters.headroom: %v is invalid: must be 0 or more", ps.path, headroom)
	}
	if mode == "tokens" {
		if _, _, err := ps.int("maxTokenConcurrency"); err != nil {
			return err
		}
		m.ignore(ps.path+".parameters.maxTokenConcurrency", "Tally limits prefill tokens still queued (saturation.maxPrefillTokens), not the tokens of requests in flight")
		if _, ok, err := ps.int("maxConcurrency"); err != nil {
			return err
		} else if ok {
			m.ignore(ps.path+".parameters.maxConcurrency", "concurrencyMode is tokens, so upstream does not limit requests either")
		}
		return nil
	}
	if mode != "" && mode != "requests" {
		return fmt.Errorf("EndpointPickerConfig: %s.parameters.concurrencyMode: %q is invalid: must be \"requests\" or \"tokens\"", ps.path, mode)
	}
	if _, _, err := ps.int("maxTokenConcurrency"); err != nil {
		return err
	}
	n, ok, err := ps.int("maxConcurrency")
	if err != nil {
		return err
	}
	if !ok {
		n = 100 // the upstream default
	}
	if n < 1 {
		return fmt.Errorf("EndpointPickerConfig: %s.parameters.maxConcurrency: %d is invalid: must be 1 or more", ps.path, n)
	}
	m.cfg.Saturation.MaxInFlightRequests = int(math.Floor(float64(n) * (1 + headroom)))
	m.mapped(ps.path+".parameters.maxConcurrency", "saturation.maxInFlightRequests",
		fmt.Sprintf("%d x (1 + headroom %v); Tally answers 429 once every endpoint is over it", n, headroom))
	return nil
}

// pdDecider maps llm-d's prefix-based-pd-decider: a request is split when
// its prompt has at least promptTokens tokens and at least nonCachedTokens
// of them are not cached on the chosen decode pod; nonCachedTokens 0 (its
// default) never splits. Tally splits only when the prefill pod's queue does
// not make the pair costlier than prefilling on the decode pod, too.
func (m *mapper) pdDecider(ps *params) error {
	d := &m.cfg.Disaggregation
	if n, ok, err := ps.int("nonCachedTokens"); err != nil {
		return err
	} else if ok {
		if n < 0 {
			return fmt.Errorf("EndpointPickerConfig: %s.parameters.nonCachedTokens: %d is invalid: must be 0 (never split) or more", ps.path, n)
		}
		d.NonCachedTokens = n
		m.mapped(ps.path+".parameters.nonCachedTokens", "disaggregation.nonCachedTokens", "the fewest tokens not cached on the decode pod that split a request; 0 never splits")
	}
	if n, ok, err := ps.int("promptTokens"); err != nil {
		return err
	} else if ok {
		if n < 0 {
			return fmt.Errorf("EndpointPickerConfig: %s.parameters.promptTokens: %d is invalid: must be 0 or more", ps.path, n)
		}
		d.PromptTokens = n
		m.mapped(ps.path+".parameters.promptTokens", "disaggregation.promptTokens", "the shortest prompt, in tokens, that may be split")
	}
	return nil
}
