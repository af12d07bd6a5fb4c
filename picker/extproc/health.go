package extproc

import (
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// Health services the gateway and the kubelet probe, by the upstream
// picker's convention.
const (
	LivenessService  = "liveness"
	ReadinessService = "readiness"
)

// readinessServices are SERVING exactly when the picker can route: the empty
// name means readiness, and gateways probe the ext_proc service by its name.
var readinessServices = []string{ReadinessService, "", extprocv3.ExternalProcessor_ServiceDesc.ServiceName}

// Health is the gRPC health service, served on its own port: liveness is
// always SERVING; readiness only once SetReady(true) (the endpoint set is
// synced and, with leader election, this replica leads).
type Health struct {
	server *health.Server
}

// NewHealth returns a Health that is live and not ready.
func NewHealth() *Health {
	h := &Health{server: health.NewServer()}
	h.server.SetServingStatus(LivenessService, healthpb.HealthCheckResponse_SERVING)
	h.SetReady(false)
	return h
}

// SetReady sets every readiness service SERVING or NOT_SERVING.
func (h *Health) SetReady(ready bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ready {
		st = healthpb.HealthCheckResponse_SERVING
	}
	for _, svc := range readinessServices {
		h.server.SetServingStatus(svc, st)
	}
}

// Register adds the health service to g.
func (h *Health) Register(g *grpc.Server) {
	healthpb.RegisterHealthServer(g, h.server)
}
