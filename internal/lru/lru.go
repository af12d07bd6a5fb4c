// Package lru keeps a least-recently-used order over the indices of a slice
// that its caller owns: the simulated engine's evictable KV blocks, the
// upstream-like router's remembered prefix blocks. The links are int32
// indices, not pointers, so a list of a million entries costs the garbage
// collector nothing and moving an entry allocates nothing.
//
// The invariant: an index is in the list at most once. PushBack takes an
// index that is not in it, Remove one that is; the caller knows which, as it
// knows which of its entries are evictable.
package lru

import (
	"iter"
	"slices"
)

const none int32 = -1

type link struct{ prev, next int32 }

// List is the order, the least recently used first. Create it with New.
type List struct {
	links      []link // by index; meaningful while the index is in the list
	head, tail int32  // least and most recently used
	len        int
}

// New returns an empty list with room for indices 0 to n-1; PushBack grows
// it for larger ones.
func New(n int) *List {
	return &List{links: make([]link, n), head: none, tail: none}
}

// Clone returns a copy of the list that changes independently of it.
func (l *List) Clone() *List {
	c := *l
	c.links = slices.Clone(l.links)
	return &c
}

// Len is how many indices the list holds.
func (l *List) Len() int { return l.len }

// Oldest is the least recently used index; ok is false when the list is
// empty.
func (l *List) Oldest() (i int32, ok bool) { return l.head, l.head != none }

// All yields the indices, the least recently used first. The list must not
// change while it runs.
func (l *List) All() iter.Seq[int32] {
	return func(yield func(int32) bool) {
		for i := l.head; i != none; i = l.links[i].next {
			if !yield(i) {
				return
			}
		}
	}
}

// PushBack adds i as the most recently used.
func (l *List) PushBack(i int32) {
	if n := int(i) + 1; n > len(l.links) {
		l.links = append(l.links, make([]link, n-len(l.links))...)
	}
	l.links[i] = link{prev: l.tail, next: none}
	if l.tail != none {
		l.links[l.tail].next = i
	} else {
		l.head = i
	}
	l.tail = i
	l.len++
}

// Remove takes i out of the list.
func (l *List) Remove(i int32) {
	n := &l.links[i]
	if n.prev != none {
		l.links[n.prev].next = n.next
	} else {
		l.head = n.next
	}
	if n.next != none {
		l.links[n.next].prev = n.prev
	} else {
		l.tail = n.prev
	}
	*n = link{prev: none, next: none}
	l.len--
}
