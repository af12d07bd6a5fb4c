package prefix

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// blocks returns n distinct chained hashes of a prompt named tag.
func blocks(tag string, n int) []uint64 { return HashSalted(nil, "m", "", text(tag, n*16), 16) }

func match(x *Index, hashes []uint64, ids ...int) []int {
	out := make([]int, len(ids))
	x.Match(hashes, ids, out)
	return out
}

func TestMatchCountsLeadingBlocksPerEndpoint(t *testing.T) {
	x := NewIndex(1000)
	a, b, c, d := x.Add(), x.Add(), x.Add(), x.Add()
	p := blocks("p", 10)
	record(x, a, p, 0)
	record(x, b, p[:4], 0)
	record(x, d, p[2:], 0) // holds everything but the head: matches nothing

	if got, want := match(x, p, a, b, c, d), []int{10, 4, 0, 0}; !slices.Equal(got, want) {
		t.Errorf("match of the recorded prompt = %v, want %v", got, want)
	}
	// A prompt that shares the first 6 blocks with p, then diverges.
	q := HashSalted(nil, "m", "", append(text("p", 6*16), text("q", 4*16)...), 16)
	if got, want := match(x, q, d, c, b, a), []int{0, 0, 4, 6}; !slices.Equal(got, want) {
		t.Errorf("match of a prompt diverging after 6 blocks = %v, want %v", got, want)
	}
	if got := match(x, nil, a, b); !slices.Equal(got, []int{0, 0}) {
		t.Errorf("match of no blocks = %v, want zeros", got)
	}
	if got := match(x, p); len(got) != 0 {
		t.Errorf("match with no candidates = %v", got)
	}
}

func TestLRUEvictsPerEndpoint(t *testing.T) {
	x := NewIndex(6)
	e, other := x.Add(), x.Add()
	pa, pb := blocks("a", 4), blocks("b", 4)
	record(x, other, pa, 0)
	record(x, e, pa, 0)
	record(x, e, pb, 0) // 8 blocks on a capacity of 6: pa's two tail blocks go

	if got := x.Len(e); got != 6 {
		t.Errorf("endpoint holds %d blocks, want its capacity 6", got)
	}
	if got := match(x, pa, e, other); !slices.Equal(got, []int{2, 4}) {
		t.Errorf("match of the older prompt = %v, want [2 4] (head kept on e, other untouched)", got)
	}
	if got := match(x, pb, e); got[0] != 4 {
		t.Errorf("match of the newer prompt = %d, want 4", got[0])
	}
	if got := x.Blocks(); got != 8 {
		t.Errorf("distinct blocks = %d, want 8 (pa held whole by other)", got)
	}

	// Touching pa again makes it recent: the next prompt evicts pb instead.
	record(x, e, pa[:2], 0)
	record(x, e, blocks("c", 2), 0)
	if got := match(x, pa, e); got[0] != 2 {
		t.Errorf("after touching, match of pa = %d, want 2", got[0])
	}
	if got := match(x, pb, e); got[0] != 2 {
		t.Errorf("after touching pa, match of pb = %d, want 2 (its tail evicted)", got[0])
	}
}

func TestRecordKeepsPromptHeadsWhenOverCapacity(t *testing.T) {
	x := NewIndex(6)
	e := x.Add()
	p := blocks("long", 10)
	record(x, e, p, 0)
	if got := match(x, p, e); got[0] != 6 {
		t.Errorf("a 10-block prompt on a 6-block endpoint matches %d blocks, want 6 (the head)", got[0])
	}
	if got := x.Blocks(); got != 6 {
		t.Errorf("distinct blocks = %d, want 6 (evicted blocks leave the map)", got)
	}
}

func TestRemoveDropsOnlyThatEndpoint(t *testing.T) {
	x := NewIndex(100)
	a, b := x.Add(), x.Add()
	shared, own := blocks("s", 5), blocks("o", 5)
	record(x, a, shared, 0)
	record(x, a, own, 0)
	record(x, b, shared, 0)

	x.Remove(a)
	x.Remove(a) // a second removal is a no-op
	if got := match(x, shared, b); got[0] != 5 {
		t.Errorf("b lost blocks when a was removed: match %d, want 5", got[0])
	}
	for x.Tidy(3) { // in batches, as the picker does between its locks
	}
	if got := x.Blocks(); got != 5 {
		t.Errorf("distinct blocks after removing a = %d, want 5 (only b's)", got)
	}
	if got := match(x, shared, b); got[0] != 5 {
		t.Errorf("b lost blocks when a was removed: match %d, want 5", got[0])
	}
}

