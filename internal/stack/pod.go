package stack

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/internal/modelsim/server"
	"github.com/tallyepp/tally/internal/pdsidecar"
)

// Prefill/decode roles, as llm-d labels its pods.
const (
	RoleLabel         = "llm-d.ai/role"
	RolePrefill       = "prefill"
	RoleDecode        = "decode"
	RolePrefillDecode = "prefill-decode"
)

func checkRole(role string) error {
	switch role {
	case "", RolePrefill, RoleDecode, RolePrefillDecode:
		return nil
	}
	return fmt.Errorf("role %q is invalid: must be %q, %q, %q or \"\" (unlabelled)", role, RolePrefill, RoleDecode, RolePrefillDecode)
}

// Pod is one pod of the pool and the simulator that serves its IP.
type Pod struct {
	Name string
	// Addr is the pod's endpoint: its IP and the target port.
	Addr netip.AddrPort
	// Role is the pod's RoleLabel, "" for none. A decode pod serves Addr
	// with the prefill/decode sidecar, its simulator on the DecoderPort.
	Role string
	// sidecar fronts a decode pod's simulator; nil for other pods.
	sidecar *pdsidecar.Sidecar

	stack *Stack

	mu     sync.Mutex
	uid    types.UID // of the pod object now in the API server
	served int
	sim    *server.Server
	srv    *http.Server
	// lis is srv's listener, closed by stopSimulator itself: srv.Close
	// closes only the listeners its Serve has taken in, and a simulator
	// reset right after it started (its Serve goroutine not yet running)
	// left the address bound, so the new one failed to listen on it.
	lis net.Listener
	// simSrv and simLis serve a decode pod's simulator on its DecoderPort.
	simSrv *http.Server
	simLis net.Listener
	// metricsFailing survives a simulator's replacement.
	metricsFailing bool
}

// FailMetrics makes the pod's simulator answer GET /metrics with 500 while
// failing is true, as a model server whose metrics exporter broke; its
// completions keep serving. False restores them.
func (p *Pod) FailMetrics(failing bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.metricsFailing = failing
	if p.sim != nil {
		p.sim.FailMetrics(failing)
	}
}

// ResetEngine replaces the pod's simulated engine with a fresh one (an empty
// KV cache, no requests), as a model server restarted in place would have.
// The pod's listener and its connections stay: the gateway's pooled
// connections keep working. Requests in flight on the old engine end (503,
// or a cut stream).
func (p *Pod) ResetEngine() error {
	sim, err := server.New(p.stack.simulatorConfig())
	if err != nil {
		return fmt.Errorf("pod %s: creating its simulator: %w", p.Name, err)
	}
	p.mu.Lock()
	old := p.sim
	if old == nil {
		p.mu.Unlock()
		sim.Close()
		return fmt.Errorf("pod %s: no simulator runs to reset", p.Name)
	}
	sim.FailMetrics(p.metricsFailing)
	p.sim = sim
	p.mu.Unlock()
	old.Close()
	return nil
}

// UID is the UID of the pod object that now stands for this pod: a new one
// after RecreatePod.
func (p *Pod) UID() types.UID {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.uid
}

// Stats reads the pod's simulated engine: its gauges (such as the prefill
// still queued) and counters. ok is false while no simulator runs.
func (p *Pod) Stats() (st engine.Stats, ok bool) {
	p.mu.Lock()
	sim := p.sim
	p.mu.Unlock()
	if sim == nil {
		return engine.Stats{}, false
	}
	return sim.Stats(), true
}

// URL is the pod's simulator base URL ("http://127.0.0.2:8000").
func (p *Pod) URL() string { return "http://" + p.Addr.String() }

// Served counts the completion requests that reached this pod.
func (p *Pod) Served() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.served
}

// Pods returns the stack's pods, in creation order.
func (s *Stack) Pods() []*Pod {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.pods)
}

// PodNames returns the pods' names, in creation order.
func (s *Stack) PodNames() []string {
	var names []string
	for _, p := range s.Pods() {
		names = append(names, p.Name)
	}
	return names
}

// AddPod creates the next pod (IP one above the last) with its simulator
// already serving, Ready or not, without a prefill/decode role.
func (s *Stack) AddPod(ctx context.Context, ready bool) (*Pod, error) {
	return s.AddPodWithRole(ctx, ready, "")
}

