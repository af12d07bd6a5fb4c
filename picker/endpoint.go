package picker

import "net/netip"

// Endpoint is one address that serves the pool: a target port on a Ready pod.
type Endpoint struct {
	// Pod names the pod that serves this endpoint (its name in the pool's namespace).
	Pod string
	// UID is the pod's UID: what identifies the endpoint's ledger row and
	// prefix memory across readiness flaps. A pod that leaves the set and
	// comes back with the same UID gets its row back; another pod at the same
	// address (a new UID) starts from zero. Empty means "identify by Pod and
	// Address" (tests, callers without a UID).
	UID string
	// Engine is the model server's type, from the pod label
	// inference.networking.k8s.io/engine-type ("vllm" when absent): it says
	// which metric names its /metrics use.
	Engine string
	// Role is the pod's part in prefill/decode disaggregation, from the pod
	// label llm-d.ai/role: RolePrefill, RoleDecode, RolePrefillDecode, or ""
	// (unlabelled: it decodes, and prefills only its own requests). Only
	// decode-capable endpoints (decode, prefill-decode, unlabelled) take
	// client traffic; prefill-capable ones (prefill, prefill-decode) may
	// prefill for others. Any other value (llm-d's encode roles) does
	// neither, as llm-d's role filters treat it.
	Role string
	// Address is the pod IP and target port. Its String form is the value the
	// picker writes into the destination header ("ip:port", "[v6]:port").
	Address netip.AddrPort
}

// The roles of Endpoint.Role, as llm-d labels its pods.
const (
	RolePrefill       = "prefill"
	RoleDecode        = "decode"
	RolePrefillDecode = "prefill-decode"
)

// decodes reports whether the endpoint may be a request's destination.
func (ep Endpoint) decodes() bool {
	return ep.Role == "" || ep.Role == RoleDecode || ep.Role == RolePrefillDecode
}

// prefills reports whether the endpoint may prefill a request another
// endpoint decodes.
func (ep Endpoint) prefills() bool {
	return ep.Role == RolePrefill || ep.Role == RolePrefillDecode
}

// EndpointSet is how the picker learns the pool's endpoints. Whoever watches
// the cluster calls it; the picker implements it.
type EndpointSet interface {
	// Replace makes eps the whole endpoint set: endpoints that are not in eps
	// are removed (their in-flight requests keep running and are released as
	// usual). The first call marks the set as synced.
	Replace(eps []Endpoint)
}
