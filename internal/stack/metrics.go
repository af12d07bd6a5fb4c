package stack

import (
	"context"
	"fmt"
	"io"
	"net/http"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Metrics is one read of a picker's /metrics, by family name.
type Metrics map[string]*dto.MetricFamily

// Value returns the value of the series of family name whose labels include
// the given name, value pairs (a gauge's, a counter's or an untyped
// metric's), and whether there is one. With no labels it is the family's
// only or first series.
func (m Metrics) Value(name string, labelPairs ...string) (float64, bool) {
	f, ok := m[name]
	if !ok {
		return 0, false
	}
	for _, s := range f.GetMetric() {
		if hasLabels(s, labelPairs) {
			switch {
			case s.Gauge != nil:
				return s.GetGauge().GetValue(), true
			case s.Counter != nil:
				return s.GetCounter().GetValue(), true
			case s.Untyped != nil:
				return s.GetUntyped().GetValue(), true
			}
		}
	}
	return 0, false
}

// Sum adds up the values of every series of family name (gauges, counters
// and untyped metrics).
func (m Metrics) Sum(name string) float64 {
	total := 0.0
	for _, s := range m[name].GetMetric() {
		total += s.GetGauge().GetValue() + s.GetCounter().GetValue() + s.GetUntyped().GetValue()
	}
	return total
}

func hasLabels(s *dto.Metric, pairs []string) bool {
	for i := 0; i+1 < len(pairs); i += 2 {
		found := false
		for _, l := range s.GetLabel() {
			if l.GetName() == pairs[i] && l.GetValue() == pairs[i+1] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// PickerMetrics reads the picker's /metrics.
func (s *Stack) PickerMetrics(ctx context.Context) (Metrics, error) {
	return readMetrics(ctx, s.http, s.PickerMetricsURL())
}

func readMetrics(ctx context.Context, c *http.Client, metricsURL string) (Metrics, error) {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	url := metricsURL + "/metrics"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("reading the picker's metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 600))
		return nil, fmt.Errorf("reading the picker's metrics: GET %s: HTTP %d: %s", url, resp.StatusCode, body)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("parsing the picker's metrics from %s: %w", url, err)
	}
	return families, nil
}
