// Package picker chooses which endpoint of an InferencePool serves each
// request, and keeps the live in-flight ledger that makes that choice right
// under bursts.
//
// A pick hashes the prompt outside any lock, then in one short critical
// section reads the ledger and the prefix index, scores the candidates,
// chooses, reserves the request's cost in the ledger and records its prompt
// blocks on the chosen endpoint. The reservation is released exactly once:
// its prefill part on the first response bytes, the rest at the end of the
// stream, on error, on disconnect, or by the sweeper as a backstop.
//
// The invariant not to break: the reservation and the prefix record are
// written inside the same critical section that read the state they were
// chosen from. Moving either after the unlock lets concurrent picks miss each
// other, and a burst piles onto one endpoint (the failure of pickers that
// learn load from metrics scrapes).
package picker
