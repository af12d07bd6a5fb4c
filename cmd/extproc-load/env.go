package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strconv"
	"time"

	"github.com/tallyepp/tally/internal/stack"
)

// defaultFirstPodIP is the first pod's address (--first-pod-ip). The demo counts up from
// 127.0.0.2, the install tests use 127.0.10.x and the end-to-end suite
// 127.0.42-46.x; a benchmark or its smoke test running beside them (go test
// runs packages in parallel) must not collide, and a thousand pods end at
// 127.0.73.232.
var defaultFirstPodIP = netip.MustParseAddr("127.0.70.1")

// benchEnv is the API server, the pool and its pods, which every picker of
// a run is started against in turn.
type benchEnv struct {
	cluster *stack.Cluster
	pods    *pods
	// roles are the first pods' prefill/decode roles (none: unlabelled).
	roles  []string
	logDir string
	// keepLogs leaves the pickers' logs in logDir after the run.
	keepLogs bool
	log      io.Writer
}

func startEnv(ctx context.Context, n int, roles []string, firstPodIP netip.Addr, keepLogs bool, log io.Writer) (*benchEnv, error) {
	e := &benchEnv{pods: newPods(), log: log, keepLogs: keepLogs, roles: roles}
	dir, err := os.MkdirTemp("", "extproc-load-")
	if err != nil {
		return nil, fmt.Errorf("creating a directory for the pickers' logs: %w", err)
	}
	e.logDir = dir
	fmt.Fprintf(log, "[extproc-load] starting the API server and a pool of %d pods (picker logs in %s)\n", n, dir)
	began := time.Now()
	e.cluster, err = stack.StartCluster(ctx, stack.ClusterOptions{
		Namespace: "bench", PoolName: "bench-pool", Pods: n, FirstPodIP: firstPodIP, Handler: e.pods.handler, Roles: roles,
	})
	if err != nil {
		return nil, errors.Join(err, os.RemoveAll(dir))
	}
	fmt.Fprintf(log, "[extproc-load] cluster up in %v\n", time.Since(began).Round(time.Millisecond))
	return e, nil
}

// grow adds pods until the pool has n.
func (e *benchEnv) grow(ctx context.Context, n int) error {
	have := len(e.cluster.Endpoints())
	if n <= have {
		return nil
	}
	began := time.Now()
	if err := e.cluster.AddPods(ctx, n-have); err != nil {
		return err
	}
	fmt.Fprintf(e.log, "[extproc-load] pool grown to %d pods in %v\n", n, time.Since(began).Round(time.Millisecond))
	return nil
}

func (e *benchEnv) endpoints() []string {
	var eps []string
	for _, a := range e.cluster.Endpoints() {
		eps = append(eps, a.String())
	}
	return eps
}

// endpointRoles maps each labelled pod's endpoint to its role; nil when
// no pod has one.
func (e *benchEnv) endpointRoles() map[string]string {
	if len(e.roles) == 0 {
		return nil
	}
	m := map[string]string{}
	for i, ep := range e.endpoints() {
		if i < len(e.roles) {
			m[ep] = e.roles[i]
		}
	}
	return m
}

// stop stops the cluster and removes the pickers' logs unless keepLogs.
func (e *benchEnv) stop() error {
	err := e.cluster.Stop()
	if err == nil && !e.keepLogs {
		err = os.RemoveAll(e.logDir)
	}
	return err
}

// pickerTarget is a started picker (its replicas, with --replicas) and the
// target that drives it.
type pickerTarget struct {
	*target
	procs []*pickerProcess
	// idleRSS is the pickers' resident set once ready, before any request.
	idleRSS int64
}

// startTarget starts the picker; with replicas of 1 or more, that many peer
// replicas of one ledger (leader election and the peer layer, as a
// Deployment of the picker with --peer-selector runs), the target's
// streams spread over their ext_proc ports in turn.
func (e *benchEnv) startTarget(ctx context.Context, kind, bin string, useTLS bool, conns, replicas int, extra []string) (_ *pickerTarget, err error) {
	if _, err := os.Stat(bin); err != nil {
		hint := "make build"
		if kind == pickerUpstream {
			hint = "make upstream-epp"
		}
		return nil, fmt.Errorf("the %s picker's binary: %w (build it with `%s`)", kind, err, hint)
	}
	pt := &pickerTarget{target: &target{name: kind, prompts: newPrompts(1), pods: e.pods, endpoints: e.endpoints(), roles: e.endpointRoles(), log: e.log}}
	defer func() {
		if err != nil {
			err = errors.Join(err, pt.stop())
		}
	}()
	var addrs []string
	for i := range max(replicas, 1) {
		began := time.Now()
		peer := ""
		if replicas > 0 {
			// The first started leads: it is the first to try the Lease.
			peer = "epp-" + strconv.Itoa(i+1)
		}
		proc, err := startPicker(ctx, kind, bin, e.cluster, useTLS, extra, e.logDir, peer)
		if err != nil {
			return nil, err
		}
		pt.procs = append(pt.procs, proc)
		fmt.Fprintf(e.log, "[extproc-load] %s picker %s ready with %d endpoints in %v\n", kind, peer, len(e.cluster.Endpoints()), time.Since(began).Round(time.Millisecond))
		addrs = append(addrs, proc.ports.GRPCAddr())
		pt.pids = append(pt.pids, proc.Pid())
		pt.metricsURLs = append(pt.metricsURLs, proc.ports.MetricsURL())
		if rss, _, err := procMemory(proc.Pid()); err == nil {
			pt.idleRSS += rss
		}
	}
	if replicas > 1 {
		if err := waitForPeers(ctx, pt.metricsURLs); err != nil {
			return nil, err
		}
	}
	if pt.client, err = dialAll(addrs, useTLS, conns); err != nil {
		return nil, err
	}
	if kind == pickerTally {
		pt.ledger = leaderLedger(pt.metricsURLs)
	}
	return pt, nil
}

func (pt *pickerTarget) stop() error {
	if pt.client != nil {
		pt.client.close()
	}
	var errs []error
	for _, p := range pt.procs {
		errs = append(errs, p.Stop())
	}
	return errors.Join(errs...)
}
