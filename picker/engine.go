package picker

import (
	"math"
	"net/netip"
	"time"

	"github.com/tallyepp/tally/picker/internal/ratemodel"
)

// The engine's own view of an endpoint, as its /metrics report it, corrects
// the ledger for what the ledger cannot see; it never gates a pick. A
// scraper (package picker/scrape) reads each endpoint's metrics on an
// interval and hands the picker each round at once (ObserveScrapes: counts,
// cumulative counters, model, adapters), under one hold of the lock.
//
//   - Foreign load: requests the engine runs or queues beyond the ledger's
//     in-flight count for it came from elsewhere (another gateway, another
//     picker replica, a batch job calling the Service, or everything before
//     this picker started). Each counts in the endpoint's cost as one
//     prompt's prefill, the mean prompt placed here (no engine the scraper
//     reads publishes its queued prompt tokens).
//     The correction fades once scrapes stop coming.
//   - Prefix capacity: the engine's KV cache size, in tokens, sizes the
//     endpoint's prefix index (the configured lruCapacityBlocks is the
//     fallback when the engine does not say).
//   - Health: an endpoint whose scrapes fail ScrapeFailureThreshold times in
//     a row stops being a candidate until one succeeds, unless every
//     endpoint is failing (then none is excluded: a broken metrics port must
//     not take the pool down).

// EngineStats is what one scrape of an endpoint's model server said.
type EngineStats struct {
	// Running and Waiting are the engine's running and queued requests.
	Running, Waiting int
	// CacheTokens is the KV cache's size in tokens; 0 when not published.
	CacheTokens int
	// KVCacheUsage is the share of the KV cache in use (0 to 1), when
	// HasKVCacheUsage. It is reported, never scored: the ledger and the
	// prefix index already say what the picker placed there.
	KVCacheUsage    float64
	HasKVCacheUsage bool
	// The engine's own prefill timing, when HasPrefillTiming: cumulative
	// counters since the engine started (vLLM's
	// vllm:request_prefill_time_seconds histogram sum, vllm:prompt_tokens_total
	// and vllm:prefix_cache_hits_total). The picker learns the endpoint's
	// prefill rate from their increase between scrapes: uncached prompt
	// tokens over prefill seconds.
	PrefillSecondsTotal float64
	PromptTokensTotal   float64
	CachedTokensTotal   float64
	HasPrefillTiming    bool
	// The engine's output counts, when HasOutputCounts: cumulative since
	// it started (vLLM's vllm:request_generation_tokens histogram, its sum
	// and its count: the output tokens of the requests that finished, and
	// how many finished). The pool learns the expected output of a request
	// from their increase between scrapes, as from the responses it sees:
	// a gateway that ends the stream at the pick shows it none.
	GenerationTokensTotal float64
	FinishedRequestsTotal float64
	HasOutputCounts       bool
	// DecodeSecondsTotal, when HasDecodeTiming (which needs the output
	// counts), is the engine's own decode time of the requests that
	// finished, cumulative (vLLM's vllm:request_decode_time_seconds
	// histogram sum: each request's first token to its last). With the
	// output counts it teaches the pool's decode speed: seconds over the
	// tokens after each request's first.
	DecodeSecondsTotal float64
	HasDecodeTiming    bool
	// Model is the base model the engine serves (the model_name label of
	// its request gauges); "" when it publishes none.
	Model string
	// LoRA adapters, when HasLoRA (vLLM's vllm:lora_requests_info): the
	// adapters of the engine's running and waiting requests, and how many
	// adapters it runs at once (its --max-loras; 0 when not said).
	RunningAdapters, WaitingAdapters []string
	MaxLoRAs                         int
	HasLoRA                          bool
}

// ScrapeTarget is one endpoint to scrape.
type ScrapeTarget struct {
	Address netip.AddrPort
	Engine  string
}

const (
	// DefaultScrapeFailureThreshold is how many scrapes in a row must fail
	// before an endpoint stops being a candidate.
	DefaultScrapeFailureThreshold = 5
	// defaultForeignRequestTokens sizes a foreign request before any prompt
	// has been placed.
	defaultForeignRequestTokens = 1024
	// meanPromptWeight is the weight of each new prompt in the mean.
	meanPromptWeight = 0.01
	// A scrape's foreign load counts in full for foreignFresh, then fades
	// with time constant foreignFade: scrapes that stop must not leave a
	// pod looking busy forever.
	foreignFresh = time.Second
	foreignFade  = 2 * time.Second
)

