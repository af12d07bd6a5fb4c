package picker

import (
	"cmp"
	"maps"
	"math"
	"net/netip"
	"slices"
	"time"
)

// EndpointStats is one endpoint's row of the ledger.
type EndpointStats struct {
	Endpoint Endpoint
	InFlight int // requests reserved and not released
	// PrefillTokens is the prefill the drain model says is still queued.
	PrefillTokens int
	Decoding      int // requests past their first byte or modelled prefill
	// Detached counts the in-flight requests whose stream ended at the
	// pick, held until the model says they are done (detach.go).
	Detached int
	// PrefillTokensPerSecond is the endpoint's prefill rate: learned from
	// streamed first bytes, the configured starting value until then.
	PrefillTokensPerSecond float64
	// Utilization is the share of the last 20 s or so (a decayed mean)
	// during which the drain model had prefill queued on it.
	Utilization float64
	// What its engine's metrics said at the last scrape (Scraped false:
	// never scraped): running and waiting requests, the requests beyond the
	// ledger (foreign) and their cost now, and whether it is failing scrapes.
	Scraped                        bool
	EngineRunning, EngineWaiting   int
	ForeignRequests, ForeignTokens int
	Unhealthy                      bool
	// KVCacheUsage is the share of its KV cache in use (0 to 1) at the last
	// scrape; -1 when the engine does not publish it or was never scraped.
	KVCacheUsage float64
	// PrefixCapacityBlocks is the size of its prefix index, from its engine
	// or the configuration.
	PrefixCapacityBlocks int
	// Cached prompt tokens its engine delivered, and the picker predicted,
	// over the responses that reported usage.
	DeliveredCachedTokens, PredictedCachedTokens int64
	// CacheTrust is the share of the prefix index's predicted cached tokens
	// its cost counts as cached: recent responses' delivered share (1 until
	// one says otherwise).
	CacheTrust float64
	// Adapters counts its requests in flight by LoRA adapter (nil: none);
	// RunningAdapters, WaitingAdapters and MaxLoRAs are what its engine
	// last said of its adapters (adapters.go).
	Adapters                         map[string]int
	RunningAdapters, WaitingAdapters []string
	MaxLoRAs                         int
	// PrefillLegs counts the prefill parts of split requests it holds now,
	// prefilling for another endpoint (disaggregation); they are among
	// InFlight and PrefillTokens.
	PrefillLegs int
	// Saturated says it may take no new work now: over a static limit
	// (saturation), or with flow control over its threshold (its queued
	// prefill would take holdPrefillMilliseconds, or its decoding slots
	// are full). The same rule decides whether a prefill pod may take a
	// prefill leg. Health is apart: see Unhealthy.
	Saturated bool
	// PrefillLegFailures counts the prefill legs it failed (a split
	// request's error before its first byte); PrefillLegsOff: it prefills
	// for no other pod now, after too many in a row (legs.go).
	PrefillLegFailures int64
	PrefillLegsOff     bool
}

// RoleStats sums the current endpoints of one role (Endpoint.Role; the
// unlabelled ones under RoleUnlabelled).
type RoleStats struct {
	Role string
	// Endpoints of the role, and of them those Saturated.
	Endpoints, Saturated int
	// The sums of their rows.
	InFlight, Decoding, PrefillTokens, PrefillLegs int
}

// RoleUnlabelled is RoleStats.Role for the endpoints without a role: they
// decode, and prefill only their own requests.
const RoleUnlabelled = "unlabelled"

// ReservationStats is one reservation not yet released, as of the
// snapshot.
type ReservationStats struct {
	// Endpoint is where it is held (its destination, or the endpoint the
	// gateway said served it), and Pod that endpoint's pod.
	Endpoint netip.AddrPort
	Pod      string
	// Prefiller is the endpoint that prefills it when it was split (the
	// zero AddrPort otherwise), PrefillerPod its pod, and PrefillHeld
	// whether that endpoint still holds its prefill part: until the
	// destination's first byte, or the prefiller's drain model says it is
	// done.
	Prefiller    netip.AddrPort
	PrefillerPod string
	PrefillHeld  bool
	// PrefillTokens is the prefill it still holds (on the prefiller when
	// split), Decoding whether its destination counts it as decoding.
	PrefillTokens int
	Decoding      bool
	Detached      bool
	PromptTokens  int
	CachedTokens  int
	// Age is the time since its pick.
	Age time.Duration
}

