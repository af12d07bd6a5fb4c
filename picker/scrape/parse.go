package scrape

import (
	"bytes"
	"strconv"
	"strings"

	"github.com/tallyepp/tally/picker"
)

// Engine types, as the pod label inference.networking.k8s.io/engine-type
// names them.
const (
	EngineVLLM   = "vllm"
	EngineSGLang = "sglang"
	EngineTRTLLM = "trtllm-serve"
)

// names are the metric families read for one engine type; an empty name is
// not published by that engine.
type names struct {
	running, waiting string
	// cacheInfo is an info gauge whose labels give the KV cache's size:
	// blockSize x numBlocks tokens, or tokens directly.
	cacheInfo, blockSizeLabel, numBlocksLabel string
	// cacheTokens is a gauge of the KV cache's size in tokens.
	cacheTokens string
	// kvUsage (and kvUsageOld, a name older servers use) is a gauge of the
	// share of the KV cache in use, 0 to 1.
	kvUsage, kvUsageOld string
	// prefillSeconds is the _sum series of a histogram of each request's
	// prefill time (first scheduled to first token); promptTokens counts
	// the prompt tokens prefilled, cached ones included, and cachedTokens
	// those found in the prefix cache. All are cumulative; the picker reads
	// the engine's prefill rate from their increase.
	prefillSeconds, promptTokens, cachedTokens string
	// generatedTokens and finishedRequests are the _sum and _count series
	// of a histogram of each finished request's output tokens: the picker
	// learns the pool's expected output from their increase.
	// decodeSeconds is the _sum series of a histogram of each finished
	// request's decode time (first token to last): with the output counts,
	// the pool's decode speed.
	generatedTokens, finishedRequests, decodeSeconds string
	// loraInfo is an info gauge of the LoRA adapters in use: labels of
	// the running and waiting requests' adapters (comma-separated) and
	// the most adapters run at once; its value is the time it was set,
	// and the latest series is read (loraSet).
	loraInfo, loraRunningLabel, loraWaitingLabel, maxLoRALabel string
	// modelLabel names the base model on the request gauges.
	modelLabel string
	// The label filters of running, waiting, kvUsage, loraInfo and
	// cacheInfo (MetricSpec.Labels): only the series that carry them are
	// read; nil reads every series of the family.
	runningLabels, waitingLabels, kvUsageLabels, loraInfoLabels, cacheInfoLabels []Label
}

var engines = map[string]names{
	EngineVLLM: {
		running: "vllm:num_requests_running", waiting: "vllm:num_requests_waiting",
		cacheInfo: "vllm:cache_config_info", blockSizeLabel: "block_size", numBlocksLabel: "num_gpu_blocks",
		kvUsage: "vllm:kv_cache_usage_perc", kvUsageOld: "vllm:gpu_cache_usage_perc",
		prefillSeconds:  "vllm:request_prefill_time_seconds_sum",
		promptTokens:    "vllm:prompt_tokens_total",
		cachedTokens:    "vllm:prefix_cache_hits_total",
		generatedTokens: "vllm:request_generation_tokens_sum", finishedRequests: "vllm:request_generation_tokens_count",
		decodeSeconds: "vllm:request_decode_time_seconds_sum",
		loraInfo:      "vllm:lora_requests_info", loraRunningLabel: "running_lora_adapters",
		loraWaitingLabel: "waiting_lora_adapters", maxLoRALabel: "max_lora",
		modelLabel: "model_name",
	},
	// No prefill timing is read for SGLang or TRT-LLM: their time to
	// first token includes the queue, and no family known to match
	// vLLM's request_prefill_time_seconds is read yet. Neither publishes
	// the adapters it has loaded, as vLLM's lora_requests_info does.
	EngineSGLang: {
		running: "sglang:num_running_reqs", waiting: "sglang:num_queue_reqs",
		// SGLang's token capacity is a gauge of its own; cache_config_info
		// carries only page_size.
		cacheTokens: "sglang:max_total_num_tokens",
		kvUsage:     "sglang:token_usage",
	},
	EngineTRTLLM: {
		running: "trtllm_num_requests_running", waiting: "trtllm_num_requests_waiting",
		kvUsage: "trtllm_kv_cache_utilization",
	},
}

