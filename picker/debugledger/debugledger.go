// Package debugledger is the document the picker serves at /debug/ledger:
// its in-flight ledger as JSON, one snapshot of the totals and every row.
// The picker binary (cmd/epp) writes it; the local stack, the demo, the load
// tool and the end-to-end tests read it with these same types.
//
// The invariant: the JSON names here are what operators and scripts read
// from a running picker, so a field is added, never renamed. The package
// imports nothing of the picker, so that readers need not build it.
package debugledger

import (
	"fmt"
	"net/netip"
	"slices"
)

// Path is where the picker's metrics server serves the document.
const Path = "/debug/ledger"

// Ledger is one snapshot of the picker's ledger: its totals and rows read
// under one hold of its lock.
type Ledger struct {
	// InFlight and PrefillTokens sum every row, retained ones included.
	InFlight      int `json:"inFlight"`
	PrefillTokens int `json:"prefillTokens"`
	// LoRALoadSeconds is what placement charges for loading an adapter.
	LoRALoadSeconds float64 `json:"loraLoadSeconds"`
	// WorkWeight is what an uncached prompt token costs a pick, relative
	// to a queued one.
	WorkWeight float64    `json:"workWeight"`
	Endpoints  []Endpoint `json:"endpoints"`
	// Retained are rows of endpoints that left the set (a pod turned
	// NotReady or deleted) and that the picker keeps for a while.
	Retained []Endpoint `json:"retained"`
	// Replica is this picker's place among its replicas, when they share
	// one ledger (--peer-selector).
	Replica *Replica `json:"replica,omitempty"`
	// Roles sums the current endpoints by their llm-d.ai/role label
	// ("unlabelled" for pods without one), sorted by role.
	Roles []Role `json:"roles"`
	// Reservations lists the requests reserved and not yet released,
	// oldest pick first, at most 1,000 of them; ReservationsOmitted counts
	// those past that.
	Reservations        []Reservation `json:"reservations"`
	ReservationsOmitted int           `json:"reservationsOmitted,omitempty"`
}

// Role sums the current endpoints of one role (prefill/decode
// disaggregation).
type Role struct {
	Role      string `json:"role"`
	Endpoints int    `json:"endpoints"`
	// Saturated counts those that may take no new work now: over a
	// saturation limit or flow control's threshold. A saturated prefill
	// pod prefills for no one.
	Saturated     int `json:"saturated"`
	InFlight      int `json:"inFlight"`
	Decoding      int `json:"decoding"`
	PrefillTokens int `json:"prefillTokens"`
	// PrefillLegs counts the prefill parts of split requests they hold.
	PrefillLegs int `json:"prefillLegs"`
}

// Reservation is one request reserved in the ledger.
type Reservation struct {
	// Endpoint is where it is held (its destination, or the endpoint that
	// served it), Pod that endpoint's pod.
	Endpoint string `json:"endpoint"`
	Pod      string `json:"pod"`
	// Prefiller is the endpoint that prefills it when it is split
	// (disaggregation), PrefillerPod its pod; PrefillHeld says that
	// endpoint still holds its prefill part (until the destination's first
	// byte, or until the picker's model says the prefill is done).
	Prefiller    string `json:"prefiller,omitempty"`
	PrefillerPod string `json:"prefillerPod,omitempty"`
	PrefillHeld  bool   `json:"prefillHeld"`
	// PrefillTokens is the prefill it still holds, on the prefiller when
	// it is split; Decoding says its endpoint counts it as decoding.
	PrefillTokens int  `json:"prefillTokens"`
	Decoding      bool `json:"decoding"`
	// Detached: its stream ended at the pick, and the picker holds it
	// until its model says the request is done.
	Detached     bool    `json:"detached"`
	PromptTokens int     `json:"promptTokens"`
	CachedTokens int     `json:"cachedTokens"`
	AgeSeconds   float64 `json:"ageSeconds"`
}

// Replica says which replica leads and how current this one's copy is.
type Replica struct {
	Self    string `json:"self"`
	Leader  string `json:"leader"`
	Leading bool   `json:"leading"`
	// LagSeconds is the age of the leader's last change when this replica
	// applied it (0 on the leader).
	LagSeconds float64 `json:"lagSeconds"`
	// Peers is how many peers this replica has a working stream to.
	Peers int `json:"peers"`
}

