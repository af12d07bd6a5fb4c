package prefix

import "math/bits"

// Index remembers which endpoints hold which prompt blocks.
//
// Layout and invariants (the picker's mutex guards an Index; it has no lock):
//
//   - Endpoints are small integer ids handed out by Add. Remove is O(1): it
//     marks the id dying and queues it; Tidy frees a dying id's blocks a
//     bounded batch at a time, and only an id with no blocks left is reused
//     by a later Add (so a reused id always starts empty, and a bit in a
//     holder bitset always belongs to the id's current owner). A dying id is
//     never a candidate: Match only reads the bits of the ids it is given.
//     Small dense ids let "which endpoints hold block h" be a bitset of
//     words uint64s, and the match of every candidate be found in one walk.
//   - slotOf maps a block hash to a slot. A slot exists exactly while at least
//     one endpoint holds the block; its holder bitset (held(slot)) has bit id
//     set exactly when endpoint id holds it, and its holder chain links one
//     node per holding endpoint.
//   - A node is one (block, endpoint) pair. It sits on two doubly linked
//     lists: the slot's holder chain and the endpoint's LRU list (head = most
//     recently used). Record never evicts: an endpoint it takes over
//     capacity is queued, and Tidy evicts its tail back to capacity, a
//     bounded batch at a time. So a pick's critical section only inserts,
//     and the evictions run in short holds of the lock right after it; a
//     list exceeds capacity by at most the blocks recorded since the last
//     Tidy.
//   - Each node carries the owner tag of the last Record that touched it,
//     so ForgetOwn can take back what one request recorded without taking
//     blocks that a later request recorded (or touched) on the same endpoint.
//   - Record leaves a prompt's blocks at the head of the list in prompt order,
//     as if it touched them last to first: a prompt's first blocks are the
//     most recently used, so eviction drops prompt tails before prompt heads
//     and keeps the leading-block matches that count.
//   - Nodes, slots and bitsets live in fixed-size pages and are recycled
//     through free lists, so touching known blocks allocates nothing, and new
//     blocks allocate only a fresh page (never copying the older ones) or grow
//     the map, until the endpoints' LRUs are full.
type Index struct {
	capacity int

	slotOf   map[uint64]int32
	slots    pages[slot]
	freeSlot int32 // head of the free slot list, linked through slot.holders

	words int        // bitset words per slot
	bits  [][]uint64 // holder bitsets, one page per page of slots

	nodes    pages[node]
	freeNode int32 // head of the free node list, linked through node.next

	eps     []lru
	freeIDs []int
	dying   []int // removed ids whose blocks Tidy has not freed yet
	over    []int // ids whose lists Record took over capacity

	// Scratch for Match, sized with eps.
	alive   []uint64
	matchOf []int
	// hint[i] is the slot Match found for block i of the prompt it walked.
	// Record checks a hint against the slot's hash before trusting it, so a
	// hint that went stale (or belongs to another prompt) only costs a map
	// lookup: it saves the second lookup when a pick records the prompt it
	// just matched.
	hint []int32
}

const (
	none int32 = -1

	pageShift = 12
	pageSize  = 1 << pageShift
	pageMask  = pageSize - 1
)

// pages is a slice that grows by whole pages, so that growing never copies
// (and never stalls the caller's critical section on a large copy).
type pages[T any] struct {
	p [][]T
	n int32
}

func (s *pages[T]) at(i int32) *T { return &s.p[i>>pageShift][i&pageMask] }

// add appends a zero element and returns its index.
func (s *pages[T]) add() int32 {
	if int(s.n>>pageShift) == len(s.p) {
		s.p = append(s.p, make([]T, pageSize))
	}
	s.n++
	return s.n - 1
}

type slot struct {
	hash    uint64
	holders int32 // first node of the holder chain; next free slot when free
}

type node struct {
	slot                   int32
	id                     int32
	owner                  uint32 // tag of the last Record that touched it
	prev, next             int32  // the endpoint's LRU list; prev is more recent
	prevHolder, nextHolder int32  // the slot's holder chain
}

