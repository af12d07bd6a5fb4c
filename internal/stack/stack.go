package stack

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/internal/modelsim/server"
)

// Defaults of Options.
const (
	DefaultNamespace  = "demo"
	DefaultPoolName   = "demo-pool"
	DefaultPods       = 4
	DefaultTargetPort = 8000
	// DefaultDecoderPort is where a decode pod's simulator listens, its
	// sidecar taking TargetPort, as llm-d's decode pods run vLLM on 8200
	// behind the sidecar on 8000.
	DefaultDecoderPort = 8200
	DefaultModel       = server.DefaultModel
)

// DefaultFirstPodIP is the first pod's IP; the next pods count up from it.
var DefaultFirstPodIP = netip.MustParseAddr("127.0.0.2")

const (
	pickerReadyTimeout  = 60 * time.Second
	gatewayReadyTimeout = 30 * time.Second
	pollInterval        = 100 * time.Millisecond
	// requestTimeout bounds one control request (health, ledger).
	requestTimeout   = 5 * time.Second
	podDeleteTimeout = 30 * time.Second
)

// Options configure a Stack. Zero fields take the defaults above.
type Options struct {
	// BinDir holds the epp and devgateway binaries (required).
	BinDir string
	// Namespace and PoolName name the InferencePool and where it lives.
	Namespace string
	PoolName  string
	// Pods is how many Ready pods to start with.
	Pods int
	// FirstPodIP is the first pod's IP (a loopback address); pod i gets
	// FirstPodIP+i. Each pod's simulator listens on its IP and TargetPort.
	FirstPodIP netip.Addr
	TargetPort int32
	// Model is the model name the simulators serve.
	Model string
	// TimeScale runs the simulators this many times faster than real time.
	TimeScale float64
	// KVBlocks sizes each simulator's KV cache (16-token blocks); 0 keeps
	// the engine's default.
	KVBlocks int
	// LateFirstByteFraction is the fraction of streamed responses each
	// simulator holds back whole until their last token, as a buffering
	// proxy would (server.Config's field of that name; 0 streams them all).
	// A request's fate follows its draw key (DrawKeyHeader), so a replay
	// holds back the same requests on every run, whichever pod serves them,
	// and a trace the same requests for every policy (TraceWorkload).
	LateFirstByteFraction float64
	// LoRAAdapters are LoRA adapter names each simulator serves besides
	// Model (server.Config.LoRAModules); none leaves LoRA off. MaxLoRAs is
	// how many may run at once on one simulator (0: vLLM's default,
	// server.DefaultMaxLoRAs; refused without LoRAAdapters). LoRALoadTime
	// is what loading one into a slot costs, in engine time (0:
	// engine.DefaultLoRALoadTime). Pod.Stats reports the loads
	// (AdapterLoads).
	LoRAAdapters []string
	MaxLoRAs     int
	LoRALoadTime time.Duration
	// Roles are the prefill/decode roles of the first pods, in order
	// (RoleLabel's values: RolePrefill, RoleDecode, RolePrefillDecode; ""
	// leaves a pod unlabelled); pods past the list are unlabelled, as is
	// every pod without Roles. A pod's role is its RoleLabel; a decode
	// pod runs the prefill/decode sidecar (internal/pdsidecar) on
	// TargetPort in front of its simulator on DecoderPort.
	Roles []string
	// DecoderPort is where decode pods' simulators listen (default
	// DefaultDecoderPort).
	DecoderPort int32
	// FailureMode is the pool's endpointPickerRef.failureMode (default FailClose).
	FailureMode infv1.EndpointPickerFailureMode
	// GatewayListen is the dev gateway's listen address (default
	// 127.0.0.1:0, a free port).
	GatewayListen string
	// PickerArgs are extra flags for the picker.
	PickerArgs []string
	// Peers makes every picker process (the first and StartReplica's) a
	// replica of one ledger (peers.go): leader election, a pod object each,
	// --peer-selector and the peer credentials. Every replica serves.
	Peers bool
	// Output receives the processes' output, each line prefixed with the
	// process name; nil drops it (the last lines still appear in errors).
	Output io.Writer
}

