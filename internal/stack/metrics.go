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

// Histogram adds up the sample sums and counts of every series of the
// histogram family name.
func (m Metrics) Histogram(name string) (sum, count float64) {
	for _, s := range m[name].GetMetric() {
		sum += s.GetHistogram().GetSampleSum()
		count += float64(s.GetHistogram().GetSampleCount())
	}
	return sum, count
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

// ReadMetrics reads the /metrics of the picker whose metrics server is at
// metricsURL.
func ReadMetrics(ctx context.Context, c *http.Client, metricsURL string) (Metrics, error) {
	return readMetrics(ctx, c, metricsURL, "the metrics at "+metricsURL)
}

// PickerMetrics reads the picker's /metrics.
func (s *Stack) PickerMetrics(ctx context.Context) (Metrics, error) {
	return readMetrics(ctx, s.http, s.PickerMetricsURL(), "the picker's metrics")
}

// PodMetrics reads pod's /metrics: its simulated engine's, as the picker
// scrapes them.
func (s *Stack) PodMetrics(ctx context.Context, pod *Pod) (Metrics, error) {
	return readMetrics(ctx, s.http, pod.URL(), "pod "+pod.Name+"'s metrics")
}

func readMetrics(ctx context.Context, c *http.Client, metricsURL, what string) (Metrics, error) {
	url := metricsURL + "/metrics"
	var families Metrics
	err := getFromPicker(ctx, c, url, what, func(body io.Reader) error {
		var err error
		parser := expfmt.NewTextParser(model.UTF8Validation)
		if families, err = parser.TextToMetricFamilies(body); err != nil {
			return fmt.Errorf("parsing %s from %s: %w", what, url, err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return families, nil
}

// getFromPicker GETs url from the picker within requestTimeout and hands
// the body of a 200 answer to read; what names what is read, in errors.
func getFromPicker(ctx context.Context, c *http.Client, url, what string, read func(body io.Reader) error) error {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("reading %s: %w", what, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 600))
		return fmt.Errorf("reading %s: GET %s: HTTP %d: %s", what, url, resp.StatusCode, body)
	}
	return read(resp.Body)
}
