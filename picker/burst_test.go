package picker

import (
	"fmt"
	"net/netip"
	"sync"
	"testing"
)

const (
	burstRequests    = 128
	burstPromptChars = 128_000 // 32,000 tokens at 4 characters per token
)

// burst picks one request per prompt from as many goroutines at once and
// releases none until all are placed. It returns how many each endpoint got.
func burst(t *testing.T, p *Picker, prompts [][]byte) map[netip.AddrPort]int {
	t.Helper()
	var (
		start = make(chan struct{})
		wg    sync.WaitGroup
		res   = make([]*Reservation, len(prompts))
		errs  = make([]error, len(prompts))
	)
	for i, pr := range prompts {
		wg.Go(func() {
			<-start
			res[i], errs[i] = p.pick(Request{Model: model, Prompt: pr})
		})
	}
	close(start)
	wg.Wait()

	split := map[netip.AddrPort]int{}
	for i, r := range res {
		if errs[i] != nil {
			t.Fatalf("pick %d: %v", i, errs[i])
		}
		split[endpointOf(r)]++
	}
	if in := p.Snapshot().InFlight; in != len(prompts) {
		t.Errorf("ledger holds %d requests after the burst, want %d", in, len(prompts))
	}
	for _, r := range res {
		p.End(r, Outcome{})
	}
	assertLedgerEmpty(t, p)
	return split
}

// burstPrompts returns burstRequests prompts of burstPromptChars that start
// with shared and go on with text unique to each.
func burstPrompts(shared []byte, tag string) [][]byte {
	n := burstPromptChars - len(shared)
	pool := text(tag, n+burstRequests*97)
	out := make([][]byte, burstRequests)
	for i := range out {
		unique := fmt.Appendf(nil, "%s request %d: ", tag, i)
		out[i] = join(shared, unique, pool[i*97:i*97+n-len(unique)])
	}
	return out
}

// warm places shared on one endpoint with a request that completes, and
// returns that endpoint.
func warm(t *testing.T, p *Picker, shared []byte) netip.AddrPort {
	r := mustPick(t, p, Request{Model: model, Prompt: shared})
	p.FirstByte(r)
	p.End(r, Outcome{})
	return endpointOf(r)
}

func splitString(p *Picker, split map[netip.AddrPort]int, holder netip.AddrPort) string {
	s := ""
	for _, st := range p.Snapshot().Endpoints {
		mark := ""
		if st.Endpoint.Address == holder {
			mark = " (held the prefix)"
		}
		s += fmt.Sprintf(" %s=%d%s", st.Endpoint.Address, split[st.Endpoint.Address], mark)
	}
	return s
}

func assertEven(t *testing.T, split map[netip.AddrPort]int) {
	t.Helper()
	total := 0
	for a, n := range split {
		total += n
		if n != 42 && n != 43 {
			t.Errorf("%s got %d requests, want 42 or 43", a, n)
		}
	}
	if len(split) != 3 || total != burstRequests {
		t.Errorf("split %v covers %d endpoints and %d requests, want 3 and %d", split, len(split), total, burstRequests)
	}
}

func TestBurstWithAWarmSharedPrefixSpreadsEvenly(t *testing.T) {
	p := newPicker(t, 3, testConfig(), Options{})
	shared := text("system prompt", 2048) // 512 tokens
	holder := warm(t, p, shared)
	if heldBlocks(p, shared, holder) != 2048/64 {
		t.Fatalf("the earlier request did not leave its prefix on %s", holder)
	}

	split := burst(t, p, burstPrompts(shared, "warm"))
	t.Logf("warm 512-token prefix, 128 x 32k tokens:%s", splitString(p, split, holder))
	assertEven(t, split)
}

func TestBurstWithAColdSharedPrefixSpreadsEvenly(t *testing.T) {
	p := newPicker(t, 3, testConfig(), Options{})
	split := burst(t, p, burstPrompts(text("fresh system prompt", 2048), "cold"))
	t.Logf("cold 512-token prefix, 128 x 32k tokens:%s", splitString(p, split, netip.AddrPort{}))
	assertEven(t, split)
}

func TestBurstWithALongHeldPrefixFavoursItsHolderButSpills(t *testing.T) {
	p := newPicker(t, 3, testConfig(), Options{})
	shared := text("long document", 120_000) // 30,000 tokens
	holder := warm(t, p, shared)

	split := burst(t, p, burstPrompts(shared, "long"))
	t.Logf("30,000-token prefix held by one endpoint, 128 x 32k tokens:%s", splitString(p, split, holder))
	for _, st := range p.Snapshot().Endpoints {
		a := st.Endpoint.Address
		if split[a] == 0 {
			t.Errorf("%s got no request: a held prefix must not take the whole burst", a)
		}
		if a != holder && split[a] >= split[holder] {
			t.Errorf("%s got %d requests, the prefix holder %d: the holder should take the most", a, split[a], split[holder])
		}
	}
}
