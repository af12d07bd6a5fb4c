package controllers

import (
	"cmp"
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/logging"
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
				Role:    role(pod),
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

// RoleLabel names a pod's part in prefill/decode disaggregation, by llm-d's
// convention: prefill, decode, prefill-decode (or its older spelling both).
const RoleLabel = "llm-d.ai/role"

// role is the pod's role label, with llm-d's deprecated "both" read as
// prefill-decode; "" when unlabelled. Other values (llm-d's encode roles)
// pass through: the picker treats them as neither prefill nor decode.
func role(pod *corev1.Pod) string {
	if r := pod.Labels[RoleLabel]; r != "both" {
		return r
	}
	return picker.RolePrefillDecode
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
//
// It also says what stops the pool from offering endpoints: the pool does
// not exist, or its selector matches no pod, or no Ready pod. Each such
// problem is logged as a warning at the default verbosity, and (for a pool
// that exists) recorded as an Event on the pool, when it starts and again
// every reportInterval while it lasts, whatever the number of events that
// wake the reconcilers; its end is logged once.
type EndpointSync struct {
	set            picker.EndpointSet
	status         *PoolStatus
	events         EventRecorder
	reportInterval time.Duration
	now            func() time.Time

	mu sync.Mutex // held from the first cache read until Replace returns
	// The problem last reported ("" for none) and when.
	reported   string
	reportedAt time.Time
}

// EventRecorder records an Event on an object; controller-runtime's
// events/v1 recorder (mgr.GetEventRecorder) implements it.
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...any)
}

// DefaultReportInterval is how often a lasting problem with the pool is
// reported again.
const DefaultReportInterval = time.Minute

// NewEndpointSync returns an EndpointSync that feeds set and reports
// problems through the reconcile's logger only.
func NewEndpointSync(set picker.EndpointSet) *EndpointSync {
	return newEndpointSync(set, Options{})
}

func newEndpointSync(set picker.EndpointSet, o Options) *EndpointSync {
	if o.Status == nil {
		o.Status = &PoolStatus{}
	}
	if o.ReportInterval <= 0 {
		o.ReportInterval = DefaultReportInterval
	}
	return &EndpointSync{set: set, status: o.Status, events: o.Events, reportInterval: o.ReportInterval, now: time.Now}
}

// Sync reads the pool named by pool and the pods it selects through c and
// replaces the whole endpoint set with them. A pool that does not exist gives
// an empty set; the PoolStatus says it is not found (the picker is not
// ready until it is). It reports whether the pool has a problem that lasts
// (see EndpointSync), for the caller to look again after ReportInterval.
func (s *EndpointSync) Sync(ctx context.Context, c client.Reader, pool types.NamespacedName) (problem bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()

	state := PoolState{Pool: pool, Seen: true}
	var p infv1.InferencePool
	if err := c.Get(ctx, pool, &p); err != nil {
		if !apierrors.IsNotFound(err) {
			return false, fmt.Errorf("reading InferencePool %s: %w", pool, err)
		}
		s.set.Replace(nil)
		return s.publish(ctx, state, nil), nil
	}
	state.Found = true
	selector := labelsOf(&p)
	state.Selector = selectorString(selector)
	var pods corev1.PodList
	if err := c.List(ctx, &pods,
		client.InNamespace(p.Namespace),
		client.MatchingLabels(selector),
	); err != nil {
		return false, fmt.Errorf("listing pods of InferencePool %s: %w", pool, err)
	}
	eps := EndpointsFor(&p, pods.Items)
	s.set.Replace(eps)
	if len(selector) > 0 { // an empty selector selects nothing (EndpointsFor)
		state.Pods = len(pods.Items)
		for i := range pods.Items {
			if _, err := netip.ParseAddr(pods.Items[i].Status.PodIP); err == nil && servesTraffic(&pods.Items[i]) {
				state.ReadyPods++
			}
		}
	}
	state.Endpoints = len(eps)
	return s.publish(ctx, state, &p), nil
}

// publish stores state and reports its problem, if it has one, when it is
// new or was last reported reportInterval ago; pool is nil when it does not
// exist. Called with s.mu held.
func (s *EndpointSync) publish(ctx context.Context, state PoolState, pool *infv1.InferencePool) (problem bool) {
	s.status.store(state)
	log := logf.FromContext(ctx)
	reason, msg := state.Problem()
	now := s.now()
	switch {
	case reason == "" && s.reported != "":
		log.Info("InferencePool offers endpoints again", "pool", state.Pool.String(),
			"readyPods", state.ReadyPods, "endpoints", state.Endpoints, "was", s.reported)
		s.reported = ""
	case reason == "":
	case reason != s.reported || now.Sub(s.reportedAt) >= s.reportInterval:
		s.reported, s.reportedAt = reason, now
		logging.Warn(log, msg, "pool", state.Pool.String(), "reason", reason,
			"pods", state.Pods, "readyPods", state.ReadyPods, "repeatEvery", s.reportInterval)
		if s.events != nil && pool != nil {
			s.events.Eventf(pool, nil, corev1.EventTypeWarning, reason, "SelectEndpoints", "%s", msg)
		}
	}
	return reason != ""
}

func labelsOf(pool *infv1.InferencePool) map[string]string {
	m := make(map[string]string, len(pool.Spec.Selector.MatchLabels))
	for k, v := range pool.Spec.Selector.MatchLabels {
		m[string(k)] = string(v)
	}
	return m
}
