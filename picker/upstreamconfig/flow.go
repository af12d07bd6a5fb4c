package upstreamconfig

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"

	"k8s.io/apimachinery/pkg/api/resource"
)

// upstreamFlowGate is the upstream feature gate that turns flow control on.
const upstreamFlowGate = "flowControl"

// The upstream flow control policies, by plugin type, and what each is in
// Tally.
var upstreamFairness = map[string]string{
	"global-strict-fairness-policy": v1alpha1.FairnessGlobalStrict,
	"round-robin-fairness-policy":   v1alpha1.FairnessRoundRobin,
}

var upstreamOrdering = map[string]string{
	"fcfs-ordering-policy": v1alpha1.OrderingFCFS,
	// Every request has the queue's one TTL in Tally, so the earliest
	// deadline is the earliest arrival.
	"edf-ordering-policy": v1alpha1.OrderingFCFS,
}

// upstreamFlowControl is the flowControl section of an EndpointPickerConfig
// (gateway-api-inference-extension v1.5.0, FlowControlConfig).
type upstreamFlowControl struct {
	MaxBytes                  *resource.Quantity `json:"maxBytes"`
	MaxRequests               *resource.Quantity `json:"maxRequests"`
	DefaultRequestTTL         *string            `json:"defaultRequestTTL"`
	DefaultPriorityBand       *upstreamBand      `json:"defaultPriorityBand"`
	PriorityBands             []upstreamBand     `json:"priorityBands"`
	UsageLimitPolicyPluginRef string             `json:"usageLimitPolicyPluginRef"`
}

type upstreamBand struct {
	Priority          int                `json:"priority"`
	MaxBytes          *resource.Quantity `json:"maxBytes"`
	MaxRequests       *resource.Quantity `json:"maxRequests"`
	FairnessPolicyRef string             `json:"fairnessPolicyRef"`
	OrderingPolicyRef string             `json:"orderingPolicyRef"`
}

// featureGates maps the featureGates list: flowControl turns flow control
// on; other gates are noted as ignored.
func (m *mapper) featureGates(raw json.RawMessage) error {
	var gates []string
	if err := json.Unmarshal(raw, &gates); err != nil {
		return fmt.Errorf("EndpointPickerConfig: featureGates: %s is invalid: must be a list of gate names", raw)
	}
	for i, g := range gates {
		if g == upstreamFlowGate {
			m.cfg.FlowControl.Enabled = true
			m.mapped(fmt.Sprintf("featureGates[%d](%s)", i, g), "flowControl.enabled", "requests wait in the picker while every endpoint is saturated")
			continue
		}
		m.ignore(fmt.Sprintf("featureGates[%d](%s)", i, g), "a feature gate Tally does not have")
	}
	return nil
}