// Known reports whether engine is a type the scraper reads.
func Known(engine string) bool {
	_, ok := engines[engine]
	return ok
}

// parse reads the Prometheus text exposition in body for the families of
// one engine and returns what the picker needs. Series of a family are
// summed (an engine serving several models, or data-parallel ranks), except
// KV cache usage, a share, which is averaged. The prefill timing is set only
// when both the prefill-time sum and the prompt-token counter are published.
// It looks at each line's name only up to the families it knows, so an
// engine publishing hundreds of families costs a scan of its bytes, not a
// parse.
func parse(body []byte, n names) (picker.EngineStats, bool) {
	var st picker.EngineStats
	var running, waiting float64
	// usage sums the current name's series, usageOld the older name's: a
	// server publishing both is read by the current one.
	var usage, usageOld struct {
		sum float64
		n   int
	}
	hasPrefill, hasPrompt := false, false
	hasGenerated, hasFinished, hasDecode := false, false, false
	// loraTied holds the labels of the lora_requests_info series at the
	// newest value (its time of setting): one, unless a change of adapters
	// was set within the clock's resolution of the last.
	var loraTiedBuf [4][]byte
	loraTied := loraTiedBuf[:0]
	loraAt := 0.0
	seenRunning, seenWaiting := false, false
	for len(body) > 0 {
		line := body
		if i := bytes.IndexByte(body, '\n'); i >= 0 {
			line, body = body[:i], body[i+1:]
		} else {
			body = nil
		}
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		end := bytes.IndexAny(line, "{ \t")
		if end <= 0 {
			continue
		}
		// Only the few families of this engine are parsed further. Each
		// string(...) == s is a comparison, never a conversion: no allocation
		// (a switch on string(...) would copy names over 32 bytes).
		//
		// which is the sum a sample adds to; found, if set, records that
		// its family is published.
		var which *float64
		var found *bool
		name := line[:end]
		switch {
		// A label filter is checked in the case itself: two specs may name
		// one family (Triton's request types), and a series the first
		// refuses may be the second's.
		case string(name) == n.running && (n.runningLabels == nil || matches(seriesLabels(line), n.runningLabels)):
			which, found = &running, &seenRunning
		case string(name) == n.waiting && (n.waitingLabels == nil || matches(seriesLabels(line), n.waitingLabels)):
			which, found = &waiting, &seenWaiting
		case string(name) == n.prefillSeconds:
			which, found = &st.PrefillSecondsTotal, &hasPrefill
		case string(name) == n.promptTokens:
			which, found = &st.PromptTokensTotal, &hasPrompt
		case string(name) == n.cachedTokens:
			which = &st.CachedTokensTotal
		case string(name) == n.generatedTokens:
			which, found = &st.GenerationTokensTotal, &hasGenerated
		case string(name) == n.finishedRequests:
			which, found = &st.FinishedRequestsTotal, &hasFinished
		case string(name) == n.decodeSeconds:
			which, found = &st.DecodeSecondsTotal, &hasDecode
		case string(name) == n.kvUsage && n.kvUsageLabels != nil:
			if !matches(seriesLabels(line), n.kvUsageLabels) {
				continue
			}
		case string(name) == n.loraInfo && n.loraInfoLabels != nil:
			if !matches(seriesLabels(line), n.loraInfoLabels) {
				continue
			}
		case string(name) == n.cacheInfo && n.cacheInfoLabels != nil:
			if !matches(seriesLabels(line), n.cacheInfoLabels) {
				continue
			}
		case string(name) == n.cacheTokens, string(name) == n.cacheInfo,
			string(name) == n.kvUsage, string(name) == n.kvUsageOld, string(name) == n.loraInfo:
		default:
			continue
		}
		_, labels, value, ok := splitSample(line)
		if !ok {
			continue
		}
		switch {
		case which != nil:
			*which += value
			if found != nil {
				*found = true
			}
			if which == &running && st.Model == "" && n.modelLabel != "" {
				st.Model = labelString(labels, n.modelLabel)
			}
		case string(name) == n.loraInfo:
			switch {
			case value != value: // NaN: no time, so no order
			case len(loraTied) == 0 || value > loraAt:
				loraTied, loraAt = append(loraTied[:0], labels), value
			case value == loraAt:
				loraTied = append(loraTied, labels)
			}
		case string(name) == n.cacheTokens:
			st.CacheTokens += int(value)
		case string(name) == n.kvUsage:
			usage.sum += value
			usage.n++
		case string(name) == n.kvUsageOld:
			usageOld.sum += value
			usageOld.n++
		default: // cacheInfo
			bs, okB := labelInt(labels, n.blockSizeLabel)
			nb, okN := labelInt(labels, n.numBlocksLabel)
			if okB && okN {
				st.CacheTokens += bs * nb
			}
		}
	}
	seen := seenRunning || seenWaiting
	st.Running, st.Waiting = int(running), int(waiting)
	if len(loraTied) > 0 {
		st.HasLoRA = true
		lora := loraSet{running: -1, waiting: -1}
		if seenRunning {
			lora.running = st.Running
		}
		if seenWaiting {
			lora.waiting = st.Waiting
		}
		lora.choose(loraTied, n)
		st.RunningAdapters, st.WaitingAdapters, st.MaxLoRAs = lora.runningAdapters, lora.waitingAdapters, lora.max
	}
	st.HasPrefillTiming = hasPrefill && hasPrompt
	if !st.HasPrefillTiming {
		st.PrefillSecondsTotal, st.PromptTokensTotal, st.CachedTokensTotal = 0, 0, 0
	}
	st.HasOutputCounts = hasGenerated && hasFinished
	if !st.HasOutputCounts {
		st.GenerationTokensTotal, st.FinishedRequestsTotal = 0, 0
	}
	st.HasDecodeTiming = st.HasOutputCounts && hasDecode
	if !st.HasDecodeTiming {
		st.DecodeSecondsTotal = 0
	}
	if usage.n == 0 {
		usage = usageOld
	}
	if usage.n > 0 {
		st.KVCacheUsage = min(max(usage.sum/float64(usage.n), 0), 1)
		st.HasKVCacheUsage = true
	}
	return st, seen
}