// Endpoint is one endpoint's row of the ledger.
type Endpoint struct {
	Pod      string `json:"pod"`
	UID      string `json:"uid,omitempty"`
	Endpoint string `json:"endpoint"`
	// Role is the pod's llm-d.ai/role label: prefill, decode,
	// prefill-decode, or "" (unlabelled: it decodes, and prefills only its
	// own requests).
	Role     string `json:"role"`
	InFlight int    `json:"inFlight"`
	// PrefillTokens is what the picker's drain model says is still queued.
	PrefillTokens int `json:"prefillTokens"`
	Decoding      int `json:"decoding"`
	// PrefillTokensPerSecond is the endpoint's prefill rate as the picker
	// has learned it.
	PrefillTokensPerSecond float64 `json:"prefillTokensPerSecond"`
	// Utilization is the share of recent time the model had prefill
	// queued here.
	Utilization float64 `json:"utilization"`
	// Engine is what the endpoint's engine said at the picker's last
	// successful scrape of its metrics; nil before the first.
	Engine *Engine `json:"engine,omitempty"`
	// Unhealthy says enough scrapes in a row failed that the picker does
	// not pick the endpoint.
	Unhealthy bool `json:"unhealthy"`
	// PrefixCapacityBlocks is the size of the endpoint's prefix index.
	PrefixCapacityBlocks int `json:"prefixCapacityBlocks"`
	// Cached prompt tokens the engine reported in usage, and those the
	// picker predicted for the same responses.
	DeliveredCachedTokens int64 `json:"deliveredCachedTokens"`
	PredictedCachedTokens int64 `json:"predictedCachedTokens"`
	// CacheTrust is the share of predicted cached tokens the cost counts.
	CacheTrust float64 `json:"cacheTrust"`
	// Adapters counts the requests in flight by LoRA adapter.
	Adapters map[string]int `json:"adapters,omitempty"`
	// PrefillLegs counts the prefill parts of split requests it holds,
	// prefilling for another endpoint (among InFlight and PrefillTokens).
	PrefillLegs int `json:"prefillLegs"`
	// Saturated says it may take no new work now (see Role.Saturated).
	Saturated bool `json:"saturated"`
}

// Engine is an endpoint's engine as the picker last scraped it.
type Engine struct {
	Running int `json:"running"`
	Waiting int `json:"waiting"`
	// ForeignRequests are the engine's requests beyond the ledger's;
	// ForeignTokens is what they add to the endpoint's cost now.
	ForeignRequests int `json:"foreignRequests"`
	ForeignTokens   int `json:"foreignTokens"`
	// The LoRA adapters of its running and waiting requests, and the most
	// it runs at once (0 until it publishes lora_requests_info).
	RunningAdapters []string `json:"runningAdapters,omitempty"`
	WaitingAdapters []string `json:"waitingAdapters,omitempty"`
	MaxLoRAs        int      `json:"maxLoras,omitempty"`
}

// String prints the fields, so that a row printed with %+v shows them.
func (e *Engine) String() string {
	if e == nil {
		return "<not scraped>"
	}
	return fmt.Sprintf("{Running:%d Waiting:%d ForeignRequests:%d ForeignTokens:%d}", e.Running, e.Waiting, e.ForeignRequests, e.ForeignTokens)
}

// Idle reports whether nothing is reserved anywhere in the ledger.
func (l Ledger) Idle() bool {
	if l.InFlight != 0 || l.PrefillTokens != 0 {
		return false
	}
	for _, e := range slices.Concat(l.Endpoints, l.Retained) {
		if e.InFlight != 0 || e.PrefillTokens != 0 || e.Decoding != 0 {
			return false
		}
	}
	return true
}

// Row returns the row of the pod object with this UID, current or retained.
func (l Ledger) Row(uid string) (row Endpoint, current, ok bool) {
	for _, e := range l.Endpoints {
		if e.UID == uid {
			return e, true, true
		}
	}
	for _, e := range l.Retained {
		if e.UID == uid {
			return e, false, true
		}
	}
	return Endpoint{}, false, false
}

// RowAt returns the current row of the endpoint at addr, if there is one.
func (l Ledger) RowAt(addr netip.AddrPort) (Endpoint, bool) {
	for _, e := range l.Endpoints {
		if e.Endpoint == addr.String() {
			return e, true
		}
	}
	return Endpoint{}, false
}

// Pods lists the pods of the ledger's endpoints, sorted.
func (l Ledger) Pods() []string {
	pods := make([]string, 0, len(l.Endpoints))
	for _, e := range l.Endpoints {
		pods = append(pods, e.Pod)
	}
	slices.Sort(pods)
	return slices.Compact(pods)
}

// RoleOf returns the summary of the endpoints of role ("unlabelled" for
// those without one).
func (l Ledger) RoleOf(role string) (Role, bool) {
	for _, r := range l.Roles {
		if r.Role == role {
			return r, true
		}
	}
	return Role{}, false
}

// PrefillsHeldOn counts the listed reservations whose prefill part the
// endpoint at addr holds now.
func (l Ledger) PrefillsHeldOn(addr netip.AddrPort) int {
	n := 0
	for _, r := range l.Reservations {
		if r.PrefillHeld && r.Prefiller == addr.String() {
			n++
		}
	}
	return n
}
