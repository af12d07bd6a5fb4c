package picker

import "github.com/tallyepp/tally/picker/internal/ilist"

// The lists of reservations and tickets: each selects the link of its own
// (ilist.Selector) that an element holds for it.
type (
	// The picker's reservations not yet released, in pick order (for the
	// sweeper).
	pickLinks struct{}
	// A row's reservations in prefill, in the order they joined its queue.
	prefillLinks struct{}
	// A row's detached reservations, in the order they were detached.
	detachLinks struct{}
	// A flow's waiting tickets, oldest first.
	flowLinks struct{}
	// The queue's waiting tickets, in arrival order.
	arrivalLinks struct{}
)

func (pickLinks) Link(r *Reservation) *ilist.Link[Reservation]    { return &r.pickLink }
func (prefillLinks) Link(r *Reservation) *ilist.Link[Reservation] { return &r.prefillLink }
func (detachLinks) Link(r *Reservation) *ilist.Link[Reservation]  { return &r.detachLink }
func (flowLinks) Link(t *Ticket) *ilist.Link[Ticket]              { return &t.flowLink }
func (arrivalLinks) Link(t *Ticket) *ilist.Link[Ticket]           { return &t.arrivalLink }