// engineView is an endpoint's row's copy of its engine's last scrape.
type engineView struct {
	// What every pick reads (foreignCost, cacheTrust) first.
	foreign       int // requests beyond the ledger at the last scrape
	foreignTokens int // the prefill cost of one of them
	// behind is the prefill, in tokens, of the requests the engine said
	// were waiting whose prefill the model had ended (observeEngine), and
	// while lagging, of the detached ones whose prefill it ended since.
	behind  int
	lagging bool
	at      int64 // when the last scrape was handed over
	// The share of predicted cached tokens the engine delivered, a mean
	// over its recent predictions; see cacheTrust.
	delivery ratemodel.DecayedMean

	scraped          bool
	running, waiting int
	busyAt           int64 // when the last scrape that found requests running or waiting was sent
	sentAt           int64 // when the last scrape was sent
	// The most requests the ledger held here since the last scrape (see
	// observeEngine).
	peak int
	// finished is how many fewer requests than the ledger held the last
	// scrape found, and recent the picks made here that may not have
	// reached the engine yet (see observeEngine).
	finished int
	recent   pickTimes
	// The engine's output counters and decode time at the start of the
	// current window (observeOutputCounts); outputBase is false
	// until one is read, and decodeBase says whether it had the decode
	// time.
	baseGenerated, baseFinished, baseDecode float64
	outputBase, decodeBase                  bool
	failures                                int
	// legFailures are the prefill legs in a row it failed (legFailed),
	// and until legsOffUntil it prefills for no other pod.
	legFailures          int
	legsOffUntil         int64
	legFailuresTotal     int64
	unhealthy            bool
	excluded             bool // unhealthy while another endpoint is healthy
	cacheTokens          int
	kvUsage              float64 // -1: not published
	delivered, predicted int64   // cached prompt tokens delivered by the engine, and predicted
	// LoRA (adapters.go): whether the engine publishes its adapters, its
	// base model, the adapters of its running and waiting requests, and
	// how many it runs at once.
	lora                             bool
	model                            string
	runningAdapters, waitingAdapters []string
	maxLoRAs                         int
}

// How the prefix index's predictions on an endpoint are trusted: each
// response that reports its cached tokens, of a request predicted to find
// some, adds the share delivered (at most 1) to a mean decayed by
// cacheTrustDecay at each, which starts from cacheTrustPrior samples of
// full trust. An engine that delivers at least cacheTrustFull of them is
// trusted in full: engines deliver less than predicted for reasons that
// pass (an eviction, a prefix another request is still computing), and
// prefix affinity is worth keeping through them.
const (
	cacheTrustDecay = 0.9
	cacheTrustPrior = 2
	cacheTrustFull  = 0.5
)

// learnCacheTrust takes a response's delivered cached tokens against the
// predicted.
func (e *engineView) learnCacheTrust(delivered, predicted int) {
	if predicted <= 0 {
		return
	}
	if e.delivery.Weight() == 0 {
		e.delivery = ratemodel.StartedAt(1, cacheTrustPrior)
	}
	e.delivery.Add(min(float64(delivered)/float64(predicted), 1), cacheTrustDecay)
}

// cacheTrust is the share of the prefix index's predicted cached tokens the
// endpoint's engine is taken to hold: 1 until responses say it delivers
// less than cacheTrustFull of them, then in proportion. An
// engine without prefix caching delivers none of them, and one that evicts
// early delivers part: the index still records every prompt it served (a
// shortfall does not forget, as the engine recomputed the blocks), so
// without this a non-caching engine would keep drawing repeats on a cache
// it does not have.
func (e *engineView) cacheTrust() float64 {
	if e.delivery.Weight() == 0 {
		return 1
	}
	return min(e.delivery.Mean()/cacheTrustFull, 1)
}

// foreignCost is the share of the endpoint's cost at now of the load its
// engine reported beyond the ledger's model: foreign requests, and the
// prefill it had not begun that the model had ended. Every candidate of
// every pick takes it: the common case, none, inlines.
func (e *engineView) foreignCost(now int64) int {
	if e.foreign|e.behind == 0 {
		return 0
	}
	return e.fadedForeignCost(now)
}

// fadedForeignCost is foreignCost where there is such load: in full
// while the scrape is fresh, then fading.
func (e *engineView) fadedForeignCost(now int64) int {
	full := float64(e.foreign*e.foreignTokens + e.behind)
	age := time.Duration(now - e.at)
	if age <= foreignFresh {
		return int(full)
	}
	return int(full * math.Exp(-float64(age-foreignFresh)/float64(foreignFade)))
}

