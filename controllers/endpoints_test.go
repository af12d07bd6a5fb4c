package controllers_test

import (
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/controllers"
	"github.com/tallyepp/tally/picker"
)

func testPool(labels map[string]string, ports ...int32) *infv1.InferencePool {
	p := &infv1.InferencePool{ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: "ns"}}
	p.Spec.Selector.MatchLabels = map[infv1.LabelKey]infv1.LabelValue{}
	for k, v := range labels {
		p.Spec.Selector.MatchLabels[infv1.LabelKey(k)] = infv1.LabelValue(v)
	}
	for _, n := range ports {
		p.Spec.TargetPorts = append(p.Spec.TargetPorts, infv1.Port{Number: infv1.PortNumber(n)})
	}
	return p
}

type podOpt func(*corev1.Pod)

func testPod(name, ip string, opts ...podOpt) corev1.Pod {
	p := corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", Labels: map[string]string{"app": "llm", "tier": "gpu"}},
		Status: corev1.PodStatus{
			PodIP:      ip,
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
		},
	}
	for _, o := range opts {
		o(&p)
	}
	return p
}

func inNamespace(ns string) podOpt { return func(p *corev1.Pod) { p.Namespace = ns } }
func withLabels(l map[string]string) podOpt {
	return func(p *corev1.Pod) { p.Labels = l }
}
func withReady(s corev1.ConditionStatus) podOpt {
	return func(p *corev1.Pod) { p.Status.Conditions[0].Status = s }
}
func noConditions(p *corev1.Pod) { p.Status.Conditions = nil }
func beingDeleted(p *corev1.Pod) {
	now := metav1.Now()
	p.DeletionTimestamp = &now
}

func addrs(eps []picker.Endpoint) []string {
	var out []string
	for _, e := range eps {
		out = append(out, e.Pod+"="+e.Address.String())
	}
	return out
}

