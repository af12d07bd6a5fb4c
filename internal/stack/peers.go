package stack

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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

// peerSetup makes the stack's peer credentials and chooses the peer port.
func (s *Stack) peerSetup() error {
	s.peerDir = filepath.Join(s.apiServer.dir, "peer-tls")
	if err := os.MkdirAll(s.peerDir, 0o700); err != nil {
		return err
	}
	if err := peercert.Write(s.peerDir, replica.ServerName, 24*time.Hour); err != nil {
		return fmt.Errorf("writing the peer credentials: %w", err)
	}
	port, err := FreePort()
	if err != nil {
		return err
	}
	s.peerPort = port
	return nil
}

// pickerCommand is the command of the picker process name with args; with
// peers, its pod object is created first (once: a restarted picker keeps
// its pod, as a container restart does) and the peer flags and environment
// are set.
func (s *Stack) pickerCommand(ctx context.Context, name string, args []string) (*exec.Cmd, error) {
	path := filepath.Join(s.opts.BinDir, "epp")
	if !s.opts.Peers {
		return exec.Command(path, args...), nil
	}
	ip, err := s.pickerPod(ctx, name)
	if err != nil {
		return nil, err
	}
	args = append([]string{
		"--ha-enable-leader-election",
		"--peer-selector=" + pickerSelector,
		"--peer-port=" + strconv.Itoa(s.peerPort),
		"--peer-cert-path=" + s.peerDir,
	}, args...)
	cmd := exec.Command(path, args...)
	cmd.Env = append(os.Environ(), "POD_NAME="+name, "POD_IP="+ip.String())
	return cmd, nil
}

// pickerPod creates the pod object of picker process name, if it has none
// yet, and returns its IP.
func (s *Stack) pickerPod(ctx context.Context, name string) (netip.Addr, error) {
	s.mu.Lock()
	ip, ok := s.pickerIPs[name]
	if !ok {
		ip = firstPickerIP
		for range len(s.pickerIPs) {
			ip = ip.Next()
		}
		s.pickerIPs[name] = ip
	}
	s.mu.Unlock()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.opts.Namespace, Name: name, Labels: pickerPodLabel},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "epp", Image: "tally.invalid/epp"}}},
	}
	switch err := s.kube.Create(ctx, pod); {
	case apierrors.IsAlreadyExists(err):
		return ip, nil
	case err != nil:
		return ip, fmt.Errorf("creating the picker's pod %s: %w", name, err)
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip.String(), PodIPs: []corev1.PodIP{{IP: ip.String()}}}
	if err := s.kube.Status().Update(ctx, pod); err != nil {
		return ip, fmt.Errorf("setting the status of the picker's pod %s: %w", name, err)
	}
	return ip, nil
}

// PeerAddr is the peer address (pod IP and --peer-port) of the picker
// process name ("epp", or a replica's Name), with Options.Peers.
func (s *Stack) PeerAddr(name string) (netip.AddrPort, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ip, ok := s.pickerIPs[name]
	return netip.AddrPortFrom(ip, uint16(s.peerPort)), ok
}

// PeerCredentials is the directory of the stack's peer credentials.
func (s *Stack) PeerCredentials() string { return s.peerDir }
