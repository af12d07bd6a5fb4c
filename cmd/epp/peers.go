package main

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tallyepp/tally/picker/replica"
)

// peerListInterval is how often the picker's own pods are listed (from the
// controllers' cache) for its peers.
const peerListInterval = time.Second

// followPeers keeps the replica's peers equal to the running pods of
// --peer-selector in --pool-namespace, each at its pod IP and --peer-port,
// until ctx ends.
func followPeers(ctx context.Context, c client.Reader, opts options, set func([]replica.Peer), log logr.Logger) {
	sel, _ := labels.Parse(opts.peerSelector) // validated with the flags
	t := time.NewTicker(peerListInterval)
	defer t.Stop()
	var last []replica.Peer
	var self selfCheck
	for {
		var pods corev1.PodList
		err := c.List(ctx, &pods, client.InNamespace(opts.poolNamespace), client.MatchingLabelsSelector{Selector: sel})
		if err == nil {
			peers := peersOf(pods.Items, uint16(opts.peerPort))
			if !slices.Equal(peers, last) {
				log.Info("peers", "peers", names(peers))
				set(peers)
				last = peers
			}
			if self.missing(pods.Items, opts.podName) {
				log.Error(nil, "flag --peer-selector does not select this pod: no peer finds this replica, and it places alone until it leads; the selector must match the picker pods' own labels, in --pool-namespace",
					"selector", opts.peerSelector, "namespace", opts.poolNamespace, "pod", opts.podName, "selected", len(pods.Items))
			}
		} else {
			log.V(1).Info("listing the picker's pods for its peers", "err", err)
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// selfCheck notices a peer selector that does not select this pod.
type selfCheck struct {
	absent int  // lists in a row without this pod
	said   bool // since it went missing
}

// selfMissingLists is how many lists in a row must lack this pod before
// it is said (the cache may not hold a new pod at once).
const selfMissingLists = 5

// missing reports, once each time it happens, that this pod (name) has
// been absent from selfMissingLists lists of the selected pods in a row.
func (s *selfCheck) missing(pods []corev1.Pod, name string) bool {
	if slices.ContainsFunc(pods, func(p corev1.Pod) bool { return p.Name == name }) {
		*s = selfCheck{}
		return false
	}
	s.absent++
	if s.absent < selfMissingLists || s.said {
		return false
	}
	s.said = true
	return true
}

// peersOf are the pods that can be peers: not finished, not being deleted,
// with an IP; sorted by name.
func peersOf(pods []corev1.Pod, port uint16) []replica.Peer {
	var peers []replica.Peer
	for _, p := range pods {
		if p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		ip, err := netip.ParseAddr(p.Status.PodIP)
		if err != nil {
			continue
		}
		peers = append(peers, replica.Peer{Name: p.Name, Addr: netip.AddrPortFrom(ip, port)})
	}
	slices.SortFunc(peers, func(a, b replica.Peer) int { return strings.Compare(a.Name, b.Name) })
	return peers
}

func names(peers []replica.Peer) []string {
	out := make([]string, len(peers))
	for i, p := range peers {
		out[i] = p.Name
	}
	return out
}