// AddPodWithRole is AddPod for a pod labelled with a prefill/decode role
// ("" for none).
func (s *Stack) AddPodWithRole(ctx context.Context, ready bool, role string) (*Pod, error) {
	if err := checkRole(role); err != nil {
		return nil, err
	}
	s.mu.Lock()
	ip := s.nextIP
	s.nextIP = ip.Next()
	p := &Pod{
		Name:  fmt.Sprintf("sim-%d", len(s.pods)),
		Addr:  netip.AddrPortFrom(ip, uint16(s.opts.TargetPort)),
		Role:  role,
		stack: s,
	}
	s.pods = append(s.pods, p)
	s.mu.Unlock()
	if !ip.IsLoopback() {
		return nil, fmt.Errorf("pod %s: IP %s is past the loopback range", p.Name, ip)
	}
	if err := p.startSimulator(); err != nil {
		return nil, err
	}
	uid, err := createPod(ctx, s.kube, s.opts.Namespace, p.Name, ip, s.opts.TargetPort, ready, p.Role)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	p.uid = uid
	p.mu.Unlock()
	return p, nil
}

// DeletePod deletes the pod's object from the API server and waits until it
// is gone. Its simulator keeps serving, and holding what it holds: requests
// already sent to the address are still in flight, as they are on a node
// until their connections break.
func (s *Stack) DeletePod(ctx context.Context, p *Pod) error {
	return deletePod(ctx, s.kube, s.opts.Namespace, p.Name)
}

// RecreatePod creates a new pod object for p after DeletePod: the same
// name and IP, served by the same simulator, but a new UID, as when a
// StatefulSet replaces a pod and the address is reused.
func (s *Stack) RecreatePod(ctx context.Context, p *Pod, ready bool) error {
	uid, err := createPod(ctx, s.kube, s.opts.Namespace, p.Name, p.Addr.Addr(), s.opts.TargetPort, ready, p.Role)
	if err != nil {
		return err
	}
	p.mu.Lock()
	p.uid = uid
	p.mu.Unlock()
	return nil
}

// SetReady sets the pod's Ready condition through the API server.
func (s *Stack) SetReady(ctx context.Context, p *Pod, ready bool) error {
	return setPodReady(ctx, s.kube, s.opts.Namespace, p.Name, ready)
}

// ResetSimulators replaces every pod's simulator with a fresh one (an empty
// KV cache, no requests) on the same address, running timeScale times faster
// than real time (0 keeps the current scale).
func (s *Stack) ResetSimulators(timeScale float64) error {
	if timeScale > 0 {
		s.mu.Lock()
		s.opts.TimeScale = timeScale
		s.mu.Unlock()
	}
	for _, p := range s.Pods() {
		p.stopSimulator()
		if err := p.startSimulator(); err != nil {
			return err
		}
	}
	// Pooled connections led to the old simulators: a POST on one fails
	// with EOF and is not retried, so drop them.
	s.http.CloseIdleConnections()
	return nil
}

// PrefilledBy names the prefill pod that ran the prefill leg of the request
// with this id (sent in RequestIDHeader), or "" if none did.
func (s *Stack) PrefilledBy(id string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.prefilledBy[id]
}

// ServedBy names the pod that received the request with this id (sent in
// RequestIDHeader), or "" if none did; with prefill/decode roles, the
// decode pod.
func (s *Stack) ServedBy(id string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.servedBy[id]
}

// Hold makes every pod hold the completion requests it receives (after
// counting them) until release is called, so a test can see where a burst
// was placed while all of it is in flight. release is idempotent; Stop
// releases too.
func (s *Stack) Hold() (release func()) {
	g := &gate{ch: make(chan struct{})}
	s.mu.Lock()
	prev := s.hold
	s.hold = g
	s.mu.Unlock()
	if prev != nil {
		prev.open()
	}
	return func() {
		s.mu.Lock()
		if s.hold == g {
			s.hold = nil
		}
		s.mu.Unlock()
		g.open()
	}
}

// gate holds requests until it opens.
type gate struct {
	ch   chan struct{}
	once sync.Once
}

func (g *gate) open() { g.once.Do(func() { close(g.ch) }) }

// Held is how many requests the pods hold now. A client that gave up is
// still counted until its request's cancellation reaches the pod: a test
// that lifts a hold after cancelling waits for 0 first, or the gateway's
// late cancellations race the opening gate to the engines.
func (s *Stack) Held() int { return int(s.held.Load()) }

func (s *Stack) currentHold() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.hold == nil {
		return nil
	}
	return s.hold.ch
}

func (s *Stack) simulatorConfig() server.Config {
	cfg := server.DefaultConfig()
	cfg.Model = s.opts.Model
	s.mu.Lock()
	cfg.TimeScale = s.opts.TimeScale
	s.mu.Unlock()
	if s.opts.KVBlocks > 0 {
		cfg.Engine.KVBlocks = s.opts.KVBlocks
	}
	cfg.LateFirstByteFraction = s.opts.LateFirstByteFraction
	for _, a := range s.opts.LoRAAdapters {
		cfg.LoRAModules = append(cfg.LoRAModules, server.LoRAModule{Name: a})
	}
	// Left 0 without adapters, so that a MaxLoRAs given alone is refused.
	cfg.Engine.MaxLoRAs = s.opts.MaxLoRAs
	if len(cfg.LoRAModules) > 0 && cfg.Engine.MaxLoRAs == 0 {
		cfg.Engine.MaxLoRAs = server.DefaultMaxLoRAs
	}
	if s.opts.LoRALoadTime != 0 {
		cfg.Engine.LoRALoadTime = s.opts.LoRALoadTime
	}
	// The gateway names a request that comes without an x-request-id at
	// random; the stack's draw key is the same on every run, and for every
	// policy that replays the same trace.
	cfg.RequestIDHeader = DrawKeyHeader
	return cfg
}