type lru struct {
	head, tail int32
	n          int
	capacity   int  // blocks remembered at most (after Tidy)
	live       bool // false once removed (dying, or free)
	over       bool // listed in Index.over
}

// NewIndex returns an empty index that remembers at most capacityBlocks
// blocks per endpoint (at least 1) unless SetCapacity says otherwise.
func NewIndex(capacityBlocks int) *Index {
	return &Index{
		capacity: max(capacityBlocks, 1),
		slotOf:   make(map[uint64]int32),
		freeSlot: none,
		freeNode: none,
		words:    1,
		alive:    make([]uint64, 1),
	}
}

// Add returns an id for a new endpoint, reusing a removed one if any. The id
// holds no blocks.
func (x *Index) Add() int {
	if n := len(x.freeIDs); n > 0 {
		id := x.freeIDs[n-1]
		x.freeIDs = x.freeIDs[:n-1]
		x.eps[id] = lru{head: none, tail: none, capacity: x.capacity, live: true}
		return id
	}
	id := len(x.eps)
	x.eps = append(x.eps, lru{head: none, tail: none, capacity: x.capacity, live: true})
	x.matchOf = append(x.matchOf, 0)
	if id >= x.words*64 {
		x.growWords(x.words * 2)
	}
	return id
}

// growWords widens every slot's bitset; it runs only when Add passes a
// multiple of 64 ids.
func (x *Index) growWords(words int) {
	for i, old := range x.bits {
		nb := make([]uint64, pageSize*words)
		for j := range pageSize {
			copy(nb[j*words:], old[j*x.words:(j+1)*x.words])
		}
		x.bits[i] = nb
	}
	x.words = words
	x.alive = make([]uint64, words)
}

// Remove forgets endpoint id in O(1): it stops being an endpoint at once
// (it must no longer be passed to Match, Record or ForgetOwn), and Tidy frees
// its blocks later. Removing an id that is not in use does nothing.
func (x *Index) Remove(id int) {
	if id < 0 || id >= len(x.eps) || !x.eps[id].live {
		return
	}
	x.eps[id].live = false
	x.dying = append(x.dying, id)
}

// Tidy evicts the least recently used blocks of endpoints that Record took
// over capacity, then frees the blocks of removed endpoints, at most budget
// blocks in all, and makes an id reusable once all of its blocks are freed.
// It reports whether work remains, so a caller can run it in short batches,
// each under its own hold of the lock that guards the index.
func (x *Index) Tidy(budget int) (more bool) {
	for budget > 0 && len(x.over) > 0 {
		id := x.over[len(x.over)-1]
		e := &x.eps[id]
		for ; budget > 0 && e.live && e.n > e.capacity; budget-- {
			x.evictTail(id)
		}
		if !e.live || e.n <= e.capacity {
			e.over = false
			x.over = x.over[:len(x.over)-1]
		}
	}
	for budget > 0 && len(x.over) == 0 && len(x.dying) > 0 {
		id := x.dying[len(x.dying)-1]
		e := &x.eps[id]
		for ; budget > 0 && e.tail != none; budget-- {
			x.evictTail(id)
		}
		if e.tail == none {
			*e = lru{head: none, tail: none}
			x.dying = x.dying[:len(x.dying)-1]
			x.freeIDs = append(x.freeIDs, id)
		}
	}
	return len(x.over) > 0 || len(x.dying) > 0
}

// Untidy reports whether Tidy has work to do.
func (x *Index) Untidy() bool { return len(x.over) > 0 || len(x.dying) > 0 }

func (x *Index) evictTail(id int) {
	t := x.eps[id].tail
	x.dropHolder(t)
	x.unlinkLRU(id, t)
	x.freeNodeAt(t)
}

// Len reports how many blocks endpoint id holds.
func (x *Index) Len(id int) int { return x.eps[id].n }

// Blocks reports how many distinct blocks at least one endpoint holds,
// counting removed endpoints and blocks over capacity until Tidy frees them.
func (x *Index) Blocks() int { return len(x.slotOf) }