// Ledger is one consistent view of the whole ledger.
type Ledger struct {
	// InFlight, Detached and PrefillTokens sum every row, retained ones
	// included: a split request (disaggregation) counts in flight on its
	// prefiller, until its prefill is done, and on its destination.
	InFlight, Detached, PrefillTokens int
	// Waiting counts the requests in the flow control queue.
	Waiting int
	// DetachEnds counts the detached reservations ended, by why: the model
	// said done, an engine scrape said so, the sweeper.
	DetachEnds [numDetachEnds]uint64
	// RateSamples counts the streamed first bytes offered to the prefill
	// rate, by what became of them (ratefit.go, rateSampleNames).
	RateSamples [numRateSamples]uint64
	// LoRALoadSeconds is what placement charges for loading an adapter:
	// loraLoadMilliseconds until first bytes have taught it.
	LoRALoadSeconds float64
	// WorkWeight is what an uncached prompt token costs a pick over the
	// current endpoints, relative to a queued one (place.go, workWeight).
	WorkWeight float64
	// ExpectedOutputTokens and DecodeSecondsPerToken are what a detached
	// request without max_tokens is expected to generate, and how long each
	// output token takes (detach.go): defaults until responses teach them
	// (the output also the engines' output counters).
	ExpectedOutputTokens, DecodeSecondsPerToken float64
	// Endpoints are the current endpoints, sorted by address.
	Endpoints []EndpointStats
	// Retained are endpoints that left the set and keep their row (in flight
	// requests, or the retention window), sorted by address.
	Retained []EndpointStats
	// Roles sums the current endpoints by role, in the order of Role.
	Roles []RoleStats
	// Reservations lists the reservations not yet released, oldest pick
	// first, at most maxListedReservations of them; only
	// SnapshotWithReservations fills it, and ReservationsOmitted counts
	// those past the limit.
	Reservations        []ReservationStats
	ReservationsOmitted int
}

// maxListedReservations bounds Ledger.Reservations: listing them holds the
// picker's lock, and a debug page need not show every one of a long burst.
const maxListedReservations = 1000

// SnapshotWithReservations is Snapshot with the reservations not yet
// released listed too (Ledger.Reservations), read under the same hold of
// the lock: for /debug/ledger, not for every metrics scrape.
func (p *Picker) SnapshotWithReservations() Ledger {
	now := p.now()
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.l.snapshot(now)
	s.Reservations, s.ReservationsOmitted = p.l.reservations(now, maxListedReservations)
	return s
}

// reservations lists at most limit of the reservations not yet released,
// oldest pick first, as of now (drained on the side, as snapshot), and
// counts those left out.
func (l *ledger) reservations(now int64, limit int) (list []ReservationStats, omitted int) {
	// Each row's drain model advanced to now, worked out once.
	drained := map[*row]*row{}
	done := func(w *row, r *Reservation) bool {
		v := drained[w]
		if v == nil {
			c := *w
			c.advance(now)
			v = &c
			drained[w] = v
		}
		return r.endPos <= v.posOut || v.posOut >= v.posIn
	}
	for r := l.picks.Front(); r != nil && len(list) < limit; r = l.picks.Next(r) {
		st := ReservationStats{Endpoint: r.row.ep.Address, Pod: r.row.ep.Pod, Prefiller: r.prefiller,
			PrefillTokens: r.prefill, Decoding: r.decoding, Detached: r.detached,
			PromptTokens: r.promptTokens, CachedTokens: r.cachedTokens, Age: time.Duration(now - r.pickedNs)}
		if w := r.prefilledOn; w != nil {
			st.PrefillerPod = w.ep.Pod
		}
		switch {
		case r.pre != nil: // split, its prefill part held on r.pre
			st.PrefillHeld = !done(r.pre, r)
			if !st.PrefillHeld {
				st.PrefillTokens = 0
			}
		case !r.decoding: // in its row's prefill queue
			if done(r.row, r) {
				st.Decoding, st.PrefillTokens = true, 0
			}
		}
		list = append(list, st)
	}
	return list, l.picks.Len() - len(list)
}

