package main

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A selector that does not select this pod is said once it has been so for
// selfMissingLists lists in a row, once, and again after the pod came back
// and went missing again.
func TestAPeerSelectorMissingThisPodIsSaidOnce(t *testing.T) {
	pod := func(name string) corev1.Pod { return corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}} }
	with := []corev1.Pod{pod("tally-a"), pod("tally-b")}
	without := []corev1.Pod{pod("tally-b")}
	var s selfCheck
	said := 0
	for range 3 * selfMissingLists {
		if s.missing(without, "tally-a") {
			said++
		}
	}
	if said != 1 {
		t.Fatalf("said %d times over %d lists without the pod, want once", said, 3*selfMissingLists)
	}
	if s.missing(with, "tally-a") {
		t.Fatal("said with the pod selected")
	}
	for i := range selfMissingLists {
		if got := s.missing(without, "tally-a"); got != (i == selfMissingLists-1) {
			t.Fatalf("list %d without the pod after it came back: said %v", i+1, got)
		}
	}
}
