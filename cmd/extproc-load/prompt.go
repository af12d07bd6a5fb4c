package main

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"
)

// bytesPerToken is how many prompt bytes stand for one token: both pickers
// estimate about four characters per token.
const bytesPerToken = 4

// Prompt kinds of a burst.
const (
	// kindFresh prompts share nothing: each differs from its first byte.
	kindFresh = "fresh"
	// kindCold prompts share a 512-token prefix that no pod holds yet.
	kindCold = "cold"
	// kindShared prompts share a 512-token prefix one pod already holds.
	kindShared = "shared"
	// kindLong prompts share a 30,000-token prefix one pod already holds.
	kindLong = "long"
)

var burstKinds = []string{kindFresh, kindCold, kindShared, kindLong}

// prefixTokens is the shared prefix of each kind.
func prefixTokens(kind string) int {
	switch kind {
	case kindCold, kindShared:
		return 512
	case kindLong:
		return 30_000
	}
	return 0
}

// corpusBytes is the pseudo-random text prompts are cut from: larger than
// the largest prompt, so different requests get different text.
const corpusBytes = 1 << 20

// prompts builds request bodies. Every body is unique from the point its
// prefix ends (a request tag, then text from a corpus at an offset of its
// own), so prompts share exactly the prefix they are given and nothing
// more, across scenarios too (each scenario takes a new nonce).
type prompts struct {
	corpus []byte
	nonce  atomic.Uint64
}

func newPrompts(seed uint64) *prompts {
	words := []string{"alpha", "beam", "cache", "delta", "engine", "flow", "graph", "hash", "index", "joule",
		"kernel", "layer", "model", "node", "order", "prefix", "query", "route", "token", "vector"}
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, 0, corpusBytes+16)
	for len(b) < corpusBytes {
		b = append(b, words[r.IntN(len(words))]...)
		b = append(b, ' ')
	}
	return &prompts{corpus: b[:corpusBytes]}
}

// newNonce names one scenario run: its prompts and prefixes share nothing
// with another run's.
func (p *prompts) newNonce() uint64 { return p.nonce.Add(1) }

// text returns n bytes of corpus starting at a position derived from key.
func (p *prompts) text(key uint64, n int) []byte {
	n = min(n, len(p.corpus))
	off := int((key * 0x9e3779b97f4a7c15 >> 11) % uint64(len(p.corpus)-n+1))
	return p.corpus[off : off+n]
}

// prefix is the shared prefix of prefixTokens tokens for one scenario run.
func (p *prompts) prefix(nonce uint64, tokens int) []byte {
	if tokens == 0 {
		return nil
	}
	head := fmt.Appendf(nil, "system prompt %d: ", nonce)
	return append(head, p.text(nonce<<20|0xfffff, tokens*bytesPerToken-len(head))...)
}

// body is request i's JSON body: a streamed completion of tokens tokens
// whose prompt starts with prefix.
func (p *prompts) body(nonce uint64, prefix []byte, i, tokens int) []byte {
	total := tokens * bytesPerToken
	b := make([]byte, 0, total+96)
	b = append(b, `{"model":"bench","prompt":"`...)
	start := len(b)
	b = append(b, prefix...)
	b = fmt.Appendf(b, "request %d-%d: ", nonce, i)
	if rest := total - (len(b) - start); rest > 0 {
		b = append(b, p.text(nonce<<20|uint64(i), rest)...)
	}
	return append(b, `","max_tokens":16,"stream":true}`...)
}
