package stack

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"time"
)

// upstreamReadyTimeout bounds the upstream picker's start: it makes a
// certificate and syncs the pool before it serves.
const upstreamReadyTimeout = 2 * time.Minute

// StartUpstream starts the upstream endpoint picker (bin is
// gateway-api-inference-extension v1.5.0's cmd/epp, as `make upstream-epp`
// builds it) as another picker of the stack's pool, with a dev gateway of
// its own in front, and waits until it serves and lists every pod. It runs
// with the flags its v1.5.0 chart passes by default (-v 1, --tracing=false,
// its own TLS), then extraArgs (a --config-text, for example). It reads
// the kubeconfig from $KUBECONFIG: it has no --kubeconfig flag. The replica
// has no ledger: Ledger fails on it.
func (s *Stack) StartUpstream(ctx context.Context, bin string, extraArgs ...string) (_ *Replica, err error) {
	ports, err := s.replicaPorts()
	if err != nil {
		return nil, err
	}
	r := &Replica{stack: s, name: "upstream-epp", ports: ports}
	args := append([]string{
		"--pool-name=" + s.opts.PoolName,
		"--pool-namespace=" + s.opts.Namespace,
		"--grpc-port=" + strconv.Itoa(ports.GRPC),
		"--grpc-health-port=" + strconv.Itoa(ports.Health),
		"--metrics-port=" + strconv.Itoa(ports.Metrics),
		"--metrics-endpoint-auth=false",
		"-v=1", "--tracing=false",
	}, extraArgs...)
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+s.kubeconfig, "NAMESPACE="+s.opts.Namespace)
	if r.picker, err = StartCommand(r.name, cmd, s.opts.Output, nil); err != nil {
		return nil, err
	}
	s.replicas = append(s.replicas, r)
	if err := r.picker.WaitServing(ctx, s.http, ports, len(s.PodNames()), upstreamReadyTimeout); err != nil {
		return nil, err
	}
	if r.gateway, r.gatewayAddr, err = s.startGateway(ctx, "devgateway-"+r.name, ports.GRPC); err != nil {
		return nil, err
	}
	return r, nil
}

// WaitServing waits, for at most timeout, until the picker process p on
// ports serves a pool of the given number of endpoints: its health service
// says "readiness" is SERVING, its metrics have an
// inference_pool_per_pod_queue_size series (Tally and the upstream picker
// both publish it) for each endpoint, and its ext_proc port accepts
// connections (the upstream picker reports ready before it listens, while
// it makes its certificate). c reads the metrics.
func (p *Process) WaitServing(ctx context.Context, c *http.Client, ports PickerPorts, endpoints int, timeout time.Duration) error {
	last := "not serving"
	err := p.waitFor(ctx, fmt.Sprintf("%s to serve %d endpoints", p.name, endpoints), timeout, pollInterval, func(ctx context.Context) bool {
		if ok, err := pickerReady(ctx, ports.Health); !ok || err != nil {
			last = fmt.Sprintf("not serving (%v)", err)
			return false
		}
		m, err := readMetrics(ctx, c, ports.MetricsURL(), p.name+"'s metrics")
		if err != nil {
			last = err.Error()
			return false
		}
		if n := len(m["inference_pool_per_pod_queue_size"].GetMetric()); n != endpoints {
			last = fmt.Sprintf("serving, %d of %d endpoints listed", n, endpoints)
			return false
		}
		conn, err := net.DialTimeout("tcp", ports.GRPCAddr(), requestTimeout)
		if err != nil {
			last = "ready, but its ext_proc port does not accept connections yet"
			return false
		}
		conn.Close()
		return true
	})
	if err != nil {
		return fmt.Errorf("%w (last: %s)", err, last)
	}
	return nil
}
