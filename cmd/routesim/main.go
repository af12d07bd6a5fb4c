// Command routesim replays an LLM-serving trace against simulated vLLM
// engines in virtual time under several routing policies (round-robin,
// least-request on scraped metrics, an upstream-like scorer, and Tally's
// real picker) and reports each policy's latency beside the no-queueing
// bound; with --pd, Tally against a model of llm-d on prefill and decode
// engines. See package internal/routesim.
//
//	routesim --trace test/data/mooncake_sample.jsonl --engines 4
//	routesim --trace test/data/mooncake_sample.jsonl --policies tally,tally-flow --load-factor 3.4 --priorities 10=0.2,-1=0.8
//	routesim --azure AzureLLMInferenceTrace_conv.csv --requests 5000 --out docs/bench
//	routesim --trace test/data/mooncake_sample.jsonl --adapters 8 --adapter-zipf 1.1 --max-loras 2 --lora-load-time 200ms
//	routesim --trace test/data/mooncake_sample.jsonl --roles prefill,prefill,decode,decode --policies tally,llm-d-like --tally-config-text '{disaggregation: {nonCachedTokens: 16}}'
//	routesim --trace test/data/mooncake_sample.jsonl --engines 4 --pd --pd-utilisation 0.5,0.8
//
// The tables go to stdout, progress to stderr; with --out DIR it also
// writes DIR/routesim.md, its SVG charts and routesim.json (--name other
// names them other.md, other-ttft-cdf.svg...). With --doc FILE as well, the
// tables and links to the charts replace the section of FILE between the
// markers named by --name, and DIR gets only the charts, as `make bench`
// does:
//
//	routesim --trace test/data/mooncake_sample.jsonl --engines 4 --out docs/bench --doc docs/benchmarks.md
//
// Same flags and seed, same numbers. Invalid flags exit 2, naming the
// flag; a failed run exits 1.
//
// Invariant: everything the simulation decides comes from the flags and the
// trace; the wall clock only times the run.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/internal/docsection"
	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/internal/routesim"
	"github.com/tallyepp/tally/picker"
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

type options struct {
	trace, azure          string
	cfg                   routesim.Config
	requests              int
	policies              string
	burst                 routesim.Burst
	tenants, systemPrompt int
	out, tallyConfig      string
	tallyConfigText       string
	priorities, flows     string
	name, doc             string
	parallel              int
	quiet                 bool
	lora                  loraFlags
	roles                 string
	pd                    pdFlags
}

// pdFlags are the prefill/decode comparison's flags (--pd).
type pdFlags struct {
	on              bool
	prefillEngines  int
	utilisations    string
	nonCachedTokens int
	comparison      routesim.PDComparison // read from the above
}

// loraFlags are the LoRA flags, copied into the configuration only with
// --adapters, so that a run without adapters describes none.
type loraFlags struct {
	adapters           int
	zipf, baseFraction float64
	maxLoRAs           int
	loadTime           time.Duration
}

