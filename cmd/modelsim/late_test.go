package main

import (
	"bytes"
	"io"
	"strings"
	"testing"
)

func TestLateFirstByteFractionFlag(t *testing.T) {
	o, err := parse([]string{"--late-first-byte-fraction", "0.25"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.cfg.LateFirstByteFraction != 0.25 {
		t.Errorf("LateFirstByteFraction = %v, want 0.25", o.cfg.LateFirstByteFraction)
	}
	if o, _ := parse(nil, io.Discard); o.cfg.LateFirstByteFraction != 0 {
		t.Errorf("LateFirstByteFraction = %v by default, want 0", o.cfg.LateFirstByteFraction)
	}
	for _, v := range []string{"1.5", "-0.1", "NaN"} {
		var stderr bytes.Buffer
		want := "--late-first-byte-fraction: " + v + " is invalid: must be from 0 to 1"
		if code := run(t.Context(), []string{"--late-first-byte-fraction", v}, &stderr); code != 2 || !strings.Contains(stderr.String(), want) {
			t.Errorf("--late-first-byte-fraction %s: exit %d, stderr %q; want 2 and %q", v, code, stderr.String(), want)
		}
	}
}