// ScrapeTargets returns the current endpoints and their engine types.
func (p *Picker) ScrapeTargets(dst []ScrapeTarget) []ScrapeTarget {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.l.scrapeTargets(dst)
}

// scrapeTargets appends the current endpoints and their engine types.
func (l *ledger) scrapeTargets(dst []ScrapeTarget) []ScrapeTarget {
	for _, w := range l.rows {
		dst = append(dst, ScrapeTarget{Address: w.ep.Address, Engine: w.ep.Engine})
	}
	return dst
}

// Scrape is one endpoint's scrape in a round: what its engine said, or
// Failed. Age is how long before the round reaches the picker the scrape
// was sent: its counts may be that old (a round waits for its slowest
// scrape, and a large pool's are sent in batches).
type Scrape struct {
	Address netip.AddrPort
	Stats   EngineStats
	Failed  bool
	Age     time.Duration
}

// maxScrapeAge bounds Scrape.Age: a scrape is not taken for older than
// this (the scraper's default timeout), and the picks of the last
// detachArrival plus this long are remembered to judge it by.
const maxScrapeAge = time.Second

// ObserveScrapes records a round of scrapes, one per endpoint, at once:
// under one lock, so that no pick sees one engine's news before another's
// of the same round. (Applied one by one as each answered, the first
// engine to say that its detached requests had ended drew a whole burst:
// 61 / 34 / 33 through NGINX Gateway Fabric's exchange.) It returns the
// endpoints that became candidates again and those that just stopped
// being ones, for the caller to log.
func (p *Picker) ObserveScrapes(round []Scrape) (recovered, failed []netip.AddrPort) {
	now := p.now()
	p.mu.Lock()
	recovered, failed = p.l.observe(round, now)
	p.rearm(now)
	p.mu.Unlock()
	if len(recovered) > 0 {
		p.metrics.healthChanges.WithLabelValues("recovered").Add(float64(len(recovered)))
	}
	if len(failed) > 0 {
		p.metrics.healthChanges.WithLabelValues("unhealthy").Add(float64(len(failed)))
	}
	return recovered, failed
}

// observe records a round of scrapes handed over at now (ObserveScrapes).
func (l *ledger) observe(round []Scrape, now int64) (recovered, failed []netip.AddrPort) {
	for _, s := range round {
		switch {
		case !s.Failed && l.observeEngine(s.Address, s.Stats, now, now-int64(min(max(s.Age, 0), maxScrapeAge))):
			recovered = append(recovered, s.Address)
		case s.Failed && l.observeFailure(s.Address):
			failed = append(failed, s.Address)
		}
	}
	l.freed(now) // the engines may have reported less load than was thought
	return recovered, failed
}

