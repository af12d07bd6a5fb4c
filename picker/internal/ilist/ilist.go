// Package ilist is an intrusive doubly linked list: it is threaded through
// its elements, which hold a Link for each list they can be on, so pushing
// and removing allocate nothing and an element can be on several lists at
// once (a reservation is on the picker's list of picks and on its
// endpoint's prefill queue). A Selector type says which of an element's
// links a kind of list uses.
//
// The invariant not to break: an element is on a list of one kind at most
// once, and its link for that kind is zero while it is on none. Push and
// Remove trust it and do not check: pushing an element twice, or removing
// one from a list it is not on, corrupts the lists it is on.
package ilist

// List is a list of *T in the order they were pushed, through the link S
// selects. The zero List is empty.
type List[T any, S Selector[T]] struct {
	head, tail *T
	n          int
}

// Link is an element's place on one list.
type Link[T any] struct {
	prev, next *T
}

// Selector picks, from an element, the link one kind of list uses. Its
// implementations are empty structs: List calls Link on the zero value.
type Selector[T any] interface {
	Link(x *T) *Link[T]
}

// Len is how many elements are on l.
func (l *List[T, S]) Len() int { return l.n }

// Front is the first element pushed of those on l, nil when l is empty.
func (l *List[T, S]) Front() *T { return l.head }

// Next is the element after x, which must be on l; nil when x is last.
func (l *List[T, S]) Next(x *T) *T {
	var at S
	return at.Link(x).next
}

// Push appends x, which must be on no list of this kind.
func (l *List[T, S]) Push(x *T) {
	var at S
	*at.Link(x) = Link[T]{prev: l.tail}
	if l.tail != nil {
		at.Link(l.tail).next = x
	} else {
		l.head = x
	}
	l.tail = x
	l.n++
}

// Remove takes x, which must be on l, off it.
func (l *List[T, S]) Remove(x *T) {
	var at S
	lx := at.Link(x)
	if lx.prev != nil {
		at.Link(lx.prev).next = lx.next
	} else {
		l.head = lx.next
	}
	if lx.next != nil {
		at.Link(lx.next).prev = lx.prev
	} else {
		l.tail = lx.prev
	}
	*lx = Link[T]{}
	l.n--
}
