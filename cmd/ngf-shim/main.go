// Command ngf-shim is a stand-in for the endpoint-picker shim that NGINX
// Gateway Fabric runs beside NGINX, for end-to-end tests of Tally behind a
// real NGINX (see package internal/ngfshim for the exchange it plays, and
// internal/ngfshim/nginx for the NGINX side). It is not part of a
// production install.
//
// Flags:
//
//	--listen ADDR      HTTP listen address (default 127.0.0.1:54800, NGF's;
//	                   port 0 picks one)
//	--picker-tls BOOL  TLS to the picker, certificate not verified since the
//	                   picker serves a self-signed one (default true)
//	--resolve HOST=IP[:PORT][,IP[:PORT]...]
//	                   the addresses X-EPP-Host HOST stands for, instead of
//	                   DNS: the ready replicas behind the picker's Service, as
//	                   cluster DNS would answer (repeatable, one per host). An
//	                   address with a port is dialled at that port instead of
//	                   X-EPP-Port: replicas on one machine listen on one IP at
//	                   several ports, where a cluster's share a port
//	-v N               log verbosity; 1 logs every request
//
// The picker's address comes with each request, in X-EPP-Host and X-EPP-Port.
// The host is resolved for each request and its addresses taken in turn, so
// the streams spread over every replica of the picker, as NGF's do.
// Once it listens it prints one line on stderr: "ngf-shim listening on ADDR".
// A bad flag exits with status 2 and names the flag; SIGTERM or SIGINT stop
// it cleanly, with status 0.
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
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/tallyepp/tally/internal/ngfshim"
)

// Exit codes: 2 for bad flags (as the flag package does), 1 for anything
// that stops the shim after its flags were accepted.
const (
	exitOK       = 0
	exitFailure  = 1
	exitBadUsage = 2
)

const (
	// defaultListenAddr is NGF's (types.GoShimPort on loopback).
	defaultListenAddr   = "127.0.0.1:54800"
	readHeaderTimeout   = 10 * time.Second
	shutdownGrace       = 10 * time.Second
	listeningLinePrefix = "ngf-shim listening on "
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Stderr)
	stop()
	os.Exit(code)
}

type options struct {
	listen    string
	pickerTLS bool
	resolve   map[string][]string // --resolve: host -> IP or IP:PORT
	verbosity int
}

func run(ctx context.Context, args []string, stderr io.Writer) int {
	opts, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "ngf-shim: %v\n", err)
		return exitBadUsage
	}
	level := slog.LevelInfo
	if opts.verbosity > 0 {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	if err := serve(ctx, opts, log, stderr); err != nil {
		log.Error("ngf-shim stopped", "err", err)
		return exitFailure
	}
	return exitOK
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("ngf-shim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.listen, "listen", defaultListenAddr, "HTTP listen address (port 0 picks a free port)")
	fs.BoolVar(&o.pickerTLS, "picker-tls", true, "use TLS to the picker without verifying its (self-signed) certificate")
	fs.IntVar(&o.verbosity, "v", 0, "log verbosity (1 logs every request)")
	var errs []error
	fs.Func("resolve", "HOST=IP[:PORT][,IP[:PORT]...]: the addresses X-EPP-Host HOST stands for, instead of DNS (the picker's replicas; a port overrides X-EPP-Port; repeatable)", func(v string) error {
		host, ips, err := parseResolve(v)
		if err != nil {
			return err
		}
		if o.resolve == nil {
			o.resolve = map[string][]string{}
		}
		if _, dup := o.resolve[host]; dup {
			return fmt.Errorf("host %q given twice: list its addresses in one --resolve", host)
		}
		o.resolve[host] = ips
		return nil
	})
	if err := fs.Parse(args); err != nil {
		return options{}, err
	}
	if fs.NArg() > 0 {
		return options{}, fmt.Errorf("unexpected argument %q: ngf-shim takes flags only", fs.Arg(0))
	}
	if _, port, err := net.SplitHostPort(o.listen); err != nil {
		errs = append(errs, fmt.Errorf("flag --listen %q: must be host:port: %w", o.listen, err))
	} else if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		errs = append(errs, fmt.Errorf("flag --listen %q: port %q must be a number from 0 to 65535", o.listen, port))
	}
	if o.verbosity < 0 {
		errs = append(errs, fmt.Errorf("flag -v: %d is invalid: must be 0 or more", o.verbosity))
	}
	return o, errors.Join(errs...)
}

// resolveUsage is the form of a --resolve value, for its errors.
const resolveUsage = "want HOST=IP[:PORT][,IP[:PORT]...]"

// parseResolve parses one --resolve value, "host=ip,ip:port".
func parseResolve(v string) (string, []string, error) {
	host, list, ok := strings.Cut(v, "=")
	host = strings.TrimSpace(host)
	if !ok || host == "" || list == "" {
		return "", nil, fmt.Errorf("%q: %s", v, resolveUsage)
	}
	var addrs []string
	for _, s := range strings.Split(list, ",") {
		s = strings.TrimSpace(s)
		if ip, err := netip.ParseAddr(s); err == nil {
			addrs = append(addrs, ip.String())
			continue
		}
		ap, err := netip.ParseAddrPort(s)
		if err != nil {
			return "", nil, fmt.Errorf("%q: %q is not an IP address or IP:PORT: %s", v, s, resolveUsage)
		}
		if ap.Port() == 0 {
			return "", nil, fmt.Errorf("%q: %q has port 0: a port is from 1 to 65535", v, s)
		}
		addrs = append(addrs, ap.String())
	}
	return host, addrs, nil
}

// resolver answers the hosts of --resolve and looks the others up in DNS.
func resolver(fixed map[string][]string) func(ctx context.Context, host string) ([]string, error) {
	return func(ctx context.Context, host string) ([]string, error) {
		if ips, ok := fixed[host]; ok {
			return ips, nil
		}
		return net.DefaultResolver.LookupHost(ctx, host)
	}
}

// serve runs the shim until ctx ends, then shuts it down.
func serve(ctx context.Context, opts options, log *slog.Logger, stderr io.Writer) error {
	ln, err := net.Listen("tcp", opts.listen)
	if err != nil {
		return fmt.Errorf("flag --listen %q: %w", opts.listen, err)
	}
	srv := &http.Server{
		Handler:           &ngfshim.Shim{Dial: ngfshim.Dialer(opts.pickerTLS), Resolve: resolver(opts.resolve), Log: log},
		ReadHeaderTimeout: readHeaderTimeout,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	fmt.Fprintf(stderr, "%s%s\n", listeningLinePrefix, ln.Addr())
	log.Info("asking the endpoint picker named in each request", "tls", opts.pickerTLS)

	select {
	case err := <-serveErr:
		return fmt.Errorf("serving HTTP: %w", err)
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownGrace)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		_ = srv.Close()
	}
	return nil
}
