package stack

import (
	"context"
	"fmt"
	"strconv"

	"github.com/tallyepp/tally/picker/debugledger"
)

// Replica is one more picker process of the stack's pool, run with the same
// flags as the first (and any given to StartReplica) on ports of its own,
// and a dev gateway of its own in
// front of it: where a cluster's gateway would route to whichever picker
// replica is ready, a test sends through the replica's gateway once the
// replica reports ready. With --ha-enable-leader-election in
// Options.PickerArgs it stands by while the first picker leads.
type Replica struct {
	stack       *Stack
	name        string
	ports       PickerPorts
	picker      *Process
	gateway     *Process
	gatewayAddr string
}

// StartReplica starts another picker and its gateway, and waits until the
// picker's endpoint set holds every pod of the stack (a standby watches the
// pool too). It does not wait for readiness: a standby is not ready.
// extraArgs follow Options.PickerArgs, so that they win over them: a
// replica with a picker configuration of its own (--config-text) is
// another picker beside the first.
func (s *Stack) StartReplica(ctx context.Context, extraArgs ...string) (_ *Replica, err error) {
	ports, err := s.replicaPorts()
	if err != nil {
		return nil, err
	}
	r := &Replica{stack: s, name: "epp-" + strconv.Itoa(len(s.replicas)+1), ports: ports}
	s.replicas = append(s.replicas, r)
	if r.picker, err = s.startPickerProcess(ctx, r.name, ports, extraArgs...); err != nil {
		return nil, err
	}
	if err := r.WaitForEndpoints(ctx, s.PodNames()...); err != nil {
		return nil, err
	}
	if r.gateway, r.gatewayAddr, err = s.startGateway(ctx, "devgateway-"+r.name, ports.GRPC); err != nil {
		return nil, err
	}
	return r, nil
}

// StartSpreadGateway starts one more dev gateway of the pool, in front of
// the first picker and every replica started so far, and returns its base
// URL: its streams go to each picker in turn, as a cluster's gateway
// spreads them over the ready endpoints of the picker's Service (with
// Options.Peers every replica serves). A stream that fails before any
// answer is retried once on the next picker. The stack stops it.
func (s *Stack) StartSpreadGateway(ctx context.Context) (string, error) {
	ports := []int{s.ports.GRPC}
	for _, r := range s.replicas {
		ports = append(ports, r.ports.GRPC)
	}
	name := "devgateway-spread-" + strconv.Itoa(len(s.spread)+1)
	p, addr, err := s.startGateway(ctx, name, ports...)
	if p != nil {
		s.spread = append(s.spread, p)
	}
	if err != nil {
		return "", err
	}
	return "http://" + addr, nil
}

// PickerGRPCAddrs are the ext_proc addresses of the first picker and of
// every replica started so far, in that order.
func (s *Stack) PickerGRPCAddrs() []string {
	addrs := []string{s.ports.GRPCAddr()}
	for _, r := range s.replicas {
		addrs = append(addrs, r.ports.GRPCAddr())
	}
	return addrs
}

// GRPCAddr is the replica's ext_proc address.
func (r *Replica) GRPCAddr() string { return r.ports.GRPCAddr() }

// replicaPorts finds free ports for another picker, none of them the
// first picker's or another replica's.
func (s *Stack) replicaPorts() (PickerPorts, error) {
	taken := []PickerPorts{s.ports}
	for _, r := range s.replicas {
		taken = append(taken, r.ports)
	}
	return FreePickerPorts(taken...)
}

// Name is the replica's process name in the stack's output.
func (r *Replica) Name() string { return r.name }

// GatewayURL is the base URL of the replica's own gateway.
func (r *Replica) GatewayURL() string { return "http://" + r.gatewayAddr }

// MetricsURL is the replica's metrics server ("/metrics", "/debug/ledger").
func (r *Replica) MetricsURL() string { return r.ports.MetricsURL() }

// Ledger reads the replica's /debug/ledger.
func (r *Replica) Ledger(ctx context.Context) (debugledger.Ledger, error) {
	return ReadLedger(ctx, r.stack.http, r.MetricsURL())
}

// Metrics reads the replica's /metrics.
func (r *Replica) Metrics(ctx context.Context) (Metrics, error) {
	return readMetrics(ctx, r.stack.http, r.MetricsURL(), "replica "+r.Name()+"'s metrics")
}

// Ready reports whether the replica's gRPC health service says "readiness"
// is SERVING (with leader election: it leads, and its endpoint set is synced).
func (r *Replica) Ready(ctx context.Context) (bool, error) {
	select {
	case <-r.picker.Done():
		return false, r.picker.exitError()
	default:
	}
	return pickerReady(ctx, r.ports.Health)
}

// WaitForEndpoints waits until the replica's endpoint set is exactly the
// given pods (in any order).
func (r *Replica) WaitForEndpoints(ctx context.Context, pods ...string) error {
	return waitForEndpoints(ctx, r.stack.http, r.picker, r.MetricsURL(), pods)
}

// Restart stops the replica's picker as Kubernetes stops a container
// (SIGTERM, then its drain) and starts it again on the same ports, as a
// rolling restart does; it does not wait for readiness.
func (r *Replica) Restart(ctx context.Context) error {
	if err := r.picker.Stop(); err != nil {
		return fmt.Errorf("stopping picker replica %s: %w", r.name, err)
	}
	p, err := r.stack.startPickerProcess(ctx, r.name, r.ports)
	if err != nil {
		return err
	}
	r.picker = p
	return nil
}

// Kill kills the replica's picker (SIGKILL), as a crash would.
func (r *Replica) Kill() { r.picker.Kill() }

// Stop stops the replica's gateway and picker, before the stack's end
// (Stop on the stack stops them too).
func (r *Replica) Stop() error { return r.stop() }

func (r *Replica) stop() error {
	if err := stopAll(r.gateway, r.picker); err != nil {
		return fmt.Errorf("stopping picker replica %s: %w", r.name, err)
	}
	return nil
}
