package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tallyepp/tally/internal/stack"
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
	pickerStopGrace    = 15 * time.Second
	pollInterval       = 100 * time.Millisecond
	controlTimeout     = 5 * time.Second
)

// pickerProcess is a picker the tool started, against a stack.Cluster.
type pickerProcess struct {
	kind       string
	cmd        *exec.Cmd
	grpcAddr   string
	healthAddr string
	metricsURL string
	logPath    string
	done       chan struct{}
	err        error // Wait's, set before done closes
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
	ports, err := stack.FreePorts(3)
	if err != nil {
		return nil, err
	}
	args := append(pickerArgs(kind, c, ports[0], ports[1], ports[2], useTLS), extra...)
	logPath := filepath.Join(logDir, fmt.Sprintf("%s-%d.log", kind, time.Now().UnixNano()))
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("creating the picker's log: %w", err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.Kubeconfig(), "NAMESPACE="+c.Namespace())
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// The kernel kills the picker if the tool dies: nothing is left behind.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("starting the %s picker (%s): %w", kind, bin, err)
	}
	p := &pickerProcess{
		kind: kind, cmd: cmd, logPath: logPath, done: make(chan struct{}),
		grpcAddr:   "127.0.0.1:" + strconv.Itoa(ports[0]),
		healthAddr: "127.0.0.1:" + strconv.Itoa(ports[1]),
		metricsURL: "http://127.0.0.1:" + strconv.Itoa(ports[2]),
	}
	go func() {
		p.err = cmd.Wait()
		logFile.Close()
		close(p.done)
	}()
	if err := p.waitReady(ctx, len(c.Endpoints())); err != nil {
		return nil, errors.Join(err, p.stop())
	}
	return p, nil
}

func (p *pickerProcess) pid() int { return p.cmd.Process.Pid }

// waitReady waits for gRPC health "readiness" SERVING and for the picker's
// inference_pool_per_pod_queue_size metric (both pickers publish it, one
// series per endpoint) to have a series for every endpoint.
func (p *pickerProcess) waitReady(ctx context.Context, endpoints int) error {
	conn, err := grpc.NewClient(p.healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("connecting to the picker's health port: %w", err)
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	ctx, cancel := context.WithTimeout(ctx, pickerReadyTimeout)
	defer cancel()
	last := "not serving"
	t := time.NewTicker(pollInterval)
	defer t.Stop()
	for {
		cctx, ccancel := context.WithTimeout(ctx, controlTimeout)
		resp, err := health.Check(cctx, &healthpb.HealthCheckRequest{Service: "readiness"})
		ccancel()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			n, err := p.endpointSeries(ctx)
			switch {
			case err != nil || n != endpoints:
				last = fmt.Sprintf("serving, %d of %d endpoints listed (%v)", n, endpoints, err)
			case !listening(p.grpcAddr):
				// The upstream picker reports ready before its ext_proc
				// port listens (with TLS, while it makes its certificate).
				last = "ready, but the ext_proc port does not accept connections yet"
			default:
				return nil
			}
		}
		select {
		case <-p.done:
			return fmt.Errorf("the %s picker exited (%v) before it was ready; its log:\n%s", p.kind, p.err, p.logTail())
		case <-ctx.Done():
			return fmt.Errorf("waiting for the %s picker to be ready: %w (last: %s); its log:\n%s", p.kind, ctx.Err(), last, p.logTail())
		case <-t.C:
		}
	}
}

func (p *pickerProcess) endpointSeries(ctx context.Context) (int, error) {
	body, err := httpGet(ctx, p.metricsURL+"/metrics")
	if err != nil {
		return 0, err
	}
	n := 0
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "inference_pool_per_pod_queue_size{") {
			n++
		}
	}
	return n, nil
}

func listening(addr string) bool {
	conn, err := net.DialTimeout("tcp", addr, controlTimeout)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

// ledgerAt reads Tally's /debug/ledger.
func ledgerAt(ctx context.Context, metricsURL string) (stack.Ledger, error) {
	body, err := httpGet(ctx, metricsURL+"/debug/ledger")
	if err != nil {
		return stack.Ledger{}, err
	}
	var l stack.Ledger
	if err := json.Unmarshal(body, &l); err != nil {
		return stack.Ledger{}, fmt.Errorf("decoding %s/debug/ledger: %w", metricsURL, err)
	}
	return l, nil
}

func httpGet(ctx context.Context, url string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, controlTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: HTTP %d", url, resp.StatusCode)
	}
	return body, nil
}

// stop sends SIGTERM, kills the picker after a grace period, and waits.
func (p *pickerProcess) stop() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(pickerStopGrace):
	}
	_ = p.cmd.Process.Kill()
	<-p.done
	return fmt.Errorf("the %s picker did not exit within %v of SIGTERM and was killed", p.kind, pickerStopGrace)
}

// logTail is the end of the picker's log, for error messages.
func (p *pickerProcess) logTail() string {
	data, _ := os.ReadFile(p.logPath)
	const keep = 4 << 10
	if len(data) > keep {
		data = data[len(data)-keep:]
	}
	return string(data)
}
