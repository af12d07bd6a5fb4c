package picker

import "github.com/tallyepp/tally/api/v1alpha1"

// blockLayout says how a prompt is cut into the blocks the prefix index
// matches: the first three quarters of maxPromptBlocks are blockSizeChars
// long, where prompts sharing a system prompt or a conversation's history
// part, and the rest are coarseFactor times as long. With the defaults (500
// blocks of 512 characters) that is about 48,000 tokens in 128-token
// blocks, then about 256,000 more in 2,048-token blocks: a long-context
// prompt is still matched to most of its length, in a bounded number of
// blocks.
type blockLayout struct {
	fine        int // blocks of blockSizeChars
	fineChars   int
	coarseChars int
	// inLock is how many leading blocks a pick records inside its critical
	// section: those of the first inLockTokens tokens. The rest follow in a
	// lock hold of their own.
	inLock int
}

// inLockTokens bounds the prompt a pick's critical section records, so that
// a huge prompt holds it no longer than a 32,000-token one.
const inLockTokens = 32_000

const coarseFactor = 16

func newBlockLayout(cfg v1alpha1.PickerConfig) blockLayout {
	fine := max(cfg.MaxPromptBlocks*3/4, 1)
	b := blockLayout{fine: fine, fineChars: cfg.BlockSizeChars, coarseChars: cfg.BlockSizeChars * coarseFactor}
	b.inLock = max(b.count(inLockTokens*cfg.CharsPerToken), 1)
	return b
}

// chars is the prompt length the first n blocks cover.
func (b blockLayout) chars(n int) int {
	if n <= b.fine {
		return n * b.fineChars
	}
	return b.fine*b.fineChars + (n-b.fine)*b.coarseChars
}

// count is how many whole blocks the first chars characters make.
func (b blockLayout) count(chars int) int {
	if chars <= b.fine*b.fineChars {
		return chars / b.fineChars
	}
	return b.fine + (chars-b.fine*b.fineChars)/b.coarseChars
}
