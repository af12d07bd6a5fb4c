package picker

import "slices"

// LoRA adapters. On an engine that publishes vLLM's lora_requests_info, a
// request whose model is not the engine's base model is for an adapter
// (vLLM serves each adapter under its own model name). Placing it where the
// adapter is not loaded costs the adapter's load time first, and where the
// engine already runs max_lora other adapters it waits for one of them to
// drain, so:
//
//   - an endpoint where the adapter is neither running nor waiting (its
//     engine's last scrape) nor held by a request in flight (the ledger,
//     updated at pick time) costs the load time (loraLoadMilliseconds at
//     first, then learned) at its prefill rate more, for this request and
//     for each request in flight there (up to maxLoadCharges in all): vLLM
//     loads an adapter between steps, and the whole batch waits. A burst
//     for a new adapter stays on the endpoints that load it until their
//     queues cost more than another load, and a busy endpoint swaps less
//     than an idle one (in the routing simulator, the load counted once
//     for the request alone swapped 3 to 12% more and its TTFT p99 was 2
//     to 8% higher, over 40 seeds at each of four loads);
//   - while an endpoint that has the adapter can take the request with its
//     queued prefill within twice the pool's even share, only such
//     endpoints are candidates: a burst for an adapter loads it on as few
//     endpoints as its size needs, not on every one (the load cost alone
//     would spread a large burst everywhere). On an endpoint busy mostly
//     with the adapter's own requests, the request counts shared among
//     the endpoints where the adapter is active: endpoints sharing a
//     burst stay within it by turns. An endpoint that holds more
//     of the prompt than every such endpoint (cached there for the same
//     adapter) stays a candidate, and the cost decides: its cache can save
//     more than the load costs;
//   - an endpoint running max_lora other adapters is not a candidate,
//     unless every candidate is such an endpoint;
//   - an endpoint where an adapter waits for a slot (starving: vLLM admits
//     other adapters' requests past it) is not a candidate for any other
//     adapter's request, unless every candidate is full: more requests for
//     the adapters holding its slots would keep them held. There the
//     starving adapter is not loaded, so its own requests avoid the
//     endpoint as any full one;
//   - these two exclusions hold while an endpoint with room can take the
//     request with its queued prefill within openSlack times the pool's
//     even share. Beyond that they give way, and the cost decides: a slot
//     on a full endpoint frees when its adapters' requests end, sooner
//     than a queue several times the others' drains (on a busy pool the
//     open endpoints were left with queues of seconds while the full ones
//     idled);
//   - an adapter short of endpoints (recruitShare) whose active endpoints
//     are past the affinity, with no other endpoint with room within
//     openSlack shares, may take a full endpoint too: the cost decides.
//
// Base-model requests, and engines that publish no adapters, are scored as
// before.

// isAdapter reports whether model is an adapter on w's engine. An engine
// that has not said (it publishes lora_requests_info only once it has run
// requests, as vLLM) is judged by the pool: in a pool where some engine
// publishes adapters, a model that is no engine's base model, or that an
// engine has run as an adapter, is an adapter everywhere.
func (l *ledger) isAdapter(w *row, model string) bool {
	if model == "" || !l.loraSeen || l.baseModels[model] {
		return false
	}
	return w.adapterFor(model, l.knownAdapters[model])
}

// adapterFor is isAdapter for a model no engine of the pool calls its base
// model; known says whether an engine has run it as an adapter.
func (w *row) adapterFor(model string, known bool) bool {
	e := &w.engine
	return model != e.model && (e.model != "" || known || w.adapterRefs[model] > 0)
}

// adapterResident reports whether model is loaded or about to be on w:
// running or waiting there, held by a request in flight, or among the last
// max_lora adapters used there (vLLM keeps an idle adapter in its slot
// until another needs it, and publishes only running and waiting ones).
func (w *row) adapterResident(model string) bool {
	return w.adapterActive(model, w.adapterRefs[model]) || w.adapterRecent(model)
}

// adapterActive reports whether model is running, waiting or held on w,
// where refs of its requests are in flight: the affinity of a burst
// follows these, not an adapter idle in a slot.
func (w *row) adapterActive(model string, refs int) bool {
	e := &w.engine
	if w.starving(model) {
		return false
	}
	return refs > 0 || slices.Contains(e.runningAdapters, model) || slices.Contains(e.waitingAdapters, model)
}

// adapterRecent reports whether model is among the last max_lora adapters
// used on w, and not starving there.
func (w *row) adapterRecent(model string) bool {
	return !w.starving(model) && slices.Contains(w.recentAdapters, model)
}

