package stack

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tallyepp/tally/internal/peercert"
	"github.com/tallyepp/tally/picker/replica"
)

// Peers (Options.Peers): every picker process of the stack is a replica of
// one ledger, as in a Deployment: each has a pod object of its own
// (labelled pickerPodLabel, at its own loopback IP, from firstPickerIP)
// found through --peer-selector, its POD_NAME and POD_IP, the peer
// credentials of the stack, and leader election.

var (
	pickerPodLabel = map[string]string{"app": "tally-epp"}
	// firstPickerIP is the first picker pod's IP: the model server pods
	// count up from 127.0.0.2, the pickers from here.
	firstPickerIP = netip.MustParseAddr("127.0.1.1")
)

const pickerSelector = "app=tally-epp"

// peerSet is what the picker processes of one pool share as peers: the
// peer credentials, the peer port, and each process's pod IP. A Stack
// (Options.Peers) and a Cluster (PeerCommand) each have one.
type peerSet struct {
	kube      client.Client
	namespace string
	dir       string
	port      int

	mu  sync.Mutex
	ips map[string]netip.Addr
}

// newPeerSet makes the peer credentials under dir and chooses the peer port.
func newPeerSet(kube client.Client, namespace, dir string) (*peerSet, error) {
	dir = filepath.Join(dir, "peer-tls")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	if err := peercert.Write(dir, replica.ServerName, 24*time.Hour); err != nil {
		return nil, fmt.Errorf("writing the peer credentials: %w", err)
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	return &peerSet{kube: kube, namespace: namespace, dir: dir, port: port, ips: map[string]netip.Addr{}}, nil
}

// peerSetup makes the stack's peer set.
func (s *Stack) peerSetup() error {
	var err error
	s.peers, err = newPeerSet(s.kube, s.opts.Namespace, s.apiServer.dir)
	return err
}

// pickerCommand is the command of the picker process name with args; with
// peers, see peerSet.command.
func (s *Stack) pickerCommand(ctx context.Context, name string, args []string) (*exec.Cmd, error) {
	path := filepath.Join(s.opts.BinDir, "epp")
	if !s.opts.Peers {
		return exec.Command(path, args...), nil
	}
	return s.peers.command(ctx, name, path, args)
}

// PeerCommand is the command of a picker process name (the binary at
// path, with args) that runs as a peer replica of the cluster's pool: its
// pod object is created first (once), and the peer flags (leader
// election, --peer-selector, --peer-port, --peer-cert-path) come before
// args, POD_NAME and POD_IP in its environment. Start several, each with
// ports of its own, for replicas of one ledger.
func (c *Cluster) PeerCommand(ctx context.Context, name, path string, args ...string) (*exec.Cmd, error) {
	c.mu.Lock()
	if c.peers == nil {
		p, err := newPeerSet(c.kube, c.opts.Namespace, c.apiServer.dir)
		if err != nil {
			c.mu.Unlock()
			return nil, err
		}
		c.peers = p
	}
	peers := c.peers
	c.mu.Unlock()
	return peers.command(ctx, name, path, args)
}

// command is the command of the picker process name: its pod object is
// created first (once: a restarted picker keeps its pod, as a container
// restart does) and the peer flags and environment are set.
func (p *peerSet) command(ctx context.Context, name, path string, args []string) (*exec.Cmd, error) {
	ip, err := p.pickerPod(ctx, name)
	if err != nil {
		return nil, err
	}
	args = append([]string{
		"--ha-enable-leader-election",
		"--peer-selector=" + pickerSelector,
		"--peer-port=" + strconv.Itoa(p.port),
		"--peer-cert-path=" + p.dir,
		// Health on the ext_proc port: a gateway in front of several
		// replicas sends streams only to the ready ones.
		"--health-checking",
	}, args...)
	cmd := exec.Command(path, args...)
	cmd.Env = append(os.Environ(), "POD_NAME="+name, "POD_IP="+ip.String())
	return cmd, nil
}

// pickerPod creates the pod object of picker process name, if it has none
// yet, and returns its IP.
func (p *peerSet) pickerPod(ctx context.Context, name string) (netip.Addr, error) {
	p.mu.Lock()
	ip, ok := p.ips[name]
	if !ok {
		ip = firstPickerIP
		for range len(p.ips) {
			ip = ip.Next()
		}
		p.ips[name] = ip
	}
	p.mu.Unlock()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: p.namespace, Name: name, Labels: pickerPodLabel},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "epp", Image: "tally.invalid/epp"}}},
	}
	switch err := p.kube.Create(ctx, pod); {
	case apierrors.IsAlreadyExists(err):
		return ip, nil
	case err != nil:
		return ip, fmt.Errorf("creating the picker's pod %s: %w", name, err)
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip.String(), PodIPs: []corev1.PodIP{{IP: ip.String()}}}
	if err := p.kube.Status().Update(ctx, pod); err != nil {
		return ip, fmt.Errorf("setting the status of the picker's pod %s: %w", name, err)
	}
	return ip, nil
}

// PeerAddr is the peer address (pod IP and --peer-port) of the picker
// process name ("epp", or a replica's Name), with Options.Peers.
func (s *Stack) PeerAddr(name string) (netip.AddrPort, bool) {
	if s.peers == nil {
		return netip.AddrPort{}, false
	}
	s.peers.mu.Lock()
	defer s.peers.mu.Unlock()
	ip, ok := s.peers.ips[name]
	return netip.AddrPortFrom(ip, uint16(s.peers.port)), ok
}

// PeerCredentials is the directory of the stack's peer credentials.
func (s *Stack) PeerCredentials() string { return s.peers.dir }