func (o *Options) setDefaults() error {
	if o.BinDir == "" {
		return errors.New("stack options: BinDir is required: the directory holding the epp and devgateway binaries")
	}
	if o.Namespace == "" {
		o.Namespace = DefaultNamespace
	}
	if o.PoolName == "" {
		o.PoolName = DefaultPoolName
	}
	if o.Pods == 0 {
		o.Pods = DefaultPods
	}
	if o.Pods < 0 {
		return fmt.Errorf("stack options: Pods: %d is invalid: must be 0 or more", o.Pods)
	}
	if len(o.Roles) > o.Pods {
		return fmt.Errorf("stack options: Roles: %d roles for %d pods: at most one a pod", len(o.Roles), o.Pods)
	}
	for i, r := range o.Roles {
		if err := checkRole(r); err != nil {
			return fmt.Errorf("stack options: Roles[%d]: %w", i, err)
		}
	}
	if o.DecoderPort == 0 {
		o.DecoderPort = DefaultDecoderPort
	}
	if !o.FirstPodIP.IsValid() {
		o.FirstPodIP = DefaultFirstPodIP
	}
	if !o.FirstPodIP.IsLoopback() {
		return fmt.Errorf("stack options: FirstPodIP: %s is invalid: must be a loopback address", o.FirstPodIP)
	}
	if o.TargetPort == 0 {
		o.TargetPort = DefaultTargetPort
	}
	if o.DecoderPort == o.TargetPort {
		return fmt.Errorf("stack options: DecoderPort: %d is invalid: it is the TargetPort, which a decode pod's sidecar takes", o.DecoderPort)
	}
	if o.Model == "" {
		o.Model = DefaultModel
	}
	if o.TimeScale == 0 {
		o.TimeScale = 1
	}
	if o.FailureMode == "" {
		o.FailureMode = infv1.EndpointPickerFailClose
	}
	if o.GatewayListen == "" {
		o.GatewayListen = "127.0.0.1:0"
	}
	for _, bin := range []string{"epp", "devgateway"} {
		if _, err := os.Stat(filepath.Join(o.BinDir, bin)); err != nil {
			return fmt.Errorf("stack options: BinDir %q: %w (build it with `go build -o %s/ ./cmd/%s`)", o.BinDir, err, o.BinDir, bin)
		}
	}
	return nil
}

// Stack is Tally running end to end on loopback. Create it with Start and
// always Stop it.
type Stack struct {
	opts Options
	apiServer

	ports       PickerPorts // the first picker's
	picker      *Process
	gateway     *Process
	gatewayAddr string
	replicas    []*Replica
	spread      []*Process // StartSpreadGateway's
	nginx       []*NGINX   // StartNGINX's
	// With Options.Peers: what the picker processes share as peers.
	peers *peerSet

	http *http.Client

	mu       sync.Mutex
	pods     []*Pod
	nextIP   netip.Addr
	servedBy map[string]string // request id -> pod name
	// prefilledBy maps a request id to the prefill pod of its prefill leg.
	prefilledBy map[string]string
	hold        *gate        // non-nil while requests are held at the pods
	held        atomic.Int64 // requests the pods hold now
}

// Start brings the whole stack up: API server, namespace, pool, pods and
// their simulators, the picker (ready, with every pod in its endpoint set)
// and the gateway (listening). On error it stops what it started.
func Start(ctx context.Context, opts Options) (_ *Stack, err error) {
	if err := opts.setDefaults(); err != nil {
		return nil, err
	}
	s := &Stack{opts: opts, nextIP: opts.FirstPodIP, servedBy: map[string]string{}, http: NewHTTPClient()}
	defer func() {
		if err != nil {
			err = errors.Join(err, s.Stop())
		}
	}()
	if err := s.apiServer.start("tally-stack", nil); err != nil {
		return nil, err
	}
	if err := createPool(ctx, s.kube, opts.Namespace, opts.PoolName, opts.TargetPort, opts.FailureMode); err != nil {
		return nil, err
	}
	for i := range opts.Pods {
		role := ""
		if i < len(opts.Roles) {
			role = opts.Roles[i]
		}
		if _, err := s.AddPodWithRole(ctx, true, role); err != nil {
			return nil, err
		}
	}
	if s.ports, err = FreePickerPorts(); err != nil {
		return nil, err
	}
	if opts.Peers {
		if err := s.peerSetup(); err != nil {
			return nil, err
		}
	}
	if err := s.StartPicker(ctx); err != nil {
		return nil, err
	}
	if err := s.WaitForEndpoints(ctx, s.PodNames()...); err != nil {
		return nil, err
	}
	if s.gateway, s.gatewayAddr, err = s.startGateway(ctx, "devgateway", s.ports.GRPC); err != nil {
		return nil, err
	}
	return s, nil
}