func TestEndpointsFor(t *testing.T) {
	sel := map[string]string{"app": "llm"}
	tests := []struct {
		name string
		pool *infv1.InferencePool
		pods []corev1.Pod
		want []string
	}{
		{
			name: "ready pods give one endpoint per target port, sorted by address",
			pool: testPool(sel, 8001, 8000),
			pods: []corev1.Pod{testPod("b", "10.0.0.10"), testPod("a", "10.0.0.9")},
			want: []string{"a=10.0.0.9:8000", "a=10.0.0.9:8001", "b=10.0.0.10:8000", "b=10.0.0.10:8001"},
		},
		{
			name: "every matchLabels entry must match",
			pool: testPool(map[string]string{"app": "llm", "tier": "cpu"}, 8000),
			pods: []corev1.Pod{testPod("a", "10.0.0.1"), testPod("b", "10.0.0.2", withLabels(map[string]string{"app": "llm", "tier": "cpu", "x": "y"}))},
			want: []string{"b=10.0.0.2:8000"},
		},
		{
			name: "a label key present with another value does not match",
			pool: testPool(sel, 8000),
			pods: []corev1.Pod{testPod("a", "10.0.0.1", withLabels(map[string]string{"app": "other"})), testPod("b", "10.0.0.2", withLabels(nil))},
			want: nil,
		},
		{
			name: "pods in another namespace are ignored",
			pool: testPool(sel, 8000),
			pods: []corev1.Pod{testPod("a", "10.0.0.1", inNamespace("other")), testPod("b", "10.0.0.2")},
			want: []string{"b=10.0.0.2:8000"},
		},
		{
			name: "not Ready, Ready unknown and no Ready condition are excluded",
			pool: testPool(sel, 8000),
			pods: []corev1.Pod{
				testPod("a", "10.0.0.1", withReady(corev1.ConditionFalse)),
				testPod("b", "10.0.0.2", withReady(corev1.ConditionUnknown)),
				testPod("c", "10.0.0.3", noConditions),
				testPod("d", "10.0.0.4"),
			},
			want: []string{"d=10.0.0.4:8000"},
		},
		{
			name: "a pod being deleted is excluded even while Ready",
			pool: testPool(sel, 8000),
			pods: []corev1.Pod{testPod("a", "10.0.0.1", beingDeleted), testPod("b", "10.0.0.2")},
			want: []string{"b=10.0.0.2:8000"},
		},
		{
			name: "pods without a parsable IP are excluded",
			pool: testPool(sel, 8000),
			pods: []corev1.Pod{testPod("a", ""), testPod("b", "not-an-ip"), testPod("c", "10.0.0.3")},
			want: []string{"c=10.0.0.3:8000"},
		},
		{
			name: "IPv6 addresses are bracketed",
			pool: testPool(sel, 8000),
			pods: []corev1.Pod{testPod("a", "fd00::1"), testPod("b", "10.0.0.2")},
			want: []string{"b=10.0.0.2:8000", "a=[fd00::1]:8000"},
		},
		{
			name: "an empty selector selects nothing",
			pool: testPool(nil, 8000),
			pods: []corev1.Pod{testPod("a", "10.0.0.1")},
			want: nil,
		},
		{
			name: "a shared address (hostNetwork) is listed once",
			pool: testPool(sel, 8000),
			pods: []corev1.Pod{testPod("b", "10.0.0.1"), testPod("a", "10.0.0.1")},
			want: []string{"a=10.0.0.1:8000"},
		},
		{
			name: "no pool, no endpoints",
			pool: nil,
			pods: []corev1.Pod{testPod("a", "10.0.0.1")},
			want: nil,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := addrs(controllers.EndpointsFor(tt.pool, tt.pods))
			if !slices.Equal(got, tt.want) {
				t.Errorf("EndpointsFor = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestEndpointsForIgnoresPodOrder(t *testing.T) {
	pool := testPool(map[string]string{"app": "llm"}, 8000, 8001)
	pods := []corev1.Pod{testPod("a", "10.0.0.3"), testPod("b", "fd00::2"), testPod("c", "10.0.0.1"), testPod("d", "10.0.0.2")}
	reversed := []corev1.Pod{pods[3], pods[2], pods[1], pods[0]}
	want := []string{
		"c=10.0.0.1:8000", "c=10.0.0.1:8001", "d=10.0.0.2:8000", "d=10.0.0.2:8001",
		"a=10.0.0.3:8000", "a=10.0.0.3:8001", "b=[fd00::2]:8000", "b=[fd00::2]:8001",
	}
	for _, in := range [][]corev1.Pod{pods, reversed} {
		if got := addrs(controllers.EndpointsFor(pool, in)); !slices.Equal(got, want) {
			t.Errorf("EndpointsFor = %q, want %q", got, want)
		}
	}
}

func TestRESTConfigNamesTheFlagOfABadKubeconfig(t *testing.T) {
	_, err := controllers.RESTConfig("/does/not/exist/kubeconfig")
	if err == nil || !strings.Contains(err.Error(), "--kubeconfig") || !strings.Contains(err.Error(), "/does/not/exist/kubeconfig") {
		t.Fatalf("error %v: want it to name --kubeconfig and the path", err)
	}
}

func TestEndpointsCarryThePodUID(t *testing.T) {
	pool := testPool(map[string]string{"app": "llm"}, 8000, 8001)
	pod := testPod("a", "10.0.0.1", func(p *corev1.Pod) { p.UID = "uid-a" })
	eps := controllers.EndpointsFor(pool, []corev1.Pod{pod})
	if len(eps) != 2 {
		t.Fatalf("got %d endpoints, want 2 (one per target port)", len(eps))
	}
	for _, e := range eps {
		if e.UID != "uid-a" {
			t.Errorf("%s: UID %q, want the pod's uid-a: the picker keys its ledger rows by it", e.Address, e.UID)
		}
		if e.Engine != "vllm" {
			t.Errorf("%s: engine %q without the label, want vllm", e.Address, e.Engine)
		}
	}
	sg := testPod("s", "10.0.0.2", withLabels(map[string]string{"app": "llm", controllers.EngineTypeLabel: "sglang"}))
	if eps := controllers.EndpointsFor(pool, []corev1.Pod{sg}); len(eps) == 0 || eps[0].Engine != "sglang" {
		t.Errorf("a pod labelled sglang gives %+v, want engine sglang", eps)
	}
}

// The llm-d.ai/role label gives each endpoint its disaggregation role, with
// the deprecated "both" read as prefill-decode.
func TestEndpointsCarryTheRoleLabel(t *testing.T) {
	pool := testPool(map[string]string{"app": "llm"}, 8000)
	for _, tc := range []struct{ label, want string }{
		{"", ""},
		{"prefill", picker.RolePrefill},
		{"decode", picker.RoleDecode},
		{"prefill-decode", picker.RolePrefillDecode},
		{"both", picker.RolePrefillDecode},
		{"encode", "encode"},
	} {
		labels := map[string]string{"app": "llm"}
		if tc.label != "" {
			labels[controllers.RoleLabel] = tc.label
		}
		eps := controllers.EndpointsFor(pool, []corev1.Pod{testPod("a", "10.0.0.1", withLabels(labels))})
		if len(eps) != 1 || eps[0].Role != tc.want {
			t.Errorf("label %q gives %+v, want one endpoint with role %q", tc.label, eps, tc.want)
		}
	}
}
