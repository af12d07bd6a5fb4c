package picker

// list is a doubly linked list threaded through its elements, in the order
// they were pushed. It allocates nothing: an element holds a link for each
// list it can be on, and L says which link this list uses. The invariant: an
// element is on a list at most once, and its link is zero while it is on
// none. The zero list is empty.
type list[T any, L linkOf[T]] struct {
	head, tail *T
}

// link is an element's place on one list.
type link[T any] struct {
	prev, next *T
}

// linkOf picks, from an element, the link one kind of list uses.
type linkOf[T any] interface {
	of(x *T) *link[T]
}

// push appends x, which must be on no list of this kind.
func (l *list[T, L]) push(x *T) {
	var at L
	*at.of(x) = link[T]{prev: l.tail}
	if l.tail != nil {
		at.of(l.tail).next = x
	} else {
		l.head = x
	}
	l.tail = x
}

// remove takes x, which must be on l, off it.
func (l *list[T, L]) remove(x *T) {
	var at L
	lx := at.of(x)
	if lx.prev != nil {
		at.of(lx.prev).next = lx.next
	} else {
		l.head = lx.next
	}
	if lx.next != nil {
		at.of(lx.next).prev = lx.prev
	} else {
		l.tail = lx.prev
	}
	*lx = link[T]{}
}

// The lists of reservations and tickets.
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

func (pickLinks) of(r *Reservation) *link[Reservation]    { return &r.pickLink }
func (prefillLinks) of(r *Reservation) *link[Reservation] { return &r.prefillLink }
func (detachLinks) of(r *Reservation) *link[Reservation]  { return &r.detachLink }
func (flowLinks) of(t *Ticket) *link[Ticket]              { return &t.flowLink }
func (arrivalLinks) of(t *Ticket) *link[Ticket]           { return &t.arrivalLink }