func parse(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("routesim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	db := routesim.DefaultBurst()
	fs.StringVar(&o.trace, "trace", "", "Mooncake-format trace (JSON lines: timestamp, input_length, output_length, hash_ids)")
	fs.StringVar(&o.azure, "azure", "", "Azure LLM inference trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens), given a synthetic system prompt per tenant")
	fs.IntVar(&o.cfg.Engines, "engines", routesim.DefaultEngines, "simulated engines")
	fs.IntVar(&o.cfg.KVBlocks, "kv-blocks", engine.DefaultKVBlocks, "KV cache of each engine, in 16-token blocks")
	fs.Float64Var(&o.cfg.LoadFactor, "load-factor", 1, "arrival rate multiplier: 2 replays the trace twice as fast")
	fs.Float64Var(&o.cfg.NonStreaming, "non-streaming", 0, "fraction of requests whose client does not stream (first bytes at the end of generation)")
	fs.Float64Var(&o.cfg.Bypass, "bypass", 0, "fraction of requests sent round-robin straight to the engines, past the policy")
	fs.Uint64Var(&o.cfg.Seed, "seed", 1, "seed of every random choice")
	fs.IntVar(&o.requests, "requests", 0, "replay the first N requests of the trace (0: all)")
	fs.StringVar(&o.policies, "policies", strings.Join(routesim.Policies(), ","), "comma-separated policies to run, of "+strings.Join(routesim.KnownPolicies(), ", ")+
		" (tally-flow: tally with flow control on; exact-greedy: a reference no router can be, which sees every engine's cache and queued prefill and sends each request where its uncached prompt plus the prefill queued ahead of it is least; forecast-greedy: another, which runs a copy of each engine with the request added and sends it where its first token comes soonest, adapter loads and slot waits included)")
	fs.IntVar(&o.burst.Requests, "burst", db.Requests, "requests of the burst scenario (0: no burst)")
	fs.IntVar(&o.burst.PromptTokens, "burst-prompt-tokens", db.PromptTokens, "prompt of each burst request, in tokens")
	fs.IntVar(&o.burst.SharedTokens, "burst-shared-tokens", db.SharedTokens, "leading prompt tokens the burst shares (whole 512-token blocks), held by one engine before it")
	fs.IntVar(&o.burst.OutputTokens, "burst-output-tokens", db.OutputTokens, "output of each burst request, in tokens")
	fs.IntVar(&o.tenants, "tenants", 16, "with --azure: tenants, each with its own system prompt (drawn Zipf-like)")
	fs.IntVar(&o.systemPrompt, "system-prompt-tokens", 1024, "with --azure: each tenant's system prompt, in tokens")
	fs.StringVar(&o.tallyConfig, "tally-config", "", "PickerConfig file (YAML or JSON) for the tally policies' picker; default: the production defaults")
	fs.StringVar(&o.tallyConfigText, "tally-config-text", "", "a PickerConfig given inline (instead of --tally-config), e.g. '{flowControl: {holdPrefillMilliseconds: 100}}'")
	fs.StringVar(&o.priorities, "priorities", "", "priorities of a share of the requests, as PRIORITY=FRACTION,... (e.g. 10=0.2,-1=0.8; the rest 0): flow control's bands, below 0 sheddable")
	fs.StringVar(&o.flows, "flows", "", "spread the requests over fairness ids flow-0, flow-1... in proportion to these comma-separated weights (e.g. 10,1)")
	fs.IntVar(&o.lora.adapters, "adapters", 0, "LoRA adapters the engines serve besides the base model; each request is for one, drawn from a Zipf mix (0: none, the base model alone), and the burst for one no engine has loaded")
	fs.Float64Var(&o.lora.zipf, "adapter-zipf", 1.1, "with --adapters: the mix's exponent: the adapter of rank k is drawn with weight 1/k^s (0: every adapter alike)")
	fs.Float64Var(&o.lora.baseFraction, "adapter-base-fraction", 0, "with --adapters: fraction (0 to 1) of the requests that stay on the base model")
	fs.IntVar(&o.lora.maxLoRAs, "max-loras", 1, "with --adapters: adapters each engine runs at once (vLLM's --max-loras; its default is 1)")
	fs.DurationVar(&o.lora.loadTime, "lora-load-time", engine.DefaultLoRALoadTime, "with --adapters: what loading an adapter into a slot costs the engine's step")
	fs.StringVar(&o.roles, "roles", "", "comma-separated role of each engine in prefill/decode disaggregation, as the pod label llm-d.ai/role: prefill, decode, prefill-decode, or empty (unlabelled); with a prefill-only engine only tally, tally-flow and llm-d-like run, and they split requests when disaggregation.nonCachedTokens is set in the picker's configuration (--tally-config-text '{disaggregation: {nonCachedTokens: 16}}'), which llm-d-like's decider reads too")
	dp := routesim.DefaultPDComparison()
	fs.BoolVar(&o.pd.on, "pd", false, "run the prefill/decode comparison instead of the policy table and the burst: --pd-prefill-engines prefill-only and the rest of --engines decode-only engines at each --pd-utilisation, tally and llm-d-like, beside tally on the same engines all serving both roles")
	fs.IntVar(&o.pd.prefillEngines, "pd-prefill-engines", dp.PrefillEngines, "with --pd: the prefill-only engines of --engines; the rest decode")
	fs.StringVar(&o.pd.utilisations, "pd-utilisation", joinFloats(dp.Utilisations), "with --pd: comma-separated prefill utilisations (0.5: llm-d-like keeps the prefill engines half busy), each run with the arrival rate scaled to it")
	fs.IntVar(&o.pd.nonCachedTokens, "pd-non-cached-tokens", dp.NonCachedTokens, "with --pd: split a request whose destination lacks at least this many prompt tokens (both policies)")
	fs.StringVar(&o.out, "out", "", "directory for routesim.md, its SVG charts and routesim.json (none when empty)")
	fs.StringVar(&o.name, "name", routesim.DefaultName, "names the files in --out (NAME.md, NAME-ttft-cdf.svg...) and the section of --doc")
	fs.StringVar(&o.doc, "doc", "", "markdown file whose section named by --name gets the tables, with links to the charts; --out, required then, gets only the charts")
	fs.IntVar(&o.parallel, "parallel", runtime.GOMAXPROCS(0), "runs at once (the numbers do not depend on it)")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress on stderr")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q: every option is a flag", fs.Arg(0))
	}
	switch {
	case (o.trace == "") == (o.azure == ""):
		return nil, errors.New("exactly one of --trace (Mooncake JSONL) or --azure (Azure CSV) is required")
	case o.requests < 0:
		return nil, fmt.Errorf("--requests: %d is invalid: must be 0 (all) or more", o.requests)
	case o.parallel < 1:
		return nil, fmt.Errorf("--parallel: %d is invalid: must be 1 or more", o.parallel)
	case o.burst.Requests < 0:
		return nil, fmt.Errorf("--burst: %d is invalid: must be 0 (none) or more", o.burst.Requests)
	case !validName(o.name):
		return nil, fmt.Errorf("--name: %q is invalid: want letters, digits, '-' and '_', starting with a letter", o.name)
	case o.doc != "" && o.out == "":
		return nil, errors.New("--doc needs --out: the directory for the charts it links")
	}
	for _, p := range splitList(o.policies) {
		if !slices.Contains(routesim.KnownPolicies(), p) {
			return nil, fmt.Errorf("--policies: %q is not a policy: accepted are %s", p, strings.Join(routesim.KnownPolicies(), ", "))
		}
	}
	if err := o.lora.apply(&o.cfg); err != nil {
		return nil, err
	}
	if o.roles != "" {
		o.cfg.Roles = strings.Split(o.roles, ",")
		for i, r := range o.cfg.Roles {
			o.cfg.Roles[i] = strings.TrimSpace(r)
		}
	}
	if err := o.pd.apply(o.cfg); err != nil {
		return nil, err
	}
	var err error
	if o.cfg.Priorities, err = parsePriorities(o.priorities); err != nil {
		return nil, fmt.Errorf("--priorities: %w", err)
	}
	if o.cfg.FlowWeights, err = parseWeights(o.flows); err != nil {
		return nil, fmt.Errorf("--flows: %w", err)
	}
	switch {
	case o.tallyConfig != "" && o.tallyConfigText != "":
		return nil, errors.New("--tally-config and --tally-config-text: give at most one")
	case o.tallyConfig != "":
		data, err := os.ReadFile(o.tallyConfig)
		if err != nil {
			return nil, fmt.Errorf("--tally-config: %w", err)
		}
		if o.cfg.Picker, err = v1alpha1.Load(data); err != nil {
			return nil, fmt.Errorf("--tally-config %s: %w", o.tallyConfig, err)
		}
	case o.tallyConfigText != "":
		if o.cfg.Picker, err = v1alpha1.Load([]byte(o.tallyConfigText)); err != nil {
			return nil, fmt.Errorf("--tally-config-text: %w", err)
		}
	}
	if err := o.cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w (flags --engines, --kv-blocks, --load-factor, --non-streaming, --bypass, --priorities, --flows, --roles)", err)
	}
	if !o.pd.on {
		for _, p := range splitList(o.policies) {
			if !routesim.RoleAware(p) && slices.Contains(o.cfg.Roles, picker.RolePrefill) {
				return nil, fmt.Errorf("--policies: %q does not know the engines' roles (--roles %s): run tally, tally-flow or llm-d-like", p, o.roles)
			}
		}
	}
	if o.burst.Requests > 0 {
		if err := o.burst.Validate(); err != nil {
			return nil, fmt.Errorf("%w (flags --burst*)", err)
		}
	}
	return o, nil
}

