package v1alpha2

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupName is the API group of InferenceObjective and InferenceModelRewrite.
const GroupName = "inference.networking.x-k8s.io"

// SchemeGroupVersion is the group and version these types are served as.
var SchemeGroupVersion = schema.GroupVersion{Group: GroupName, Version: "v1alpha2"}

// KindInferenceObjective is the kind of InferenceObjective.
const KindInferenceObjective = "InferenceObjective"

// KindInferenceModelRewrite is the kind of InferenceModelRewrite.
const KindInferenceModelRewrite = "InferenceModelRewrite"

var schemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)

// AddToScheme registers InferenceObjective, InferenceModelRewrite and their
// lists.
var AddToScheme = schemeBuilder.AddToScheme

// Install is AddToScheme, under the name the upstream API packages use.
var Install = schemeBuilder.AddToScheme

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(SchemeGroupVersion,
		&InferenceObjective{}, &InferenceObjectiveList{},
		&InferenceModelRewrite{}, &InferenceModelRewriteList{})
	metav1.AddToGroupVersion(s, SchemeGroupVersion)
	return nil
}