// Record notes that endpoint id now holds every block in hashes, making them
// its most recently used with hashes[0] first, and tags them with owner.
// Blocks beyond the endpoint's capacity are evicted, least recently used
// first, by the next Tidy.
func (x *Index) Record(id int, hashes []uint64, owner uint32) {
	e := &x.eps[id]
	// Leading blocks that already head the endpoint's list, in prompt order,
	// stay where they are: recording a prompt the endpoint just received (or
	// one sharing its head) does no list surgery for them. The rest go right
	// after them, last block first, which leaves the same order as touching
	// every block last to first.
	k, anchor := 0, none
	for cur := e.head; k < len(hashes) && cur != none; k++ {
		s, ok := x.lookup(k, hashes[k])
		if !ok || x.node(cur).slot != s {
			break
		}
		x.node(cur).owner = owner
		anchor, cur = cur, x.node(cur).next
	}
	if k >= e.capacity {
		return // the list is all prompt head: later blocks would be evicted at once
	}
	for i := len(hashes) - 1; i >= k; i-- {
		h := hashes[i]
		s, known := x.lookup(i, h)
		if known && x.has(s, id) {
			n := x.holderNode(s, id)
			x.node(n).owner = owner
			if n != anchor { // n == anchor only for a repeated hash
				x.unlinkLRU(id, n)
				x.insertAfter(id, anchor, n)
			}
			continue
		}
		if !known {
			s = x.newSlot(h)
			x.slotOf[h] = s
		}
		n := x.newNode(s, int32(id))
		x.node(n).owner = owner
		x.addHolder(s, n)
		x.insertAfter(id, anchor, n)
	}
	x.checkCapacity(id)
}

// SetCapacity sets how many blocks endpoint id remembers (at least 1); a
// smaller capacity than it holds is enforced by the next Tidy.
func (x *Index) SetCapacity(id, blocks int) {
	x.eps[id].capacity = max(blocks, 1)
	x.checkCapacity(id)
}

// Capacity reports how many blocks endpoint id remembers.
func (x *Index) Capacity(id int) int { return x.eps[id].capacity }

func (x *Index) checkCapacity(id int) {
	if e := &x.eps[id]; e.n > e.capacity && !e.over {
		e.over = true
		x.over = append(x.over, id)
	}
}

// ForgetOwn drops the blocks in hashes from endpoint id where it holds them
// and the last Record to touch them was tagged owner: a block another
// request recorded there since is kept.
func (x *Index) ForgetOwn(id int, hashes []uint64, owner uint32) { x.forget(id, hashes, true, owner) }

func (x *Index) forget(id int, hashes []uint64, onlyOwned bool, owner uint32) {
	for _, h := range hashes {
		s, ok := x.slotOf[h]
		if !ok || !x.has(s, id) {
			continue
		}
		n := x.holderNode(s, id)
		if onlyOwned && x.node(n).owner != owner {
			continue
		}
		x.dropHolder(n)
		x.unlinkLRU(id, n)
		x.freeNodeAt(n)
	}
}

// Match sets matched[i] to the number of leading blocks of hashes that
// endpoint ids[i] holds, for every i (matched must be as long as ids). It
// walks the blocks once for all ids and stops at the first block that no
// candidate still matching holds.
func (x *Index) Match(hashes []uint64, ids []int, matched []int) {
	alive := x.alive
	clear(alive)
	for _, id := range ids {
		alive[id>>6] |= 1 << (id & 63)
		x.matchOf[id] = 0
	}
	done := len(hashes)
	x.hint = x.hint[:0]
	for i, h := range hashes {
		s, ok := x.slotOf[h]
		if !ok {
			done = i
			break
		}
		x.hint = append(x.hint, s)
		held := x.held(s)
		anyAlive := false
		for w := range alive {
			still := alive[w] & held[w]
			for dropped := alive[w] &^ still; dropped != 0; dropped &= dropped - 1 {
				x.matchOf[w<<6|bits.TrailingZeros64(dropped)] = i
			}
			alive[w] = still
			anyAlive = anyAlive || still != 0
		}
		if !anyAlive {
			break
		}
	}
	for w, a := range alive {
		for ; a != 0; a &= a - 1 {
			x.matchOf[w<<6|bits.TrailingZeros64(a)] = done
		}
	}
	for i, id := range ids {
		matched[i] = x.matchOf[id]
	}
}