// apply checks the prefill/decode flags, naming the one at fault, and
// makes the comparison of --pd.
func (p *pdFlags) apply(cfg routesim.Config) error {
	if !p.on {
		return nil
	}
	us, err := parseWeights(p.utilisations)
	if err != nil {
		return fmt.Errorf("--pd-utilisation: %w", err)
	}
	p.comparison = routesim.PDComparison{PrefillEngines: p.prefillEngines, DecodeEngines: cfg.Engines - p.prefillEngines,
		Utilisations: us, NonCachedTokens: p.nonCachedTokens}
	switch c := p.comparison; {
	case len(cfg.Roles) > 0:
		return errors.New("--roles and --pd: give at most one (--pd sets the roles: --pd-prefill-engines prefill, the rest of --engines decode)")
	case c.PrefillEngines < 1 || c.DecodeEngines < 1:
		return fmt.Errorf("--pd-prefill-engines: %d is invalid: must be from 1 to %d (--engines %d less one decode engine)", p.prefillEngines, cfg.Engines-1, cfg.Engines)
	case c.NonCachedTokens < 1:
		return fmt.Errorf("--pd-non-cached-tokens: %d is invalid: must be 1 or more", c.NonCachedTokens)
	}
	if err := p.comparison.Validate(); err != nil {
		return fmt.Errorf("--pd-utilisation: %w", err)
	}
	return nil
}