func TestRemovedIDIsReusedEmpty(t *testing.T) {
	x := NewIndex(100)
	a, b := x.Add(), x.Add()
	p := blocks("p", 5)
	record(x, a, p, 0)
	record(x, b, p, 0)
	x.Remove(a)
	if again := x.Add(); again == a {
		t.Fatalf("Add reused id %d before its blocks were reclaimed", a)
	}
	for x.Tidy(2) {
	}

	again := x.Add()
	if again != a {
		t.Fatalf("Add after Remove(%d) returned %d, want the freed id", a, again)
	}
	if x.Len(again) != 0 {
		t.Errorf("reused id holds %d blocks, want 0", x.Len(again))
	}
	if got := match(x, p, again, b); !slices.Equal(got, []int{0, 5}) {
		t.Errorf("match after reuse = %v, want [0 5]", got)
	}
	if x.Add() != 3 {
		t.Errorf("with no free id, Add should hand out the next one")
	}
}

func TestForgetDropsOnlyTheNamedBlocks(t *testing.T) {
	x := NewIndex(100)
	a, b := x.Add(), x.Add()
	p := blocks("p", 6)
	record(x, a, p, 0)
	record(x, b, p, 0)
	x.forget(a, p[3:], false, 0)
	x.forget(a, blocks("unknown", 3), false, 0)
	if got := match(x, p, a, b); !slices.Equal(got, []int{3, 6}) {
		t.Errorf("after forgetting a's last 3 blocks, match = %v, want [3 6]", got)
	}
	if x.Len(a) != 3 {
		t.Errorf("a holds %d blocks, want 3", x.Len(a))
	}
}

func TestManyEndpointsWidenTheBitsets(t *testing.T) {
	x := NewIndex(100)
	p := blocks("p", 40)
	var ids, want []int
	for i := range 150 {
		id := x.Add()
		record(x, id, p[:i%41], 0)
		ids = append(ids, id)
		want = append(want, i%41)
	}
	if got := match(x, p, ids...); !slices.Equal(got, want) {
		t.Errorf("match across 150 endpoints:\n got %v\nwant %v", got, want)
	}
}

// model is a plain reference implementation of the Index semantics.
type model struct {
	capacity int
	eps      map[int][]uint64 // most recently used first
	owner    map[[2]uint64]uint32
}

func (m *model) record(id int, hashes []uint64, owner uint32) {
	for _, h := range hashes {
		m.owner[[2]uint64{uint64(id), h}] = owner
	}
	for i := len(hashes) - 1; i >= 0; i-- {
		l := m.eps[id]
		if j := slices.Index(l, hashes[i]); j >= 0 {
			l = slices.Delete(l, j, j+1)
		} else if len(l) >= m.capacity {
			l = l[:len(l)-1]
		}
		m.eps[id] = slices.Insert(l, 0, hashes[i])
	}
}

func (m *model) forget(id int, hashes []uint64) {
	m.eps[id] = slices.DeleteFunc(m.eps[id], func(h uint64) bool { return slices.Contains(hashes, h) })
}

func (m *model) forgetOwn(id int, hashes []uint64, owner uint32) {
	m.eps[id] = slices.DeleteFunc(m.eps[id], func(h uint64) bool {
		return slices.Contains(hashes, h) && m.owner[[2]uint64{uint64(id), h}] == owner
	})
}

func (m *model) match(id int, hashes []uint64) int {
	n := 0
	for n < len(hashes) && slices.Contains(m.eps[id], hashes[n]) {
		n++
	}
	return n
}

func (m *model) blocks() int {
	seen := map[uint64]bool{}
	for _, l := range m.eps {
		for _, h := range l {
			seen[h] = true
		}
	}
	return len(seen)
}

