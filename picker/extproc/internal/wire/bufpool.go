package wire

import (
	"math/bits"
	"sync"
)

// DirtyPool is a gRPC buffer pool that hands buffers out as they were
// returned. gRPC's default pool clears each buffer's whole capacity on Get
// (up to a megabyte for one 16 KB frame), though every user writes a
// buffer before reading it: gRPC reads frames into them, the Codec writes
// answers into them. Buffers come in power-of-two tiers from 256 bytes to
// 1 MiB; larger ones are not pooled.
type DirtyPool struct {
	tiers [maxTier - minTier + 1]sync.Pool
}

const (
	minTier = 8  // 256 bytes
	maxTier = 20 // 1 MiB
)

// tier is the tier whose buffers hold n bytes, or -1 past the largest.
func tier(n int) int {
	t := max(bits.Len(uint(max(n, 1)-1)), minTier)
	if t > maxTier {
		return -1
	}
	return t - minTier
}

// Get returns a buffer of length n, holding whatever it held before.
func (p *DirtyPool) Get(n int) *[]byte {
	t := tier(n)
	if t < 0 {
		b := make([]byte, n)
		return &b
	}
	if b, ok := p.tiers[t].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<(t+minTier))
	return &b
}

// Put takes b back for a later Get.
func (p *DirtyPool) Put(b *[]byte) {
	// A buffer goes to the tier it fills: one with room for less (from
	// outside this pool) is dropped.
	c := cap(*b)
	if t := tier(c); t >= 0 && 1<<(t+minTier) == c {
		p.tiers[t].Put(b)
	}
}
