package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tallyepp/tally/internal/docsection"
)

const sampleTrace = "../../test/data/mooncake_sample.jsonl"

func TestRunWritesTablesAndCharts(t *testing.T) {
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	args := []string{"--trace", sampleTrace, "--requests", "30", "--engines", "2", "--burst", "8",
		"--burst-prompt-tokens", "1024", "--burst-shared-tokens", "512", "--bypass", "0.3", "--non-streaming", "0.5", "--out", dir}
	if code := run(args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	for _, want := range []string{"| tally |", "| upstream-like |", "| bound |", "Burst:", "requests/s"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
		}
	}
	if !strings.Contains(stderr.String(), "trace tally") {
		t.Errorf("no progress on stderr: %q", stderr.String())
	}
	for _, name := range []string{"routesim.md", "routesim.json", "routesim-ttft-cdf.svg", "routesim-burst-inflight.svg"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Error(err)
		}
	}
}

func TestBadFlagsExit2NamingTheFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "--trace"},
		{[]string{"--trace", "a", "--azure", "b"}, "exactly one"},
		{[]string{"--trace", sampleTrace, "--engines", "0"}, "engines"},
		{[]string{"--trace", sampleTrace, "--bypass", "2"}, "bypass"},
		{[]string{"--trace", sampleTrace, "--burst-shared-tokens", "99999"}, "burst shared tokens"},
		{[]string{"--trace", sampleTrace, "--policies", "tally,random"}, "--policies"},
		{[]string{"--trace", sampleTrace, "--name", "a/b"}, "--name"},
		{[]string{"--trace", sampleTrace, "--doc", "x.md"}, "--doc needs --out"},
		{[]string{"--trace", sampleTrace, "--priorities", "10:0.2"}, "--priorities"},
		{[]string{"--trace", sampleTrace, "--priorities", "10=0.7,-1=0.7"}, "at most 1"},
		{[]string{"--trace", sampleTrace, "--flows", "10,x"}, "--flows"},
		{[]string{"--trace", sampleTrace, "--flows", "10,0"}, "flow weights"},
		{[]string{"--trace", sampleTrace, "--tally-config-text", "{flowControl: {ordering: random}}"}, "flowControl.ordering"},
		{[]string{"--trace", sampleTrace, "--adapters", "-1"}, "--adapters: -1 is invalid"},
		{[]string{"--trace", sampleTrace, "--adapters", "8", "--max-loras", "0"}, "--max-loras: 0 is invalid"},
		{[]string{"--trace", sampleTrace, "--adapters", "8", "--adapter-zipf", "-1"}, "--adapter-zipf: -1 is invalid"},
		{[]string{"--trace", sampleTrace, "--adapters", "8", "--adapter-base-fraction", "2"}, "--adapter-base-fraction: 2 is invalid"},
		{[]string{"--trace", sampleTrace, "--adapters", "8", "--lora-load-time", "soon"}, "lora-load-time"},
		{[]string{"--trace", sampleTrace, "--roles", "prefill,decode,decode,encode"}, "roles: engine 3"},
		{[]string{"--trace", sampleTrace, "--roles", "prefill,prefill,decode,decode"}, "--policies: \"round-robin\" does not know the engines' roles"},
		{[]string{"--trace", sampleTrace, "--pd", "--pd-prefill-engines", "4"}, "--pd-prefill-engines: 4 is invalid"},
		{[]string{"--trace", sampleTrace, "--pd", "--pd-utilisation", "0.5,x"}, "--pd-utilisation"},
		{[]string{"--trace", sampleTrace, "--pd", "--pd-utilisation", "0.5,0"}, "prefill utilisation: 0 is invalid"},
		{[]string{"--trace", sampleTrace, "--pd", "--pd-non-cached-tokens", "0"}, "--pd-non-cached-tokens: 0 is invalid"},
		{[]string{"--trace", sampleTrace, "--pd", "--roles", "prefill,decode,decode,decode"}, "--roles and --pd"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(tc.args, &stdout, &stderr)
		if code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want an error naming %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

func TestTallyConfig(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "picker.yaml")
	if err := os.WriteFile(cfg, []byte("prefillTokensPerSecond: 48000\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	args := []string{"--trace", sampleTrace, "--requests", "10", "--burst", "0", "--policies", "tally", "--tally-config", cfg, "--quiet"}
	if code := run(args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "`prefillTokensPerSecond: 48000`") {
		t.Errorf("the report does not name the configuration:\n%s", stdout.String())
	}
	if err := os.WriteFile(cfg, []byte("prefillTokensPerSecnd: 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if code := run([]string{"--trace", sampleTrace, "--tally-config", cfg}, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), "--tally-config") {
		t.Errorf("a misspelt field: exit %d, %q", code, stderr.String())
	}
}

// tally-flow with priorities and flows: the report counts the held and
// refused requests, per priority and per flow, and names the picker
// configuration given inline.
func TestFlowControlReport(t *testing.T) {
	var stdout, stderr bytes.Buffer
	args := []string{"--trace", sampleTrace, "--requests", "60", "--engines", "2", "--burst", "0", "--load-factor", "8",
		"--policies", "tally,tally-flow", "--priorities", "10=0.2,-1=0.5", "--flows", "3,1",
		"--tally-config-text", "{flowControl: {holdPrefillMilliseconds: 100}}", "--quiet"}
	if code := run(args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{
		"priorities 10=0.2,-1=0.5 (the rest 0); flows weighted 3,1.", "`flowControl.holdPrefillMilliseconds: 100`",
		"| tally-flow | 60 |", "| shed | queue full | TTL |", "Per priority (", "| tally-flow | -1 |", "| tally-flow | flow-1 | 1 |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q:\n%s", want, out)
		}
	}
}

func TestDocGetsTheSectionWithRelativeLinks(t *testing.T) {
	dir := t.TempDir()
	doc := filepath.Join(dir, "benchmarks.md")
	begin, end := docsection.Markers("sim-mixed")
	if err := os.WriteFile(doc, []byte("# Benchmarks\n\n"+begin+"\nold\n"+end+"\n\nHand-written.\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	args := []string{"--trace", sampleTrace, "--requests", "20", "--engines", "2", "--burst", "8",
		"--burst-prompt-tokens", "1024", "--burst-shared-tokens", "512", "--bypass", "0.3", "--non-streaming", "0.5",
		"--out", filepath.Join(dir, "bench"), "--name", "sim-mixed", "--doc", doc}
	if code := run(args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	data, err := os.ReadFile(doc)
	if err != nil {
		t.Fatal(err)
	}
	got := string(data)
	for _, want := range []string{
		"## Routing simulator: mooncake_sample.jsonl, 2 engines, 30% of requests past the policy, 50% of clients not streaming",
		"](bench/sim-mixed-ttft-cdf.svg)", "](bench/sim-mixed-burst-inflight.svg)", "| tally |", "Hand-written.",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("the file lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "\nold\n") {
		t.Errorf("the old section is still there:\n%s", got)
	}
	for _, name := range []string{"sim-mixed-ttft-cdf.svg", "sim-mixed-burst-inflight.svg"} {
		if _, err := os.Stat(filepath.Join(dir, "bench", name)); err != nil {
			t.Error(err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "bench", "sim-mixed.md")); err == nil {
		t.Error("with --doc, the tables went to --out as well")
	}
	if !strings.Contains(stderr.String(), "wrote section") {
		t.Errorf("no word of the section on stderr: %q", stderr.String())
	}

	// A file without the section's markers is left alone, and the error
	// says what to add.
	if err := os.WriteFile(doc, []byte("# Benchmarks\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	stderr.Reset()
	if code := run(args, &stdout, &stderr); code != 1 || !strings.Contains(stderr.String(), begin) {
		t.Errorf("no markers: exit %d, %q", code, stderr.String())
	}
}

func TestAdapterFlags(t *testing.T) {
	o, err := parse([]string{"--trace", sampleTrace, "--adapters", "8", "--adapter-zipf", "1.1", "--max-loras", "2", "--lora-load-time", "150ms"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if c := o.cfg; c.Adapters != 8 || c.AdapterZipf != 1.1 || c.MaxLoRAs != 2 || c.LoRALoadTime != 150*time.Millisecond || c.BaseFraction != 0 {
		t.Errorf("config %+v: want 8 adapters, Zipf 1.1, max_loras 2, a load 150ms", c)
	}
	// Without --adapters the LoRA flags describe nothing.
	o, err = parse([]string{"--trace", sampleTrace, "--max-loras", "3"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if c := o.cfg; c.Adapters != 0 || c.MaxLoRAs != 0 {
		t.Errorf("config %+v: want no adapters", c)
	}
	var stdout, stderr bytes.Buffer
	args := []string{"--trace", sampleTrace, "--requests", "40", "--burst", "16", "--burst-prompt-tokens", "1024",
		"--burst-shared-tokens", "512", "--adapters", "4", "--max-loras", "2", "--policies", "round-robin,tally", "--quiet"}
	if code := run(args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	for _, want := range []string{"4 LoRA adapters", "| swaps | per 1,000 requests |", "Burst for LoRA adapter lora-burst"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
		}
	}
}

// --pd writes the prefill/decode comparison into its section of --doc,
// and --roles runs the role-aware policies on a P/D pool.
func TestPrefillDecode(t *testing.T) {
	dir := t.TempDir()
	doc := filepath.Join(dir, "bench.md")
	begin, end := docsection.Markers("pd")
	if err := os.WriteFile(doc, []byte("# B\n\n"+begin+"\n"+end+"\n\nkept\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	args := []string{"--trace", sampleTrace, "--requests", "60", "--pd", "--pd-utilisation", "0.4", "--out", dir, "--doc", doc, "--name", "pd", "--quiet"}
	if code := run(args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	data, err := os.ReadFile(doc)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"## Routing simulator, prefill/decode: mooncake_sample.jsonl, 2 prefill + 2 decode engines", "| 40% |", "| P/D | tally |", "| P/D | llm-d-like |", "| shared | tally |", "kept"} {
		if !strings.Contains(string(data), want) {
			t.Errorf("the document lacks %q:\n%s", want, data)
		}
	}
	stdout.Reset()
	stderr.Reset()
	args = []string{"--trace", sampleTrace, "--requests", "40", "--burst", "0", "--roles", "prefill,decode,decode", "--engines", "3",
		"--policies", "tally,llm-d-like", "--tally-config-text", "{disaggregation: {nonCachedTokens: 16}}", "--quiet"}
	if code := run(args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	for _, want := range []string{"| tally |", "| llm-d-like |"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
		}
	}
}
