package engine

import (
	"slices"
	"testing"
	"time"
)

// A prefill leg ends after its token and keeps its blocks, in use, for the
// lease; then they are freed but stay cached.
func TestPrefillLegHoldsBlocksForTheLease(t *testing.T) {
	cfg := DefaultConfig()
	cfg.KVLease = 2 * time.Second
	e := newEngine(t, cfg)
	hashes := chain(blocksOf(1, 64)...)
	mustAdd(t, e, Request{ID: "p", PromptTokens: 64 * 16, OutputTokens: 1, BlockHashes: hashes, RemoteDecode: true})
	fin := runUntil(t, e, Finished, "p")
	if fin.OutputTokens != 1 {
		t.Fatalf("prefill leg finished after %d tokens, want 1", fin.OutputTokens)
	}
	st := e.Stats()
	if st.HeldRequests != 1 || st.KVBlocksInUse != 65 || st.RunningRequests != 0 {
		t.Fatalf("after the prefill leg: held %d, blocks in use %d, running %d; want 1, 65 (64 prompt + 1 output), 0",
			st.HeldRequests, st.KVBlocksInUse, st.RunningRequests)
	}
	ids, ok := e.HeldBlockIDs("p")
	if !ok || len(ids) != 64 {
		t.Fatalf("HeldBlockIDs = %d ids, %v; want the 64 prompt blocks, true", len(ids), ok)
	}
	if slices.Contains(ids[1:], ids[0]) {
		t.Fatalf("HeldBlockIDs repeats a block: %v", ids)
	}

	e.AdvanceTo(fin.At + cfg.KVLease - time.Millisecond)
	if st := e.Stats(); st.HeldRequests != 1 || st.KVBlocksInUse != 65 {
		t.Fatalf("just before the lease ends: held %d, in use %d; want 1, 65", st.HeldRequests, st.KVBlocksInUse)
	}
	e.AdvanceTo(fin.At + cfg.KVLease)
	st = e.Stats()
	if st.HeldRequests != 0 || st.KVBlocksInUse != 0 || st.LeasesExpired != 1 || st.KVBlocksCached != 64 {
		t.Fatalf("at the lease's end: held %d, in use %d, expired %d, cached %d; want 0, 0, 1, 64",
			st.HeldRequests, st.KVBlocksInUse, st.LeasesExpired, st.KVBlocksCached)
	}
	if e.Release("p") {
		t.Fatal("Release after the lease ran out reported the leg held")
	}
	if _, ok := e.HeldBlockIDs("p"); ok {
		t.Fatal("HeldBlockIDs after the lease ran out reported the leg held")
	}
}

func TestReleaseFreesAHeldLegOnce(t *testing.T) {
	e := newEngine(t, DefaultConfig())
	mustAdd(t, e, Request{ID: "p", PromptTokens: 160, OutputTokens: 1, BlockHashes: chain(blocksOf(1, 10)...), RemoteDecode: true})
	runUntil(t, e, Finished, "p")
	if !e.Release("p") {
		t.Fatal("Release of a held leg reported it unknown")
	}
	if e.Release("p") {
		t.Fatal("a second Release reported the leg still held")
	}
	st := e.Stats()
	if st.KVBlocksInUse != 0 || st.LeasesReleased != 1 || st.LeasesExpired != 0 {
		t.Fatalf("after Release: in use %d, released %d, expired %d; want 0, 1, 0", st.KVBlocksInUse, st.LeasesReleased, st.LeasesExpired)
	}
	if err := e.Add(Request{ID: "x", PromptTokens: 1, OutputTokens: 1, RemoteDecode: true, RemotePrefill: true}); err == nil {
		t.Fatal("Add took a request that is both a prefill and a decode leg")
	}
}