// TestIndexAgreesWithAReferenceModel runs random operations on an Index and
// on the reference model and compares them after each. A Match precedes
// every step, so Record often runs with hints from another prompt; the small
// capacity makes prompts longer than an endpoint's LRU.
func TestIndexAgreesWithAReferenceModel(t *testing.T) {
	for _, capacity := range []int{5, 20} {
		t.Run(fmt.Sprint("capacity=", capacity), func(t *testing.T) { testAgainstModel(t, capacity) })
	}
}

func testAgainstModel(t *testing.T, capacity int) {
	rng := rand.New(rand.NewPCG(7, uint64(capacity)))
	// Prompts sharing prefixes of various lengths, so blocks are shared.
	var prompts [][]uint64
	for i := range 12 {
		base := text(fmt.Sprint("base", i%3), (i%5)*16)
		prompts = append(prompts, HashSalted(nil, "m", "", append(base, text(fmt.Sprint("tail", i), 8*16)...), 16))
	}
	x := NewIndex(capacity)
	ref := &model{capacity: capacity, eps: map[int][]uint64{}, owner: map[[2]uint64]uint32{}}
	live := []int{}
	for step := range 5000 {
		switch op := rng.IntN(10); {
		case op == 0 || len(live) == 0:
			id := x.Add()
			if _, taken := ref.eps[id]; taken {
				t.Fatalf("step %d: Add returned %d, which is in use", step, id)
			}
			ref.eps[id] = nil
			live = append(live, id)
		case op == 1 && len(live) > 1:
			j := rng.IntN(len(live))
			x.Remove(live[j])
			delete(ref.eps, live[j])
			live = slices.Delete(live, j, j+1)
		case op == 2:
			id, p := live[rng.IntN(len(live))], prompts[rng.IntN(len(prompts))]
			lo := rng.IntN(len(p))
			x.forget(id, p[lo:], false, 0)
			ref.forget(id, p[lo:])
		case op == 3:
			id, p := live[rng.IntN(len(live))], prompts[rng.IntN(len(prompts))]
			lo, owner := rng.IntN(len(p)), uint32(rng.IntN(3))
			x.ForgetOwn(id, p[lo:], owner)
			ref.forgetOwn(id, p[lo:], owner)
		case op == 4:
			x.Tidy(rng.IntN(8) + 1) // removed blocks go a batch at a time
		default:
			id, p := live[rng.IntN(len(live))], prompts[rng.IntN(len(prompts))]
			p = p[:rng.IntN(len(p)+1)]
			owner := uint32(rng.IntN(3))
			record(x, id, p, owner)
			ref.record(id, p, owner)
		}
		q := prompts[rng.IntN(len(prompts))]
		got := match(x, q, live...)
		for i, id := range live {
			if want := ref.match(id, q); got[i] != want {
				t.Fatalf("step %d: endpoint %d matches %d blocks, reference %d", step, id, got[i], want)
			}
			if got := lruOrder(x, id); !slices.Equal(got, ref.eps[id]) {
				t.Fatalf("step %d: endpoint %d LRU order\n got %x\nwant %x", step, id, got, ref.eps[id])
			}
		}
		if len(x.dying) == 0 && x.Blocks() != ref.blocks() {
			t.Fatalf("step %d: %d distinct blocks, reference %d", step, x.Blocks(), ref.blocks())
		}
	}
}

// lruOrder lists the blocks of id, most recently used first, walking the
// list both ways to check its links.
func lruOrder(x *Index, id int) []uint64 {
	var fwd, back []uint64
	for n := x.eps[id].head; n != none; n = x.node(n).next {
		fwd = append(fwd, x.slot(x.node(n).slot).hash)
	}
	for n := x.eps[id].tail; n != none; n = x.node(n).prev {
		back = append(back, x.slot(x.node(n).slot).hash)
	}
	slices.Reverse(back)
	if !slices.Equal(fwd, back) || len(fwd) != x.Len(id) {
		panic("LRU list links disagree")
	}
	return fwd
}

