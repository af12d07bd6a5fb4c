package picker

import (
	"context"
	"net/netip"
	"time"
)

// Prepared is a request as hashed for the ledger: its prompt's block
// hashes in place of the text. One replica of the picker prepares a
// request and another places it (package replica): the hashing, the costly
// part of a pick, stays with the replica that parsed the request.
type Prepared struct {
	// Request without its Prompt: PromptChars holds the prompt's length.
	Request Request
	// Hashes are the prompt's block hashes (Prepare's layout).
	Hashes []uint64
}

// Prepare hashes req's prompt, outside any lock, into what AdmitPrepared
// and Hold take. Replicas that share hashes must share the configuration
// the hashing reads (the block size and the block limits).
func (p *Picker) Prepare(req Request) Prepared {
	hashes := p.hash(nil, req)
	if len(req.Prompt) > 0 {
		req.PromptChars = len(req.Prompt)
	}
	req.Prompt, req.CacheSalt = nil, ""
	return Prepared{Request: req, Hashes: hashes}
}

// AdmitPrepared is Admit for a request another replica prepared.
func (p *Picker) AdmitPrepared(ctx context.Context, pr Prepared) (*Reservation, error) {
	r, t, err := p.EnqueuePrepared(pr)
	if t == nil {
		return r, err
	}
	return t.Wait(ctx)
}

// EnqueuePrepared is Enqueue for a request another replica prepared.
func (p *Picker) EnqueuePrepared(pr Prepared) (*Reservation, *Ticket, error) {
	start := time.Now()
	r := p.l.newReservation(pr.Request, pr.Hashes, p.now())
	return p.enqueue(r, pr.Request, start)
}

// Hold places pr where another replica placed it: on endpoints[0], with
// endpoints as its fallbacks, at the cost placement would give it there,
// and records its prompt's blocks there. It is how a replica's ledger
// follows the placements of the replica that leads. The reservation ends
// as any other (FirstByte, ServedBy, End). A split request (prefiller
// valid: disaggregation) holds its prefill on the prefiller. When
// endpoints[0] is not one of this picker's endpoints the reservation holds
// nothing (its End does nothing) and ok is false.
func (p *Picker) Hold(pr Prepared, endpoints []netip.AddrPort, prefiller netip.AddrPort) (r *Reservation, ok bool) {
	r = p.l.newReservation(pr.Request, pr.Hashes, p.now())
	p.mu.Lock()
	ok = p.l.hold(r, pr.Request, endpoints, prefiller)
	untidy := ok && p.l.untidy()
	p.rearm(r.pickedNs)
	p.mu.Unlock()
	if !ok {
		r.released = true
		r.nEndpoints = copy(r.endpoints[:], endpoints)
		r.prefiller = prefiller
		r.hashes = nil
		return r, false
	}
	if r.nHashes > p.blocks.inLock {
		p.mu.Lock()
		untidy = p.l.recordTail(r) || untidy
		p.mu.Unlock()
	}
	if untidy {
		p.tidy()
	}
	return r, true
}
