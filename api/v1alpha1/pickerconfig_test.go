package v1alpha1

import (
	"reflect"
	"strings"
	"testing"
)

func TestLoadFillsDefaults(t *testing.T) {
	c, err := Load([]byte("apiVersion: tally.tallyepp.io/v1alpha1\nkind: PickerConfig\nfallbackEndpoints: 2\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := Default()
	want.FallbackEndpoints = 2
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("got %+v, want %+v", c, want)
	}
}

func TestLoadAcceptsAnEmptyDocument(t *testing.T) {
	c, err := Load([]byte(""))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c, Default()) {
		t.Fatalf("got %+v", c)
	}
}

func TestLoadRejectsWithTheFieldNamed(t *testing.T) {
	for _, tc := range []struct{ doc, want string }{
		{"blockSize: 64", `unknown field "blockSize"`},
		{"saturation:\n  maxInflight: 3", `unknown field "maxInflight"`},
		{"blockSizeChars: 3", "blockSizeChars: 3 is invalid: must be from 4 to 4096"},
		{"charsPerToken: -1", "charsPerToken"},
		{"fallbackEndpoints: 99", "fallbackEndpoints"},
		{"maxRequestBytes: 10", "maxRequestBytes"},
		{"decodeWeightTokens: -5", "decodeWeightTokens"},
		{"saturation: {maxPrefillTokens: -1}", "saturation.maxPrefillTokens"},
		{"kind: Other", `kind: "Other" is invalid`},
		{"apiVersion: v1", "apiVersion"},
		{"blockSizeChars: many", "blockSizeChars"},
		{"- a\n- b", "cannot unmarshal"},
	} {
		_, err := Load([]byte(tc.doc))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want it to contain %q", tc.doc, err, tc.want)
		}
	}
}

func TestFlowControlErrorsNameTheField(t *testing.T) {
	for doc, field := range map[string]string{
		"flowControl: {enabled: true, ordering: lifo}":           "flowControl.ordering",
		"flowControl: {fairness: random}":                        "flowControl.fairness",
		"flowControl: {requestTTLSeconds: -5}":                   "flowControl.requestTTLSeconds",
		"flowControl: {holdPrefillMilliseconds: -1}":             "flowControl.holdPrefillMilliseconds",
		"flowControl: {bands: [{priority: 1}, {priority: 1}]}":   "flowControl.bands[1].priority",
		"flowControl: {bands: [{priority: 1, maxRequests: -2}]}": "flowControl.bands[0].maxRequests",
		"flowControl: {maxDecodingRequests: -1}":                 "flowControl.maxDecodingRequests",
		"flowControl: {enabled: true, holdPrefillMillis: 5}":     "holdPrefillMillis",
	} {
		_, err := Load([]byte(doc))
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%q: error %v, want one naming %s", doc, err, field)
		}
	}
	c, err := Load([]byte("flowControl: {enabled: true, bands: [{priority: 10, maxRequests: 3}]}"))
	if err != nil {
		t.Fatal(err)
	}
	if b := c.FlowControl.BandFor(10); b.MaxRequests != 3 || b.MaxBytes != DefaultBandMaxBytes {
		t.Errorf("band 10 = %+v, want 3 requests and the default bytes", b)
	}
	if b := c.FlowControl.BandFor(-4); b.MaxRequests != DefaultBandMaxRequests || b.Priority != -4 {
		t.Errorf("an unlisted band = %+v, want the default band's limits", b)
	}
}

func TestDisaggregationIsOffByDefaultAndNamesItsFields(t *testing.T) {
	if Default().Disaggregation.Enabled() {
		t.Error("disaggregation is on by default, want off (nonCachedTokens 0, as llm-d)")
	}
	c, err := Load([]byte("disaggregation: {nonCachedTokens: 16, promptTokens: 64}"))
	if err != nil {
		t.Fatal(err)
	}
	if d := c.Disaggregation; !d.Enabled() || d.NonCachedTokens != 16 || d.PromptTokens != 64 {
		t.Errorf("disaggregation = %+v, want on with 16 and 64", d)
	}
	for doc, field := range map[string]string{
		"disaggregation: {nonCachedTokens: -1}": "disaggregation.nonCachedTokens: -1 is invalid",
		"disaggregation: {promptTokens: -3}":    "disaggregation.promptTokens: -3 is invalid",
		"disaggregation: {nonCached: 3}":        `unknown field "nonCached"`,
	} {
		_, err := Load([]byte(doc))
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%q: error %v, want one naming %s", doc, err, field)
		}
	}
}