// loraSet is the adapter set read from vLLM's lora_requests_info. vLLM sets
// the series of the current running and waiting adapters to the current
// time on each stats update, so a new series appears each time the set
// changes and the current one is the newest. Two series can share the
// newest value: a clock read to whole seconds, or two changes within its
// resolution. The upstream picker keeps the first of them (the datalayer
// extractor) or passes over a series whose lists are both empty (the older
// backend), so it reads an adapter as running after its last request has
// ended; among ties this one reads the series that agrees with the
// engine's request counts, set in the same stats update, and then the
// fewest adapters: a phantom adapter makes an idle engine look full (with
// max_lora 1, for every other adapter), a missed one costs only an
// adapter's load time.
type loraSet struct {
	// running and waiting are the engine's running and waiting requests;
	// -1 when it does not publish them.
	running, waiting int

	runningAdapters, waitingAdapters []string
	max                              int
}

// choose reads the set from the labels of the series tied at the newest
// value (at least one).
func (l *loraSet) choose(tied [][]byte, n names) {
	var best []byte
	for i, labels := range tied {
		r := splitNames(labelString(labels, n.loraRunningLabel))
		w := splitNames(labelString(labels, n.loraWaitingLabel))
		if i > 0 && !l.before(r, w, labels, best) {
			continue
		}
		best, l.runningAdapters, l.waitingAdapters = labels, r, w
	}
	l.max, _ = labelInt(best, n.maxLoRALabel)
	// An engine that runs nothing runs no adapter, whatever the newest
	// series says: with several API server processes, vLLM's gauge sums
	// the processes' times, so an old set that each process set can
	// outweigh the newer one that only one did.
	if l.running == 0 {
		l.runningAdapters = nil
	}
	if l.waiting == 0 {
		l.waitingAdapters = nil
	}
}