// apply checks the LoRA flags, naming the one at fault, and copies them
// into cfg with --adapters.
func (l loraFlags) apply(cfg *routesim.Config) error {
	switch {
	case l.adapters < 0:
		return fmt.Errorf("--adapters: %d is invalid: must be 0 (none) or more", l.adapters)
	case l.adapters == 0:
		return nil
	case l.maxLoRAs < 1:
		return fmt.Errorf("--max-loras: %d is invalid: must be 1 or more with --adapters", l.maxLoRAs)
	case !(l.zipf >= 0 && l.zipf <= 10):
		return fmt.Errorf("--adapter-zipf: %v is invalid: must be from 0 (every adapter alike) to 10", l.zipf)
	case !(l.baseFraction >= 0 && l.baseFraction <= 1):
		return fmt.Errorf("--adapter-base-fraction: %v is invalid: must be from 0 to 1", l.baseFraction)
	case l.loadTime < 0:
		return fmt.Errorf("--lora-load-time: %v is invalid: must be 0 or more", l.loadTime)
	}
	cfg.Adapters, cfg.AdapterZipf, cfg.BaseFraction = l.adapters, l.zipf, l.baseFraction
	cfg.MaxLoRAs, cfg.LoRALoadTime = l.maxLoRAs, l.loadTime
	return nil
}

