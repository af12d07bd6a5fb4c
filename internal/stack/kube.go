package stack

import (
	"context"
	"fmt"
	"maps"
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
)

// PickerServiceName and PickerServicePort are what the pool's
// endpointPickerRef names, as a gateway would read them. No Service exists:
// the dev gateway is told the picker's address directly.
const (
	PickerServiceName = "tally-epp"
	PickerServicePort = 9002
)

// podSelectorLabel selects the pool's pods, as a model server Deployment's
// template labels would.
var podSelectorLabel = map[string]string{"app": "sim"}

// createPool creates the namespace, if it is not there, and the pool in it.
func createPool(ctx context.Context, c client.Client, namespace, name string, targetPort int32, mode infv1.EndpointPickerFailureMode) error {
	if err := createNamespace(ctx, c, namespace); err != nil {
		return err
	}
	if err := c.Create(ctx, newPool(namespace, name, targetPort, mode)); err != nil {
		return fmt.Errorf("creating InferencePool %s/%s: %w", namespace, name, err)
	}
	return nil
}

func newPool(namespace, name string, targetPort int32, mode infv1.EndpointPickerFailureMode) *infv1.InferencePool {
	labels := make(map[infv1.LabelKey]infv1.LabelValue, len(podSelectorLabel))
	for k, v := range podSelectorLabel {
		labels[infv1.LabelKey(k)] = infv1.LabelValue(v)
	}
	return &infv1.InferencePool{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: infv1.InferencePoolSpec{
			Selector:    infv1.LabelSelector{MatchLabels: labels},
			TargetPorts: []infv1.Port{{Number: infv1.PortNumber(targetPort)}},
			EndpointPickerRef: &infv1.EndpointPickerRef{
				Name:        PickerServiceName,
				Port:        &infv1.Port{Number: PickerServicePort},
				FailureMode: mode,
			},
		},
	}
}

func createNamespace(ctx context.Context, c client.Client, name string) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if err := c.Create(ctx, ns); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating namespace %s: %w", name, err)
	}
	return nil
}

// createPod creates a pod of the pool and, with no kubelet to do it, sets
// its status: the pod IP and the Ready condition. It returns the UID the
// API server gave the pod.
func createPod(ctx context.Context, c client.Client, namespace, name string, ip netip.Addr, port int32, ready bool, role string) (types.UID, error) {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, Labels: podLabels(role)},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name:  "model-server",
			Image: "tally.invalid/modelsim",
			Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: port}},
		}}},
	}
	if err := c.Create(ctx, pod); err != nil {
		return "", fmt.Errorf("creating pod %s/%s: %w", namespace, name, err)
	}
	pod.Status = corev1.PodStatus{
		Phase:  corev1.PodRunning,
		PodIP:  ip.String(),
		PodIPs: []corev1.PodIP{{IP: ip.String()}},
		Conditions: []corev1.PodCondition{
			{Type: corev1.PodReady, Status: conditionStatus(ready), LastTransitionTime: metav1.Now()},
		},
	}
	if err := c.Status().Update(ctx, pod); err != nil {
		return "", fmt.Errorf("setting the status of pod %s/%s: %w", namespace, name, err)
	}
	return pod.UID, nil
}

// podLabels are a pod's labels: the pool's selector and, for a pod with a
// prefill/decode role, llm-d's role label.
func podLabels(role string) map[string]string {
	labels := maps.Clone(podSelectorLabel)
	if role != "" {
		labels[RoleLabel] = role
	}
	return labels
}

// deletePod deletes a pod at once (no kubelet would confirm a graceful
// deletion) and waits until the API server no longer has it, so that a pod
// created next under its name is a new object.
func deletePod(ctx context.Context, c client.Client, namespace, name string) error {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name}}
	if err := c.Delete(ctx, pod, client.GracePeriodSeconds(0)); err != nil {
		return fmt.Errorf("deleting pod %s/%s: %w", namespace, name, err)
	}
	err := wait.PollUntilContextTimeout(ctx, pollInterval, podDeleteTimeout, true, func(ctx context.Context) (bool, error) {
		err := c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: name}, &corev1.Pod{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, err
	})
	if err != nil {
		return fmt.Errorf("waiting for pod %s/%s to be gone: %w", namespace, name, err)
	}
	return nil
}

// setPodReady sets the pod's Ready condition, retrying on conflicts.
func setPodReady(ctx context.Context, c client.Client, namespace, name string, ready bool) error {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pod := &corev1.Pod{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: name}, pod); err != nil {
			return err
		}
		for i := range pod.Status.Conditions {
			if pod.Status.Conditions[i].Type == corev1.PodReady {
				pod.Status.Conditions[i].Status = conditionStatus(ready)
				pod.Status.Conditions[i].LastTransitionTime = metav1.Now()
			}
		}
		return c.Status().Update(ctx, pod)
	})
	if err != nil {
		return fmt.Errorf("setting Ready=%v on pod %s/%s: %w", ready, namespace, name, err)
	}
	return nil
}

// setFailureMode changes the pool's endpointPickerRef.failureMode.
func setFailureMode(ctx context.Context, c client.Client, namespace, name string, mode infv1.EndpointPickerFailureMode) error {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pool := &infv1.InferencePool{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: name}, pool); err != nil {
			return err
		}
		pool.Spec.EndpointPickerRef.FailureMode = mode
		return c.Update(ctx, pool)
	})
	if err != nil {
		return fmt.Errorf("setting failureMode %s on pool %s/%s: %w", mode, namespace, name, err)
	}
	return nil
}

func conditionStatus(ok bool) corev1.ConditionStatus {
	if ok {
		return corev1.ConditionTrue
	}
	return corev1.ConditionFalse
}
