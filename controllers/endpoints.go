package controllers

import (
	"cmp"
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sync"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/picker"
)

// EndpointsFor returns the endpoints of pool: one podIP:port for each target
// port of each pod that the pool selects and that can take traffic now. The
// result is sorted by address, so equal inputs give equal outputs whatever the
// order of pods.
//
// A pod counts when it is in the pool's namespace, carries every label of
// spec.selector.matchLabels, has a parsable pod IP, is not being deleted, and
// has condition Ready=True.
func EndpointsFor(pool *infv1.InferencePool, pods []corev1.Pod) []picker.Endpoint {
	// The API server rejects a pool without matchLabels; should one reach us
	// anyway, selecting nothing is safer than selecting every pod in the
	// namespace, which is what an empty label selector means.
	if pool == nil || len(pool.Spec.Selector.MatchLabels) == 0 {
		return nil
	}
	var eps []picker.Endpoint
	for i := range pods {
		pod := &pods[i]
		if !inPool(pool, pod) || !servesTraffic(pod) {
			continue
		}
		ip, err := netip.ParseAddr(pod.Status.PodIP)
		if err != nil {
			continue
		}
		for _, port := range pool.Spec.TargetPorts {
			if port.Number < 1 || port.Number > 65535 {
				continue
			}
			eps = append(eps, picker.Endpoint{
				Pod:     pod.Name,
				UID:     string(pod.UID),
				Engine:  engineType(pod),
				Address: netip.AddrPortFrom(ip, uint16(port.Number)),
			})
		}
	}
	slices.SortFunc(eps, func(a, b picker.Endpoint) int {
		return cmp.Or(a.Address.Compare(b.Address), cmp.Compare(a.Pod, b.Pod))
	})
	// The picker keys its ledger by address. Two pods can only report the
	// same IP through hostNetwork, and only one of them can hold the port;
	// keep one entry (the first pod name) rather than count it twice.
	return slices.CompactFunc(eps, func(a, b picker.Endpoint) bool {
		return a.Address == b.Address
	})
}

// EngineTypeLabel names a pod's model-server type, by the upstream
// convention; its metric names depend on it.
const EngineTypeLabel = "inference.networking.k8s.io/engine-type"

// engineType is the pod's engine type label, "vllm" when absent.
func engineType(pod *corev1.Pod) string {
	if t := pod.Labels[EngineTypeLabel]; t != "" {
		return t
	}
	return "vllm"
}

func inPool(pool *infv1.InferencePool, pod *corev1.Pod) bool {
	if pod.Namespace != pool.Namespace {
		return false
	}
	for k, v := range pool.Spec.Selector.MatchLabels {
		got, ok := pod.Labels[string(k)]
		if !ok || got != string(v) {
			return false
		}
	}
	return true
}

// servesTraffic reports whether the pod is Ready and not on its way out: a pod
// with a deletionTimestamp may still report Ready while it drains, and new
// requests must not be placed on it.
func servesTraffic(pod *corev1.Pod) bool {
	if pod.DeletionTimestamp != nil {
		return false
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// EndpointSync recomputes the pool's endpoint set and hands it to the picker.
// Both reconcilers share one EndpointSync, so their recomputations never
// interleave: each one reads the cache and calls Replace under the same lock,
// and since the cache only moves forward, the last Replace always carries the
// newest view. (Without the lock, a reconciler that read the cache first could
// call Replace last and undo a newer set.)
type EndpointSync struct {
	set picker.EndpointSet

	mu sync.Mutex // held from the first cache read until Replace returns
}

// NewEndpointSync returns an EndpointSync that feeds set.
func NewEndpointSync(set picker.EndpointSet) *EndpointSync {
	return &EndpointSync{set: set}
}

// Sync reads the pool named by pool and the pods it selects through c and
// replaces the whole endpoint set with them. A pool that does not exist gives
// an empty set, which still counts as synced: the picker then answers 503
// rather than waiting forever.
func (s *EndpointSync) Sync(ctx context.Context, c client.Reader, pool types.NamespacedName) error {
	s.mu.Lock()
	defer s.mu.Unlock()

	var p infv1.InferencePool
	if err := c.Get(ctx, pool, &p); err != nil {
		if apierrors.IsNotFound(err) {
			s.set.Replace(nil)
			return nil
		}
		return fmt.Errorf("reading InferencePool %s: %w", pool, err)
	}
	var pods corev1.PodList
	if err := c.List(ctx, &pods,
		client.InNamespace(p.Namespace),
		client.MatchingLabels(labelsOf(&p)),
	); err != nil {
		return fmt.Errorf("listing pods of InferencePool %s: %w", pool, err)
	}
	s.set.Replace(EndpointsFor(&p, pods.Items))
	return nil
}

func labelsOf(pool *infv1.InferencePool) map[string]string {
	m := make(map[string]string, len(pool.Spec.Selector.MatchLabels))
	for k, v := range pool.Spec.Selector.MatchLabels {
		m[string(k)] = string(v)
	}
	return m
}
