package prefix

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/tallyepp/tally/test/benchcpu"
)

// text returns n bytes that differ from block to block, derived from tag.
func text(tag string, n int) []byte {
	var b bytes.Buffer
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "%s-%d;", tag, i)
	}
	return b.Bytes()[:n]
}

func TestHashFollowsTheDocumentedChain(t *testing.T) {
	for _, bs := range []int{16, 4096, 5000} {
		prompt := text("p", 3*bs)
		got := HashSalted(nil, "llama", "", prompt, bs)
		if len(got) != 3 {
			t.Fatalf("block size %d: %d hashes, want 3", bs, len(got))
		}
		prev := xxhash.Sum64String("llama")
		for i := range 3 {
			buf := binary.LittleEndian.AppendUint64(nil, prev)
			buf = binary.LittleEndian.AppendUint64(buf, xxhash.Sum64(prompt[i*bs:(i+1)*bs]))
			prev = xxhash.Sum64(buf)
			if got[i] != prev {
				t.Fatalf("block size %d, block %d: got %x, want xxhash(h_prev ‖ xxhash(block)) = %x", bs, i, got[i], prev)
			}
		}
	}
}

func TestHashCountsOnlyFullBlocks(t *testing.T) {
	for _, n := range []int{0, 1, 63, 64, 65, 127, 128, 130} {
		if got := len(HashSalted(nil, "m", "", text("x", n), 64)); got != n/64 {
			t.Errorf("%d bytes: %d hashes, want %d", n, got, n/64)
		}
	}
	if got := HashSalted(nil, "m", "", text("x", 640), 0); len(got) != 0 {
		t.Errorf("block size 0: %d hashes, want none", len(got))
	}
}

func TestHashChainsSoOnlyLeadingBlocksAgree(t *testing.T) {
	a := text("a", 5*32)
	b := bytes.Clone(a)
	b[32+3] ^= 1 // differs inside block 1 only
	ha, hb := HashSalted(nil, "m", "", a, 32), HashSalted(nil, "m", "", b, 32)
	if ha[0] != hb[0] {
		t.Errorf("block 0 is identical but hashes differ")
	}
	for i := 1; i < 5; i++ {
		if ha[i] == hb[i] {
			t.Errorf("block %d: hashes agree after an earlier block differed", i)
		}
	}

	// The same content at two positions hashes differently.
	same := bytes.Repeat([]byte("0123456789abcdef"), 2)
	h := HashSalted(nil, "m", "", same, 16)
	if h[0] == h[1] {
		t.Errorf("identical blocks at different positions share a hash")
	}
}

func TestHashIsSeededByModel(t *testing.T) {
	p := text("p", 64)
	if HashSalted(nil, "m1", "", p, 64)[0] == HashSalted(nil, "m2", "", p, 64)[0] {
		t.Errorf("two models give the same block hash")
	}
}

func TestHashAppendsWithoutAllocating(t *testing.T) {
	p := text("p", 64*100)
	dst := append(make([]uint64, 0, 101), 42)
	out := HashSalted(dst, "m", "", p, 64)
	if len(out) != 101 || out[0] != 42 {
		t.Fatalf("Hash did not append to dst: len %d, first %d", len(out), out[0])
	}
	allocs := testing.AllocsPerRun(100, func() { _ = HashSalted(dst[:0], "m", "", p, 64) })
	if allocs != 0 {
		t.Errorf("Hash allocated %.1f times per call with enough capacity, want 0", allocs)
	}
}

func BenchmarkHash(b *testing.B) {
	for _, tokens := range []int{1_000, 8_000, 32_000} {
		p := text("bench", tokens*4)
		dst := make([]uint64, 0, len(p)/64)
		b.Run(fmt.Sprintf("tokens=%dk", tokens/1000), func(b *testing.B) {
			b.SetBytes(int64(len(p)))
			b.ReportAllocs()
			start, ok := benchcpu.ProcessCPU()
			for b.Loop() {
				dst = HashSalted(dst[:0], "bench-model", "", p, 64)
			}
			if end, ok2 := benchcpu.ProcessCPU(); ok && ok2 && end > start {
				b.ReportMetric(float64(len(p))*float64(b.N)/1e6/(end-start).Seconds(), "cpu-MB/s")
			}
		})
	}
}

func TestHashSaltedSeedsTheChainWithModelAndSalt(t *testing.T) {
	p := text("p", 3*64)
	salted := HashSalted(nil, "m", "tenant-a", p, 64)
	prev := xxhash.Sum64([]byte("m\x00tenant-a"))
	for i, h := range salted {
		buf := binary.LittleEndian.AppendUint64(nil, prev)
		prev = xxhash.Sum64(binary.LittleEndian.AppendUint64(buf, xxhash.Sum64(p[i*64:(i+1)*64])))
		if h != prev {
			t.Fatalf("block %d: %x, want xxhash(h_prev ‖ xxhash(block)) from seed xxhash(model ‖ 0 ‖ salt) = %x", i, h, prev)
		}
	}
	// Every block differs between salts, models and no salt; the same salt
	// gives the same chain.
	others := [][]uint64{
		HashSalted(nil, "m", "", p, 64),
		HashSalted(nil, "m", "tenant-b", p, 64),
		HashSalted(nil, "mt", "enant-a", p, 64),
		HashSalted(nil, "m2", "tenant-a", p, 64),
	}
	for _, other := range others {
		for i := range salted {
			if salted[i] == other[i] {
				t.Errorf("block %d shared across salts or models", i)
			}
		}
	}
	if again := HashSalted(nil, "m", "tenant-a", p, 64); !slices.Equal(again, salted) {
		t.Error("the same salt gave another chain")
	}
	// The streaming path for large blocks is seeded alike.
	big := text("b", 5000)
	if a, b := HashSalted(nil, "m", "s", big, 5000), HashSalted(nil, "m", "", big, 5000); a[0] == b[0] {
		t.Error("streaming path: the salt did not seed the chain")
	}
	dst := make([]uint64, 0, 3)
	if allocs := testing.AllocsPerRun(100, func() { _ = HashSalted(dst[:0], "m", "tenant-a", p, 64) }); allocs != 0 {
		t.Errorf("HashSalted allocated %.1f times per call, want 0", allocs)
	}
}

func TestHashTieredContinuesOneChain(t *testing.T) {
	prompt := text("tiered", 64*10+256*3+100)
	fine := HashSalted(nil, "m", "", prompt[:64*10], 64)
	got := HashTiered(nil, "m", "", prompt, 64, 10, 256, 12)
	if len(got) != 12 {
		t.Fatalf("%d hashes, want 10 fine and 2 coarse (the cap)", len(got))
	}
	if !slices.Equal(got[:10], fine) {
		t.Error("the fine head differs from Hash")
	}
	// The coarse tail chains from the last fine hash.
	again := HashTiered(nil, "m", "", append(slices.Clone(prompt[:64*10]), bytes.Repeat([]byte("z"), 256*2)...), 64, 10, 256, 12)
	if again[10] == got[10] || again[9] != got[9] {
		t.Error("coarse blocks do not depend on their own text, or the head changed")
	}
	// A prompt shorter than the fine part hashes as Hash does.
	if short := HashTiered(nil, "m", "", prompt[:64*4], 64, 10, 256, 12); !slices.Equal(short, fine[:4]) {
		t.Error("a short prompt hashes differently from Hash")
	}
}