// Stop stops everything the stack started, in reverse order, and removes
// its temporary files. It is safe to call more than once.
func (s *Stack) Stop() error {
	var errs []error
	for _, n := range s.nginx {
		errs = append(errs, n.stop())
	}
	s.nginx = nil
	errs = append(errs, stopAll(s.spread...))
	s.spread = nil
	for _, r := range s.replicas {
		errs = append(errs, r.stop())
	}
	s.replicas = nil
	errs = append(errs, stopAll(s.gateway, s.picker))
	s.mu.Lock()
	pods := s.pods
	hold := s.hold
	s.hold = nil
	s.mu.Unlock()
	if hold != nil {
		hold.open()
	}
	for _, p := range pods {
		p.stopSimulator()
	}
	errs = append(errs, s.apiServer.stop())
	if t, ok := s.http.Transport.(*http.Transport); ok {
		t.CloseIdleConnections()
	}
	return errors.Join(errs...)
}

// Client is an administrator's client of the stack's API server; it
// knows the pool type and the v1alpha2 types (InferenceObjective,
// InferenceModelRewrite).
func (s *Stack) Client() client.Client { return s.kube }

// RestConfig is the administrator's connection to the API server.
func (s *Stack) RestConfig() *rest.Config { return s.restConfig }

// Kubeconfig is the path of a kubeconfig file for the API server.
func (s *Stack) Kubeconfig() string { return s.kubeconfig }

// APIServerURL is the API server's address.
func (s *Stack) APIServerURL() string { return s.restConfig.Host }

// Options returns the options the stack runs with, defaults filled in.
func (s *Stack) Options() Options {
	s.mu.Lock() // ResetSimulators may change TimeScale
	defer s.mu.Unlock()
	return s.opts
}

// GatewayURL is the dev gateway's base URL ("http://127.0.0.1:PORT").
func (s *Stack) GatewayURL() string { return "http://" + s.gatewayAddr }

// PickerMetricsURL is the picker's metrics server ("/metrics", "/debug/ledger").
func (s *Stack) PickerMetricsURL() string { return s.ports.MetricsURL() }

// HTTPClient is the client the stack uses for its own requests.
func (s *Stack) HTTPClient() *http.Client { return s.http }

// Ports handed to processes come from below Linux's default ephemeral
// range (32768-60999): a port from that range, free when chosen, can become
// the local port of an outgoing connection before the process binds it, or
// while a picker restarts on it.
const (
	minFreePort = 20000
	maxFreePort = 32767
)

// FreePort finds a port free on the loopback interface, for a process to
// listen on. It is free when this returns; the process told to use it
// binds it soon after.
func FreePort() (int, error) {
	for range 1000 {
		port := minFreePort + rand.IntN(maxFreePort-minFreePort+1)
		lis, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
		if err != nil {
			continue // taken
		}
		lis.Close()
		return port, nil
	}
	return 0, fmt.Errorf("finding a free port: none of 1000 tried from %d to %d was free", minFreePort, maxFreePort)
}

// PickerPorts are the loopback ports one picker process serves on: ext_proc,
// gRPC health and metrics.
type PickerPorts struct{ GRPC, Health, Metrics int }

// GRPCAddr is the picker's ext_proc address.
func (p PickerPorts) GRPCAddr() string { return "127.0.0.1:" + strconv.Itoa(p.GRPC) }

// MetricsURL is the base URL of the picker's metrics server.
func (p PickerPorts) MetricsURL() string { return "http://127.0.0.1:" + strconv.Itoa(p.Metrics) }

// FreePorts finds n distinct free ports (FreePort), none of them in taken.
func FreePorts(n int, taken ...int) ([]int, error) {
	ports := make([]int, 0, n)
	for len(ports) < n {
		p, err := FreePort()
		if err != nil {
			return nil, err
		}
		if !slices.Contains(ports, p) && !slices.Contains(taken, p) {
			ports = append(ports, p)
		}
	}
	return ports, nil
}

// FreePickerPorts finds three distinct free ports, none of them in taken.
func FreePickerPorts(taken ...PickerPorts) (PickerPorts, error) {
	var used []int
	for _, t := range taken {
		used = append(used, t.GRPC, t.Health, t.Metrics)
	}
	ports, err := FreePorts(3, used...)
	if err != nil {
		return PickerPorts{}, err
	}
	return PickerPorts{GRPC: ports[0], Health: ports[1], Metrics: ports[2]}, nil
}

