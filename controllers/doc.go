// Package controllers watches the one InferencePool the picker serves, and the
// pods in its namespace, and keeps the picker's endpoint set equal to the
// pool's Ready pods times its target ports. It also tells the picker the
// priorities of the InferenceObjectives and the rules of the
// InferenceModelRewrites that reference the pool.
//
// The invariant not to break: every reconcile, whichever event woke it,
// recomputes the WHOLE endpoint set from the cache and calls Replace while
// holding the one lock that both reconcilers share (EndpointSync). Patching
// the set incrementally, or reading the cache outside that lock, lets an older
// view of the cluster overwrite a newer one. Objectives and rewrites follow
// the same rule: the whole set, from the cache, under one workqueue key.
package controllers
