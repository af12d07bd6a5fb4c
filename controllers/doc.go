// Package controllers watches the one InferencePool the picker serves, and the
// pods in its namespace, and keeps the picker's endpoint set equal to the
// pool's Ready pods times its target ports.
//
// The invariant not to break: every reconcile, whichever event woke it,
// recomputes the WHOLE endpoint set from the cache and calls Replace while
// holding the one lock that both reconcilers share (EndpointSync). Patching
// the set incrementally, or reading the cache outside that lock, lets an older
// view of the cluster overwrite a newer one.
package controllers
