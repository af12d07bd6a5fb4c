package controllers

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/types"
)

// PoolState is what the controllers last saw of the pool, at their last
// recompute of the endpoint set.
type PoolState struct {
	// Pool names the pool.
	Pool types.NamespacedName
	// Seen: a recompute has run; until then nothing below is known.
	Seen bool
	// Found: the pool exists.
	Found bool
	// Selector is the pool's spec.selector.matchLabels, as k=v,... sorted.
	Selector string
	// Pods counts the pods its selector matches; ReadyPods those of them
	// that can take traffic (Ready, with a pod IP, not being deleted);
	// Endpoints is the endpoint set's size (ready pods times target ports).
	Pods, ReadyPods, Endpoints int
}

// Problem says, in words a user can act on, why the pool offers no
// endpoint, and a one-word reason for it (the reason of the Event recorded
// on the pool); both "" when it offers some.
func (s PoolState) Problem() (reason, message string) {
	switch {
	case !s.Seen:
		return "NotRead", fmt.Sprintf("the picker has not read InferencePool %s yet", s.Pool)
	case !s.Found:
		return "PoolNotFound", fmt.Sprintf("InferencePool %s does not exist: create it, or start the picker with the --pool-name and --pool-namespace of an existing pool", s.Pool)
	case s.Pods == 0:
		return "NoPods", fmt.Sprintf("InferencePool %s selects no pod: no pod in namespace %s carries the labels of its selector (%s)", s.Pool, s.Pool.Namespace, s.Selector)
	case s.ReadyPods == 0:
		return "NoReadyPods", fmt.Sprintf("InferencePool %s selects %d pod(s), none of them Ready: no endpoint in the pool yet", s.Pool, s.Pods)
	case s.Endpoints == 0:
		return "NoTargetPorts", fmt.Sprintf("InferencePool %s selects %d Ready pod(s) but has no valid target port", s.Pool, s.ReadyPods)
	}
	return "", ""
}

// PoolStatus holds the latest PoolState; the controllers store it, readers
// (readiness, the answers of refused requests) load it. Safe for concurrent
// use; the zero value has seen nothing.
type PoolStatus struct {
	v atomic.Pointer[PoolState]
}

// Load returns the latest state.
func (p *PoolStatus) Load() PoolState {
	if s := p.v.Load(); s != nil {
		return *s
	}
	return PoolState{}
}

func (p *PoolStatus) store(s PoolState) { p.v.Store(&s) }

// Ready reports whether the picker can serve the pool: it has been read
// and exists. A pool with no Ready pod is still ready to serve: its
// endpoints can come at any moment, and a picker that is not ready is
// taken out of the gateway's rotation, which cannot tell the user why.
func (p *PoolStatus) Ready() bool {
	s := p.Load()
	return s.Seen && s.Found
}

// NoEndpointReason is the latest state's Problem message: why the pool
// offers no endpoint, "" when it offers some.
func (p *PoolStatus) NoEndpointReason() string {
	_, msg := p.Load().Problem()
	return msg
}

// selectorString writes matchLabels as k=v,... in key order.
func selectorString(m map[string]string) string {
	var b strings.Builder
	for i, k := range slices.Sorted(maps.Keys(m)) {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(k + "=" + m[k])
	}
	return b.String()
}
