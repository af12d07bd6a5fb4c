package v1alpha1

import (
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
	if c != want {
		t.Fatalf("got %+v, want %+v", c, want)
	}
}

func TestLoadAcceptsAnEmptyDocument(t *testing.T) {
	c, err := Load([]byte(""))
	if err != nil {
		t.Fatal(err)
	}
	if c != Default() {
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
