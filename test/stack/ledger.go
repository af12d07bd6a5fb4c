package stack

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
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
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	url := s.PickerMetricsURL() + "/debug/ledger"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return Ledger{}, err
	}
	resp, err := s.http.Do(req)
	if err != nil {
		return Ledger{}, fmt.Errorf("reading the ledger: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return Ledger{}, fmt.Errorf("reading the ledger: GET %s: HTTP %d", url, resp.StatusCode)
	}
	var l Ledger
	if err := json.NewDecoder(resp.Body).Decode(&l); err != nil {
		return Ledger{}, fmt.Errorf("decoding the ledger from %s: %w", url, err)
	}
	return l, nil
}

// WaitForEndpoints waits until the picker's endpoint set is exactly the
// given pods (in any order).
func (s *Stack) WaitForEndpoints(ctx context.Context, pods ...string) error {
	want := slices.Sorted(slices.Values(pods))
	var last []string
	err := s.picker.waitFor(ctx, fmt.Sprintf("the picker's endpoints to be %v", want), pickerReadyTimeout, pollInterval, func(ctx context.Context) bool {
		l, err := s.Ledger(ctx)
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
