package routesim

import (
	"crypto/sha256"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/tallyepp/tally/internal/modelsim/engine"
)

// The expansion of hash_ids into text is internal/stack's, byte for byte, so
// the simulator and the demo replay the same prompts. The golden values
// were computed with stack.TraceRequest.PromptText.
func TestPromptTextMatchesTestStack(t *testing.T) {
	r := Request{InputTokens: 1100, HashIDs: []int{0, 42288, 7}}
	const (
		head = "bgxeqes nrcchd  ysfun    kvet   c erlisfexdsgmqdznndqid u odauakowvojoy vbwocshy"
		sum  = "0722397767c1db542f9dd59b177f25f477b70527a2ccfa118b33a88192953a73"
	)
	for _, cache := range []*idText{{}, newIDText(2), newIDText(1)} {
		var text []byte
		for range 2 { // the second time from the cache
			text = cache.appendPrompt(text[:0], r)
			if len(text) != 4400 {
				t.Fatalf("len = %d, want 4400", len(text))
			}
			if got := string(text[:80]); got != head {
				t.Fatalf("head = %q, want %q", got, head)
			}
			if got := fmt.Sprintf("%x", sha256.Sum256(text)); got != sum {
				t.Fatalf("sha256 = %s, want %s", got, sum)
			}
		}
	}
}

// Two prompts share exactly the engine blocks their leading hash_ids share,
// cut where the shorter one ends.
func TestBlockHashesShareLeadingIDs(t *testing.T) {
	a := Request{InputTokens: 1100, HashIDs: []int{1, 2, 3}}
	b := Request{InputTokens: 1500, HashIDs: []int{1, 2, 4}}
	c := Request{InputTokens: 600, HashIDs: []int{1, 2}}
	ha := engine.TextBlockHashes(string(a.AppendPromptText(nil)), chunkChars)
	hb := engine.TextBlockHashes(string(b.AppendPromptText(nil)), chunkChars)
	hc := engine.TextBlockHashes(string(c.AppendPromptText(nil)), chunkChars)
	if len(ha) != 1100/16 || len(hb) != 1500/16 || len(hc) != 600/16 {
		t.Fatalf("block counts %d %d %d", len(ha), len(hb), len(hc))
	}
	if got := leadingHits(set(ha), hb); got != 64 {
		t.Errorf("a and b share %d blocks, want 64 (two hash_ids)", got)
	}
	if got := leadingHits(set(ha), hc); got != 600/16 {
		t.Errorf("a holds %d blocks of c, want all %d", got, 600/16)
	}
}

func set(hs []uint64) map[uint64]struct{} {
	m := make(map[uint64]struct{})
	for _, h := range hs {
		m[h] = struct{}{}
	}
	return m
}

// The rows themselves are parsed by stack.LoadTrace and tested there; what
// routesim adds is arrivals counted from the first row, in order.
func TestLoadMooncake(t *testing.T) {
	in := `{"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [5, 6]}

{"timestamp": 1500, "input_length": 10, "output_length": 1, "hash_ids": [9]}
`
	reqs, err := LoadMooncake(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 2 || reqs[0].Arrival != 0 || reqs[1].Arrival != 500*time.Millisecond || reqs[1].InputTokens != 10 {
		t.Fatalf("got %+v", reqs)
	}
	back := `{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1]}` + "\n\n" + `{"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": [1]}`
	_, err = LoadMooncake(strings.NewReader(back))
	if want := "line 3: field timestamp: 4 is before the previous row's"; err == nil || err.Error() != want {
		t.Errorf("a row going back in time: error %v, want %q", err, want)
	}
	if _, err := LoadMooncake(strings.NewReader(`{"timestamp": 1, "output_length": 3, "hash_ids": [5]}`)); err == nil {
		t.Error("a malformed row was accepted")
	}
}

func TestLoadAzure(t *testing.T) {
	in := "TIMESTAMP,ContextTokens,GeneratedTokens\n" +
		"2023-11-16 18:15:46.6805900,1500,44\n" +
		"2023-11-16 18:15:50.9951690,300,0\n"
	reqs, err := LoadAzure(strings.NewReader(in), AzurePrefix{Tenants: 1, SystemPromptTokens: 1024, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 2 || reqs[1].Arrival != 4314579*time.Microsecond || reqs[1].OutputTokens != 1 {
		t.Fatalf("got %+v", reqs)
	}
	// One tenant: both start with its two-id system prompt, cut short for
	// the short one; the rest is each request's own.
	if a, b := reqs[0].HashIDs, reqs[1].HashIDs; len(a) != 3 || len(b) != 1 || a[0] != 0 || a[1] != 1 || b[0] != 0 || a[2] < 2 {
		t.Fatalf("hash ids %v %v", a, b)
	}
	if _, err := LoadAzure(strings.NewReader("a,b,c\n"), AzurePrefix{Tenants: 1}); err == nil {
		t.Error("a wrong header was accepted")
	}
}
