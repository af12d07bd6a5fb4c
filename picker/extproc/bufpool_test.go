package extproc

import "testing"

func TestDirtyPoolSizes(t *testing.T) {
	var p dirtyPool
	for _, c := range []struct{ n, capacity int }{
		{0, 256}, {1, 256}, {256, 256}, {257, 512}, {16384, 16384}, {16385, 32768},
		{1 << 20, 1 << 20}, {1<<20 + 1, 1<<20 + 1},
	} {
		b := p.Get(c.n)
		if len(*b) != c.n || cap(*b) != c.capacity {
			t.Errorf("Get(%d): len %d cap %d, want len %d cap %d", c.n, len(*b), cap(*b), c.n, c.capacity)
		}
		p.Put(b)
	}
	// A buffer from elsewhere, whose capacity is no tier's, never comes back
	// too small for its tier.
	odd := make([]byte, 300)
	p.Put(&odd)
	for range 100 {
		if b := p.Get(400); cap(*b) < 400 {
			t.Fatalf("Get(400) gave a buffer of capacity %d", cap(*b))
		}
	}
}

// A huge body grows into the large pools and gives its buffer back there,
// so the next huge body reuses it instead of allocating: fresh 8 MiB
// buffers per request ran the garbage collector often enough to put a
// small pick's p99 at several times its value alone.
func TestHugeBodiesReuseLargeBuffers(t *testing.T) {
	s := &Server{}
	s.buffers.New = func() any { return new([]byte) }
	chunk := make([]byte, 62_000)
	grow := func() *stream {
		st := &stream{s: s}
		for len(*orEmpty(st.body)) < 9<<20 {
			if err := st.buffer(chunk); err != nil {
				t.Fatal(err)
			}
		}
		return st
	}
	first := grow()
	if c := cap(*first.body); c != 16<<20 {
		t.Fatalf("a 9 MiB body has capacity %d, want the 16 MiB tier's", c)
	}
	kept := &(*first.body)[:1][0]
	first.dropBody()
	second := grow()
	if &(*second.body)[:1][0] != kept {
		// sync.Pool may drop entries under the race detector's
		// randomisation; say so rather than fail on it.
		if raceEnabled {
			t.Skip("the pool dropped the buffer (race detector)")
		}
		t.Error("the second huge body did not reuse the first one's buffer")
	}
	second.dropBody()
	// Small buffers stay in the small pool; large tiers hold only large.
	small := make([]byte, 0, 64<<10)
	s.putBuffer(&small)
	if b := s.getLarge(2 << 20); cap(*b) < 2<<20 {
		t.Errorf("getLarge(2 MiB) gave capacity %d", cap(*b))
	}
}

func orEmpty(b *[]byte) *[]byte {
	if b == nil {
		return new([]byte)
	}
	return b
}
