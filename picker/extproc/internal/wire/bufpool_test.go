package wire

import "testing"

func TestDirtyPoolSizes(t *testing.T) {
	var p DirtyPool
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
