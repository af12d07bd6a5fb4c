package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/picker/debugledger"
)

// The pickers the tool can start.
const (
	pickerTally    = "tally"
	pickerUpstream = "upstream"
)

const (
	// pickerReadyTimeout bounds the wait for a picker to serve and to list
	// every pod: a thousand pods take the upstream picker a while.
	pickerReadyTimeout = 3 * time.Minute
	// pollInterval is how often a wait for the ledger looks again.
	pollInterval = 100 * time.Millisecond
)

// pickerProcess is a picker the tool started, against a stack.Cluster.
type pickerProcess struct {
	*stack.Process
	ports stack.PickerPorts
}

// pickerArgs are the flags each picker runs with. Both serve plain gRPC
// (--secure-serving=false) unless useTLS, and unauthenticated metrics. The
// upstream picker gets what its v1.5.0 chart passes by default (-v 1,
// --tracing=false, JSON logs) and reads the kubeconfig from $KUBECONFIG:
// it has no --kubeconfig flag.
func pickerArgs(kind string, c *stack.Cluster, grpcPort, healthPort, metricsPort int, useTLS bool) []string {
	args := []string{
		"--pool-name=" + c.PoolName(),
		"--pool-namespace=" + c.Namespace(),
		"--grpc-port=" + strconv.Itoa(grpcPort),
		"--grpc-health-port=" + strconv.Itoa(healthPort),
		"--metrics-port=" + strconv.Itoa(metricsPort),
		"--metrics-endpoint-auth=false",
		"--secure-serving=" + strconv.FormatBool(useTLS),
	}
	switch kind {
	case pickerTally:
		args = append(args, "--kubeconfig="+c.Kubeconfig(), "--shutdown-delay=0s")
	case pickerUpstream:
		args = append(args, "-v=1", "--tracing=false", "--zap-encoder=json")
	}
	return args
}

// startPicker starts the picker binary of kind against the cluster, its
// output in a log file under logDir, and waits until it is ready and lists
// every pod of the cluster.
//
// peer, when not empty, names the picker process as a peer replica of the
// pool (stack.Cluster.PeerCommand): leader election and the peer layer.
func startPicker(ctx context.Context, kind, bin string, c *stack.Cluster, useTLS bool, extra []string, logDir, peer string) (*pickerProcess, error) {
	ports, err := stack.FreePickerPorts()
	if err != nil {
		return nil, err
	}
	args := append(pickerArgs(kind, c, ports.GRPC, ports.Health, ports.Metrics, useTLS), extra...)
	cmd := exec.Command(bin, args...)
	name := kind + " picker"
	if peer != "" {
		if cmd, err = c.PeerCommand(ctx, peer, bin, args...); err != nil {
			return nil, err
		}
		name = kind + " picker " + peer
	}
	cmd.Env = append(cmd.Environ(), "KUBECONFIG="+c.Kubeconfig(), "NAMESPACE="+c.Namespace())
	logPath := filepath.Join(logDir, fmt.Sprintf("%s%s-%d.log", kind, peer, time.Now().UnixNano()))
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("creating the picker's log: %w", err)
	}
	proc, err := stack.StartCommand(name, cmd, logFile, nil)
	if err != nil {
		logFile.Close()
		return nil, err
	}
	go func() {
		<-proc.Done() // its output is all written by then
		logFile.Close()
	}()
	p := &pickerProcess{Process: proc, ports: ports}
	if err := proc.WaitServing(ctx, http.DefaultClient, ports, len(c.Endpoints()), pickerReadyTimeout); err != nil {
		return nil, errors.Join(fmt.Errorf("%w (its log: %s)", err, logPath), proc.Stop())
	}
	return p, nil
}

// ledgerAt reads Tally's /debug/ledger.
func ledgerAt(ctx context.Context, metricsURL string) (debugledger.Ledger, error) {
	return stack.ReadLedger(ctx, http.DefaultClient, metricsURL)
}

// leaderLedger reads the ledger of the replica that leads, of the metrics
// servers at urls: the leader's ledger is the pool's (a follower's is its
// copy of it, so the ledgers must not be summed). A picker without
// replicas leads itself; if none says it leads, the first is read.
func leaderLedger(urls []string) func(context.Context) (debugledger.Ledger, error) {
	return func(ctx context.Context) (debugledger.Ledger, error) {
		var first debugledger.Ledger
		for i, url := range urls {
			l, err := ledgerAt(ctx, url)
			if err != nil {
				return l, err
			}
			if l.Replica == nil || l.Replica.Leading {
				return l, nil
			}
			if i == 0 {
				first = l
			}
		}
		return first, nil
	}
}

// leaderIndex is the index of the metrics server, of urls, whose replica
// leads; -1 if none can be told.
func leaderIndex(ctx context.Context, urls []string) int {
	for i, url := range urls {
		if l, err := ledgerAt(ctx, url); err == nil && l.Replica != nil && l.Replica.Leading {
			return i
		}
	}
	return -1
}

// peersTimeout bounds the wait for replicas to find their leader.
const peersTimeout = 30 * time.Second

// waitForPeers waits until one replica of the metrics servers at urls
// leads and every other has a stream to it: a follower that has not found
// its leader yet places locally, which is not what a run should measure.
func waitForPeers(ctx context.Context, urls []string) error {
	deadline := time.Now().Add(peersTimeout)
	for {
		leaders, following, last := 0, 0, ""
		for _, url := range urls {
			l, err := ledgerAt(ctx, url)
			switch {
			case err != nil:
				last = err.Error()
			case l.Replica == nil:
				last = url + " runs without the peer layer"
			case l.Replica.Leading:
				leaders++
			case l.Replica.Leader != "" && l.Replica.Peers > 0:
				following++
			default:
				last = fmt.Sprintf("%s: leader %q, %d peers", url, l.Replica.Leader, l.Replica.Peers)
			}
		}
		if leaders == 1 && following == len(urls)-1 {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("waiting %v for the replicas to find their leader: %d lead, %d follow (last: %s)", peersTimeout, leaders, following, last)
		}
		time.Sleep(pollInterval)
	}
}

// replicaReport is each replica's view of the run from its metrics: whether
// it leads, the picks it forwarded to the leader and those it placed on its
// own ledger (by reason), since it started.
func replicaReport(ctx context.Context, urls []string) []string {
	var out []string
	for _, url := range urls {
		m, err := stack.ReadMetrics(ctx, http.DefaultClient, url)
		if err != nil {
			out = append(out, fmt.Sprintf("%s: %v", url, err))
			continue
		}
		leads, _ := m.Value("tally_peer_is_leader")
		fwd, _ := m.Value("tally_peer_forwarded_picks_total")
		line := fmt.Sprintf("%s: leading %v, forwarded %.0f picks, placed locally:", url, leads == 1, fwd)
		for _, s := range m["tally_peer_local_placements_total"].GetMetric() {
			for _, l := range s.GetLabel() {
				if l.GetName() == "reason" {
					line += fmt.Sprintf(" %s %.0f", l.GetValue(), s.GetCounter().GetValue())
				}
			}
		}
		out = append(out, line)
	}
	return out
}
