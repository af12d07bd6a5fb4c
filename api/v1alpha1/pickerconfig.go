package v1alpha1

import (
	"cmp"
	"errors"
	"fmt"
	"strings"

	"sigs.k8s.io/yaml"
)

const (
	// GroupVersion is the apiVersion a PickerConfig file declares.
	GroupVersion = "tally.tallyepp.io/v1alpha1"
	// KindPickerConfig is the kind a PickerConfig file declares.
	KindPickerConfig = "PickerConfig"
)

// Defaults, each with its unit in its name.
const (
	// DefaultBlockSizeChars is about 128 tokens: a match misses at most 127
	// tokens of a shared prefix, and with maxPromptBlocks the index covers
	// about 48,000 tokens in these blocks (then more in coarse ones) in
	// at most 500 blocks, recorded within about 100 µs. Finer blocks cover
	// less of a long prompt in the same time: on a real conversation trace
	// (Mooncake, prompts of 22,000 tokens on average) 512 placed requests
	// better than 256 (cmd/routesim; docs/benchmarks.md).
	DefaultBlockSizeChars = 512
	// DefaultLRUCapacityBlocks is about 1.6 million tokens per endpoint,
	// until the endpoint's engine says how large its KV cache is.
	DefaultLRUCapacityBlocks  = 12_500
	DefaultCharsPerToken      = 4
	DefaultDecodeWeightTokens = 128
	DefaultFallbackEndpoints  = 3
	// MaxFallbackEndpoints is the longest destination list a pick returns.
	MaxFallbackEndpoints         = 16
	DefaultMaxRequestBytes int64 = 32 << 20
	// DefaultEndpointRetentionSeconds is how long an endpoint that left the
	// set keeps its ledger row and prefix memory (a readiness flap).
	DefaultEndpointRetentionSeconds = 300
	// DefaultPrefillTokensPerSecond is each endpoint's starting prefill rate,
	// before the picker has learned it from streamed first bytes.
	DefaultPrefillTokensPerSecond = 10_000
	// DefaultTransferTokensPerSecond is a KV transfer between pods (NIXL
	// over RDMA) of an 8B model: 16 tokens' blocks in 50 µs.
	DefaultTransferTokensPerSecond = 320_000
	// DefaultMaxPromptBlocks caps the prompt blocks hashed and recorded per
	// request, so that a huge prompt holds the picker's lock no longer than
	// a 32,000-token one (250 blocks of 512 characters): 375 blocks of
	// blockSizeChars (about 48,000 tokens), then 125 of 16 times that
	// (about 256,000 tokens more).
	DefaultMaxPromptBlocks = 500
	// DefaultLoRALoadMilliseconds is what loading a LoRA adapter costs
	// an engine before its request's prefill starts.
	DefaultLoRALoadMilliseconds = 200
)

// Flow control defaults (flowControl), each with its unit in its name.
const (
	// DefaultHoldPrefillMilliseconds: an endpoint is saturated once the
	// prefill queued on it would take a quarter of a second at its prefill
	// rate (about 2,500 tokens at 10,000 tokens/s).
	DefaultHoldPrefillMilliseconds = 250
	// DefaultRequestTTLSeconds is how long a request may wait in the
	// queue, as the upstream picker's queue TTL.
	DefaultRequestTTLSeconds = 60
	// DefaultMaxReorderMilliseconds bounds how long the cheapest-first
	// order may pass over a request: older ones are served oldest first.
	DefaultMaxReorderMilliseconds = 4000
	// DefaultBandMaxRequests and DefaultBandMaxBytes are each priority
	// band's limits, as upstream's defaults.
	DefaultBandMaxRequests       = 5000
	DefaultBandMaxBytes    int64 = 1_000_000_000
)

// Flow control orderings and fairness policies.
const (
	OrderingCheapest     = "cheapest"
	OrderingFCFS         = "fcfs"
	FairnessRoundRobin   = "round-robin"
	FairnessGlobalStrict = "global-strict"
	DefaultOrdering      = OrderingCheapest
	DefaultFairness      = FairnessRoundRobin
)