// adapterLoadFor reports whether a request for adapter a ("" for the base
// model) placed on w waits for a to load, and whether it waits first for
// a slot: w's engine runs max_lora other adapters.
func (w *row) adapterLoadFor(a string) (load, wait bool) {
	if a == "" || w.adapterResident(a) {
		return false, false
	}
	return true, w.adapterSlotsFull()
}

// adapterSlotsFull reports whether w's engine runs max_lora adapters: one
// more waits for a slot.
func (w *row) adapterSlotsFull() bool {
	m := w.engine.maxLoRAs
	return m > 0 && w.activeAdapters() >= m
}

// starving reports whether model's requests wait on w's engine for a slot
// (at its last scrape): waiting there, not running, with every slot held by
// running adapters. vLLM admits other adapters' waiting requests past them,
// so while the running adapters' requests keep coming they wait on.
func (w *row) starving(model string) bool {
	e := &w.engine
	return e.maxLoRAs > 0 && len(e.runningAdapters) >= e.maxLoRAs &&
		slices.Contains(e.waitingAdapters, model) && !slices.Contains(e.runningAdapters, model)
}

// starves reports whether some adapter other than model starves on w: a
// request for one of w's running adapters there would keep its slot held.
func (w *row) starves(model string) bool {
	for _, a := range w.engine.waitingAdapters {
		if a != model && w.starving(a) {
			return true
		}
	}
	return false
}

// useAdapter records that a is in use on w: the most recent of its last
// max_lora adapters (at least one), those its slots hold.
func (w *row) useAdapter(a string) {
	slots := max(w.engine.maxLoRAs, 1)
	if i := slices.Index(w.recentAdapters, a); i >= 0 {
		w.recentAdapters = slices.Delete(w.recentAdapters, i, i+1)
	}
	w.recentAdapters = slices.Insert(w.recentAdapters, 0, a)
	if len(w.recentAdapters) > slots {
		w.recentAdapters = w.recentAdapters[:slots]
	}
}

// activeAdapters counts the distinct adapters w runs: its engine's, and
// those of requests in flight there the engine had not reported.
func (w *row) activeAdapters() int {
	n := len(w.engine.runningAdapters)
	for a, refs := range w.adapterRefs {
		if refs > 0 && !slices.Contains(w.engine.runningAdapters, a) {
			n++
		}
	}
	return n
}

// openSlack bounds, in even shares of the pool's queued prefill, the queue
// an endpoint with room for an adapter may take a request to while the
// full and starving endpoints are kept out. It is above the affinity's 2,
// so a burst that fills the adapter's endpoints spreads to open ones
// before full ones (docs/design.md, "LoRA adapters").
const openSlack = 3

// recruitShare is how far an adapter's share of the pool's requests in
// flight (the request included) must exceed its active endpoints' share
// of the endpoints for it to be short of endpoints: then the full
// endpoints may take it too, and the cost decides (docs/design.md).
const recruitShare = 1.25

// Why adapterCost takes a candidate out (candidate.loraOut).
const (
	loraIn        = iota
	loraFull      // runs max_lora other adapters
	loraStarves   // another adapter starves there
	loraNotNeeded // the adapter's active endpoints can take the request
)

// maxLoadCharges bounds how many times an adapter's load is charged on an
// endpoint (once for the request, once for each request in flight there):
// the decoding requests' wait is one extra step, not their first token
// (docs/design.md).
const maxLoadCharges = 16

