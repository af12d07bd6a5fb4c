package controllers_test

import (
	"context"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// These specs post raw objects, so that what reaches the API server is exactly
// the case named (the typed structs would omit empty fields).
var _ = Describe("The InferencePool CRD, served by the API server", func() {
	var ns string
	BeforeEach(func() { ns = newNamespace() })

	gvk := schema.GroupVersionKind{Group: "inference.networking.k8s.io", Version: "v1", Kind: "InferencePool"}
	pool := func(name string, spec map[string]any) *unstructured.Unstructured {
		u := &unstructured.Unstructured{Object: map[string]any{"spec": spec}}
		u.SetGroupVersionKind(gvk)
		u.SetNamespace(ns)
		u.SetName(name)
		return u
	}
	ports := func(numbers ...int64) []any {
		var out []any
		for _, n := range numbers {
			out = append(out, map[string]any{"number": n})
		}
		return out
	}
	selector := map[string]any{"matchLabels": map[string]any{"app": "llm"}}

	DescribeTable("rejects an invalid pool as Invalid, naming the field",
		func(spec map[string]any, field, message string) {
			err := k8s.Create(context.Background(), pool("bad", spec))
			Expect(err).To(HaveOccurred())
			Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want Invalid, got %v", err)
			Expect(err.Error()).To(ContainSubstring(field))
			Expect(err.Error()).To(ContainSubstring(message))
		},
		Entry("without a selector",
			map[string]any{"targetPorts": ports(8000)},
			"spec.selector", "Required value"),
		Entry("with empty matchLabels",
			map[string]any{"selector": map[string]any{"matchLabels": map[string]any{}}, "targetPorts": ports(8000)},
			"spec.selector.matchLabels", "at least 1"),
		Entry("with more than 8 target ports",
			map[string]any{"selector": selector, "targetPorts": ports(8000, 8001, 8002, 8003, 8004, 8005, 8006, 8007, 8008)},
			"spec.targetPorts", "at most 8"),
		Entry("with a duplicate target port",
			map[string]any{"selector": selector, "targetPorts": ports(8000, 8001, 8000)},
			"spec.targetPorts", "port number must be unique"),
		Entry("with a Service endpointPickerRef without a port",
			map[string]any{"selector": selector, "targetPorts": ports(8000), "endpointPickerRef": map[string]any{"name": "tally-epp"}},
			"spec.endpointPickerRef", "port is required"),
	)

	It("accepts a valid pool and fills in the defaults", func() {
		u := pool("good", map[string]any{
			"selector":          selector,
			"targetPorts":       ports(8000, 8001, 8002, 8003, 8004, 8005, 8006, 8007),
			"endpointPickerRef": map[string]any{"name": "tally-epp", "port": map[string]any{"number": int64(9002)}},
		})
		Expect(k8s.Create(context.Background(), u)).To(Succeed())

		field := func(path ...string) string {
			v, found, err := unstructured.NestedString(u.Object, path...)
			Expect(err).NotTo(HaveOccurred())
			Expect(found).To(BeTrue(), "field %v missing from the stored pool", path)
			return v
		}
		Expect(field("spec", "appProtocol")).To(Equal("http"))
		Expect(field("spec", "endpointPickerRef", "kind")).To(Equal("Service"))
		Expect(field("spec", "endpointPickerRef", "failureMode")).To(Equal("FailClose"))
	})
})
