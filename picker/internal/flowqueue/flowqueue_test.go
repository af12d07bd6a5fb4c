package flowqueue

import (
	"slices"
	"testing"

	"github.com/tallyepp/tally/picker/internal/ilist"
)

type item struct {
	name string
	link ilist.Link[item]
	flow *Flow[item, links]
}

type links struct{}

func (links) Link(x *item) *ilist.Link[item] { return &x.link }

func limit(int) Limit { return Limit{MaxRequests: 3, MaxBytes: 100} }

// turns walks b's ring from its turn.
func turns(b *Band[item, links]) []string {
	var ids []string
	f := b.Turn()
	for range b.Flows() {
		ids = append(ids, f.ID())
		f = f.Next()
	}
	return ids
}

func TestBandsAreKeptHighestPriorityFirst(t *testing.T) {
	var q Queue[item, links]
	for _, p := range []int{0, 10, -1, 5, 10} {
		q.Band(p, limit)
	}
	var got []int
	for _, b := range q.Bands() {
		got = append(got, b.Priority())
	}
	if want := []int{10, 5, 0, -1}; !slices.Equal(got, want) {
		t.Fatalf("bands %v, want %v", got, want)
	}
}

func TestAFlowJoinsLastInTheTurnAndLeavesWhenEmpty(t *testing.T) {
	var q Queue[item, links]
	b := q.Band(0, limit)
	add := func(name, flow string) *item {
		x := &item{name: name}
		x.flow = q.Add(x, b, flow, 10)
		return x
	}
	a1, b1 := add("a1", "a"), add("b1", "b")
	a2 := add("a2", "a")
	add("c1", "c")
	if got := turns(b); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("turn order %v, want a b c", got)
	}
	b.Pass(a1.flow) // a went: b's turn, and a is last
	if got := turns(b); !slices.Equal(got, []string{"b", "c", "a"}) {
		t.Fatalf("after a's turn %v, want b c a", got)
	}
	add("d1", "d") // joins last: just before b, whose turn is next
	if got := turns(b); !slices.Equal(got, []string{"b", "c", "a", "d"}) {
		t.Fatalf("after d joined %v, want b c a d", got)
	}
	q.Remove(b1, b1.flow, 10) // b empties: the turn moves on to c
	if got := turns(b); !slices.Equal(got, []string{"c", "a", "d"}) {
		t.Fatalf("after b emptied %v, want c a d", got)
	}
	if f := a1.flow; f.Front() != a1 || f.After(a1) != a2 || f.After(a2) != nil {
		t.Fatal("a flow's elements are not oldest first")
	}
	q.Remove(a1, a1.flow, 10)
	if got := turns(b); !slices.Equal(got, []string{"c", "a", "d"}) {
		t.Fatalf("a still holds a2: %v, want c a d", got)
	}
	if q.Len() != 3 || q.Bytes() != 30 || b.Len() != 3 {
		t.Fatalf("counts %d, %d bytes, band %d; want 3, 30, 3", q.Len(), q.Bytes(), b.Len())
	}
	if again := q.Add(&item{name: "b2"}, b, "b", 10); again == b1.flow {
		t.Fatal("an emptied flow was kept: its id made a new one")
	}
}

func TestABandFitsWithinItsLimits(t *testing.T) {
	var q Queue[item, links]
	b := q.Band(0, limit)
	if !b.Fits(100) || b.Fits(101) {
		t.Fatal("an empty band of 100 bytes takes 100 bytes and not 101")
	}
	for range 3 {
		q.Add(&item{}, b, "f", 1)
	}
	if b.Fits(1) {
		t.Fatal("a band of 3 requests holding 3 took a fourth")
	}
}
