package controllers

import (
	"context"
	"fmt"
	"sync/atomic"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/tallyepp/tally/picker/logging"
)

// accepter marks the resources a picker applies Accepted, the one
// condition InferenceObjective and InferenceModelRewrite define: True,
// reason Accepted, at the generation applied. Upstream's picker (v1.5.0)
// writes no status and its chart grants no access to it: where the picker
// may not write, it says so once in its log and goes on.
type accepter struct {
	kind      string // for the log and errors
	w         client.StatusClient
	forbidden atomic.Bool // a write was refused: said once
}

// accept marks obj Accepted with msg, unless its conditions (conds of
// obj) say so already.
func accept[T client.Object](ctx context.Context, a *accepter, obj T, conds func(T) *[]metav1.Condition, msg string) error {
	cond := metav1.Condition{
		Type:               "Accepted",
		Status:             metav1.ConditionTrue,
		Reason:             "Accepted",
		Message:            truncate(msg, maxConditionMessage),
		ObservedGeneration: obj.GetGeneration(),
	}
	if c := meta.FindStatusCondition(*conds(obj), cond.Type); c != nil &&
		c.Status == cond.Status && c.Reason == cond.Reason && c.Message == cond.Message && c.ObservedGeneration == cond.ObservedGeneration {
		return nil
	}
	patched := obj.DeepCopyObject().(T)
	meta.SetStatusCondition(conds(patched), cond)
	err := a.w.Status().Patch(ctx, patched, client.MergeFrom(obj))
	switch {
	case err == nil, apierrors.IsNotFound(err):
		return nil
	case apierrors.IsForbidden(err):
		if !a.forbidden.Swap(true) {
			logging.Warn(log.FromContext(ctx), fmt.Sprintf("may not write %s status (RBAC: patch on its status); the picker applies them all the same, their status stays as it is", a.kind),
				"name", obj.GetName(), "error", err.Error())
		}
		return nil
	}
	return fmt.Errorf("writing the status of %s %s: %w", a.kind, obj.GetName(), err)
}

// maxConditionMessage is the API's bound on a condition's message.
const maxConditionMessage = 32768

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-3] + "..."
}