// observeEngine records one endpoint's scrape, handed over at now and
// sent at sent.
func (l *ledger) observeEngine(addr netip.AddrPort, s EngineStats, now, sent int64) (recovered bool) {
	w, ok := l.byAddr[key(addr)]
	if !ok {
		return false
	}
	e := &w.engine
	prevSent := e.sentAt
	e.scraped, e.at, e.sentAt, e.failures = true, now, sent, 0
	e.running, e.waiting = s.Running, s.Waiting
	e.lora, e.maxLoRAs = s.HasLoRA, s.MaxLoRAs
	e.runningAdapters, e.waitingAdapters = s.RunningAdapters, s.WaitingAdapters
	if s.Model != "" {
		e.model = s.Model
	}
	l.loraSeen = l.loraSeen || s.HasLoRA
	l.learnModels(s)
	for _, list := range [][]string{s.WaitingAdapters, s.RunningAdapters} { // running ones most recent
		for _, a := range list {
			w.useAdapter(a)
		}
	}
	e.kvUsage = -1
	if s.HasKVCacheUsage {
		e.kvUsage = s.KVCacheUsage
	}
	if s.Running+s.Waiting > 0 {
		e.busyAt = sent
	}
	// The engine's counts were read some time before now: foreign load is
	// what they hold beyond the ledger at its fullest since the last
	// scrape, so that requests that ended in between are not taken for it.
	peak := max(e.peak, w.inFlight)
	// Fewer requests than the ledger holds, less those placed later than
	// detachArrival before the scrape was sent (they may not have reached
	// the engine when it was read): some detached ones ended before the
	// model says. Only as many as two scrapes in a row say are ended, so
	// one round's scrapes on either side of a burst's end do not draw the
	// next burst to the pod scraped last (docs/design.md, "Engine scrapes").
	young := e.recent.since(sent - int64(detachArrival))
	finished := max(w.inFlight-young-(s.Running+s.Waiting), 0)
	if n := min(finished, e.finished); n > 0 && w.detached > 0 {
		// Both scrapes must have been sent late enough to count the
		// requests ended: the last one's shortfall may have been of
		// others (a gateway's cancelled requests just before a burst).
		l.drain(w, now)
		l.shortenDetached(w, n, now, min(e.busyAt, prevSent))
	}
	e.finished = finished
	l.observePrefillTiming(w, s, now)
	l.observeOutputCounts(w, s)
	e.foreign = max(s.Running+s.Waiting-peak, 0)
	e.peak = w.inFlight
	e.behind, e.lagging = 0, false
	if w.detached > 0 && s.Waiting > e.foreign {
		// Waiting requests have not begun their prefill. More of them
		// than the model still has in prefill here, beyond the foreign
		// ones, are detached requests whose prefill the model ended
		// before the engine began it: its rate is faster than the engine
		// is now (a rate taught by an engine that answers many requests
		// at once). They count until the engine says they started.
		l.drain(w, now)
		if n := s.Waiting - e.foreign - (w.inFlight - w.decoding); n > 0 {
			// Until the next scrape, the model's rate is not the
			// engine's: the prefill it ends here counts as well
			// (scheduleDetached), or a burst placed more slowly than
			// the model drains would find the endpoint idle between
			// scrapes.
			e.behind, e.lagging = w.behindTokens(n), true
		}
	}
	// No engine the scraper reads says how many prompt tokens its queue
	// holds: a foreign request is sized as the mean prompt placed here.
	e.foreignTokens = int(l.meanPromptTokens)
	if s.CacheTokens > 0 && s.CacheTokens != e.cacheTokens {
		e.cacheTokens = s.CacheTokens
		l.index.SetCapacity(w.id, max(int(int64(s.CacheTokens)*int64(l.cfg.CharsPerToken)/int64(l.cfg.BlockSizeChars)), 1))
	}
	if e.unhealthy {
		e.unhealthy = false
		recovered = true
		l.refreshCandidates()
	}
	return recovered
}

// observeFailure records a failed scrape of the endpoint at addr. It
// reports whether the endpoint just turned unhealthy. Only an endpoint whose
// metrics have been read before can: one whose metrics were never read (on
// another port or path, an engine the scraper cannot read) serves on the
// ledger alone, since scrapes correct the ledger and do not decide who may
// serve.
func (l *ledger) observeFailure(addr netip.AddrPort) (failed bool) {
	w, ok := l.byAddr[key(addr)]
	if !ok || !w.engine.scraped {
		return false
	}
	e := &w.engine
	e.failures++
	if !e.unhealthy && e.failures >= l.failureThreshold {
		e.unhealthy, failed = true, true
		l.refreshCandidates()
	}
	return failed
}

// refreshCandidates rebuilds the candidates after the set or an
// endpoint's health changed.
func (l *ledger) refreshCandidates() {
	healthy := 0
	for _, w := range l.rows {
		if !w.engine.unhealthy && w.decodes {
			healthy++
		}
	}
	l.candidateRows, l.prefillRows = l.candidateRows[:0], l.prefillRows[:0]
	for _, w := range l.rows {
		// Failing destinations are still better than none; a failing
		// prefiller is never needed (the destination can prefill).
		w.engine.excluded = w.engine.unhealthy && (healthy > 0 || !w.decodes)
		if w.engine.excluded {
			continue
		}
		if w.decodes {
			l.candidateRows = append(l.candidateRows, w)
		}
		if w.prefills {
			l.prefillRows = append(l.prefillRows, w)
		}
	}
	clear(l.candidateRows[len(l.candidateRows):cap(l.candidateRows)])
	clear(l.prefillRows[len(l.prefillRows):cap(l.prefillRows)])
}

// pickTimes are the times of the recent picks on an endpoint, oldest first.
type pickTimes struct {
	at   []int64
	head int
}

// add records a pick at t, and forgets those a scrape sent now would not
// count (before t-detachArrival-maxScrapeAge).
func (q *pickTimes) add(t int64) {
	q.since(t - int64(detachArrival+maxScrapeAge))
	q.at = append(q.at, t)
}

// since forgets the picks at or before cutoff and counts the others.
func (q *pickTimes) since(cutoff int64) int {
	for q.head < len(q.at) && q.at[q.head] <= cutoff {
		q.head++
	}
	if q.head > 0 && q.head >= len(q.at)/2 {
		n := copy(q.at, q.at[q.head:])
		q.at, q.head = q.at[:n], 0
	}
	return len(q.at) - q.head
}
