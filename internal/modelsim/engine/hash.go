package engine

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// TextBlockHashes names each full block of blockBytes bytes of a text
// prompt for Request.BlockHashes: a hash chained over the blocks before it,
// so equal hashes mean equal prefixes. The simulator's server hashes text
// prompts with it, and so must anything that predicts its cache.
func TextBlockHashes(text string, blockBytes int) []uint64 {
	hashes := make([]uint64, len(text)/blockBytes)
	d := xxhash.New()
	var prev [8]byte
	for i := range hashes {
		d.Reset()
		_, _ = d.Write(prev[:])
		_, _ = d.WriteString(text[i*blockBytes : (i+1)*blockBytes])
		hashes[i] = d.Sum64()
		binary.LittleEndian.PutUint64(prev[:], hashes[i])
	}
	return hashes
}

// AdapterBlockHashes keys a prompt's block hashes by the LoRA adapter it
// runs with, as vLLM puts the adapter's name into every block hash: the
// same prompt under another adapter, or the base model, shares no block.
// Each hash is mixed with the adapter alone, so the chain is kept: equal
// keyed hashes still mean equal prefixes under one adapter. The engine
// keys Request.BlockHashes with it; anything that predicts the engine's
// cache across adapters (a routing simulation's bound) keys them the same.
func AdapterBlockHashes(hashes []uint64, adapter string) []uint64 {
	keyed := make([]uint64, len(hashes))
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], xxhash.Sum64String(adapter))
	for i, h := range hashes {
		binary.LittleEndian.PutUint64(b[8:], h)
		keyed[i] = xxhash.Sum64(b[:])
	}
	return keyed
}
