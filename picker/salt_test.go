package picker

import "testing"

// TestCacheSaltSeparatesPrefixes: a model server never shares KV cache
// between requests whose cache salts differ, so neither does the prefix
// index; the same salt shares as the same model does.
func TestCacheSaltSeparatesPrefixes(t *testing.T) {
	p := newPicker(t, 3, testConfig(), Options{})
	prompt := text("shared system prompt", 64*40)
	salted := func(salt string) Request {
		r := on(addr(0), prompt)
		r.CacheSalt = salt
		return r
	}
	first := mustPick(t, p, salted("tenant-a"))
	defer p.End(first, Outcome{})

	for _, tc := range []struct {
		name       string
		salt       string
		wantCached bool
	}{
		{"same salt", "tenant-a", true},
		{"another salt", "tenant-b", false},
		{"no salt", "", false},
	} {
		r := mustPick(t, p, salted(tc.salt))
		if got := cachedTokens(r) > 0; got != tc.wantCached {
			t.Errorf("%s: %d cached tokens on the endpoint that holds the tenant-a prefix; want cached %v", tc.name, cachedTokens(r), tc.wantCached)
		}
		p.End(r, Outcome{})
	}

	// Unsalted requests hash as before: the index holds the unsalted chain
	// of an unsalted pick.
	plain := mustPick(t, p, on(addr(1), prompt))
	p.End(plain, Outcome{})
	if got := heldBlocks(p, prompt, addr(1)); got != 40 {
		t.Errorf("unsalted pick recorded %d blocks of prefix.Hash's chain on its endpoint, want 40", got)
	}
	if got := heldBlocks(p, prompt, addr(0)); got != 40 {
		// addr(0) received the no-salt request of the table above.
		t.Errorf("%d unsalted blocks on endpoint 0, want 40", got)
	}
}
