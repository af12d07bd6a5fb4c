package lru

import (
	"slices"
	"testing"
)

// order walks the list from the oldest, checking the links both ways.
func order(t *testing.T, l *List) []int32 {
	t.Helper()
	var out []int32
	prev := none
	for i := l.head; i != none; i = l.links[i].next {
		if l.links[i].prev != prev {
			t.Fatalf("index %d links back to %d, want %d", i, l.links[i].prev, prev)
		}
		out = append(out, i)
		prev = i
	}
	if l.tail != prev {
		t.Fatalf("tail is %d, want %d", l.tail, prev)
	}
	if l.Len() != len(out) {
		t.Fatalf("Len() = %d, want %d", l.Len(), len(out))
	}
	return out
}

func TestListKeepsTheOrderOfUse(t *testing.T) {
	l := New(2)
	if _, ok := l.Oldest(); ok {
		t.Fatal("an empty list has an oldest index")
	}
	for _, i := range []int32{3, 0, 1, 5} { // 3 and 5 grow the list
		l.PushBack(i)
	}
	if got, want := order(t, l), []int32{3, 0, 1, 5}; !slices.Equal(got, want) {
		t.Fatalf("order %v, want %v", got, want)
	}
	l.Remove(0) // middle
	l.PushBack(0)
	l.Remove(3) // oldest
	l.Remove(0) // newest
	if got, want := order(t, l), []int32{1, 5}; !slices.Equal(got, want) {
		t.Fatalf("order %v, want %v", got, want)
	}
	if i, ok := l.Oldest(); !ok || i != 1 {
		t.Fatalf("Oldest() = %d, %v; want 1, true", i, ok)
	}
	l.Remove(1)
	l.Remove(5)
	if got := order(t, l); len(got) != 0 {
		t.Fatalf("order %v, want empty", got)
	}
	l.PushBack(4)
	if i, ok := l.Oldest(); !ok || i != 4 {
		t.Fatalf("Oldest() = %d, %v; want 4, true", i, ok)
	}
}

func TestACloneChangesApartFromItsList(t *testing.T) {
	l := New(4)
	for _, i := range []int32{2, 0, 3} {
		l.PushBack(i)
	}
	c := l.Clone()
	c.Remove(0)
	c.PushBack(1)
	l.Remove(2)
	if got, want := order(t, l), []int32{0, 3}; !slices.Equal(got, want) {
		t.Errorf("the list's order %v, want %v", got, want)
	}
	if got, want := order(t, c), []int32{2, 3, 1}; !slices.Equal(got, want) {
		t.Errorf("the clone's order %v, want %v", got, want)
	}
}
