package stack

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/internal/ngfshim/nginx"
)

const (
	shimBin             = "ngf-shim"
	nginxReadyTimeout   = 30 * time.Second
	shimListeningPrefix = "ngf-shim listening on "
)

// NGINXOptions configure StartNGINX.
type NGINXOptions struct {
	// FailureMode is what NGINX does when the picker names no endpoint
	// (default: the stack's Options.FailureMode). NGINX reads it from its
	// configuration: SetFailureMode does not change it.
	FailureMode infv1.EndpointPickerFailureMode
	// SpreadOverReplicas names the picker by its Service's host name
	// (PickerHost), which the shim resolves to every picker process
	// started so far (PickerGRPCAddrs), so NGINX's requests spread over
	// the replicas as NGF's spread over a Service's pods. The stack's
	// pickers listen on one IP at several ports, so each resolved address
	// carries its port. Replicas started later are not among them.
	// Without it NGINX asks the first picker alone.
	SpreadOverReplicas bool
}

// PickerHost is the host name of the picker's Service, as NGF names it to
// its shim: StartNGINX with SpreadOverReplicas passes it.
func (s *Stack) PickerHost() string {
	return PickerServiceName + "." + s.opts.Namespace + ".svc.cluster.local"
}

// NGINX is a real NGINX in front of the stack's picker, configured the way
// NGINX Gateway Fabric configures one for an InferencePool route, with the
// NGF shim (cmd/ngf-shim) it asks for endpoints. Clients send to URL, as
// they would to the dev gateway's GatewayURL.
type NGINX struct {
	dir   string
	shim  *Process
	nginx *Process
	addr  netip.AddrPort
}

// StartNGINX starts the shim and NGINX in front of the stack's picker and
// waits until NGINX accepts connections. FailOpen's endpoints are the
// stack's pods as they are now. The stack's Stop stops them, also when
// StartNGINX failed half way.
func (s *Stack) StartNGINX(ctx context.Context, opts NGINXOptions) (*NGINX, error) {
	bin, jsModule, err := nginx.Find()
	if err != nil {
		return nil, fmt.Errorf("starting NGINX: %w", err)
	}
	shim := filepath.Join(s.opts.BinDir, shimBin)
	if _, err := os.Stat(shim); err != nil {
		return nil, fmt.Errorf("starting NGINX: %w (build it with `go build -o %s/ ./cmd/%s`)", err, s.opts.BinDir, shimBin)
	}
	if opts.FailureMode == "" {
		opts.FailureMode = s.opts.FailureMode
	}
	n := &NGINX{}
	s.nginx = append(s.nginx, n)
	name := "nginx"
	if len(s.nginx) > 1 {
		name += "-" + strconv.Itoa(len(s.nginx))
	}
	if n.dir, err = os.MkdirTemp(s.dir, "nginx-"); err != nil {
		return nil, fmt.Errorf("starting NGINX: %w", err)
	}
	var shimAddr netip.AddrPort
	var pickerHost string
	var shimArgs []string
	if opts.SpreadOverReplicas {
		pickerHost = s.PickerHost()
		shimArgs = append(shimArgs, "--resolve="+pickerHost+"="+strings.Join(s.PickerGRPCAddrs(), ","))
	}
	if n.shim, shimAddr, err = startShim(ctx, strings.Replace(name, "nginx", shimBin, 1), shim, s.opts.Output, shimArgs...); err != nil {
		return nil, err
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	n.addr = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))
	var pods []netip.AddrPort
	for _, p := range s.Pods() {
		pods = append(pods, p.Addr)
	}
	conf, err := nginx.Render(nginx.Config{
		Dir:           n.dir,
		JSModule:      jsModule,
		Listen:        n.addr,
		Shim:          shimAddr,
		Picker:        netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(s.ports.GRPC)),
		PickerHost:    pickerHost,
		PoolEndpoints: pods,
		FailureMode:   opts.FailureMode,
	})
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(n.dir, nginx.ConfigName), conf, 0o600); err != nil {
		return nil, fmt.Errorf("writing nginx.conf: %w", err)
	}
	if err := os.WriteFile(filepath.Join(n.dir, nginx.ScriptName), nginx.Script, 0o600); err != nil {
		return nil, fmt.Errorf("writing the NJS script: %w", err)
	}
	if n.nginx, err = startProcess(name, bin, nginx.Args(n.dir), s.opts.Output, nil); err != nil {
		return nil, err
	}
	err = n.nginx.waitFor(ctx, "NGINX to accept connections on "+n.addr.String(), nginxReadyTimeout, pollInterval, func(ctx context.Context) bool {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", n.addr.String())
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
	if err != nil {
		return nil, err
	}
	return n, nil
}

// startShim starts the shim on a free loopback port and returns it with
// its address once it listens; extra are more flags.
func startShim(ctx context.Context, name, path string, out io.Writer, extra ...string) (*Process, netip.AddrPort, error) {
	listening := make(chan string, 1)
	onLine := func(line string) {
		if _, addr, ok := strings.Cut(line, shimListeningPrefix); ok {
			select {
			case listening <- strings.TrimSpace(addr):
			default:
			}
		}
	}
	// The picker serves TLS (--secure-serving, self-signed) as the stack
	// runs it.
	args := append([]string{"--listen=127.0.0.1:0", "--picker-tls=true", "-v=1"}, extra...)
	p, err := startProcess(name, path, args, out, onLine)
	if err != nil {
		return nil, netip.AddrPort{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, gatewayReadyTimeout)
	defer cancel()
	select {
	case line := <-listening:
		addr, err := netip.ParseAddrPort(line)
		if err != nil {
			return p, netip.AddrPort{}, fmt.Errorf("%s printed %q: not ip:port: %w", name, shimListeningPrefix+line, err)
		}
		return p, addr, nil
	case <-p.Done():
		return p, netip.AddrPort{}, fmt.Errorf("waiting for %s to listen: %w", name, p.exitError())
	case <-ctx.Done():
		return p, netip.AddrPort{}, fmt.Errorf("waiting for %s to print %q: %w; its last output:\n%s", name, shimListeningPrefix, ctx.Err(), p.Output())
	}
}

// URL is NGINX's base URL ("http://127.0.0.1:PORT").
func (n *NGINX) URL() string { return "http://" + n.addr.String() }

// ErrorLog returns NGINX's error log so far, at level info: the NJS
// handler's line for each request (the endpoint chosen, or the shim's
// status and body when there was none) is there.
func (n *NGINX) ErrorLog() (string, error) {
	b, err := os.ReadFile(filepath.Join(n.dir, "error.log"))
	if err != nil {
		return "", fmt.Errorf("reading NGINX's error log: %w", err)
	}
	return string(b), nil
}

func (n *NGINX) stop() error {
	if err := stopAll(n.nginx, n.shim); err != nil {
		return fmt.Errorf("stopping NGINX: %w", err)
	}
	return nil
}