// snapshot reads the whole ledger as of now without changing it: what the
// drain model and the detach model would have finished by now (a drain, an
// expiry) is worked out on the side. Reading must change nothing, or
// whoever reads (metrics, /debug/ledger) would change what the ledger
// decides later.
func (l *ledger) snapshot(now int64) Ledger {
	s := Ledger{Endpoints: make([]EndpointStats, 0, len(l.rows))}
	s.DetachEnds = l.detachEnds
	s.Waiting = l.queue.waiting.Len()
	s.RateSamples = l.rateSamples
	s.LoRALoadSeconds = l.loraLoad.Mean()
	s.WorkWeight = 1
	s.ExpectedOutputTokens, s.DecodeSecondsPerToken = l.meanOutputTokens, l.decodeNsPerToken/1e9
	// The detached reservations the model says are done by now, and the
	// rows they leave.
	done := map[*row][]*Reservation{}
	for _, r := range l.detachedDue {
		if r.doneAt <= now {
			done[r.row] = append(done[r.row], r)
		}
	}
	for _, w := range l.all {
		v := l.projected(w, now, done)
		s.DetachEnds[detachEndModel] += uint64(len(done[w]))
		e := &w.engine
		st := EndpointStats{Endpoint: w.ep, InFlight: v.inFlight, PrefillTokens: v.queued,
			Decoding: v.decoding, Detached: v.detached, PrefillTokensPerSecond: w.rate, Utilization: v.utilization,
			Scraped: e.scraped, EngineRunning: e.running, EngineWaiting: e.waiting,
			ForeignRequests: e.foreign, ForeignTokens: e.foreignCost(now), Unhealthy: e.unhealthy,
			KVCacheUsage:          -1,
			PrefixCapacityBlocks:  l.index.Capacity(w.id),
			DeliveredCachedTokens: e.delivered, PredictedCachedTokens: e.predicted, CacheTrust: e.cacheTrust(),
			PrefillLegFailures: e.legFailuresTotal, PrefillLegsOff: !w.prefillsNow(now),
			Adapters: v.adapters, RunningAdapters: e.runningAdapters,
			WaitingAdapters: e.waitingAdapters, MaxLoRAs: e.maxLoRAs}
		if e.scraped {
			st.KVCacheUsage = e.kvUsage
		}
		st.PrefillLegs = v.legs
		st.Saturated = l.saturated(w, v.queued, v.decoding, now)
		s.InFlight += st.InFlight
		s.Detached += st.Detached
		s.PrefillTokens += st.PrefillTokens
		if w.current {
			s.Endpoints = append(s.Endpoints, st)
			s.Roles = addRole(s.Roles, st)
		} else {
			s.Retained = append(s.Retained, st)
		}
	}
	slices.SortFunc(s.Roles, func(a, b RoleStats) int { return cmp.Compare(a.Role, b.Role) })
	if n := len(s.Endpoints); n > 0 {
		u := 0.0
		for _, e := range s.Endpoints {
			u += e.Utilization
		}
		s.WorkWeight = weightAt(u / float64(n))
	}
	byAddress := func(a, b EndpointStats) int { return a.Endpoint.Address.Compare(b.Endpoint.Address) }
	slices.SortFunc(s.Endpoints, byAddress)
	slices.SortFunc(s.Retained, byAddress)
	return s
}

// addRole adds st to its role's sums in roles.
func addRole(roles []RoleStats, st EndpointStats) []RoleStats {
	role := st.Endpoint.Role
	if role == "" {
		role = RoleUnlabelled
	}
	i := slices.IndexFunc(roles, func(r RoleStats) bool { return r.Role == role })
	if i < 0 {
		i = len(roles)
		roles = append(roles, RoleStats{Role: role})
	}
	r := &roles[i]
	r.Endpoints++
	if st.Saturated {
		r.Saturated++
	}
	r.InFlight += st.InFlight
	r.Decoding += st.Decoding
	r.PrefillTokens += st.PrefillTokens
	r.PrefillLegs += st.PrefillLegs
	return roles
}

// projection is a row as a drain to now, and the detached expiry after it,
// would leave it.
type projection struct {
	inFlight, queued, decoding, detached int
	legs                                 int // prefill parts of split requests held
	utilization                          float64
	adapters                             map[string]int
}

// projected works out what drain and expireDetached would leave of w at
// now, without changing w. It appends to done[w] the detached
// reservations whose modelled prefill ends by now and whose end follows
// by now too; with done nil, it works out the drain alone.
func (l *ledger) projected(w *row, now int64, done map[*row][]*Reservation) projection {
	v := *w // the drain model's scalars, advanced on the copy
	v.advance(now)
	p := projection{inFlight: w.inFlight, decoding: w.decoding, detached: w.detached}
	if w.prefills {
		for r := w.inPrefill.Front(); r != nil; r = w.inPrefill.Next(r) {
			if r.pre == w {
				p.legs++
			}
		}
	}
	prefill, left := w.prefill, false
	for r := w.inPrefill.Front(); r != nil; r = w.inPrefill.Next(r) {
		if r.endPos > v.posOut && v.posOut < v.posIn {
			left = true
			break
		}
		prefill -= r.prefill
		if r.pre == w {
			// A split request's prefill part: done, a drain drops it
			// from its prefiller (row.drain); its request decodes on its
			// destination, whose projection does not see this end (a
			// detached one's modelled end shows after the next drain).
			p.inFlight--
			p.legs--
			continue
		}
		p.decoding++
		if r.detached && done != nil {
			end := min(max(w.at+int64(max(r.endPos-w.posOut, 0)/w.rate*1e9), r.enqueuedAt), now)
			if end+int64(l.expectedOutputTokens(r)*l.decodeNsPerToken) <= now {
				done[w] = append(done[w], r)
			}
		}
	}
	if left {
		p.queued = min(prefill, max(int(math.Ceil(v.posIn-v.posOut)), 0))
	}
	p.utilization = v.utilization
	if done == nil {
		return p
	}
	p.adapters = maps.Clone(w.adapterRefs)
	for _, r := range done[w] {
		p.inFlight--
		p.detached--
		p.decoding--
		if r.adapter != "" {
			if p.adapters[r.adapter]--; p.adapters[r.adapter] <= 0 {
				delete(p.adapters, r.adapter)
			}
		}
	}
	return p
}
