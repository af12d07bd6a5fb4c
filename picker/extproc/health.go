package extproc

import (
	"sync"

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
	// UpstreamChartService is what the upstream inferencepool chart's
	// probes ask for with one replica, as liveness and readiness both. It
	// answers as readiness: the kubelet stops liveness probes once a pod is
	// deleted, so a drain that turns it NOT_SERVING does not restart the pod.
	UpstreamChartService = "inference-extension"
)

// readinessServices are SERVING exactly when the picker can route: the empty
// name means readiness, and gateways probe the ext_proc service by its name.
var readinessServices = []string{ReadinessService, "", extprocv3.ExternalProcessor_ServiceDesc.ServiceName, UpstreamChartService}

// Health is the gRPC health service, served on its own port: liveness is
// always SERVING; readiness only once SetReady(true) (the endpoint set is
// synced and, with leader election, this replica leads), until Drain.
type Health struct {
	server *health.Server

	mu       sync.Mutex
	draining bool
}

// NewHealth returns a Health that is live and not ready.
func NewHealth() *Health {
	h := &Health{server: health.NewServer()}
	h.server.SetServingStatus(LivenessService, healthpb.HealthCheckResponse_SERVING)
	h.SetReady(false)
	return h
}

// SetReady sets every readiness service SERVING or NOT_SERVING. After Drain
// it changes nothing.
func (h *Health) SetReady(ready bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.draining {
		return
	}
	h.setReadiness(ready)
}

// Drain sets every readiness service NOT_SERVING for good, so that gateways
// and the kubelet stop sending while open streams finish; liveness stays
// SERVING.
func (h *Health) Drain() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.draining = true
	h.setReadiness(false)
}

func (h *Health) setReadiness(ready bool) {
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
