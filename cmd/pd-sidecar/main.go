// Command pd-sidecar is the decode pod's prefill/decode sidecar as llm-d
// runs it, for tests and the local stack (a tool, not part of the
// product): it listens on the decode pod's port and proxies to the vLLM
// beside it, running a prefill leg on the pod named by the
// x-prefiller-host-port header first. See package internal/pdsidecar.
//
//	pd-sidecar --addr :8000 --decoder http://127.0.0.1:8200
//
// It logs a "serving" line with the address actually bound (useful with
// port 0) and shuts down on SIGTERM or SIGINT, letting requests in flight
// finish for --shutdown-grace. Invalid flags exit 2, naming the flag.
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
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/tallyepp/tally/internal/pdsidecar"
)

const (
	defaultAddr          = ":8000"
	defaultDecoder       = "http://127.0.0.1:8200"
	defaultShutdownGrace = 5 * time.Second
	readHeaderTimeout    = 10 * time.Second
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stderr))
}

type options struct {
	addr    string
	decoder *url.URL
	grace   time.Duration
}

// parse reads the flags; an error names the flag at fault.
func parse(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("pd-sidecar", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.addr, "addr", defaultAddr, "host:port to listen on: the decode pod's serving port")
	decoder := fs.String("decoder", defaultDecoder, "base URL of the local vLLM the sidecar fronts")
	fs.DurationVar(&o.grace, "shutdown-grace", defaultShutdownGrace, "on SIGTERM/SIGINT, how long requests in flight may finish")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q: pd-sidecar takes only flags", fs.Arg(0))
	}
	var errs []error
	u, err := url.Parse(*decoder)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		errs = append(errs, fmt.Errorf("--decoder: %q is invalid: must be an http or https URL with a host, such as %s", *decoder, defaultDecoder))
	}
	o.decoder = u
	if _, _, err := net.SplitHostPort(o.addr); err != nil {
		errs = append(errs, fmt.Errorf("--addr: %q is invalid: must be host:port (%v)", o.addr, err))
	}
	if o.grace < 0 {
		errs = append(errs, fmt.Errorf("--shutdown-grace: %v is invalid: must be 0 or more", o.grace))
	}
	return o, errors.Join(errs...)
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
		fmt.Fprintf(stderr, "pd-sidecar: %v\n", err)
		return 2
	}
	sc, err := pdsidecar.New(pdsidecar.Config{Decoder: o.decoder})
	if err != nil {
		fmt.Fprintf(stderr, "pd-sidecar: %v\n", err)
		return 2
	}
	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		fmt.Fprintf(stderr, "pd-sidecar: --addr %s: %v\n", o.addr, err)
		return 1
	}
	srv := &http.Server{Handler: sc, ReadHeaderTimeout: readHeaderTimeout}
	log.Info("serving", "addr", ln.Addr().String(), "decoder", o.decoder.String())
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()

	select {
	case <-ctx.Done():
		log.Info("shutting down", "grace", o.grace)
	case err := <-serveErr:
		log.Error("serving failed", "err", err)
		return 1
	}
	graceCtx, cancel := context.WithTimeout(context.Background(), o.grace)
	defer cancel()
	if err := srv.Shutdown(graceCtx); err != nil {
		srv.Close() // the grace ran out: cut the rest
	}
	return 0
}