// lookup returns the slot of block i, whose hash is h, if any endpoint
// holds it. It trusts Match's hint for block i only if the slot still has
// hash h (a free slot has hash 0, hence the h != 0 test).
func (x *Index) lookup(i int, h uint64) (int32, bool) {
	if i < len(x.hint) && h != 0 {
		if s := x.hint[i]; x.slot(s).hash == h {
			return s, true
		}
	}
	s, ok := x.slotOf[h]
	return s, ok
}

func (x *Index) node(n int32) *node { return x.nodes.at(n) }
func (x *Index) slot(s int32) *slot { return x.slots.at(s) }

// held is the holder bitset of slot s.
func (x *Index) held(s int32) []uint64 {
	off := int(s&pageMask) * x.words
	return x.bits[s>>pageShift][off : off+x.words]
}

func (x *Index) has(s int32, id int) bool {
	return x.held(s)[id>>6]&(1<<(id&63)) != 0
}

// holderNode finds the node of id in the holder chain of s, which must hold it.
func (x *Index) holderNode(s int32, id int) int32 {
	for n := x.slot(s).holders; ; n = x.node(n).nextHolder {
		if int(x.node(n).id) == id {
			return n
		}
	}
}

func (x *Index) newSlot(h uint64) int32 {
	s := x.freeSlot
	if s != none {
		x.freeSlot = x.slot(s).holders
	} else {
		s = x.slots.add()
		if len(x.bits) < len(x.slots.p) {
			x.bits = append(x.bits, make([]uint64, pageSize*x.words))
		}
	}
	*x.slot(s) = slot{hash: h, holders: none}
	return s
}

func (x *Index) newNode(s, id int32) int32 {
	n := x.freeNode
	if n != none {
		x.freeNode = x.node(n).next
	} else {
		n = x.nodes.add()
	}
	*x.node(n) = node{slot: s, id: id, prev: none, next: none, prevHolder: none, nextHolder: none}
	return n
}

func (x *Index) freeNodeAt(n int32) {
	*x.node(n) = node{slot: none, id: none, next: x.freeNode}
	x.freeNode = n
}

func (x *Index) addHolder(s, n int32) {
	nd, sl := x.node(n), x.slot(s)
	id := int(nd.id)
	x.held(s)[id>>6] |= 1 << (id & 63)
	nd.nextHolder = sl.holders
	if sl.holders != none {
		x.node(sl.holders).prevHolder = n
	}
	sl.holders = n
}

// dropHolder takes node n off its slot, freeing the slot (and its map entry)
// when n was its last holder. It leaves n on its LRU list.
func (x *Index) dropHolder(n int32) {
	nd := x.node(n)
	s, id := nd.slot, int(nd.id)
	sl := x.slot(s)
	x.held(s)[id>>6] &^= 1 << (id & 63)
	if nd.prevHolder != none {
		x.node(nd.prevHolder).nextHolder = nd.nextHolder
	} else {
		sl.holders = nd.nextHolder
	}
	if nd.nextHolder != none {
		x.node(nd.nextHolder).prevHolder = nd.prevHolder
	}
	if sl.holders == none {
		delete(x.slotOf, sl.hash)
		*sl = slot{holders: x.freeSlot}
		x.freeSlot = s
	}
}

// insertAfter links n into id's list right after node at, or at the head
// when at is none.
func (x *Index) insertAfter(id int, at, n int32) {
	e, nd := &x.eps[id], x.node(n)
	next := e.head
	if at != none {
		next = x.node(at).next
		x.node(at).next = n
	} else {
		e.head = n
	}
	nd.prev, nd.next = at, next
	if next != none {
		x.node(next).prev = n
	} else {
		e.tail = n
	}
	e.n++
}

func (x *Index) unlinkLRU(id int, n int32) {
	e, nd := &x.eps[id], x.node(n)
	if nd.prev != none {
		x.node(nd.prev).next = nd.next
	} else {
		e.head = nd.next
	}
	if nd.next != none {
		x.node(nd.next).prev = nd.prev
	} else {
		e.tail = nd.prev
	}
	e.n--
}
