package main

import (
	"bytes"
	"context"
	"log/slog"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/controllers"
)

func testPool(mode infv1.EndpointPickerFailureMode) *infv1.InferencePool {
	p := &infv1.InferencePool{
		ObjectMeta: metav1.ObjectMeta{Name: "llama", Namespace: "inference"},
		Spec: infv1.InferencePoolSpec{
			Selector:    infv1.LabelSelector{MatchLabels: map[infv1.LabelKey]infv1.LabelValue{"app": "vllm"}},
			TargetPorts: []infv1.Port{{Number: 8000}},
		},
	}
	if mode != "" {
		p.Spec.EndpointPickerRef = &infv1.EndpointPickerRef{Name: "epp", FailureMode: mode}
	}
	return p
}

func testPod(name, ip string, ready bool, labels map[string]string) *corev1.Pod {
	cond := corev1.ConditionFalse
	if ready {
		cond = corev1.ConditionTrue
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "inference", Labels: labels},
		Status: corev1.PodStatus{
			PodIP:      ip,
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: cond}},
		},
	}
}

func fakeReader(objs ...client.Object) client.WithWatch {
	return fake.NewClientBuilder().WithScheme(controllers.Scheme()).WithObjects(objs...).Build()
}

func TestFetchPoolReadsFailureModeAndReadyEndpoints(t *testing.T) {
	vllm := map[string]string{"app": "vllm"}
	c := fakeReader(
		testPool(infv1.EndpointPickerFailOpen),
		testPod("a", "10.0.0.2", true, vllm),
		testPod("b", "10.0.0.1", true, vllm),
		testPod("not-ready", "10.0.0.3", false, vllm),
		testPod("other", "10.0.0.4", true, map[string]string{"app": "other"}),
	)
	v, err := fetchPool(context.Background(), c, types.NamespacedName{Namespace: "inference", Name: "llama"})
	if err != nil {
		t.Fatal(err)
	}
	if v.FailureMode != infv1.EndpointPickerFailOpen {
		t.Errorf("failure mode %q, want FailOpen", v.FailureMode)
	}
	if want := []string{"10.0.0.1:8000", "10.0.0.2:8000"}; !slices.Equal(v.Endpoints, want) {
		t.Errorf("endpoints %v, want %v (Ready pods of the pool only)", v.Endpoints, want)
	}
}

func TestFetchPoolDefaultsToFailClose(t *testing.T) {
	c := fakeReader(testPool(""))
	v, err := fetchPool(context.Background(), c, types.NamespacedName{Namespace: "inference", Name: "llama"})
	if err != nil {
		t.Fatal(err)
	}
	if v.FailureMode != infv1.EndpointPickerFailClose || len(v.Endpoints) != 0 {
		t.Errorf("got %+v, want FailClose and no endpoints", v)
	}
}

func TestPollerAppliesOverridesAndKeepsTheLastViewOnError(t *testing.T) {
	vllm := map[string]string{"app": "vllm"}
	pool := testPool(infv1.EndpointPickerFailOpen)
	c := fakeReader(pool, testPod("a", "10.0.0.2", true, vllm))
	failClose := infv1.EndpointPickerFailClose
	var logs bytes.Buffer
	state := newPoolState(PoolView{FailureMode: infv1.EndpointPickerFailClose})
	p := &poolPoller{
		reader:    c,
		pool:      types.NamespacedName{Namespace: "inference", Name: "llama"},
		overrides: poolOverrides{failureMode: &failClose},
		state:     state,
		log:       slog.New(slog.NewTextHandler(&logs, nil)),
	}
	p.poll(context.Background())
	v := state.View()
	if v.FailureMode != infv1.EndpointPickerFailClose || !slices.Equal(v.Endpoints, []string{"10.0.0.2:8000"}) {
		t.Fatalf("got %+v, want the --failure-mode override and the pool's endpoint", v)
	}

	if err := c.Delete(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	p.poll(context.Background())
	p.poll(context.Background())
	if got := state.View(); !slices.Equal(got.Endpoints, v.Endpoints) {
		t.Errorf("after a failed poll the view became %+v, want the last one kept", got)
	}
	if n := bytes.Count(logs.Bytes(), []byte("polling the pool failed")); n != 1 {
		t.Errorf("a repeated error was logged %d times, want once:\n%s", n, logs.String())
	}
}