// A decode leg computes one prompt token, after pulling its blocks; the
// same prompt computed locally takes its whole prefill.
func TestDecodeLegPullsInsteadOfPrefilling(t *testing.T) {
	cfg := DefaultConfig()
	cfg.KVTransferDurationPerBlock = time.Millisecond
	const blocks = 1000 // 16,000 tokens: about 0.33 s of prefill, 1 s of transfer
	e := newEngine(t, cfg)
	mustAdd(t, e, Request{ID: "d", PromptTokens: blocks * 16, OutputTokens: 4, BlockHashes: chain(blocksOf(1, blocks)...), RemotePrefill: true})

	d, evs := e.Step() // admits d and starts its transfer
	if len(evs) != 0 || d != cfg.StepBaseDuration {
		t.Fatalf("admission step: %v, events %v; want an empty step of %v", d, evs, cfg.StepBaseDuration)
	}
	st := e.Stats()
	if st.WaitingRequests != 1 || st.RunningRequests != 0 || st.KVBlocksInUse != blocks+1 || st.KVBlocksPulled != blocks {
		t.Fatalf("during the transfer: waiting %d, running %d, in use %d, pulled %d; want 1, 0, %d, %d",
			st.WaitingRequests, st.RunningRequests, st.KVBlocksInUse, st.KVBlocksPulled, blocks+1, blocks)
	}
	if next, ok := e.NextEventAt(); !ok || next != blocks*time.Millisecond {
		t.Fatalf("NextEventAt = %v, %v; want the transfer's end %v", next, ok, blocks*time.Millisecond)
	}
	first := runUntil(t, e, FirstToken, "d")
	oneToken := cfg.StepBaseDuration + cfg.PrefillDurationPerToken
	if want := blocks*time.Millisecond + oneToken; first.At != want {
		t.Fatalf("first token at %v, want the transfer's end plus a one-token step: %v", first.At, want)
	}
	runUntil(t, e, Finished, "d")
	if st := e.Stats(); st.PrefillTokens != 1 || st.KVBlocksInUse != 0 {
		t.Fatalf("after the decode leg: %d prefill tokens computed, %d blocks in use; want 1, 0", st.PrefillTokens, st.KVBlocksInUse)
	}

	local := newEngine(t, cfg)
	mustAdd(t, local, Request{ID: "l", PromptTokens: blocks * 16, OutputTokens: 4, BlockHashes: chain(blocksOf(1, blocks)...)})
	if lf := runUntil(t, local, FirstToken, "l"); lf.At < 16*blocks*cfg.PrefillDurationPerToken {
		t.Fatalf("the local prefill's first token at %v, before its prefill time", lf.At)
	}
}

// A decode leg pulls only the blocks its engine does not cache, and the
// blocks it pulled serve later requests from the cache.
func TestDecodeLegPullsOnlyUncachedBlocks(t *testing.T) {
	cfg := DefaultConfig()
	e := newEngine(t, cfg)
	mustAdd(t, e, Request{ID: "warm", PromptTokens: 40 * 16, OutputTokens: 1, BlockHashes: chain(blocksOf(1, 40)...)})
	runUntil(t, e, Finished, "warm")
	mustAdd(t, e, Request{ID: "d", PromptTokens: 100 * 16, OutputTokens: 1, BlockHashes: chain(blocksOf(1, 100)...), RemotePrefill: true})
	runUntil(t, e, Finished, "d")
	st := e.Stats()
	if st.KVBlocksPulled != 60 {
		t.Fatalf("pulled %d blocks, want the 60 not cached", st.KVBlocksPulled)
	}
	if got := e.CachedPrefixTokens(chain(blocksOf(1, 100)...), 100*16+1); got != 100*16 {
		t.Fatalf("after the decode leg the cache holds %d tokens of its prompt, want %d", got, 100*16)
	}
}

// A transfer counts against MaxRunningRequests, as vLLM admits it.
func TestTransfersCountAsAdmitted(t *testing.T) {
	cfg := DefaultConfig()
	cfg.MaxRunningRequests = 1
	e := newEngine(t, cfg)
	mustAdd(t, e, Request{ID: "d", PromptTokens: 1600, OutputTokens: 1, RemotePrefill: true})
	mustAdd(t, e, Request{ID: "n", PromptTokens: 16, OutputTokens: 1})
	e.Step()
	if st := e.Stats(); st.WaitingRequests != 2 || st.RunningRequests != 0 {
		t.Fatalf("with one slot taken by a transfer: waiting %d, running %d; want 2, 0", st.WaitingRequests, st.RunningRequests)
	}
	if !e.Cancel("d") {
		t.Fatal("Cancel of a transferring leg reported it unknown")
	}
	if st := e.Stats(); st.KVBlocksInUse != 0 || st.WaitingRequests != 1 {
		t.Fatalf("after cancelling the transfer: in use %d, waiting %d; want 0, 1", st.KVBlocksInUse, st.WaitingRequests)
	}
	runUntil(t, e, Finished, "n")
}
