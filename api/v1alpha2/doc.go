// Package v1alpha2 holds the InferenceObjective and InferenceModelRewrite
// APIs of the Gateway API Inference Extension (group
// inference.networking.x-k8s.io, version v1alpha2), as released in
// gateway-api-inference-extension v1.5.0. Tally pins v1.6.0 of that module
// for the InferencePool API, and v1.6.0 no longer carries these types, so
// they are declared here.
//
// Invariant: the Go types and their json tags match the CRDs in
// config/crd/bases/inference.networking.x-k8s.io_inferenceobjectives.yaml
// and inference.networking.x-k8s.io_inferencemodelrewrites.yaml, copied from
// v1.5.0; a field the CRD lacks would be pruned by the API server without an
// error. crd_test.go checks both directions.
// +kubebuilder:object:generate=true
// +groupName=inference.networking.x-k8s.io
package v1alpha2
