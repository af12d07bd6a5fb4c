package main

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/controllers"
)

// poolPollInterval is how often the API server is asked for the pool and its
// pods. A dev gateway polls rather than watches: two small requests per
// interval, and no cache to keep.
const poolPollInterval = 500 * time.Millisecond

// poolOverrides are the static values given by flags; a nil field means "from
// the pool".
type poolOverrides struct {
	failureMode *infv1.EndpointPickerFailureMode
	endpoints   []string // nil: from the pool; set by --endpoints
}

func (o poolOverrides) apply(v PoolView) PoolView {
	if o.failureMode != nil {
		v.FailureMode = *o.failureMode
	}
	if o.endpoints != nil {
		v.Endpoints = slices.Clone(o.endpoints)
	}
	return v
}

// poolState holds the latest PoolView; requests read it without locking.
type poolState struct {
	view atomic.Pointer[PoolView]
}

func newPoolState(v PoolView) *poolState {
	s := &poolState{}
	s.view.Store(&v)
	return s
}

// View returns the current view. Callers must not modify its Endpoints.
func (s *poolState) View() PoolView { return *s.view.Load() }

func (s *poolState) set(v PoolView) { s.view.Store(&v) }

// fetchPool reads the pool and its pods and returns the failure mode and the
// endpoints the picker would see (controllers.EndpointsFor: Ready pods, one
// endpoint per target port).
func fetchPool(ctx context.Context, c client.Reader, name types.NamespacedName) (PoolView, error) {
	var pool infv1.InferencePool
	if err := c.Get(ctx, name, &pool); err != nil {
		return PoolView{}, fmt.Errorf("reading InferencePool %s: %w", name, err)
	}
	labels := make(client.MatchingLabels, len(pool.Spec.Selector.MatchLabels))
	for k, v := range pool.Spec.Selector.MatchLabels {
		labels[string(k)] = string(v)
	}
	var pods corev1.PodList
	if err := c.List(ctx, &pods, client.InNamespace(name.Namespace), labels); err != nil {
		return PoolView{}, fmt.Errorf("listing the pods of InferencePool %s: %w", name, err)
	}
	v := PoolView{FailureMode: infv1.EndpointPickerFailClose}
	if ref := pool.Spec.EndpointPickerRef; ref != nil && ref.FailureMode != "" {
		v.FailureMode = ref.FailureMode
	}
	for _, ep := range controllers.EndpointsFor(&pool, pods.Items) {
		v.Endpoints = append(v.Endpoints, ep.Address.String())
	}
	return v, nil
}

// poolPoller refreshes a poolState from the API server.
type poolPoller struct {
	reader    client.Reader
	pool      types.NamespacedName
	overrides poolOverrides
	state     *poolState
	log       *slog.Logger

	lastErr string // logged once per distinct error, not every interval
}

// poll refreshes the state once. On error the previous view is kept: a
// gateway that loses the API server keeps routing as it last knew.
func (p *poolPoller) poll(ctx context.Context) {
	v, err := fetchPool(ctx, p.reader, p.pool)
	if err != nil {
		if msg := err.Error(); msg != p.lastErr {
			p.log.Warn("polling the pool failed; keeping the last view", "err", err)
			p.lastErr = msg
		}
		return
	}
	p.lastErr = ""
	v = p.overrides.apply(v)
	if old := p.state.View(); old.FailureMode != v.FailureMode || !slices.Equal(old.Endpoints, v.Endpoints) {
		p.log.Info("pool changed", "pool", p.pool.String(), "failure_mode", v.FailureMode, "endpoints", v.Endpoints)
	}
	p.state.set(v)
}

// run polls every interval until ctx ends.
func (p *poolPoller) run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			p.poll(ctx)
		}
	}
}