// ServeHTTP records which pod a completion request reached, holds it while
// the stack holds, and passes it to the simulator. A decode leg's pull of
// its KV blocks (server.PullPath) is neither counted nor held: it stands for
// the NIXL transfer between engines, not a request to the pod, and holding
// it would hold a decode leg that the hold already let through.
func (p *Pod) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s := p.stack
	if r.Method == http.MethodPost && r.URL.Path != server.PullPath {
		p.mu.Lock()
		p.served++
		p.mu.Unlock()
		if id := r.Header.Get(RequestIDHeader); id != "" {
			s.mu.Lock()
			// A prefill pod sees only prefill legs, which carry their
			// request's id: the decode pod stays the one that served it.
			if p.Role == RolePrefill {
				if s.prefilledBy == nil {
					s.prefilledBy = map[string]string{}
				}
				s.prefilledBy[id] = p.Name
			} else {
				s.servedBy[id] = p.Name
			}
			s.mu.Unlock()
		}
		if hold := s.currentHold(); hold != nil {
			// Read the body first: an HTTP/1 server notices that the
			// client went away (and cancels r's context) only once the
			// request's body has been read to its end.
			body, err := io.ReadAll(r.Body)
			if err != nil {
				return
			}
			r.Body = io.NopCloser(bytes.NewReader(body))
			s.held.Add(1)
			select {
			case <-hold:
			case <-r.Context().Done():
				s.held.Add(-1)
				return
			}
			s.held.Add(-1)
		}
	}
	if p.sidecar != nil {
		p.sidecar.ServeHTTP(w, r)
		return
	}
	p.serveSimulator(w, r)
}

// serveSimulator passes a request to the pod's simulator now.
func (p *Pod) serveSimulator(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	sim := p.sim
	p.mu.Unlock()
	if sim == nil {
		http.Error(w, "simulator stopped", http.StatusServiceUnavailable)
		return
	}
	sim.ServeHTTP(w, r)
}

func (p *Pod) startSimulator() error {
	sim, err := server.New(p.stack.simulatorConfig())
	if err != nil {
		return fmt.Errorf("pod %s: creating its simulator: %w", p.Name, err)
	}
	lis, err := net.Listen("tcp", p.Addr.String())
	if err != nil {
		sim.Close()
		return fmt.Errorf("pod %s: listening on its IP: %w", p.Name, err)
	}
	var simSrv *http.Server
	var simLis net.Listener
	if p.Role == RoleDecode {
		decoder := netip.AddrPortFrom(p.Addr.Addr(), uint16(p.stack.opts.DecoderPort))
		if simLis, err = net.Listen("tcp", decoder.String()); err != nil {
			sim.Close()
			lis.Close()
			return fmt.Errorf("pod %s: listening on its decoder port: %w", p.Name, err)
		}
		simSrv = &http.Server{Handler: http.HandlerFunc(p.serveSimulator), ReadHeaderTimeout: 10 * time.Second}
		if p.sidecar == nil {
			sc, err := pdsidecar.New(pdsidecar.Config{Decoder: &url.URL{Scheme: "http", Host: decoder.String()}, Client: p.stack.http})
			if err != nil {
				sim.Close()
				lis.Close()
				simLis.Close()
				return fmt.Errorf("pod %s: creating its sidecar: %w", p.Name, err)
			}
			p.sidecar = sc
		}
	}
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	p.mu.Lock()
	sim.FailMetrics(p.metricsFailing)
	p.sim, p.srv, p.lis = sim, srv, lis
	p.simSrv, p.simLis = simSrv, simLis
	p.mu.Unlock()
	go srv.Serve(lis)
	if simSrv != nil {
		go simSrv.Serve(simLis)
	}
	return nil
}

func (p *Pod) stopSimulator() {
	p.mu.Lock()
	sim, srv, lis := p.sim, p.srv, p.lis
	simSrv, simLis := p.simSrv, p.simLis
	p.sim, p.srv, p.lis = nil, nil, nil
	p.simSrv, p.simLis = nil, nil
	p.mu.Unlock()
	if srv != nil {
		srv.Close()
		lis.Close() // already closed when Serve had taken it in
	}
	if simSrv != nil {
		simSrv.Close()
		simLis.Close()
	}
	if sim != nil {
		sim.Close()
	}
}