func run(args []string, stdout, stderr io.Writer) int {
	o, err := parse(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "routesim:", err)
		return 2
	}
	var reqs []routesim.Request
	var source string
	if o.trace != "" {
		reqs, err = routesim.LoadMooncakeFile(o.trace)
		source = baseName(o.trace)
	} else {
		reqs, err = routesim.LoadAzureFile(o.azure, routesim.AzurePrefix{Tenants: o.tenants, SystemPromptTokens: o.systemPrompt, Seed: o.cfg.Seed})
		source = fmt.Sprintf("%s (%d tenants, %d-token system prompts)", baseName(o.azure), o.tenants, o.systemPrompt)
	}
	if err != nil {
		fmt.Fprintln(stderr, "routesim:", err)
		return 1
	}
	if o.requests > 0 && o.requests < len(reqs) {
		reqs = reqs[:o.requests]
	}
	if o.pd.on {
		return runPD(o, args, reqs, source, stdout, stderr)
	}
	s := routesim.Suite{Config: o.cfg, Policies: splitList(o.policies), Parallel: o.parallel}
	if o.burst.Requests > 0 {
		s.Burst = &o.burst
	}
	if !o.quiet {
		s.Progress = func(msg string) { fmt.Fprintln(stderr, "routesim:", msg) }
	}
	rep, err := s.Run(reqs, source)
	if err != nil {
		fmt.Fprintln(stderr, "routesim:", err)
		return 1
	}
	rep.Command = "routesim " + strings.Join(args, " ")
	if err := rep.WriteMarkdown(stdout); err != nil {
		fmt.Fprintln(stderr, "routesim: writing the report:", err)
		return 1
	}
	switch {
	case o.doc != "":
		// The tables go into the document; --out gets only the charts.
		if err := rep.WriteCharts(o.out, o.name); err != nil {
			fmt.Fprintln(stderr, "routesim: --out:", err)
			return 1
		}
		if err := writeDoc(o.doc, o.out, o.name, rep); err != nil {
			fmt.Fprintln(stderr, "routesim: --doc:", err)
			return 1
		}
		if !o.quiet {
			fmt.Fprintf(stderr, "routesim: wrote section %q of %s, charts in %s\n", o.name, o.doc, o.out)
		}
	case o.out != "":
		if err := rep.WriteDir(o.out, o.name); err != nil {
			fmt.Fprintln(stderr, "routesim: --out:", err)
			return 1
		}
	}
	return 0
}

