package controllers_test

import (
	"context"
	"reflect"
	"time"

	"github.com/google/go-cmp/cmp"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tallyepp/tally/api/v1alpha2"
)

// api/v1alpha2's tests compare the types with the CRD file; these check what
// the API server does with the types: a field the schema lacks would be
// pruned without an error.
var _ = Describe("The InferenceObjective CRD, served by the API server", func() {
	var ns string
	BeforeEach(func() { ns = newNamespace() })
	ctx := context.Background()

	It("keeps every field of our types, spec and status", func() {
		want := v1alpha2.InferenceObjective{
			Spec: v1alpha2.InferenceObjectiveSpec{
				Priority: new(-3),
				PoolRef:  v1alpha2.PoolObjectReference{Group: "inference.networking.k8s.io", Kind: "InferencePool", Name: "llm"},
			},
			Status: v1alpha2.InferenceObjectiveStatus{Conditions: []metav1.Condition{{
				Type:               string(v1alpha2.ObjectiveConditionAccepted),
				Status:             metav1.ConditionTrue,
				ObservedGeneration: 1,
				// The API server keeps whole seconds.
				LastTransitionTime: metav1.NewTime(time.Now().Truncate(time.Second)),
				Reason:             string(v1alpha2.ObjectiveReasonAccepted),
				Message:            "set by the test",
			}}},
		}
		// A field added to the types but not set here would go unchecked.
		Expect(unsetFields("spec", reflect.ValueOf(want.Spec))).To(BeEmpty())
		Expect(unsetFields("status", reflect.ValueOf(want.Status))).To(BeEmpty())

		o := want.DeepCopy()
		o.Namespace, o.Name = ns, "chat"
		Expect(k8s.Create(ctx, o)).To(Succeed())
		// Status goes through its subresource; create ignores it.
		o.Status = *want.Status.DeepCopy()
		Expect(k8s.Status().Update(ctx, o)).To(Succeed())

		var got v1alpha2.InferenceObjective
		Expect(k8s.Get(ctx, types.NamespacedName{Namespace: ns, Name: "chat"}, &got)).To(Succeed())
		Expect(cmp.Diff(want.Spec, got.Spec)).To(BeEmpty(), "spec (-written +read)")
		Expect(cmp.Diff(want.Status, got.Status)).To(BeEmpty(), "status (-written +read)")
	})

	It("fills in poolRef's group and kind when they are left out", func() {
		createObjective(ns, "plain", "llm", nil)
		var got v1alpha2.InferenceObjective
		Expect(k8s.Get(ctx, types.NamespacedName{Namespace: ns, Name: "plain"}, &got)).To(Succeed())
		Expect(got.Spec.PoolRef).To(Equal(v1alpha2.PoolObjectReference{Group: "inference.networking.k8s.io", Kind: "InferencePool", Name: "llm"}))
		Expect(got.Spec.Priority).To(BeNil())
	})
})

// unsetFields lists the zero-valued fields under v (structs field by field,
// slices element by element), by json-ish path.
func unsetFields(path string, v reflect.Value) []string {
	if v.IsZero() {
		return []string{path}
	}
	switch v.Kind() {
	case reflect.Pointer:
		return unsetFields(path, v.Elem())
	case reflect.Struct:
		if _, ok := v.Interface().(metav1.Time); ok {
			return nil
		}
		var out []string
		for i := range v.NumField() {
			out = append(out, unsetFields(path+"."+v.Type().Field(i).Name, v.Field(i))...)
		}
		return out
	case reflect.Slice:
		var out []string
		for i := range v.Len() {
			out = append(out, unsetFields(path+"[]", v.Index(i))...)
		}
		return out
	}
	return nil
}
