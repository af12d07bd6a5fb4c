package stack

import (
	"context"
	"fmt"
	"net"
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
		"--grpc-port=" + strconv.Itoa(ports.grpc),
		"--grpc-health-port=" + strconv.Itoa(ports.health),
		"--metrics-port=" + strconv.Itoa(ports.metrics),
		"--metrics-endpoint-auth=false",
		"-v=1", "--tracing=false",
	}, extraArgs...)
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+s.kubeconfig, "NAMESPACE="+s.opts.Namespace)
	if r.picker, err = startCommand(r.name, cmd, s.opts.Output, nil); err != nil {
		return nil, err
	}
	s.replicas = append(s.replicas, r)
	if err := r.waitUpstreamReady(ctx, len(s.PodNames())); err != nil {
		return nil, err
	}
	if r.gateway, r.gatewayAddr, err = s.startGateway(ctx, "devgateway-"+r.name, ports.grpc); err != nil {
		return nil, err
	}
	return r, nil
}

// waitUpstreamReady waits until the upstream picker's health service says
// "readiness" is SERVING, its ext_proc port accepts connections (it
// reports ready before, while it makes its certificate) and its metrics
// have an inference_pool_per_pod_queue_size series for each of the pods.
func (r *Replica) waitUpstreamReady(ctx context.Context, pods int) error {
	last := "not serving"
	err := r.picker.waitFor(ctx, "the upstream picker to serve every pod", upstreamReadyTimeout, pollInterval, func(ctx context.Context) bool {
		if ok, err := pickerReady(ctx, r.ports.health); !ok || err != nil {
			last = fmt.Sprintf("not serving (%v)", err)
			return false
		}
		m, err := r.Metrics(ctx)
		if err != nil {
			last = err.Error()
			return false
		}
		if n := len(m["inference_pool_per_pod_queue_size"].GetMetric()); n != pods {
			last = fmt.Sprintf("serving, %d of %d pods listed", n, pods)
			return false
		}
		conn, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(r.ports.grpc), requestTimeout)
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
