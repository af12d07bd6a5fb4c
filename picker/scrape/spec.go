package scrape

import (
	"bytes"
	"fmt"
	"strings"
)

// MetricSpec names the series a value is read from: the series of family
// Name that carry every label of Labels with its value. Several series
// that match are summed (averaged for a share), as for a family without
// labels. The upstream picker's metric flags write it
// name{label=value,...}: Triton's TensorRT-LLM backend publishes its
// waiting and running requests as two series of one family,
// nv_trt_llm_request_metrics{request_type=waiting} and
// {request_type=scheduled}, so a spec without its labels would read their
// sum as both.
type MetricSpec struct {
	Name   string
	Labels []Label
}

// Label is one label=value a series must carry.
type Label struct{ Name, Value string }

// String writes the spec as ParseMetricSpec reads it.
func (s MetricSpec) String() string {
	if len(s.Labels) == 0 {
		return s.Name
	}
	parts := make([]string, len(s.Labels))
	for i, l := range s.Labels {
		parts[i] = l.Name + "=" + l.Value
	}
	return s.Name + "{" + strings.Join(parts, ",") + "}"
}

// ParseMetricSpec reads name or name{label=value,...}, as the upstream
// picker's metric flags take it (a value may also be quoted, as in the
// exposition format). The empty string is the zero spec: not read.
func ParseMetricSpec(spec string) (MetricSpec, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return MetricSpec{}, nil
	}
	name, rest, hasLabels := strings.Cut(spec, "{")
	name = strings.TrimSpace(name)
	if name == "" {
		return MetricSpec{}, fmt.Errorf("%q is invalid: the metric name is empty", spec)
	}
	if strings.ContainsAny(name, "}=\", \t") {
		return MetricSpec{}, fmt.Errorf("%q is invalid: must be a metric name, optionally followed by {label=value,...}", spec)
	}
	s := MetricSpec{Name: name}
	if !hasLabels {
		return s, nil
	}
	body, ok := strings.CutSuffix(rest, "}")
	if !ok || strings.ContainsAny(body, "{}") {
		return MetricSpec{}, fmt.Errorf("%q is invalid: the label filter must be one {label=value,...} at the end", spec)
	}
	for pair := range strings.SplitSeq(body, ",") {
		k, v, ok := strings.Cut(pair, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"' {
			v = v[1 : len(v)-1]
		}
		if !ok || k == "" || v == "" {
			return MetricSpec{}, fmt.Errorf("%q is invalid: label filter %q must be label=value", spec, strings.TrimSpace(pair))
		}
		s.Labels = append(s.Labels, Label{Name: k, Value: v})
	}
	return s, nil
}

// matches reports whether a series' labels (the text between its braces)
// carry every label of want with its value.
func matches(labels []byte, want []Label) bool {
	for _, l := range want {
		if !hasLabel(labels, l) {
			return false
		}
	}
	return true
}

// hasLabel finds l.Name="l.Value" among labels. Filters name plain values
// (request types, block types): a value with escapes is compared as
// labelString decodes it.
func hasLabel(labels []byte, l Label) bool {
	if bytes.IndexByte(labels, '\\') >= 0 {
		return labelString(labels, l.Name) == l.Value
	}
	for len(labels) > 0 {
		eq := bytes.IndexByte(labels, '=')
		if eq < 0 || eq+1 >= len(labels) || labels[eq+1] != '"' {
			return false
		}
		k := bytes.TrimSpace(labels[:eq])
		v := labels[eq+2:]
		closeQuote := bytes.IndexByte(v, '"')
		if closeQuote < 0 {
			return false
		}
		if string(k) == l.Name {
			return string(v[:closeQuote]) == l.Value
		}
		labels = bytes.TrimLeft(v[closeQuote+1:], ", ")
	}
	return false
}

// seriesLabels is the text between a sample line's braces; nil without.
func seriesLabels(line []byte) []byte {
	open := bytes.IndexByte(line, '{')
	if open < 0 {
		return nil
	}
	end := bytes.LastIndexByte(line, '}')
	if end < open {
		return nil
	}
	return line[open+1 : end]
}
