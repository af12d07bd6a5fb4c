package main

import (
	"bytes"
	"encoding/json"
	"io"
	"strings"
	"testing"

	"github.com/tallyepp/tally/picker/logging"
)

// logLines parses the JSON lines the production logger wrote.
func logLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("log line %q is not JSON: %v", l, err)
		}
		lines = append(lines, m)
	}
	return lines
}

func TestWarningsAreWarnLevelLines(t *testing.T) {
	for _, args := range [][]string{
		{"--pool-name", "p"},
		// More verbose logging turns the sampler off: the warning must
		// come out as one all the same.
		{"--pool-name", "p", "-v", "4"},
	} {
		opts, _, err := parseFlags(args, func(string) string { return "" }, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		log := newLogger(opts, &out)
		logging.Warn(log.WithName("scrape"), "cannot read an endpoint's metrics", "endpoint", "10.0.0.1:8000")
		log.Info("ready", "pool", "default/p")

		lines := logLines(t, out.String())
		if len(lines) != 2 {
			t.Fatalf("%v: got %d lines, want 2:\n%s", args, len(lines), out.String())
		}
		warn, info := lines[0], lines[1]
		if warn["level"] != "warn" || warn["msg"] != "cannot read an endpoint's metrics" || warn["endpoint"] != "10.0.0.1:8000" || warn["logger"] != "scrape" {
			t.Errorf("%v: warning line = %v, want level warn with its message, logger and values", args, warn)
		}
		if _, ok := warn[logging.WarningKey]; ok {
			t.Errorf("%v: warning line keeps its %q mark: %v", args, logging.WarningKey, warn)
		}
		if info["level"] != "info" {
			t.Errorf("%v: info line = %v, want level info", args, info)
		}
	}
}
