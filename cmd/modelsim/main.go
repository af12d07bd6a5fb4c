// Command modelsim serves simulated vLLM model servers for tests and demos
// of the picker: one independent engine (its own KV cache, queue and
// /metrics) per --addr, each speaking the OpenAI completions API and vLLM's
// metrics. See package internal/modelsim/server for what is served.
//
//	modelsim --addr 127.0.0.2:8000,127.0.0.3:8000 --time-scale 10
//	modelsim --lora-modules sql=/adapters/sql,chat --max-loras 2 --lora-load-time 150ms
//
// LoRA adapters are off unless --lora-modules names some, as vLLM serves
// them with --enable-lora --lora-modules name=path ...: here the entries are
// comma-separated or the flag repeated, and an entry without "=path" is a
// name alone. --max-loras (default 1, as vLLM's) bounds the adapters running
// at once; --lora-load-time is what loading one into a slot costs.
//
// It logs one "serving" line per address, with the address actually bound
// (useful with port 0), and shuts down on SIGTERM or SIGINT: it stops
// accepting, lets requests in flight finish for --shutdown-grace, then cuts
// the rest and exits 0. Invalid flags exit 2, naming the flag.
//
// Invariant: every address gets its own server.Server; engines never share
// state, as separate pods would not.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tallyepp/tally/internal/modelsim/server"
)

const (
	defaultAddr          = "127.0.0.1:8000"
	defaultShutdownGrace = 5 * time.Second
	readHeaderTimeout    = 10 * time.Second
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stderr)
	stop()
	os.Exit(code)
}

// addrList is a repeatable flag whose values may also be comma-separated.
type addrList []string

func (a *addrList) String() string { return strings.Join(*a, ",") }

func (a *addrList) Set(v string) error {
	for part := range strings.SplitSeq(v, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(part); err != nil {
			return fmt.Errorf("%q is not host:port: %w", part, err)
		}
		*a = append(*a, part)
	}
	return nil
}

// loraModules is --lora-modules: name or name=path entries, repeatable and
// comma-separated.
type loraModules []server.LoRAModule

func (l *loraModules) String() string {
	parts := make([]string, len(*l))
	for i, m := range *l {
		parts[i] = m.Name
		if m.Path != "" {
			parts[i] += "=" + m.Path
		}
	}
	return strings.Join(parts, ",")
}

func (l *loraModules) Set(v string) error {
	for part := range strings.SplitSeq(v, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, path, _ := strings.Cut(part, "=")
		if name == "" {
			return fmt.Errorf("%q has no adapter name: want name or name=path", part)
		}
		*l = append(*l, server.LoRAModule{Name: name, Path: path})
	}
	return nil
}

type options struct {
	addrs         addrList
	cfg           server.Config
	shutdownGrace time.Duration
}

