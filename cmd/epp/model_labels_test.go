package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestMaxModelNameLabelsFlag(t *testing.T) {
	o, _, err := parseFlags([]string{"--pool-name", "p"}, env(nil), &bytes.Buffer{})
	if err != nil || o.maxModelNameLabels != 1000 {
		t.Fatalf("default: %d (%v), want 1000", o.maxModelNameLabels, err)
	}
	o, _, err = parseFlags([]string{"--pool-name", "p", "--max-model-name-labels", "20"}, env(nil), &bytes.Buffer{})
	if err != nil || o.maxModelNameLabels != 20 {
		t.Fatalf("--max-model-name-labels 20: %d (%v)", o.maxModelNameLabels, err)
	}
	_, _, err = parseFlags([]string{"--pool-name", "p", "--max-model-name-labels", "0"}, env(nil), &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "--max-model-name-labels") || !strings.Contains(err.Error(), "1 or more") {
		t.Fatalf("--max-model-name-labels 0: %v, want an error naming the flag and what is accepted", err)
	}
}