// PickerConfig configures how the picker scores and places requests.
// Every field is optional; Load fills in the defaults above.
type PickerConfig struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`

	// BlockSizeChars is the size, in characters of prompt text, of one prefix
	// block: the unit in which shared prefixes are found (512 is about 128 tokens).
	BlockSizeChars int `json:"blockSizeChars,omitempty"`
	// LRUCapacityBlocks is how many prefix blocks are remembered per endpoint;
	// the least recently used are forgotten first.
	LRUCapacityBlocks int `json:"lruCapacityBlocks,omitempty"`
	// CharsPerToken estimates tokens from prompt characters.
	CharsPerToken int `json:"charsPerToken,omitempty"`
	// DecodeWeightTokens is what one decoding request on an endpoint adds to
	// its cost, in prefill tokens. Zero means the default; use a small value
	// such as 1 to make decoding load nearly irrelevant.
	DecodeWeightTokens int `json:"decodeWeightTokens,omitempty"`
	// FallbackEndpoints is how many endpoints, best first, the picker lists in
	// the destination header so the gateway can fall back on a failure.
	FallbackEndpoints int `json:"fallbackEndpoints,omitempty"`
	// MaxRequestBytes bounds a request body; a larger one is answered 413.
	MaxRequestBytes int64 `json:"maxRequestBytes,omitempty"`
	// MaxBufferedRequestBytes bounds the request bytes buffered over all
	// streams at once; a stream that would pass it is answered 503. Zero
	// derives it from the memory limit the picker runs under (GOMEMLIMIT):
	// half of it, or 1 GiB without one, and never less than maxRequestBytes.
	MaxBufferedRequestBytes int64 `json:"maxBufferedRequestBytes,omitempty"`
	// MaxPromptBlocks caps the prompt blocks hashed and recorded per request:
	// the first three quarters are blockSizeChars long, the rest 16 times
	// as long. A longer prompt is matched and recorded on what those cover
	// only (its prefill cost still counts every token).
	MaxPromptBlocks int `json:"maxPromptBlocks,omitempty"`
	// EndpointRetentionSeconds is how long an endpoint that left the pool's
	// endpoint set (a pod turned NotReady) keeps its ledger row and prefix
	// memory; it keeps them anyway while requests are still in flight on it.
	EndpointRetentionSeconds int `json:"endpointRetentionSeconds,omitempty"`
	// PrefillTokensPerSecond is the starting estimate of each endpoint's
	// prefill rate; the picker learns the real rate from streamed responses.
	PrefillTokensPerSecond int `json:"prefillTokensPerSecond,omitempty"`
	// LoRALoadMilliseconds is what a request for a LoRA adapter costs more
	// on an endpoint whose engine has not loaded it (an engine that
	// publishes vLLM's lora_requests_info): about the time to load it. It
	// is the starting value: the picker learns the load time from the
	// streamed first bytes of requests that waited for a load.
	LoRALoadMilliseconds int `json:"loraLoadMilliseconds,omitempty"`
	// Saturation, when set, answers 429 once every candidate endpoint is over
	// a limit (a request without a body is routed all the same). Off by
	// default: requests queue on the model servers instead.
	Saturation Saturation `json:"saturation,omitempty"`
	// FlowControl, when enabled, holds requests in the picker while every
	// candidate endpoint is saturated, and dispatches them best first as
	// capacity frees. Off by default.
	FlowControl FlowControl `json:"flowControl,omitempty"`
	// Disaggregation, when on, lets a request's prefill run on another pod
	// than the one that decodes it (llm-d's prefill/decode
	// disaggregation; pods carry the llm-d.ai/role label). Off by default.
	Disaggregation Disaggregation `json:"disaggregation,omitempty"`
}

// Disaggregation is when a request's prefill runs on a prefill pod, the KV
// cache moving to its decode pod: as llm-d's prefix-based-pd-decider, only
// for a prompt of at least PromptTokens whose tokens not cached on the
// chosen decode pod are at least NonCachedTokens, and, beyond llm-d, only
// when the prefill pod's queue does not make the pair costlier than
// prefilling on the decode pod.
type Disaggregation struct {
	// NonCachedTokens is the fewest uncached prompt tokens that split a
	// request; 0 turns disaggregation off (llm-d's default).
	NonCachedTokens int `json:"nonCachedTokens,omitempty"`
	// PromptTokens is the shortest prompt, in tokens, that may be split.
	PromptTokens int `json:"promptTokens,omitempty"`
	// TransferTokensPerSecond is how fast a prefill pod's KV cache reaches
	// a decode pod, in prompt tokens: a split pays its uncached tokens'
	// transfer at this rate in its time to first token.
	TransferTokensPerSecond int `json:"transferTokensPerSecond,omitempty"`
}

// Enabled reports whether requests may be split.
func (d Disaggregation) Enabled() bool { return d.NonCachedTokens > 0 }

// FlowControl is late binding: a request that arrives while every candidate
// endpoint is saturated waits in the picker, its stream held open, and is
// placed when an endpoint frees, by priority band (the InferenceObjective's
// priority, highest first), fairness between flows in a band (the
// x-gateway-inference-fairness-id header), and order inside a flow.
type FlowControl struct {
	Enabled bool `json:"enabled,omitempty"`
	// HoldPrefillMilliseconds is the saturation threshold: an endpoint is
	// saturated while the prefill queued on it (the ledger's drain model,
	// plus load its engine reports beyond the ledger) would take this long
	// at its learned prefill rate.
	HoldPrefillMilliseconds int `json:"holdPrefillMilliseconds,omitempty"`
	// MaxDecodingRequests saturates an endpoint once this many of its
	// requests are decoding; 0 is no limit.
	MaxDecodingRequests int `json:"maxDecodingRequests,omitempty"`
	// RequestTTLSeconds is the longest wait; past it the request is
	// answered 429.
	RequestTTLSeconds int `json:"requestTTLSeconds,omitempty"`
	// Ordering inside a flow: "cheapest" (the request with the least
	// uncached prefill on the freed endpoint first, oldest first past
	// maxReorderMilliseconds) or "fcfs".
	Ordering string `json:"ordering,omitempty"`
	// MaxReorderMilliseconds: a request that has waited this long is no
	// longer passed over by cheaper ones (ordering "cheapest").
	MaxReorderMilliseconds int `json:"maxReorderMilliseconds,omitempty"`
	// Fairness between the flows of a band: "round-robin" (each flow in
	// turn) or "global-strict" (the flow whose oldest request is oldest).
	Fairness string `json:"fairness,omitempty"`
	// MaxRequests and MaxBytes bound the whole queue; 0 is no bound.
	MaxRequests int   `json:"maxRequests,omitempty"`
	MaxBytes    int64 `json:"maxBytes,omitempty"`
	// DefaultBand holds the limits of a priority not listed in bands.
	DefaultBand Band `json:"defaultBand,omitempty"`
	// Bands sets the limits of particular priorities; a zero limit takes
	// defaultBand's.
	Bands []Band `json:"bands,omitempty"`
}

// Band is the queue limit of one priority: requests waiting, and their
// body bytes. A request past either is answered 429.
type Band struct {
	Priority    int   `json:"priority"`
	MaxRequests int   `json:"maxRequests,omitempty"`
	MaxBytes    int64 `json:"maxBytes,omitempty"`
}

// BandFor returns the limits of priority: its entry in Bands, or
// DefaultBand, zero limits filled from DefaultBand.
func (f FlowControl) BandFor(priority int) Band {
	b := f.DefaultBand
	for _, x := range f.Bands {
		if x.Priority == priority {
			b.MaxRequests, b.MaxBytes = cmp.Or(x.MaxRequests, b.MaxRequests), cmp.Or(x.MaxBytes, b.MaxBytes)
			break
		}
	}
	b.Priority = priority
	return b
}

// Saturation limits per endpoint. Zero turns a limit off.
type Saturation struct {
	// MaxInFlightRequests is the most requests one endpoint may hold.
	MaxInFlightRequests int `json:"maxInFlightRequests,omitempty"`
	// MaxPrefillTokens is the most outstanding prefill tokens one endpoint may hold.
	MaxPrefillTokens int `json:"maxPrefillTokens,omitempty"`
}

// Default returns the configuration used when no file is given.
func Default() PickerConfig {
	c := PickerConfig{}
	c.setDefaults()
	return c
}

// WithDefaults returns c with every zero field set to its default: the one
// place defaults are filled in, for Load and for callers that build a
// PickerConfig in code.
func WithDefaults(c PickerConfig) PickerConfig {
	c.setDefaults()
	return c
}

func (c *PickerConfig) setDefaults() {
	c.APIVersion = cmp.Or(c.APIVersion, GroupVersion)
	c.Kind = cmp.Or(c.Kind, KindPickerConfig)
	c.BlockSizeChars = cmp.Or(c.BlockSizeChars, DefaultBlockSizeChars)
	c.LRUCapacityBlocks = cmp.Or(c.LRUCapacityBlocks, DefaultLRUCapacityBlocks)
	c.CharsPerToken = cmp.Or(c.CharsPerToken, DefaultCharsPerToken)
	c.DecodeWeightTokens = cmp.Or(c.DecodeWeightTokens, DefaultDecodeWeightTokens)
	c.FallbackEndpoints = cmp.Or(c.FallbackEndpoints, DefaultFallbackEndpoints)
	c.MaxRequestBytes = cmp.Or(c.MaxRequestBytes, DefaultMaxRequestBytes)
	c.MaxPromptBlocks = cmp.Or(c.MaxPromptBlocks, DefaultMaxPromptBlocks)
	c.EndpointRetentionSeconds = cmp.Or(c.EndpointRetentionSeconds, DefaultEndpointRetentionSeconds)
	c.PrefillTokensPerSecond = cmp.Or(c.PrefillTokensPerSecond, DefaultPrefillTokensPerSecond)
	c.LoRALoadMilliseconds = cmp.Or(c.LoRALoadMilliseconds, DefaultLoRALoadMilliseconds)
	c.Disaggregation.TransferTokensPerSecond = cmp.Or(c.Disaggregation.TransferTokensPerSecond, DefaultTransferTokensPerSecond)
	f := &c.FlowControl
	f.HoldPrefillMilliseconds = cmp.Or(f.HoldPrefillMilliseconds, DefaultHoldPrefillMilliseconds)
	f.RequestTTLSeconds = cmp.Or(f.RequestTTLSeconds, DefaultRequestTTLSeconds)
	f.Ordering = cmp.Or(f.Ordering, DefaultOrdering)
	f.MaxReorderMilliseconds = cmp.Or(f.MaxReorderMilliseconds, DefaultMaxReorderMilliseconds)
	f.Fairness = cmp.Or(f.Fairness, DefaultFairness)
	f.DefaultBand.MaxRequests = cmp.Or(f.DefaultBand.MaxRequests, DefaultBandMaxRequests)
	f.DefaultBand.MaxBytes = cmp.Or(f.DefaultBand.MaxBytes, DefaultBandMaxBytes)
}

// Load decodes a PickerConfig strictly (an unknown field is an error),
// fills in defaults and validates it. Errors name the field at fault and
// what it accepts.
func Load(data []byte) (PickerConfig, error) {
	var c PickerConfig
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		return PickerConfig{}, fmt.Errorf("picker config: %s", strings.TrimPrefix(err.Error(), "error unmarshaling JSON: while decoding JSON: "))
	}
	c.setDefaults()
	if err := c.Validate(); err != nil {
		return PickerConfig{}, err
	}
	return c, nil
}

// Validate reports every invalid field, one per line.
func (c *PickerConfig) Validate() error {
	var errs []error
	bad := func(field string, got any, accepted string) {
		errs = append(errs, fmt.Errorf("picker config: %s: %v is invalid: %s", field, got, accepted))
	}
	if c.APIVersion != GroupVersion {
		bad("apiVersion", fmt.Sprintf("%q", c.APIVersion), fmt.Sprintf("must be %q", GroupVersion))
	}
	if c.Kind != KindPickerConfig {
		bad("kind", fmt.Sprintf("%q", c.Kind), fmt.Sprintf("must be %q", KindPickerConfig))
	}
	if c.BlockSizeChars < 4 || c.BlockSizeChars > 4096 {
		bad("blockSizeChars", c.BlockSizeChars, "must be from 4 to 4096")
	}
	if c.LRUCapacityBlocks < 1 || c.LRUCapacityBlocks > 100_000_000 {
		bad("lruCapacityBlocks", c.LRUCapacityBlocks, "must be from 1 to 100000000")
	}
	if c.CharsPerToken < 1 || c.CharsPerToken > 64 {
		bad("charsPerToken", c.CharsPerToken, "must be from 1 to 64")
	}
	if c.DecodeWeightTokens < 0 || c.DecodeWeightTokens > 1_000_000 {
		bad("decodeWeightTokens", c.DecodeWeightTokens, "must be from 0 to 1000000")
	}
	if c.FallbackEndpoints < 1 || c.FallbackEndpoints > MaxFallbackEndpoints {
		bad("fallbackEndpoints", c.FallbackEndpoints, fmt.Sprintf("must be from 1 to %d", MaxFallbackEndpoints))
	}
	if c.MaxRequestBytes < 1024 || c.MaxRequestBytes > 1<<30 {
		bad("maxRequestBytes", c.MaxRequestBytes, "must be from 1024 to 1073741824")
	}
	if c.MaxBufferedRequestBytes != 0 && (c.MaxBufferedRequestBytes < c.MaxRequestBytes || c.MaxBufferedRequestBytes > 1<<40) {
		bad("maxBufferedRequestBytes", c.MaxBufferedRequestBytes, "must be 0 (derived from the memory limit) or from maxRequestBytes to 1099511627776")
	}
	if c.MaxPromptBlocks < 1 || c.MaxPromptBlocks > 1_000_000 {
		bad("maxPromptBlocks", c.MaxPromptBlocks, "must be from 1 to 1000000")
	}
	if c.EndpointRetentionSeconds < 1 || c.EndpointRetentionSeconds > 86_400 {
		bad("endpointRetentionSeconds", c.EndpointRetentionSeconds, "must be from 1 to 86400")
	}
	if c.PrefillTokensPerSecond < 1 || c.PrefillTokensPerSecond > 100_000_000 {
		bad("prefillTokensPerSecond", c.PrefillTokensPerSecond, "must be from 1 to 100000000")
	}
	if c.LoRALoadMilliseconds < 1 || c.LoRALoadMilliseconds > 600_000 {
		bad("loraLoadMilliseconds", c.LoRALoadMilliseconds, "must be from 1 to 600000")
	}
	if c.Saturation.MaxInFlightRequests < 0 {
		bad("saturation.maxInFlightRequests", c.Saturation.MaxInFlightRequests, "must be 0 (off) or more")
	}
	if c.Saturation.MaxPrefillTokens < 0 {
		bad("saturation.maxPrefillTokens", c.Saturation.MaxPrefillTokens, "must be 0 (off) or more")
	}
	if d := c.Disaggregation; d.NonCachedTokens < 0 || d.NonCachedTokens > 100_000_000 {
		bad("disaggregation.nonCachedTokens", d.NonCachedTokens, "must be 0 (off) or from 1 to 100000000")
	}
	if d := c.Disaggregation; d.PromptTokens < 0 || d.PromptTokens > 100_000_000 {
		bad("disaggregation.promptTokens", d.PromptTokens, "must be from 0 to 100000000")
	}
	if d := c.Disaggregation; d.TransferTokensPerSecond < 1 || d.TransferTokensPerSecond > 1_000_000_000 {
		bad("disaggregation.transferTokensPerSecond", d.TransferTokensPerSecond, "must be from 1 to 1000000000")
	}
	f := c.FlowControl
	if f.HoldPrefillMilliseconds < 1 || f.HoldPrefillMilliseconds > 600_000 {
		bad("flowControl.holdPrefillMilliseconds", f.HoldPrefillMilliseconds, "must be from 1 to 600000")
	}
	if f.MaxDecodingRequests < 0 {
		bad("flowControl.maxDecodingRequests", f.MaxDecodingRequests, "must be 0 (no limit) or more")
	}
	if f.RequestTTLSeconds < 1 || f.RequestTTLSeconds > 3600 {
		bad("flowControl.requestTTLSeconds", f.RequestTTLSeconds, "must be from 1 to 3600")
	}
	if f.Ordering != OrderingCheapest && f.Ordering != OrderingFCFS {
		bad("flowControl.ordering", fmt.Sprintf("%q", f.Ordering), fmt.Sprintf("must be %q or %q", OrderingCheapest, OrderingFCFS))
	}
	if f.MaxReorderMilliseconds < 1 || f.MaxReorderMilliseconds > 3_600_000 {
		bad("flowControl.maxReorderMilliseconds", f.MaxReorderMilliseconds, "must be from 1 to 3600000")
	}
	if f.Fairness != FairnessRoundRobin && f.Fairness != FairnessGlobalStrict {
		bad("flowControl.fairness", fmt.Sprintf("%q", f.Fairness), fmt.Sprintf("must be %q or %q", FairnessRoundRobin, FairnessGlobalStrict))
	}
	if f.MaxRequests < 0 {
		bad("flowControl.maxRequests", f.MaxRequests, "must be 0 (no bound) or more")
	}
	if f.MaxBytes < 0 {
		bad("flowControl.maxBytes", f.MaxBytes, "must be 0 (no bound) or more")
	}
	if f.DefaultBand.MaxRequests < 1 {
		bad("flowControl.defaultBand.maxRequests", f.DefaultBand.MaxRequests, "must be 1 or more")
	}
	if f.DefaultBand.MaxBytes < 1 {
		bad("flowControl.defaultBand.maxBytes", f.DefaultBand.MaxBytes, "must be 1 or more")
	}
	seen := map[int]bool{}
	for i, b := range f.Bands {
		if seen[b.Priority] {
			bad(fmt.Sprintf("flowControl.bands[%d].priority", i), b.Priority, "must differ from every other band's")
		}
		seen[b.Priority] = true
		if b.MaxRequests < 0 {
			bad(fmt.Sprintf("flowControl.bands[%d].maxRequests", i), b.MaxRequests, "must be 0 (defaultBand's) or more")
		}
		if b.MaxBytes < 0 {
			bad(fmt.Sprintf("flowControl.bands[%d].maxBytes", i), b.MaxBytes, "must be 0 (defaultBand's) or more")
		}
	}
	return errors.Join(errs...)
}