// parse reads the flags; its errors name the flag at fault and what it
// accepts.
func parse(args []string, stderr io.Writer) (options, error) {
	o := options{cfg: server.DefaultConfig()}
	fs := flag.NewFlagSet("modelsim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Var(&o.addrs, "addr", fmt.Sprintf("host:port to serve one engine on; repeat or comma-separate for more engines (default %s)", defaultAddr))
	fs.StringVar(&o.cfg.Model, "model", o.cfg.Model, "served model name")
	fs.IntVar(&o.cfg.Engine.KVBlocks, "kv-blocks", o.cfg.Engine.KVBlocks,
		"KV cache size per engine, in blocks of 16 tokens (the default, 400,000 tokens, is about what an 8B model leaves on one 80 GB GPU)")
	fs.Float64Var(&o.cfg.TimeScale, "time-scale", o.cfg.TimeScale, fmt.Sprintf("how many times faster than real time the engines run, above 0 and at most %d", server.MaxTimeScale))
	fs.IntVar(&o.cfg.CharsPerToken, "chars-per-token", o.cfg.CharsPerToken, "prompt bytes per token, as the picker estimates them (1 to 64)")
	fs.Float64Var(&o.cfg.ErrorRate, "error-rate", 0, "fraction of completion requests answered 500 (0 to 1)")
	fs.DurationVar(&o.cfg.AddedLatency, "added-latency", 0, "wall-clock delay before a completion request reaches the engine")
	fs.Float64Var(&o.cfg.HangRate, "hang-rate", 0, "fraction of completion requests never answered until the client goes away (0 to 1)")
	fs.Float64Var(&o.cfg.LateFirstByteFraction, "late-first-byte-fraction", 0,
		"fraction of streamed responses held back whole until their last token, as a buffering proxy would (0 to 1); chosen per request by a hash of its X-Request-Id header, or of its prompt; each says how long it was held in its X-Modelsim-Held-Back-Ms header")
	fs.Uint64Var(&o.cfg.Seed, "seed", 1, "seed of the fault draws; engine i uses seed+i")
	fs.DurationVar(&o.shutdownGrace, "shutdown-grace", defaultShutdownGrace, "on SIGTERM/SIGINT, how long requests in flight may finish before they are cut")
	fs.DurationVar(&o.cfg.Engine.KVLease, "kv-lease", o.cfg.Engine.KVLease, "engine time a prefill leg (kv_transfer_params.do_remote_decode) holds its KV blocks for a decode server to pull")
	fs.DurationVar(&o.cfg.Engine.KVTransferDurationPerBlock, "kv-transfer-per-block", o.cfg.Engine.KVTransferDurationPerBlock, "engine time a decode leg (kv_transfer_params.do_remote_prefill) takes to pull one KV block")
	fs.StringVar(&o.cfg.KVLoadFailurePolicy, "kv-load-failure-policy", o.cfg.KVLoadFailurePolicy, `what a decode leg whose KV blocks are gone does, as vLLM's kv_load_failure_policy: "fail" (answer 500) or "recompute" (prefill locally)`)
	var lora loraModules
	fs.Var(&lora, "lora-modules", "LoRA adapters served besides --model, as name or name=path (path is the root /v1/models reports); repeat or comma-separate (default none: LoRA off)")
	maxLoRAs := fs.Int("max-loras", server.DefaultMaxLoRAs, "with --lora-modules, how many adapters may run at once (the engine's adapter slots)")
	loraLoadTime := fs.Duration("lora-load-time", o.cfg.Engine.LoRALoadTime, "with --lora-modules, engine time a step takes longer for each adapter it loads into a slot")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q: modelsim takes only flags", fs.Arg(0))
	}
	if len(o.addrs) == 0 {
		o.addrs = addrList{defaultAddr}
	}
	var errs []error
	bad := func(flag string, got any, accepted string) {
		errs = append(errs, fmt.Errorf("--%s: %v is invalid: %s", flag, got, accepted))
	}
	c := o.cfg
	if c.Model == "" {
		bad("model", `""`, "must not be empty")
	}
	if c.Engine.KVBlocks < 1 || c.Engine.KVBlocks > 1<<30 {
		bad("kv-blocks", c.Engine.KVBlocks, "must be from 1 to 1073741824")
	}
	if !(c.TimeScale > 0 && c.TimeScale <= server.MaxTimeScale) {
		bad("time-scale", c.TimeScale, fmt.Sprintf("must be above 0 and at most %d", server.MaxTimeScale))
	}
	if c.CharsPerToken < 1 || c.CharsPerToken > 64 {
		bad("chars-per-token", c.CharsPerToken, "must be from 1 to 64")
	}
	if !(c.ErrorRate >= 0 && c.ErrorRate <= 1) {
		bad("error-rate", c.ErrorRate, "must be from 0 to 1")
	}
	if c.AddedLatency < 0 {
		bad("added-latency", c.AddedLatency, "must be 0 or more")
	}
	if !(c.HangRate >= 0 && c.HangRate <= 1) {
		bad("hang-rate", c.HangRate, "must be from 0 to 1")
	}
	if !(c.LateFirstByteFraction >= 0 && c.LateFirstByteFraction <= 1) {
		bad("late-first-byte-fraction", c.LateFirstByteFraction, "must be from 0 to 1")
	}
	if c.Engine.KVLease <= 0 {
		bad("kv-lease", c.Engine.KVLease, "must be positive")
	}
	if c.Engine.KVTransferDurationPerBlock < 0 {
		bad("kv-transfer-per-block", c.Engine.KVTransferDurationPerBlock, "must be 0 or more")
	}
	if c.KVLoadFailurePolicy != server.KVLoadFailureFail && c.KVLoadFailurePolicy != server.KVLoadFailureRecompute {
		bad("kv-load-failure-policy", c.KVLoadFailurePolicy, `must be "fail" or "recompute"`)
	}
	if o.shutdownGrace < 0 {
		bad("shutdown-grace", o.shutdownGrace, "must be 0 or more")
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	switch {
	case len(lora) > 0:
		o.cfg.LoRAModules = lora
		o.cfg.Engine.MaxLoRAs = *maxLoRAs
		o.cfg.Engine.LoRALoadTime = *loraLoadTime
		if *maxLoRAs < 1 {
			bad("max-loras", *maxLoRAs, "must be 1 or more")
		}
		if *loraLoadTime < 0 {
			bad("lora-load-time", *loraLoadTime, "must be 0 or more")
		}
		names := map[string]bool{}
		for _, m := range lora {
			switch {
			case m.Name == c.Model:
				bad("lora-modules", m.Name, "names the base model (--model); an adapter needs a name of its own")
			case names[m.Name]:
				bad("lora-modules", m.Name, "is given twice")
			}
			names[m.Name] = true
		}
	case set["max-loras"]:
		bad("max-loras", *maxLoRAs, "needs --lora-modules: without adapters LoRA is off")
	case set["lora-load-time"]:
		bad("lora-load-time", *loraLoadTime, "needs --lora-modules: without adapters LoRA is off")
	}
	seen := map[string]bool{}
	for _, a := range o.addrs {
		if seen[a] {
			bad("addr", a, "is given twice: each address serves its own engine")
		}
		seen[a] = true
	}
	if err := errors.Join(errs...); err != nil {
		return o, err
	}
	// Anything the flags let through but the server refuses is still a
	// flag error.
	if err := o.cfg.Validate(); err != nil {
		return o, err
	}
	return o, nil
}

// run serves until ctx ends and returns the exit code: 0 after a clean
// shutdown, 1 when serving fails, 2 on invalid flags.
func run(ctx context.Context, args []string, stderr io.Writer) int {
	log := slog.New(slog.NewTextHandler(stderr, nil))
	o, err := parse(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "modelsim: %v\n", err)
		return 2
	}

	type engineServer struct {
		sim  *server.Server
		http *http.Server
		ln   net.Listener
	}
	var servers []engineServer
	closeAll := func() {
		for _, s := range servers {
			s.sim.Close()
			s.ln.Close()
		}
	}
	for i, addr := range o.addrs {
		cfg := o.cfg
		cfg.Seed += uint64(i)
		sim, err := server.New(cfg)
		if err != nil {
			closeAll()
			fmt.Fprintf(stderr, "modelsim: --addr %s: %v\n", addr, err)
			return 1
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			sim.Close()
			closeAll()
			fmt.Fprintf(stderr, "modelsim: --addr %s: %v\n", addr, err)
			return 1
		}
		servers = append(servers, engineServer{sim: sim, ln: ln, http: &http.Server{Handler: sim, ReadHeaderTimeout: readHeaderTimeout}})
	}

	serveErr := make(chan error, len(servers))
	var wg sync.WaitGroup
	for _, s := range servers {
		attrs := []any{"addr", s.ln.Addr().String(), "model", o.cfg.Model, "kv_blocks", o.cfg.Engine.KVBlocks, "time_scale", o.cfg.TimeScale}
		if lora := o.cfg.LoRAModules; len(lora) > 0 {
			attrs = append(attrs, "lora_modules", (*loraModules)(&lora).String(), "max_loras", o.cfg.Engine.MaxLoRAs)
		}
		log.Info("serving", attrs...)
		wg.Go(func() {
			if err := s.http.Serve(s.ln); !errors.Is(err, http.ErrServerClosed) {
				serveErr <- fmt.Errorf("serving %s: %w", s.ln.Addr(), err)
			}
		})
	}

	code := 0
	select {
	case <-ctx.Done():
		log.Info("shutting down", "grace", o.shutdownGrace)
	case err := <-serveErr:
		log.Error("serving failed", "err", err)
		code = 1
	}
	graceCtx, cancel := context.WithTimeout(context.Background(), o.shutdownGrace)
	defer cancel()
	var shut sync.WaitGroup
	for _, s := range servers {
		shut.Go(func() {
			// Stop accepting and wait for requests in flight; when the grace
			// ends, Close cuts the rest (streams, hanging requests) so that
			// their handlers return.
			if err := s.http.Shutdown(graceCtx); err != nil {
				s.sim.Close()
				s.http.Close()
			}
			s.sim.Close()
		})
	}
	shut.Wait()
	wg.Wait()
	return code
}