// adapterCost adds what model's adapter costs on each candidate and
// takes out those with no room for it, unless no candidate with room can
// take the request within openSlack even shares; the full ones stay in
// for an adapter short of endpoints when only its own have room
// (recruitShare). It returns how many candidates it took out.
func (l *ledger) adapterCost(cands []candidate, model string, promptTokens int) (full int) {
	if model == "" || l.baseModels[model] {
		return 0 // a base model is no adapter anywhere
	}
	// Whether model is an adapter on each candidate, active there, and
	// its requests in flight there, worked out once (on the candidate): the
	// rules below read them several times over every candidate.
	known := l.knownAdapters[model]
	// The pool's even share of queued prefill, this request included, and
	// whether an endpoint with the adapter takes it within twice that; the
	// adapter's requests in flight and the pool's, this one in both; the
	// endpoints where the adapter is active.
	total, n, refs, inFlight, active := promptTokens, 0, 1, 1, 0
	for i := range cands {
		c := &cands[i]
		if c.taken {
			continue
		}
		c.refs = c.w.adapterRefs[model]
		c.adapter = c.w.adapterFor(model, known)
		c.active = c.adapter && c.w.adapterActive(model, c.refs)
		total += c.queued
		n++
		refs += c.refs
		inFlight += c.w.inFlight
		if c.active {
			active++
		}
	}
	within := func(c *candidate, shares int) bool { return (c.queued+c.uncached)*n <= shares*total }
	// fits is within, except where the adapter's own requests are most of
	// an endpoint's in flight (a burst of it): there the request counts
	// shared among the adapter's active endpoints, which take the burst's
	// requests in turn. Counting all of it took another endpoint in
	// whenever they were even: 128 requests of 8,192 tokens sharing no
	// prefix landed 43/43/42 on three of four endpoints, where two keep
	// each within twice the even share, and on 7 of 8 (cmd/routesim's
	// burst).
	fits := func(c *candidate, shares int) bool {
		if 2*c.refs > c.w.inFlight {
			return (active*c.queued+c.uncached)*n <= shares*active*total
		}
		return within(c, shares)
	}
	affine, affineUncached := false, 0
	for i := range cands {
		c := &cands[i]
		if !c.taken && c.active {
			if fits(c, 2) {
				if !affine || c.uncached < affineUncached {
					affineUncached = c.uncached
				}
				affine = true
			}
		}
	}
	// open counts the endpoints with room within openSlack shares, others
	// those of them where the adapter is not resident.
	open, others := 0, 0
	for i := range cands {
		c := &cands[i]
		c.loraOut = loraIn
		if !c.taken && c.adapter && c.w.starves(model) {
			c.loraOut = loraStarves
			continue
		}
		if c.taken || !c.adapter || c.active || c.w.adapterRecent(model) {
			if !c.taken && fits(c, openSlack) {
				open++
			}
			continue
		}
		if affine && c.uncached >= affineUncached {
			c.loraOut = loraNotNeeded
			continue
		}
		// Loading the adapter stalls the engine's whole batch: every
		// request in flight there waits the load time too.
		c.cost += int(l.loraLoad.Mean() * c.w.rate * float64(min(1+c.w.inFlight, maxLoadCharges)))
		if c.w.adapterSlotsFull() {
			c.loraOut = loraFull
			continue
		}
		if within(c, openSlack) {
			open++
			others++
		}
	}
	if open == 0 {
		return 0 // every candidate is full, or has a long queue: the cost decides
	}
	short := active > 0 && float64(refs)/float64(inFlight) > recruitShare*float64(active)/float64(n)
	recruit := short && others == 0
	for i := range cands {
		c := &cands[i]
		if c.loraOut == loraIn || c.loraOut == loraFull && recruit {
			continue
		}
		c.taken = true
		full++
	}
	return full
}

// What loading an adapter takes is learned: a streamed request placed
// where its adapter was not resident waits for the load before its
// prefill, so its first byte, less what the prefill model says its queue
// and prompt took, is one sample (learnPrefill). Left in the rate
// fit, such samples dragged the prefill rate down. A request placed where
// the engine ran max_lora other adapters waits first for one of them to
// drain, for as long as their requests run: it teaches nothing. Learned
// from those too, a load of 200 ms was learned as up to 3 s at 70% load
// in the routing simulator and up to 13 s at 100%, and every load was
// charged that much. The samples' mean (ledger.loraLoad) starts from
// loraLoadPrior samples of the configured loraLoadMilliseconds, and each
// sample weighs the earlier ones by loraLoadDecay (a memory of about ten
// loads).
const (
	loraLoadPrior = 2
	loraLoadDecay = 0.9
	// maxLoRALoadSeconds bounds one sample: a first byte later than that
	// beyond its prefill waited for something else.
	maxLoRALoadSeconds = 600
)

// holdAdapter and dropAdapter count r's adapter on its row.
func (w *row) holdAdapter(r *Reservation) {
	if r.adapter == "" {
		return
	}
	if w.adapterRefs == nil {
		w.adapterRefs = make(map[string]int)
	}
	w.adapterRefs[r.adapter]++
	w.useAdapter(r.adapter)
}

func (w *row) dropAdapter(r *Reservation) {
	if r.adapter == "" {
		return
	}
	if w.adapterRefs[r.adapter]--; w.adapterRefs[r.adapter] <= 0 {
		delete(w.adapterRefs, r.adapter)
	}
}

// maxKnownModels bounds the models remembered as adapters or base models:
// names come from engines, but a pool's are few.
const maxKnownModels = 4096

// learnModels remembers the base model and the adapters an engine
// reports.
func (l *ledger) learnModels(s EngineStats) {
	if s.Model != "" && !l.baseModels[s.Model] && len(l.baseModels) < maxKnownModels {
		if l.baseModels == nil {
			l.baseModels = map[string]bool{}
		}
		l.baseModels[s.Model] = true
	}
	for _, list := range [][]string{s.RunningAdapters, s.WaitingAdapters} {
		for _, a := range list {
			if !l.knownAdapters[a] && len(l.knownAdapters) < maxKnownModels {
				if l.knownAdapters == nil {
					l.knownAdapters = map[string]bool{}
				}
				l.knownAdapters[a] = true
			}
		}
	}
}
