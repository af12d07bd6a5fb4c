package v1alpha2

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The types below match gateway-api-inference-extension v1.5.0
// apix/v1alpha2/inferencemodelrewrite_types.go: the same names and fields,
// and doc text taken from there. Two json tags differ, so that the tags say
// what the CRD says (crd_test.go checks that a field is required exactly
// when it has no omitempty):
//   - TargetModel.Weight has omitempty: the CRD does not require it, and
//     without omitempty an unset weight is sent as 0, which the CRD's
//     minimum of 1 rejects, so a Go client could not leave weights out.
//   - Match.Model has no omitempty: the CRD requires it. Leaving it nil is
//     rejected either way.
//
// Copyright 2025 The Kubernetes Authors. Licensed under the Apache License,
// Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0).
//
// The kubebuilder validation markers are left out: the CRD is upstream's,
// copied, not generated from these types.

// InferenceModelRewrite is the Schema for the InferenceModelRewrite API.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
type InferenceModelRewrite struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   InferenceModelRewriteSpec   `json:"spec,omitempty"`
	Status InferenceModelRewriteStatus `json:"status,omitempty"`
}

// InferenceModelRewriteList contains a list of InferenceModelRewrite.
//
// +kubebuilder:object:root=true
type InferenceModelRewriteList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []InferenceModelRewrite `json:"items"`
}

// InferenceModelRewriteSpec defines the desired state of
// InferenceModelRewrite.
type InferenceModelRewriteSpec struct {
	// PoolRef is a reference to the inference pool.
	PoolRef *PoolObjectReference `json:"poolRef"`

	// Rules are the ordered set of rules for rewriting inference requests.
	// The first rule to match a request will be used.
	//
	// --- Precedence and Conflict Resolution ---
	// If multiple InferenceModelRewrite resources target the same
	// InferencePool, the controller will merge them based on precedence.
	//
	// Across all rules specified on applicable rewrites, precedence MUST be
	// given to the match having an "Exact" model match over a generic match
	// (a rule with an empty `matches` array).
	//
	// If ties still exist across multiple InferenceModelRewrite resources
	// (e.g. two rewrites both have an exact match for the same model),
	// matching precedence MUST be determined by the oldest resource based on
	// creation timestamp.
	//
	// If ties still exist within a single InferenceModelRewrite resource,
	// the FIRST matching rule (in list order) is used.
	Rules []InferenceModelRewriteRule `json:"rules"`
}

// InferenceModelRewriteRule defines the match criteria and corresponding
// action. For details on how precedence is determined across multiple rules
// and InferenceModelRewrite resources, see the "Precedence and Conflict
// Resolution" section in InferenceModelRewriteSpec.
type InferenceModelRewriteRule struct {
	// Matches defines the criteria for matching a request. If multiple match
	// criteria are specified, a request matches if ANY of the criteria are
	// satisfied (logical OR). If empty, the rule matches all requests.
	//
	// +optional
	Matches []Match `json:"matches,omitempty"`

	// Targets defines how to distribute traffic across a set of weighted
	// model targets. This is used for traffic splitting, A/B tests, or
	// canary rollouts. The CRD requires at least one when it is given.
	//
	// +optional
	Targets []TargetModel `json:"targets,omitempty"`
}

// TargetModel defines a weighted model destination for traffic
// distribution.
type TargetModel struct {
	// Weight defines the proportion of requests forwarded to the specified
	// model. This is computed as weight/(sum of all weights in this
	// TargetModels list). Weight is not a percentage and the sum of weights
	// does not need to equal 100. The CRD accepts 1 to 1000000.
	//
	// If a weight is set for any targetModel, it must be set for all
	// targetModels. Conversely weights are optional, so long as ALL
	// targetModels do not specify a weight.
	//
	// +optional
	Weight int32 `json:"weight,omitempty"`

	// ModelRewrite specifies a static model name destination.
	ModelRewrite string `json:"modelRewrite"`
}

// Match defines the criteria for matching the LLM requests.
type Match struct {
	// Model specifies the criteria for matching the 'model' field within
	// the JSON request body.
	Model *ModelMatch `json:"model"`
}

// ModelMatch defines how to match against the model name in the request
// body.
type ModelMatch struct {
	// Type specifies the kind of string matching to use. Supported value is
	// "Exact". The CRD defaults it to "Exact".
	//
	// +optional
	Type *MatchValidationType `json:"type,omitempty"`

	// Value is the model name string to match against.
	Value string `json:"value"`
}

// MatchValidationType specifies the type of string matching to use.
type MatchValidationType string

const (
	// MatchExact indicates that the model name must match exactly.
	MatchExact MatchValidationType = "Exact"
)

// InferenceModelRewriteStatus defines the observed state of
// InferenceModelRewrite.
type InferenceModelRewriteStatus struct {
	// Conditions track the state of the InferenceModelRewrite.
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

// InferenceModelRewriteConditionType is a type of condition for the
// InferenceModelRewrite.
type InferenceModelRewriteConditionType string

// InferenceModelRewriteConditionReason is the reason for a given
// InferenceModelRewriteConditionType.
type InferenceModelRewriteConditionReason string

const (
	// RewriteConditionAccepted indicates if the rewrite is accepted, and if
	// not, why. This is the primary condition for this resource. Tally's
	// picker, like upstream's, never sets it.
	//
	// Possible reasons for this condition to be True are:
	//
	// * "Accepted"
	//
	// Possible reasons for this condition to be Unknown are:
	//
	// * "Pending"
	RewriteConditionAccepted InferenceModelRewriteConditionType = "Accepted"

	// RewriteReasonAccepted indicates the rewrite is valid, non-conflicting,
	// and has been successfully applied to the inference pool.
	RewriteReasonAccepted InferenceModelRewriteConditionReason = "Accepted"

	// RewriteReasonPending is the initial state, and indicates that the
	// controller has not yet reconciled the InferenceModelRewrite.
	RewriteReasonPending InferenceModelRewriteConditionReason = "Pending"
)