// StartPicker starts the picker process and waits until its gRPC health
// service reports "readiness" SERVING. The picker keeps its ports across
// restarts, so the gateway finds it again.
func (s *Stack) StartPicker(ctx context.Context) error {
	if s.picker != nil {
		select {
		case <-s.picker.Done():
		default:
			return errors.New("the picker is already running")
		}
	}
	p, err := s.startPickerProcess(ctx, "epp", s.ports)
	if err != nil {
		return err
	}
	s.picker = p
	return p.waitFor(ctx, "the picker to report readiness SERVING", pickerReadyTimeout, pollInterval, func(ctx context.Context) bool {
		ready, _ := pickerReady(ctx, s.ports.Health)
		return ready
	})
}

// startPickerProcess starts a picker of the stack's pool on ports, with
// Options.PickerArgs and then extraArgs.
func (s *Stack) startPickerProcess(ctx context.Context, name string, ports PickerPorts, extraArgs ...string) (*Process, error) {
	args := append([]string{
		"--pool-name=" + s.opts.PoolName,
		"--pool-namespace=" + s.opts.Namespace,
		"--kubeconfig=" + s.kubeconfig,
		"--grpc-port=" + strconv.Itoa(ports.GRPC),
		"--grpc-health-port=" + strconv.Itoa(ports.Health),
		"--metrics-port=" + strconv.Itoa(ports.Metrics),
		// Tests and the demo read /metrics and /debug/ledger over plain
		// HTTP on loopback, without a token.
		"--metrics-endpoint-auth=false",
		// Stopping the stack need not wait for gateways to notice.
		"--shutdown-delay=0s",
	}, s.opts.PickerArgs...)
	args = append(args, extraArgs...)
	cmd, err := s.pickerCommand(ctx, name, args)
	if err != nil {
		return nil, err
	}
	return StartCommand(name, cmd, s.opts.Output, nil)
}

// pickerReady asks the picker's gRPC health service on healthPort whether
// "readiness" is SERVING.
func pickerReady(ctx context.Context, healthPort int) (bool, error) {
	conn, err := grpc.NewClient("127.0.0.1:"+strconv.Itoa(healthPort), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return false, fmt.Errorf("connecting to the picker's health port: %w", err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "readiness"})
	if err != nil {
		return false, fmt.Errorf("checking the picker's readiness: %w", err)
	}
	return resp.GetStatus() == healthpb.HealthCheckResponse_SERVING, nil
}

// KillPicker kills the picker (SIGKILL), as a crash would.
func (s *Stack) KillPicker() {
	if s.picker != nil {
		s.picker.Kill()
	}
}

// Picker is the running (or last) picker process.
func (s *Stack) Picker() *Process { return s.picker }

// startGateway starts a dev gateway of the pool in front of the pickers
// whose ext_proc ports are pickerGRPCPorts (streams spread over them in
// turn) and returns it with its address.
func (s *Stack) startGateway(ctx context.Context, name string, pickerGRPCPorts ...int) (*Process, string, error) {
	listening := make(chan string, 1)
	const prefix = "devgateway listening on "
	onLine := func(line string) {
		if _, addr, ok := strings.Cut(line, prefix); ok {
			select {
			case listening <- strings.TrimSpace(addr):
			default:
			}
		}
	}
	listen := s.opts.GatewayListen
	if name != "devgateway" {
		listen = "127.0.0.1:0" // a fixed GatewayListen is the first gateway's
	}
	addrs := make([]string, len(pickerGRPCPorts))
	for i, port := range pickerGRPCPorts {
		addrs[i] = "127.0.0.1:" + strconv.Itoa(port)
	}
	args := []string{
		"--listen=" + listen,
		"--picker-addr=" + strings.Join(addrs, ","),
		"--picker-tls=true",
		"--kubeconfig=" + s.kubeconfig,
		"--pool-name=" + s.opts.PoolName,
		"--pool-namespace=" + s.opts.Namespace,
	}
	p, err := startProcess(name, filepath.Join(s.opts.BinDir, "devgateway"), args, s.opts.Output, onLine)
	if err != nil {
		return nil, "", err
	}
	ctx, cancel := context.WithTimeout(ctx, gatewayReadyTimeout)
	defer cancel()
	select {
	case addr := <-listening:
		return p, addr, nil
	case <-p.Done():
		return p, "", fmt.Errorf("waiting for the gateway to listen: %w", p.exitError())
	case <-ctx.Done():
		return p, "", fmt.Errorf("waiting for the gateway to print %q: %w; its last output:\n%s", prefix, ctx.Err(), p.Output())
	}
}

// SetFailureMode changes the pool's failure mode through the API server.
func (s *Stack) SetFailureMode(ctx context.Context, mode infv1.EndpointPickerFailureMode) error {
	return setFailureMode(ctx, s.kube, s.opts.Namespace, s.opts.PoolName, mode)
}
