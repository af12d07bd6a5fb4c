// Package protocol names the headers and dynamic metadata through which the
// picker and the gateway route a request, as the Gateway API Inference
// Extension's endpoint picker protocol spells them (the upstream picker's
// pkg/epp/metadata, v1.5.0). Gateways that implement the Inference
// Extension, and their Helm charts, use exactly these.
//
// The invariant: this package imports nothing, so that the picker, the dev
// gateway and the test clients that play Envoy all take the names from one
// place without depending on one another.
package protocol

const (
	// DestinationHeader carries the endpoint the picker chose, then its
	// fallbacks: "ip:port[,ip:port...]". The gateway's original-destination
	// cluster routes on it.
	DestinationHeader = "x-gateway-destination-endpoint"
	// LBNamespace is the dynamic metadata namespace the gateway's load
	// balancer reads the destination from (under DestinationKey) and writes
	// the endpoint that served into (under ServedKey).
	LBNamespace = "envoy.lb"
	// DestinationKey is the destination's key under LBNamespace.
	DestinationKey = DestinationHeader
	// ServedKey, under LBNamespace in the response's metadata context,
	// names the endpoint that served the request (a fallback may have).
	ServedKey = "x-gateway-destination-endpoint-served"
	// SubsetNamespace and SubsetKey carry the gateway's subset hint in the
	// request's metadata context: the only endpoints the pick may come
	// from.
	SubsetNamespace = "envoy.lb.subset_hint"
	SubsetKey       = "x-gateway-destination-endpoint-subset"
	// PrefillerHeader names, on a request whose prefill runs on another
	// pod than its destination (llm-d's prefill/decode disaggregation),
	// the pod that prefills it: "ip:port". The destination's sidecar sends
	// it the prefill leg, then decodes with the KV cache it hands over.
	PrefillerHeader = "x-prefiller-host-port"
)