// writeDoc replaces the section called name of the markdown file doc with
// the report, its charts (written into out) linked relative to doc.
func writeDoc(doc, out, name string, rep *routesim.Report) error {
	rel, err := filepath.Rel(filepath.Dir(doc), out)
	if err != nil {
		return fmt.Errorf("linking the charts in %s from %s: %w", out, doc, err)
	}
	linked := *rep
	for _, chart := range []*string{&linked.ChartTTFT, &linked.ChartInFlight} {
		if *chart != "" {
			*chart = path.Join(filepath.ToSlash(rel), *chart)
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "## Routing simulator: %s\n\n", rep.Title())
	fmt.Fprintf(&b, "Generated by `cmd/routesim` (package `internal/routesim`): the trace replayed in virtual time against %d simulated vLLM engines, under each routing policy, beside the no-queueing bound. Deterministic: the same flags and seed give the same numbers on any machine; only the wall time at the end is the machine's.", rep.Config.Engines)
	if c := rep.Config; c.Bypass > 0 {
		fmt.Fprintf(&b, " %g%% of the requests go round-robin straight to the engines, past the policy: Tally sees them only as the engines' load in its scrapes.", 100*c.Bypass)
	}
	if c := rep.Config; c.NonStreaming > 0 {
		fmt.Fprintf(&b, " %g%% of the clients do not stream: a policy hears of such a response's first bytes only at its end.", 100*c.NonStreaming)
	}
	if c := rep.Config; c.Adapters > 0 {
		fmt.Fprintf(&b, " The engines serve %d LoRA adapters, at most %d at once: Tally and upstream-like see them in vLLM's lora_requests_info.", c.Adapters, c.MaxLoRAs)
	}
	b.WriteString("\n\n")
	if err := linked.WriteMarkdown(&b); err != nil {
		return err
	}
	return docsection.WriteFile(doc, name, b.String())
}

// parsePriorities reads --priorities: PRIORITY=FRACTION, comma-separated.
func parsePriorities(v string) ([]routesim.PriorityShare, error) {
	var shares []routesim.PriorityShare
	for _, part := range splitList(v) {
		p, f, ok := strings.Cut(part, "=")
		prio, perr := strconv.Atoi(strings.TrimSpace(p))
		frac, ferr := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if !ok || perr != nil || ferr != nil {
			return nil, fmt.Errorf("%q is invalid: want PRIORITY=FRACTION, e.g. 10=0.2", part)
		}
		shares = append(shares, routesim.PriorityShare{Priority: prio, Fraction: frac})
	}
	return shares, nil
}

// parseWeights reads --flows: positive numbers, comma-separated.
func parseWeights(v string) ([]float64, error) {
	var weights []float64
	for _, part := range splitList(v) {
		w, err := strconv.ParseFloat(part, 64)
		if err != nil {
			return nil, fmt.Errorf("%q is invalid: want a positive number", part)
		}
		weights = append(weights, w)
	}
	return weights, nil
}

func validName(s string) bool {
	for i, c := range s {
		letter := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
		if !letter && (i == 0 || !(c >= '0' && c <= '9' || c == '-' || c == '_')) {
			return false
		}
	}
	return s != ""
}

func splitList(s string) []string {
	var out []string
	for part := range strings.SplitSeq(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}

func baseName(path string) string {
	if i := strings.LastIndexByte(path, '/'); i >= 0 {
		return path[i+1:]
	}
	return path
}

// runPD runs the prefill/decode comparison (--pd) and writes its tables:
// to stdout, and into the section --name of --doc (or --out/NAME.md).
func runPD(o *options, args []string, reqs []routesim.Request, source string, stdout, stderr io.Writer) int {
	var progress func(string)
	if !o.quiet {
		progress = func(msg string) { fmt.Fprintln(stderr, "routesim:", msg) }
	}
	rep, err := o.pd.comparison.Run(reqs, source, o.cfg, o.parallel, progress)
	if err != nil {
		fmt.Fprintln(stderr, "routesim:", err)
		return 1
	}
	rep.Command = "routesim " + strings.Join(args, " ")
	if err := rep.WriteMarkdown(stdout); err != nil {
		fmt.Fprintln(stderr, "routesim: writing the report:", err)
		return 1
	}
	var b strings.Builder
	fmt.Fprintf(&b, "## Routing simulator, prefill/decode: %s\n\n", rep.Title())
	fmt.Fprintf(&b, "Generated by `cmd/routesim --pd` (package `internal/routesim`): the trace replayed in virtual time against simulated vLLM engines. A split request runs as llm-d's sidecar runs it: a prefill leg (one output token) on its prefill engine, then, when that leg ends, its decode leg on its destination, which pulls the blocks it does not cache (vLLM's NixlConnector, %v a block) and generates the output. Tally is the real picker with `disaggregation.nonCachedTokens` set; llm-d-like scores decode engines as upstream-like does (scrapes every 50 ms, a prefix index written after the pick) plus llm-d's active-request counts, splits by its prefix-based-pd-decider, and scores prefill engines the same way. Deterministic: the same flags and seed give the same numbers on any machine; only the wall time at the end is the machine's.\n\n", rep.Config.EngineConfig().KVTransferDurationPerBlock)
	if err := rep.WriteMarkdown(&b); err != nil {
		return 1
	}
	switch {
	case o.doc != "":
		if err := docsection.WriteFile(o.doc, o.name, b.String()); err != nil {
			fmt.Fprintln(stderr, "routesim: --doc:", err)
			return 1
		}
	case o.out != "":
		if err := os.MkdirAll(o.out, 0o755); err != nil {
			fmt.Fprintln(stderr, "routesim: --out:", err)
			return 1
		}
		if err := os.WriteFile(filepath.Join(o.out, o.name+".md"), []byte(b.String()), 0o644); err != nil {
			fmt.Fprintln(stderr, "routesim: --out:", err)
			return 1
		}
	}
	return 0
}

func joinFloats(xs []float64) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.FormatFloat(x, 'g', -1, 64)
	}
	return strings.Join(s, ",")
}
