package picker

import (
	"net/netip"

	"github.com/tallyepp/tally/picker/internal/ilist"
)

// Reservation is one placed request's hold on the ledger, from Admit to
// End. Its lifecycle goes through the Picker (FirstByte, ServedBy, End),
// safe to call concurrently and in any order; each takes effect at most
// once, and none after the reservation ended (End, or the sweeper).
type Reservation struct {
	// Fixed at pick time.
	pickedNs     int64 // ledger time of the pick
	promptChars  int
	promptTokens int
	cachedBlocks int // of the hashed blocks, those the chosen endpoint held
	nHashes      int // the prompt's hashed blocks
	stream       bool
	bodiless     bool   // Request.bodiless: nothing runs on the engine for it
	whole        bool   // Request.DestinationOnly: never split
	maxTokens    int    // the request's max_tokens; 0 when it gives none
	adapter      string // its LoRA adapter on its row's engine; "" for the base model
	// adapterLoad: its adapter was not resident on its row when it took
	// it, so its first byte waits for the load (adapters.go); adapterWait:
	// the row's engine ran max_lora other adapters then, so it waits first
	// for one of them to drain.
	adapterLoad, adapterWait bool
	endpoints                [maxFallbackEndpoints]netip.AddrPort
	nEndpoints               int
	// prefiller is the pod that prefills a split request (disaggregation):
	// its KV cache moves to the destination, which decodes. Invalid when
	// the destination prefills itself.
	prefiller netip.AddrPort
	// splitWhy says why the pick split it or did not (disaggregation
	// only; "" when it is off).
	splitWhy splitDecision

	// Guarded by the picker's lock.
	row      *row // current holder; its counters include this reservation until released
	prefill  int  // prefill tokens still held (0 once decoding)
	decoding bool // past the first byte, or past the modelled prefill
	// pre is the prefiller's row while it holds the prefill part of a split
	// request (its request and prefill); nil before a split and once the
	// part is released. A split request decodes on row from the pick: it
	// holds a decode slot there and no prefill, and prefill counts the
	// part's tokens.
	pre *row
	// prefilledOn is the prefiller's row of a split request, kept after its
	// part is released: its first byte teaches that row's rate.
	prefilledOn  *row
	sawFirstByte bool
	released     bool
	delivered    bool
	heldBefore   int      // leading blocks the holder had before this request recorded there
	cachedTokens int      // of the prompt's tokens, those heldBefore holds
	owner        uint32   // tag of this request's records in the prefix index
	tailOn       *row     // where its pick left a long prompt's tail to record
	hashes       []uint64 // the prompt's blocks, kept for ServedBy
	hashBuf      *[]uint64
	firstByteNs  int64 // clock of its first response bytes
	outputTokens int   // its response's output tokens, when its End said

	// Detached (detach.go): its row's list of detached reservations, and
	// its modelled end and place in the picker's schedule once its prefill
	// is done (heapIdx -1 while not scheduled).
	detached   bool
	detachLink ilist.Link[Reservation]
	doneAt     int64
	heapIdx    int

	// The drain model of its row, while in prefill: where its prefill ends
	// in the row's queue, the work (tokens) from joining the queue to its
	// end, when it joined, and its neighbours in the queue.
	endPos      float64
	work        int
	enqueuedAt  int64
	prefillLink ilist.Link[Reservation]

	// The sweeper's list, in pick order.
	pickLink ilist.Link[Reservation]
}

// Endpoints lists the chosen endpoint, then the next best by cost (exact ties
// in random order), at most FallbackEndpoints in all; saturated endpoints are
// not listed. The slice is shared: do not modify it.
func (r *Reservation) Endpoints() []netip.AddrPort { return r.endpoints[:r.nEndpoints] }

// Prefiller is the endpoint that prefills the request when it is split
// (disaggregation): the destination pulls the KV cache from it and decodes.
// ok is false when the destination prefills the request itself.
func (r *Reservation) Prefiller() (addr netip.AddrPort, ok bool) {
	return r.prefiller, r.prefiller.IsValid()
}

// split reports whether r's prefill runs on another endpoint than its row.
func (r *Reservation) split() bool { return r.prefiller.IsValid() }
