package main

import (
	"context"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// extProcService is the service a gateway's gRPC health check of the
// picker's ext_proc port names (the picker serves it with
// --health-checking).
const extProcService = "envoy.service.ext_proc.v3.ExternalProcessor"

// healthInterval is how often each picker's health is checked, and the
// bound of one check.
const healthInterval = 500 * time.Millisecond

// healthChecks checks the health of each picker connection every
// healthInterval, as Envoy's gRPC health checking of an ext_proc cluster
// does: a picker that is not SERVING (starting, draining, gone) gets no new
// stream while another is. A picker that does not serve health on its
// ext_proc port (Unimplemented) counts as healthy.
type healthChecks struct {
	healthy []atomic.Bool
}

func newHealthChecks(n int) *healthChecks {
	h := &healthChecks{healthy: make([]atomic.Bool, n)}
	for i := range h.healthy {
		h.healthy[i].Store(true) // until a check says otherwise
	}
	return h
}

// run checks conns until ctx ends.
func (h *healthChecks) run(ctx context.Context, conns []grpc.ClientConnInterface) {
	t := time.NewTicker(healthInterval)
	defer t.Stop()
	for {
		for i, conn := range conns {
			h.healthy[i].Store(check(ctx, conn))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func check(ctx context.Context, conn grpc.ClientConnInterface) bool {
	ctx, cancel := context.WithTimeout(ctx, healthInterval)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: extProcService})
	if status.Code(err) == codes.Unimplemented {
		return true
	}
	return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
}

// ok reports whether picker i passed its last check.
func (h *healthChecks) ok(i int) bool { return h.healthy[i].Load() }
