// Package prefix estimates, for a prompt, how much of it each endpoint
// already holds in its KV cache: prompts are cut into fixed-size blocks, each
// block is named by a hash chained over everything before it, and an Index
// remembers which endpoints recently received which blocks.
//
// The invariant not to break: a block hash stands for the whole prompt up to
// and including that block (h_i depends on h_{i-1}). Matching therefore only
// ever counts leading blocks; a hash that does not chain would make two
// prompts that share a middle block look like they share a prefix.
package prefix

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// HashSalted appends to dst the chained hashes of the full blocks of
// prompt, each blockSize bytes long, and returns the extended slice:
//
//	h_0 = xxhash(seed(model, salt) ‖ xxhash(block_0))
//	h_i = xxhash(h_{i-1} ‖ xxhash(block_i))
//
// where ‖ is concatenation with the 64-bit values written little-endian.
// Hashing each block alone, then the 16-byte pair, needs no copy of the
// block next to the previous hash. The model name seeds the chain because
// two models never share KV cache, and so does the request's cache salt
// (vLLM's "cache_salt"): a server never shares KV cache between requests
// whose salts differ.
//
//	seed(model, "")   = xxhash(model)
//	seed(model, salt) = xxhash(model ‖ 0x00 ‖ salt)
//
// The NUL keeps ("ab", "c") and ("a", "bc") apart; no served model name
// contains one. The seed only steers placement: a crafted name that
// collided with it would share routing, never a server's cache. A trailing
// partial block is not hashed: it cannot be matched reliably and a model
// server caches whole blocks only. HashSalted does not allocate when dst has
// capacity for len(prompt)/blockSize more hashes. A blockSize below 1
// hashes nothing.
func HashSalted(dst []uint64, model, salt string, prompt []byte, blockSize int) []uint64 {
	if blockSize < 1 {
		return dst
	}
	return chain(dst, seed(model, salt), prompt, blockSize)
}

// HashTiered hashes the first fineBlocks full blocks of prompt as
// HashSalted does with blockSize, then continues the same chain over blocks
// of coarseSize bytes, at most maxBlocks hashes in all: a long prompt is
// matched finely where prompts usually part (their head) and coarsely in
// its tail, in a bounded number of blocks. The chain is one chain, so the
// invariant holds across the change of size: each hash stands for the
// whole prompt up to the end of its block.
func HashTiered(dst []uint64, model, salt string, prompt []byte, blockSize, fineBlocks, coarseSize, maxBlocks int) []uint64 {
	if blockSize < 1 || maxBlocks < 1 {
		return dst
	}
	fineBlocks = min(fineBlocks, maxBlocks)
	start := len(dst)
	fine := min(len(prompt), fineBlocks*blockSize)
	dst = HashSalted(dst, model, salt, prompt[:fine], blockSize)
	if len(dst)-start < fineBlocks || coarseSize < 1 {
		return dst
	}
	h := seed(model, salt)
	if len(dst) > start {
		h = dst[len(dst)-1]
	}
	tail := prompt[fine:]
	tail = tail[:min(len(tail), (maxBlocks-fineBlocks)*coarseSize)]
	return chain(dst, h, tail, coarseSize)
}

func seed(model, salt string) uint64 {
	if salt == "" {
		return xxhash.Sum64String(model)
	}
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString(model) // Digest writes never fail.
	_, _ = d.Write([]byte{0})
	_, _ = d.WriteString(salt)
	return d.Sum64()
}

// chain appends the hashes of prompt's full blocks, chained on from h.
// Its frame stays small: a goroutine's first stack holds it, where a copy
// of each block on the stack made every stream's goroutine grow its stack
// (a tenth of a pick's CPU).
func chain(dst []uint64, h uint64, prompt []byte, blockSize int) []uint64 {
	var pair [16]byte
	for off := 0; off+blockSize <= len(prompt); off += blockSize {
		binary.LittleEndian.PutUint64(pair[:8], h)
		binary.LittleEndian.PutUint64(pair[8:], xxhash.Sum64(prompt[off:off+blockSize]))
		h = xxhash.Sum64(pair[:])
		dst = append(dst, h)
	}
	return dst
}