func TestTouchingKnownBlocksDoesNotAllocate(t *testing.T) {
	x := NewIndex(1000)
	ids := []int{x.Add(), x.Add(), x.Add()}
	p := blocks("p", 200)
	record(x, ids[1], p, 0)
	out := make([]int, len(ids))
	allocs := testing.AllocsPerRun(100, func() {
		x.Match(p, ids, out)
		record(x, ids[1], p, 0)
	})
	if allocs != 0 {
		t.Errorf("Match+Record of known blocks allocated %.1f times, want 0", allocs)
	}
}

func TestForgetOwnKeepsBlocksOthersRecordedSince(t *testing.T) {
	x := NewIndex(100)
	a := x.Add()
	shared, mine := blocks("s", 3), blocks("m", 3)
	record(x, a, shared, 1)
	record(x, a, mine, 1)
	record(x, a, shared, 2) // a later request recorded the shared head there too

	x.ForgetOwn(a, append(slices.Clone(shared), mine...), 1)
	if got := match(x, shared, a); got[0] != 3 {
		t.Errorf("the later request's blocks: match %d, want 3 (kept)", got[0])
	}
	if got := match(x, mine, a); got[0] != 0 {
		t.Errorf("the forgotten request's own blocks: match %d, want 0", got[0])
	}
}

func TestRemoveIsConstantTimeAndReclaimIsBounded(t *testing.T) {
	x := NewIndex(10_000)
	a, b := x.Add(), x.Add()
	record(x, a, blocks("a", 10_000), 0)
	record(x, b, blocks("b", 10), 0)
	x.Remove(a)
	if x.Len(a) != 10_000 {
		t.Fatalf("Remove freed %d blocks at once, want none (Reclaim frees them)", 10_000-x.Len(a))
	}
	batches := 0
	for x.Tidy(1000) {
		batches++
		if batches > 10 {
			t.Fatal("Reclaim(1000) did not finish 10,000 blocks in 10 batches")
		}
	}
	if x.Blocks() != 10 {
		t.Errorf("after reclaim %d distinct blocks, want 10 (b's)", x.Blocks())
	}
}

// record records and then tidies fully, in small batches, as the picker
// does right after a pick.
func record(x *Index, id int, hashes []uint64, owner uint32) {
	x.Record(id, hashes, owner)
	for x.Tidy(3) {
	}
}

func TestRecordDefersEvictionToTidy(t *testing.T) {
	x := NewIndex(6)
	e := x.Add()
	pa, pb := blocks("a", 4), blocks("b", 4)
	record(x, e, pa, 0)
	x.Record(e, pb, 0)
	if x.Len(e) != 8 || !x.Untidy() {
		t.Fatalf("after recording 8 blocks on a capacity of 6: %d blocks, untidy %v; want 8 until Tidy", x.Len(e), x.Untidy())
	}
	if x.Tidy(1) != true || x.Len(e) != 7 {
		t.Fatalf("Tidy(1) left %d blocks, want 7 and more to do", x.Len(e))
	}
	if x.Tidy(10) || x.Len(e) != 6 {
		t.Fatalf("Tidy(10) left %d blocks, want 6 and nothing more", x.Len(e))
	}
	if got := match(x, pa, e); got[0] != 2 {
		t.Errorf("pa matches %d blocks, want its head 2 (its tail was least recently used)", got[0])
	}
}

func TestSetCapacityShrinksOneEndpoint(t *testing.T) {
	x := NewIndex(100)
	a, b := x.Add(), x.Add()
	p := blocks("p", 50)
	record(x, a, p, 0)
	record(x, b, p, 0)
	x.SetCapacity(a, 10)
	for x.Tidy(4) {
	}
	if x.Len(a) != 10 || x.Len(b) != 50 || x.Capacity(a) != 10 || x.Capacity(b) != 100 {
		t.Errorf("after SetCapacity(a, 10): a holds %d (cap %d), b %d (cap %d); want 10 (10) and 50 (100)",
			x.Len(a), x.Capacity(a), x.Len(b), x.Capacity(b))
	}
	if got := match(x, p, a, b); !slices.Equal(got, []int{10, 50}) {
		t.Errorf("match = %v, want [10 50]: a keeps the prompt's head", got)
	}
}
