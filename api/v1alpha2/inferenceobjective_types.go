package v1alpha2

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The types below match gateway-api-inference-extension v1.5.0
// apix/v1alpha2 (inferenceobjective_types.go and shared_types.go): the same
// names, fields and json tags, and doc text taken from there.
//
// Copyright 2025 The Kubernetes Authors. Licensed under the Apache License,
// Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0).
//
// The kubebuilder validation markers are left out: the CRD is upstream's,
// copied, not generated from these types.

// InferenceObjective is the Schema for the InferenceObjectives API.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
type InferenceObjective struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   InferenceObjectiveSpec   `json:"spec,omitempty"`
	Status InferenceObjectiveStatus `json:"status,omitempty"`
}

// InferenceObjectiveList contains a list of InferenceObjective.
//
// +kubebuilder:object:root=true
type InferenceObjectiveList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []InferenceObjective `json:"items"`
}

// InferenceObjectiveSpec represents the desired state of a specific model
// use case. This resource is managed by the "Inference Workload Owner"
// persona.
type InferenceObjectiveSpec struct {
	// Priority defines how important it is to serve the request compared to
	// other requests in the same pool. The higher the value, the more
	// critical the request is; negative values are allowed. No default value
	// is set for this field; implementations that consume it (such as the
	// Endpoint Picker) treat an unset value as 0. Priority is used in flow
	// control: requests of higher priority are always served first, and
	// fairness is only enforced between requests of the same priority.
	// +optional
	Priority *int `json:"priority,omitempty"`

	// PoolRef is a reference to the inference pool, the pool must exist in
	// the same namespace.
	PoolRef PoolObjectReference `json:"poolRef"`
}

// InferenceObjectiveStatus defines the observed state of InferenceObjective.
type InferenceObjectiveStatus struct {
	// Conditions track the state of the InferenceObjective.
	//
	// Known condition types are:
	//
	// * "Accepted"
	//
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// InferenceObjectiveConditionType is a type of condition for the
// InferenceObjective.
type InferenceObjectiveConditionType string

// InferenceObjectiveConditionReason is the reason for a given
// InferenceObjectiveConditionType.
type InferenceObjectiveConditionReason string

const (
	// ObjectiveConditionAccepted indicates if the objective config is
	// accepted, and if not, why. Tally's picker, like upstream's, never sets
	// it.
	ObjectiveConditionAccepted InferenceObjectiveConditionType = "Accepted"

	// ObjectiveReasonAccepted is the desired state. Model conforms to the
	// state of the pool.
	ObjectiveReasonAccepted InferenceObjectiveConditionReason = "Accepted"

	// ObjectiveReasonPending is the initial state, and indicates that the
	// controller has not yet reconciled the InferenceObjective.
	ObjectiveReasonPending InferenceObjectiveConditionReason = "Pending"
)

// Group refers to a Kubernetes Group. It must either be an empty string or
// a RFC 1123 subdomain.
type Group string

// Kind refers to a Kubernetes Kind.
type Kind string

// ObjectName refers to the name of a Kubernetes object.
type ObjectName string

// PoolObjectReference identifies an API object within the namespace of the
// referrer.
type PoolObjectReference struct {
	// Group is the group of the referent. The CRD defaults it to
	// "inference.networking.k8s.io".
	//
	// +optional
	Group Group `json:"group,omitempty"`

	// Kind is kind of the referent. For example "InferencePool". The CRD
	// defaults it to "InferencePool".
	//
	// +optional
	Kind Kind `json:"kind,omitempty"`

	// Name is the name of the referent.
	Name ObjectName `json:"name"`
}
