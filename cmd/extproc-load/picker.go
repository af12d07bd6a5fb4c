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
func startPicker(ctx context.Context, kind, bin string, c *stack.Cluster, useTLS bool, extra []string, logDir string) (*pickerProcess, error) {
	ports, err := stack.FreePickerPorts()
	if err != nil {
		return nil, err
	}
	args := append(pickerArgs(kind, c, ports.GRPC, ports.Health, ports.Metrics, useTLS), extra...)
	logPath := filepath.Join(logDir, fmt.Sprintf("%s-%d.log", kind, time.Now().UnixNano()))
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("creating the picker's log: %w", err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.Kubeconfig(), "NAMESPACE="+c.Namespace())
	proc, err := stack.StartCommand(kind+" picker", cmd, logFile, nil)
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
