package stack

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"slices"
)

// Ledger is the picker's in-flight ledger as /debug/ledger reports it.
type Ledger struct {
	// InFlight and PrefillTokens sum every row, retained ones included.
	InFlight      int              `json:"inFlight"`
	PrefillTokens int              `json:"prefillTokens"`
	Endpoints     []LedgerEndpoint `json:"endpoints"`
	// Retained are rows of endpoints that left the set (a pod turned
	// NotReady or deleted) and that the picker keeps for a while.
	Retained []LedgerEndpoint `json:"retained"`
}

// LedgerEndpoint is one endpoint's row of the ledger.
type LedgerEndpoint struct {
	Pod      string `json:"pod"`
	UID      string `json:"uid"`
	Endpoint string `json:"endpoint"`
	InFlight int    `json:"inFlight"`
	// PrefillTokens is what the picker's model says is still queued.
	PrefillTokens int `json:"prefillTokens"`
	Decoding      int `json:"decoding"`
	// PrefillTokensPerSecond is the endpoint's prefill rate as the picker
	// has learned it.
	PrefillTokensPerSecond float64 `json:"prefillTokensPerSecond"`
	// Engine is what the endpoint's engine said at the picker's last
	// successful scrape of its metrics; nil before the first.
	Engine *LedgerEngine `json:"engine"`
	// Unhealthy says enough scrapes in a row failed that the picker does
	// not pick the endpoint.
	Unhealthy bool `json:"unhealthy"`
	// PrefixCapacityBlocks is the size of the endpoint's prefix index.
	PrefixCapacityBlocks int `json:"prefixCapacityBlocks"`
	// Cached prompt tokens the engine reported in usage, and those the
	// picker predicted for the same responses.
	DeliveredCachedTokens int64 `json:"deliveredCachedTokens"`
	PredictedCachedTokens int64 `json:"predictedCachedTokens"`
}

// LedgerEngine is an endpoint's engine as the picker last scraped it.
type LedgerEngine struct {
	Running int `json:"running"`
	Waiting int `json:"waiting"`
	// ForeignRequests are the engine's requests beyond the ledger's;
	// ForeignTokens is what they add to the endpoint's cost now.
	ForeignRequests int `json:"foreignRequests"`
	ForeignTokens   int `json:"foreignTokens"`
	// The LoRA adapters of its running and waiting requests.
	RunningAdapters []string `json:"runningAdapters"`
	WaitingAdapters []string `json:"waitingAdapters"`
	// MaxLoRAs is how many adapters it runs at once; 0 until it publishes
	// lora_requests_info.
	MaxLoRAs int `json:"maxLoras"`
}

// String prints the fields, so that a row printed with %+v shows them.
func (e *LedgerEngine) String() string {
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
func (l Ledger) Row(uid string) (row LedgerEndpoint, current, ok bool) {
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
	return LedgerEndpoint{}, false, false
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

// Ledger reads the picker's /debug/ledger.
func (s *Stack) Ledger(ctx context.Context) (Ledger, error) {
	return readLedger(ctx, s.http, s.PickerMetricsURL())
}

// RowAt returns the current row of the endpoint at addr, if there is one.
func (l Ledger) RowAt(addr netip.AddrPort) (LedgerEndpoint, bool) {
	for _, e := range l.Endpoints {
		if e.Endpoint == addr.String() {
			return e, true
		}
	}
	return LedgerEndpoint{}, false
}

// readLedger reads /debug/ledger from the picker whose metrics server is at
// metricsURL.
func readLedger(ctx context.Context, c *http.Client, metricsURL string) (Ledger, error) {
	url := metricsURL + "/debug/ledger"
	var l Ledger
	err := getFromPicker(ctx, c, url, "the ledger", func(body io.Reader) error {
		if err := json.NewDecoder(body).Decode(&l); err != nil {
			return fmt.Errorf("decoding the ledger from %s: %w", url, err)
		}
		return nil
	})
	if err != nil {
		return Ledger{}, err
	}
	return l, nil
}

// WaitForEndpoints waits until the picker's endpoint set is exactly the
// given pods (in any order).
func (s *Stack) WaitForEndpoints(ctx context.Context, pods ...string) error {
	return waitForEndpoints(ctx, s.http, s.picker, s.PickerMetricsURL(), pods)
}

func waitForEndpoints(ctx context.Context, c *http.Client, picker *Process, metricsURL string, pods []string) error {
	want := slices.Sorted(slices.Values(pods))
	var last []string
	err := picker.waitFor(ctx, fmt.Sprintf("the picker's endpoints to be %v", want), pickerReadyTimeout, pollInterval, func(ctx context.Context) bool {
		l, err := readLedger(ctx, c, metricsURL)
		if err != nil {
			return false
		}
		last = l.Pods()
		return slices.Equal(last, want)
	})
	if err != nil {
		return fmt.Errorf("%w (last seen: %v)", err, last)
	}
	return nil
}