// before reports whether the series of labels, with running r and
// waiting w, is to be read rather than the one chosen so far (of labels
// than, with l's lists): the one that agrees with the request counts, then
// fewer running adapters, then fewer waiting ones, then the labels' bytes,
// so that the order of the exposition does not matter.
func (l *loraSet) before(r, w []string, labels, than []byte) bool {
	if a, b := l.agrees(r, w), l.agrees(l.runningAdapters, l.waitingAdapters); a != b {
		return a
	}
	if len(r) != len(l.runningAdapters) {
		return len(r) < len(l.runningAdapters)
	}
	if len(w) != len(l.waitingAdapters) {
		return len(w) < len(l.waitingAdapters)
	}
	return bytes.Compare(labels, than) < 0
}

// agrees reports whether lists of running and waiting adapters fit the
// engine's request counts: each adapter listed is some request's.
func (l *loraSet) agrees(r, w []string) bool {
	return (l.running < 0 || len(r) <= l.running) && (l.waiting < 0 || len(w) <= l.waiting)
}

// splitSample splits `name{labels} value [timestamp]`.
func splitSample(line []byte) (name, labels []byte, value float64, ok bool) {
	end := bytes.IndexAny(line, "{ \t")
	if end <= 0 {
		return nil, nil, 0, false
	}
	name, rest := line[:end], line[end:]
	if rest[0] == '{' {
		close := bytes.LastIndexByte(rest, '}')
		if close < 0 {
			return nil, nil, 0, false
		}
		labels, rest = rest[1:close], rest[close+1:]
	}
	rest = bytes.TrimLeft(rest, " \t")
	if i := bytes.IndexAny(rest, " \t"); i >= 0 {
		rest = rest[:i] // a timestamp follows
	}
	v, err := strconv.ParseFloat(string(rest), 64)
	if err != nil {
		return nil, nil, 0, false
	}
	return name, labels, v, true
}

// labelInt finds key="123" among labels.
func labelInt(labels []byte, key string) (int, bool) {
	for len(labels) > 0 {
		eq := bytes.IndexByte(labels, '=')
		if eq < 0 || eq+1 >= len(labels) || labels[eq+1] != '"' {
			return 0, false
		}
		k := bytes.TrimSpace(labels[:eq])
		v := labels[eq+2:]
		closeQuote := bytes.IndexByte(v, '"') // engines' numeric labels carry no escapes
		if closeQuote < 0 {
			return 0, false
		}
		if string(k) == key {
			n, err := strconv.Atoi(string(v[:closeQuote]))
			return n, err == nil
		}
		labels = bytes.TrimLeft(v[closeQuote+1:], ", ")
	}
	return 0, false
}

// labelString finds key="value" among labels and returns value, its
// escapes (\\, \", \n) decoded; "" when absent.
func labelString(labels []byte, key string) string {
	for len(labels) > 0 {
		eq := bytes.IndexByte(labels, '=')
		if eq < 0 || eq+1 >= len(labels) || labels[eq+1] != '"' {
			return ""
		}
		k := bytes.TrimSpace(labels[:eq])
		v := labels[eq+2:]
		var out []byte
		i := 0
		for ; i < len(v) && v[i] != '"'; i++ {
			if v[i] == '\\' && i+1 < len(v) {
				i++
				switch v[i] {
				case 'n':
					out = append(out, '\n')
				default:
					out = append(out, v[i])
				}
				continue
			}
			out = append(out, v[i])
		}
		if i >= len(v) {
			return ""
		}
		if string(k) == key {
			return string(out)
		}
		labels = bytes.TrimLeft(v[i+1:], ", ")
	}
	return ""
}

// splitNames splits a comma-separated list of adapter names; nil for none.
func splitNames(s string) []string {
	var out []string
	for _, name := range strings.Split(s, ",") {
		if name = strings.TrimSpace(name); name != "" {
			out = append(out, name)
		}
	}
	return out
}
