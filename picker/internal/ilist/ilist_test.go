package ilist

import (
	"slices"
	"testing"
)

// item can be on two kinds of list at once.
type item struct {
	name     string
	byA, byB Link[item]
}

type (
	aLinks struct{}
	bLinks struct{}
)

func (aLinks) Link(x *item) *Link[item] { return &x.byA }
func (bLinks) Link(x *item) *Link[item] { return &x.byB }

// names reads l front to back, and checks that back to front (through the
// prev links) gives the same elements reversed.
func names[S Selector[item]](t *testing.T, l *List[item, S]) []string {
	t.Helper()
	var fwd []*item
	for x := l.Front(); x != nil; x = l.Next(x) {
		fwd = append(fwd, x)
	}
	var back []*item
	var at S
	for x := l.tail; x != nil; x = at.Link(x).prev {
		back = append(back, x)
	}
	slices.Reverse(back)
	if !slices.Equal(fwd, back) {
		t.Fatalf("forward and backward walks differ: %d and %d elements", len(fwd), len(back))
	}
	var out []string
	for _, x := range fwd {
		out = append(out, x.name)
	}
	return out
}

func TestPushAndRemoveKeepPushOrder(t *testing.T) {
	var l List[item, aLinks]
	if l.Front() != nil {
		t.Fatal("the zero list is not empty")
	}
	xs := make([]*item, 5)
	for i, n := range []string{"a", "b", "c", "d", "e"} {
		xs[i] = &item{name: n}
		l.Push(xs[i])
	}
	if got, want := names(t, &l), []string{"a", "b", "c", "d", "e"}; !slices.Equal(got, want) {
		t.Fatalf("after pushes: %v, want %v", got, want)
	}
	for _, step := range []struct {
		remove *item
		want   []string
	}{
		{xs[2], []string{"a", "b", "d", "e"}}, // middle
		{xs[0], []string{"b", "d", "e"}},      // front
		{xs[4], []string{"b", "d"}},           // back
		{xs[3], []string{"b"}},
		{xs[1], nil}, // the only one
	} {
		l.Remove(step.remove)
		if got := names(t, &l); !slices.Equal(got, step.want) {
			t.Fatalf("after removing %s: %v, want %v", step.remove.name, got, step.want)
		}
		if l.Len() != len(step.want) {
			t.Fatalf("after removing %s: Len %d, want %d", step.remove.name, l.Len(), len(step.want))
		}
		if step.remove.byA != (Link[item]{}) {
			t.Fatalf("%s's link is not zero once off the list", step.remove.name)
		}
	}
	// Removed elements can be pushed again, and go to the back.
	l.Push(xs[3])
	l.Push(xs[0])
	if got, want := names(t, &l), []string{"d", "a"}; !slices.Equal(got, want) || l.Len() != 2 {
		t.Fatalf("pushed again: %v (Len %d), want %v", got, l.Len(), want)
	}
}

// An element on two lists at once: each list keeps its own order, and
// leaving one leaves the other as it was.
func TestAnElementOnTwoLists(t *testing.T) {
	var a List[item, aLinks]
	var b List[item, bLinks]
	x, y, z := &item{name: "x"}, &item{name: "y"}, &item{name: "z"}
	a.Push(x)
	a.Push(y)
	a.Push(z)
	b.Push(z)
	b.Push(x)
	if got, want := names(t, &a), []string{"x", "y", "z"}; !slices.Equal(got, want) {
		t.Fatalf("list a: %v, want %v", got, want)
	}
	if got, want := names(t, &b), []string{"z", "x"}; !slices.Equal(got, want) {
		t.Fatalf("list b: %v, want %v", got, want)
	}
	a.Remove(x)
	if got, want := names(t, &b), []string{"z", "x"}; !slices.Equal(got, want) {
		t.Fatalf("list b after x left list a: %v, want %v", got, want)
	}
	b.Remove(z)
	if got, want := names(t, &a), []string{"y", "z"}; !slices.Equal(got, want) {
		t.Fatalf("list a after z left list b: %v, want %v", got, want)
	}
	if got, want := names(t, &b), []string{"x"}; !slices.Equal(got, want) {
		t.Fatalf("list b: %v, want %v", got, want)
	}
}

func TestPushAndRemoveAllocateNothing(t *testing.T) {
	var l List[item, aLinks]
	xs := []*item{{name: "a"}, {name: "b"}, {name: "c"}}
	allocs := testing.AllocsPerRun(100, func() {
		for _, x := range xs {
			l.Push(x)
		}
		l.Remove(xs[1])
		l.Remove(xs[0])
		l.Remove(xs[2])
	})
	if allocs != 0 {
		t.Errorf("%v allocations per push and remove round, want 0", allocs)
	}
}
