// Package picker chooses which endpoint of an InferencePool serves each
// request, and keeps the live in-flight ledger that makes that choice right
// under bursts.
//
// A pick hashes the prompt outside any lock (its first maxPromptBlocks
// blocks only), then in one short critical section reads the ledger and the
// prefix index, scores the candidates, chooses, reserves the request's cost
// in the ledger and records its prompt blocks on the chosen endpoint. The
// evictions those records owe run right after, in short holds of the lock of
// their own. The reservation is released exactly once: its prefill part at
// the first response bytes or when the drain model says it is done (below),
// the rest at the end of the stream, on error, on disconnect, or by the
// sweeper as a backstop. A stream the gateway ends at the pick (no response
// phase will come) detaches its reservation instead: it ends when the model
// says the request is done, or an engine scrape does (detach.go).
//
// # Endpoint identity
//
// A ledger row belongs to a pod (its UID) and address, not to an address: an
// endpoint that leaves the set (a readiness flap) keeps its row and prefix
// memory, no longer a candidate, while requests are in flight on it or for
// the retention window, and the same pod gets the same row back. Another pod
// at the same address starts from zero. Forgetting a row is O(1) under the
// lock; its prefix entries are freed afterwards in bounded batches.
//
// # Prefill drain model
//
// Each endpoint's outstanding prefill is a FIFO queue that drains at the
// endpoint's prefill rate, in tokens per second. A reservation joins the
// back of its endpoint's queue with its uncached prompt tokens; the model's
// position moves forward at the rate, never past what is queued, and a
// reservation whose end the position has passed has finished its prefill:
// it moves to decoding. Its first response bytes end its prefill too,
// whichever comes first, taking what the model still counted for it out of
// the queue. An endpoint's cost uses the drained amount, so a request whose
// client does not stream (its first bytes come only when generation ends)
// stops counting as prefill once the engine has computed its prompt.
//
// The rate starts at the configured prefillTokensPerSecond and is learned
// from streamed requests: a streamed first byte says the request's own
// prefill and the prefill queued ahead of it took the time since it joined
// the queue. The pool's rate is one fit over every endpoint's samples; an
// endpoint differs from it only by a bounded factor its own samples earn; a
// first byte that came with the whole response, or long after the modelled
// whole request, is not learned; an engine that publishes its prefill timing
// floors its rate (ratefit.go). Endpoints that see only non-streamed (or
// only short) traffic keep the pool's rate.
//
// Everything the model does under the lock is O(1) per candidate (amortised:
// each reservation leaves its queue once) and allocates nothing.
//
// # The ledger
//
// The Picker holds one lock over the ledger (ledger.go): a lock-free state
// machine that changes only through its named operations (place, first
// byte, served-by, end, observe a scrape round, set the endpoint set,
// dispatch, sweep), each given its time; it reads no clock, and reading it
// (Snapshot, the metrics) changes nothing. The same operations in the same
// order leave two ledgers equal (docs/design.md).
//
// The invariant not to break: the reservation and the prefix record are
// written inside the same critical section that read the state they were
// chosen from. Moving either after the unlock lets concurrent picks miss each
// other, and a burst piles onto one endpoint (the failure of pickers that
// learn load from metrics scrapes).
package picker
