package stack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
)

// podCreateWorkers bounds the pods created at once: a thousand pods are
// two thousand API calls, and the API server shares the cores.
const podCreateWorkers = 8

// ClusterOptions configure a Cluster. Zero fields take the Stack defaults.
type ClusterOptions struct {
	Namespace string
	PoolName  string
	// Pods is how many Ready pods to start with (0 is allowed: AddPods later).
	Pods int
	// FirstPodIP is the first pod's IP (a loopback address); pod i gets
	// FirstPodIP+i.
	FirstPodIP netip.Addr
	TargetPort int32
	// Handler returns what serves one pod's address; nil answers 404 to
	// everything. A benchmark that plays the model server itself needs no
	// more than a /metrics page here.
	Handler func(addr netip.AddrPort) http.Handler
	// Roles are the prefill/decode roles (RoleLabel's values) of the first
	// pods, in order, pods added later included; "" or a pod past the list
	// is unlabelled. The caller serves every address as it likes: a
	// Cluster runs no sidecar in front of a decode pod.
	Roles []string
}

// Cluster is the part of a Stack below the picker: a real API server, an
// InferencePool and its Ready pods, each pod's IP served by a listener of
// the caller's. It starts no picker and no gateway, so that a tool can run
// any picker (Tally's or the upstream one) against the same pool. Create it
// with StartCluster and always Stop it.
type Cluster struct {
	opts ClusterOptions
	apiServer

	mu      sync.Mutex
	addrs   []netip.AddrPort
	servers []*http.Server
	// listeners are the servers', closed by Stop itself: srv.Close closes
	// only those its Serve has taken in (see Pod.stopSimulator).
	listeners []net.Listener
	nextIP    netip.Addr
	peers     *peerSet // PeerCommand's, made at its first call
}

// StartCluster starts the API server, creates the namespace, the pool and
// opts.Pods Ready pods, and serves each pod's address. On error it stops
// what it started.
func StartCluster(ctx context.Context, opts ClusterOptions) (_ *Cluster, err error) {
	if opts.Namespace == "" {
		opts.Namespace = DefaultNamespace
	}
	if opts.PoolName == "" {
		opts.PoolName = DefaultPoolName
	}
	if opts.Pods < 0 {
		return nil, fmt.Errorf("cluster options: Pods: %d is invalid: must be 0 or more", opts.Pods)
	}
	for i, r := range opts.Roles {
		if err := checkRole(r); err != nil {
			return nil, fmt.Errorf("cluster options: Roles[%d]: %w", i, err)
		}
	}
	if !opts.FirstPodIP.IsValid() {
		opts.FirstPodIP = DefaultFirstPodIP
	}
	if !opts.FirstPodIP.IsLoopback() {
		return nil, fmt.Errorf("cluster options: FirstPodIP: %s is invalid: must be a loopback address", opts.FirstPodIP)
	}
	if opts.TargetPort == 0 {
		opts.TargetPort = DefaultTargetPort
	}
	c := &Cluster{opts: opts, nextIP: opts.FirstPodIP}
	defer func() {
		if err != nil {
			err = errors.Join(err, c.Stop())
		}
	}()
	// Creating many pods is many calls: no client-side rate limit.
	if err := c.apiServer.start("tally-cluster", func(cfg *rest.Config) { cfg.QPS, cfg.Burst = 1000, 2000 }); err != nil {
		return nil, err
	}
	if err := createPool(ctx, c.kube, opts.Namespace, opts.PoolName, opts.TargetPort, infv1.EndpointPickerFailClose); err != nil {
		return nil, err
	}
	if err := c.AddPods(ctx, opts.Pods); err != nil {
		return nil, err
	}
	return c, nil
}

// AddPods serves n more pod addresses (IPs counting up from the last) and
// creates their pods, Ready.
func (c *Cluster) AddPods(ctx context.Context, n int) error {
	c.mu.Lock()
	first := len(c.addrs)
	var added []netip.AddrPort
	for range n {
		ip := c.nextIP
		if !ip.IsLoopback() {
			c.mu.Unlock()
			return fmt.Errorf("pod %d: IP %s is past the loopback range", first+len(added), ip)
		}
		c.nextIP = ip.Next()
		added = append(added, netip.AddrPortFrom(ip, uint16(c.opts.TargetPort)))
	}
	c.mu.Unlock()
	for _, addr := range added {
		if err := c.serve(addr); err != nil {
			return err
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(podCreateWorkers)
	for i, addr := range added {
		role := ""
		if first+i < len(c.opts.Roles) {
			role = c.opts.Roles[first+i]
		}
		g.Go(func() error {
			_, err := createPod(gctx, c.kube, c.opts.Namespace, fmt.Sprintf("pod-%d", first+i), addr.Addr(), c.opts.TargetPort, true, role)
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	c.mu.Lock()
	c.addrs = append(c.addrs, added...)
	c.mu.Unlock()
	return nil
}

func (c *Cluster) serve(addr netip.AddrPort) error {
	lis, err := net.Listen("tcp", addr.String())
	if err != nil {
		return fmt.Errorf("listening on pod address %s: %w", addr, err)
	}
	var h http.Handler = http.NotFoundHandler()
	if c.opts.Handler != nil {
		h = c.opts.Handler(addr)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	c.mu.Lock()
	c.servers = append(c.servers, srv)
	c.listeners = append(c.listeners, lis)
	c.mu.Unlock()
	go srv.Serve(lis)
	return nil
}

// Endpoints are the pods' addresses (IP and target port), in creation order.
func (c *Cluster) Endpoints() []netip.AddrPort {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.addrs)
}

// Kubeconfig is the path of an administrator's kubeconfig for the API server.
func (c *Cluster) Kubeconfig() string { return c.kubeconfig }

// Namespace and PoolName name the pool.
func (c *Cluster) Namespace() string { return c.opts.Namespace }

// PoolName is the InferencePool's name.
func (c *Cluster) PoolName() string { return c.opts.PoolName }

// Client is an administrator's client of the API server.
func (c *Cluster) Client() client.Client { return c.kube }

// Stop closes the pods' listeners, stops the API server and removes the
// temporary files. It is safe to call more than once.
func (c *Cluster) Stop() error {
	var errs []error
	c.mu.Lock()
	servers, listeners := c.servers, c.listeners
	c.servers, c.listeners = nil, nil
	c.mu.Unlock()
	for _, srv := range servers {
		srv.Close()
	}
	for _, lis := range listeners {
		lis.Close() // already closed when Serve had taken it in
	}
	errs = append(errs, c.apiServer.stop())
	return errors.Join(errs...)
}
