package main

import (
	"bytes"
	"testing"
)

// The conformance hooks let a client choose its endpoint: off unless asked for.
func TestConformanceTestHooksAreOffByDefault(t *testing.T) {
	o, _, err := parseFlags([]string{"--pool-name", "p"}, env(nil), &bytes.Buffer{})
	if err != nil || o.conformanceTestHooks {
		t.Fatalf("default: hooks %v, err %v; want off", o.conformanceTestHooks, err)
	}
	o, ignored, err := parseFlags([]string{"--pool-name", "p", "--conformance-test-hooks"}, env(nil), &bytes.Buffer{})
	if err != nil || !o.conformanceTestHooks || len(ignored) != 0 {
		t.Fatalf("--conformance-test-hooks: hooks %v, ignored %v, err %v; want on, nothing ignored", o.conformanceTestHooks, ignored, err)
	}
}