// flowControl maps the flowControl section: the queue's limits and TTL, the
// bands' limits, and the bands' fairness and ordering policies (one of
// each for every band in Tally). plugins resolves a policy reference.
func (m *mapper) flowControl(raw json.RawMessage, plugins []upstreamPlugin, enabled bool) error {
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(raw, &keys); err != nil {
		return fmt.Errorf("EndpointPickerConfig: flowControl: must be an object: %w", err)
	}
	var fc upstreamFlowControl
	if err := json.Unmarshal(raw, &fc); err != nil {
		return fmt.Errorf("EndpointPickerConfig: flowControl: %s", strings.TrimPrefix(err.Error(), "json: "))
	}
	if !enabled {
		m.ignore("flowControl", "featureGates does not list flowControl, so flow control is off, as upstream")
		return nil
	}
	known := []string{"maxBytes", "maxRequests", "defaultRequestTTL", "defaultPriorityBand", "priorityBands", "usageLimitPolicyPluginRef"}
	for _, k := range sortedKeys(keys) {
		if !slices.Contains(known, k) {
			m.ignore("flowControl."+k, "not a field Tally knows")
		}
	}
	out := &m.cfg.FlowControl
	var err error
	if out.MaxBytes, err = quantity("flowControl.maxBytes", fc.MaxBytes); err != nil {
		return err
	}
	if fc.MaxBytes != nil {
		m.mapped("flowControl.maxBytes", "flowControl.maxBytes", "bytes of the whole queue")
	}
	n, err := quantity("flowControl.maxRequests", fc.MaxRequests)
	if err != nil {
		return err
	}
	out.MaxRequests = int(n)
	if fc.MaxRequests != nil {
		m.mapped("flowControl.maxRequests", "flowControl.maxRequests", "requests in the whole queue")
	}
	if fc.DefaultRequestTTL != nil {
		d, err := time.ParseDuration(*fc.DefaultRequestTTL)
		if err != nil || d < 0 {
			return fmt.Errorf("EndpointPickerConfig: flowControl.defaultRequestTTL: %q is invalid: must be a duration such as 30s", *fc.DefaultRequestTTL)
		}
		if d > 0 {
			out.RequestTTLSeconds = int(math.Ceil(d.Seconds()))
			m.mapped("flowControl.defaultRequestTTL", "flowControl.requestTTLSeconds", "rounded up to whole seconds")
		}
	}
	if fc.UsageLimitPolicyPluginRef != "" {
		m.ignore("flowControl.usageLimitPolicyPluginRef", "Tally's saturation threshold is flowControl.holdPrefillMilliseconds of queued prefill, from its ledger")
	}
	var fairness, ordering string
	band := func(path string, b upstreamBand) (v1alpha1.Band, error) {
		out := v1alpha1.Band{Priority: b.Priority}
		var err error
		if out.MaxBytes, err = quantity(path+".maxBytes", b.MaxBytes); err != nil {
			return out, err
		}
		n, err := quantity(path+".maxRequests", b.MaxRequests)
		if err != nil {
			return out, err
		}
		out.MaxRequests = int(n)
		if b.MaxBytes != nil || b.MaxRequests != nil {
			m.mapped(path, strings.Replace(path, "priorityBands", "bands", 1), "the band's limits")
		}
		for _, ref := range []struct {
			field, name string
			types       map[string]string
			into        *string
		}{{"fairnessPolicyRef", b.FairnessPolicyRef, upstreamFairness, &fairness}, {"orderingPolicyRef", b.OrderingPolicyRef, upstreamOrdering, &ordering}} {
			if ref.name == "" {
				continue
			}
			field := path + "." + ref.field
			typ := ref.name
			for _, p := range plugins {
				if p.ref() == ref.name {
					typ = p.Type
				}
			}
			v, ok := ref.types[typ]
			switch {
			case !ok:
				m.ignore(field, fmt.Sprintf("%q is no policy Tally has", ref.name))
			case *ref.into != "" && *ref.into != v:
				m.ignore(field, fmt.Sprintf("Tally has one such policy for every band; %s is used", *ref.into))
			default:
				*ref.into = v
				m.mapped(field, "flowControl."+strings.TrimSuffix(ref.field, "PolicyRef"), v)
			}
		}
		return out, nil
	}
	if fc.DefaultPriorityBand != nil {
		b, err := band("flowControl.defaultPriorityBand", *fc.DefaultPriorityBand)
		if err != nil {
			return err
		}
		out.DefaultBand = v1alpha1.Band{MaxRequests: b.MaxRequests, MaxBytes: b.MaxBytes}
	}
	for i, ub := range fc.PriorityBands {
		b, err := band(fmt.Sprintf("flowControl.priorityBands[%d]", i), ub)
		if err != nil {
			return err
		}
		out.Bands = append(out.Bands, b)
	}
	out.Fairness, out.Ordering = fairness, ordering
	if fairness == "" {
		m.ignore("flowControl fairness", fmt.Sprintf("no fairnessPolicyRef given: Tally's default %q (upstream's is %q)", v1alpha1.DefaultFairness, v1alpha1.FairnessGlobalStrict))
	}
	if ordering == "" {
		m.ignore("flowControl ordering", fmt.Sprintf("no orderingPolicyRef given: Tally's default %q (upstream's is %q)", v1alpha1.DefaultOrdering, v1alpha1.OrderingFCFS))
	}
	return nil
}

// quantity reads a resource quantity as a whole number (0 when absent).
func quantity(field string, q *resource.Quantity) (int64, error) {
	if q == nil {
		return 0, nil
	}
	n, ok := q.AsInt64()
	if !ok || n < 0 {
		return 0, fmt.Errorf("EndpointPickerConfig: %s: %q is invalid: must be a whole number of 0 or more (such as 5000, 1k or 1Gi)", field, q.String())
	}
	return n, nil
}

func sortedKeys(m map[string]json.RawMessage) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
