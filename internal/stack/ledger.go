package stack

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"

	"github.com/tallyepp/tally/picker/debugledger"
)

// Ledger reads the picker's /debug/ledger.
func (s *Stack) Ledger(ctx context.Context) (debugledger.Ledger, error) {
	return ReadLedger(ctx, s.http, s.PickerMetricsURL())
}

// ReadLedger reads /debug/ledger from the picker whose metrics server is at
// metricsURL.
func ReadLedger(ctx context.Context, c *http.Client, metricsURL string) (debugledger.Ledger, error) {
	url := metricsURL + debugledger.Path
	var l debugledger.Ledger
	err := getFromPicker(ctx, c, url, "the ledger", func(body io.Reader) error {
		if err := json.NewDecoder(body).Decode(&l); err != nil {
			return fmt.Errorf("decoding the ledger from %s: %w", url, err)
		}
		return nil
	})
	if err != nil {
		return debugledger.Ledger{}, err
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
		l, err := ReadLedger(ctx, c, metricsURL)
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
