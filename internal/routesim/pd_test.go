package routesim

import (
	"bytes"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/picker"
)

// pdConfig is two prefill-only engines (0, 1), one decode-only (2) and
// one unlabelled (3), splitting at nonCached uncached tokens.
func pdConfig(nonCached int) Config {
	c := Config{Engines: 4, KVBlocks: engine.DefaultKVBlocks, LoadFactor: 1.5, Seed: 3,
		Roles: []string{picker.RolePrefill, picker.RolePrefill, picker.RoleDecode, ""}}
	c.Picker.Disaggregation.NonCachedTokens = nonCached
	return c
}

// A P/D run accounts for every request once: each ends once on a
// decode-capable engine, a split one after one prefill leg on a
// prefill-only engine, whose blocks its decode leg took; the engines'
// own counters say the same as the outcomes.
func TestAPDRunServesEveryRequestOnceOnTheRightRoles(t *testing.T) {
	w, err := Prepare(loadSample(t, 150), pdConfig(16))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{Tally, LLMDLike} {
		res, err := w.Run(p)
		if err != nil {
			t.Fatal(err)
		}
		ends := make([]int64, 4) // requests or legs each engine should have finished
		legs := make([]int64, 4) // prefill legs
		decode := make([]int, 4) // decode and whole legs
		split := 0
		for i, o := range res.Outcomes {
			if o.Engine != 2 && o.Engine != 3 {
				t.Fatalf("%s: request %d decoded on engine %d (role %q)", p, i, o.Engine, w.cfg.role(o.Engine))
			}
			if o.TTFT <= 0 || o.E2E < o.TTFT {
				t.Fatalf("%s: request %d: TTFT %v, E2E %v", p, i, o.TTFT, o.E2E)
			}
			ends[o.Engine]++
			decode[o.Engine]++
			if o.Prefiller < 0 {
				continue
			}
			split++
			if o.Prefiller != 0 && o.Prefiller != 1 {
				t.Fatalf("%s: request %d prefilled on engine %d (role %q)", p, i, o.Prefiller, w.cfg.role(o.Prefiller))
			}
			if o.PrefillEnd <= 0 || o.PrefillEnd >= o.TTFT {
				t.Fatalf("%s: request %d: prefill leg ended at %v, first token at %v", p, i, o.PrefillEnd, o.TTFT)
			}
			ends[o.Prefiller]++
			legs[o.Prefiller]++
		}
		if split == 0 || split == len(res.Outcomes) && p == Tally {
			t.Errorf("%s: %d of %d requests split; want some", p, split, len(res.Outcomes))
		}
		var pulled int64
		for e, st := range res.Engines {
			if st.FinishedRequests != ends[e] || st.AbortedRequests != 0 {
				t.Errorf("%s: engine %d finished %d and aborted %d requests or legs; the outcomes say %d finished", p, e, st.FinishedRequests, st.AbortedRequests, ends[e])
			}
			if st.LeasesReleased != legs[e] || st.LeasesExpired != 0 || st.HeldRequests != 0 {
				t.Errorf("%s: engine %d: %d leases released, %d expired, %d held; want %d released, none else", p, e, st.LeasesReleased, st.LeasesExpired, st.HeldRequests, legs[e])
			}
			if res.Placed[e] != decode[e] {
				t.Errorf("%s: engine %d: placed %d, decoded %d", p, e, res.Placed[e], decode[e])
			}
			pulled += st.KVBlocksPulled
		}
		if pulled == 0 {
			t.Errorf("%s: the decode legs pulled no KV blocks", p)
		}
		if got := res.PrefillLegs; got[2] != 0 || got[3] != 0 || int64(got[0]) != legs[0] || int64(got[1]) != legs[1] {
			t.Errorf("%s: prefill legs per engine %v, want %v", p, got, legs)
		}
	}
}

// Same inputs, same numbers: both P/D policies, and the whole
// comparison.
func TestAPDRunIsDeterministic(t *testing.T) {
	w, err := Prepare(loadSample(t, 120), pdConfig(16))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{Tally, LLMDLike} {
		a, err := w.Run(p)
		if err != nil {
			t.Fatal(err)
		}
		b, err := w.Run(p)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(a.Outcomes, b.Outcomes) || !reflect.DeepEqual(a.Engines, b.Engines) || !reflect.DeepEqual(a.PrefillLegs, b.PrefillLegs) {
			t.Errorf("%s: two runs of the same workload differ", p)
		}
	}
	c := DefaultPDComparison()
	c.Utilisations = []float64{0.3, 0.6}
	reqs := loadSample(t, 80)
	var reports [2]*PDReport
	for k := range reports {
		r, err := c.Run(reqs, "sample", Config{KVBlocks: engine.DefaultKVBlocks, Seed: 1}, 1+k, nil)
		if err != nil {
			t.Fatal(err)
		}
		r.Wall = 0
		for l := range r.Loads {
			for i := range r.Loads[l].Runs {
				r.Loads[l].Runs[i].Wall = 0
			}
		}
		reports[k] = r
	}
	if !reflect.DeepEqual(reports[0], reports[1]) {
		t.Errorf("the comparison differs between two runs (1 and 2 at once)")
	}
	r := reports[0]
	if len(r.Loads) != 2 || len(r.Loads[0].Runs) != 3 {
		t.Fatalf("loads %d, runs at the first %d; want 2 and 3", len(r.Loads), len(r.Loads[0].Runs))
	}
	if !(r.Loads[1].LoadFactor > r.Loads[0].LoadFactor) {
		t.Errorf("load factors %v then %v: a higher utilisation needs faster arrivals", r.Loads[0].LoadFactor, r.Loads[1].LoadFactor)
	}
	for _, l := range r.Loads {
		d, _ := l.run(PoolPD, LLMDLike)
		if d.PrefillUtilisation < l.Utilisation*0.7 || d.PrefillUtilisation > l.Utilisation*1.3 {
			t.Errorf("at %v: llm-d-like's prefill engines were %.2f busy; the calibration aims at it", l.Utilisation, d.PrefillUtilisation)
		}
		if s, _ := l.run(PoolShared, Tally); s.Split != 0 {
			t.Errorf("at %v: the shared pool split %d requests", l.Utilisation, s.Split)
		}
	}
	var b bytes.Buffer
	if err := r.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| 30% |", "| P/D | llm-d-like |", "| shared | tally |", "Tally's TTFT p99 over llm-d-like's", "splitting wins on"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("the report lacks %q:\n%s", want, b.String())
		}
	}
}

// llm-d-like's decider splits a request when its destination lacks at
// least nonCachedTokens of the prompt by the prefix index, and never
// without a prefill engine or with the threshold 0.
func TestLLMDLikeSplitsByItsDeciderThreshold(t *testing.T) {
	var now time.Duration
	hashes := make([]uint64, 64) // 64 blocks of 16 tokens: 1,024 tokens
	for k := range hashes {
		hashes[k] = uint64(k + 1)
	}
	j := &job{Request: Request{InputTokens: 1024}, upstreamHashes: hashes}
	for _, tc := range []struct {
		nonCached, heldBlocks int
		want                  bool
	}{
		{nonCached: 16, heldBlocks: 0, want: true},
		{nonCached: 1024, heldBlocks: 0, want: true},
		{nonCached: 1025, heldBlocks: 0, want: false},
		{nonCached: 512, heldBlocks: 32, want: true},  // 512 uncached
		{nonCached: 513, heldBlocks: 32, want: false}, // 512 uncached
		{nonCached: 16, heldBlocks: 63, want: true},   // 16 uncached
		{nonCached: 17, heldBlocks: 63, want: false},
		{nonCached: 0, heldBlocks: 0, want: false}, // off
	} {
		p, err := newPolicy(LLMDLike, pdConfig(tc.nonCached), &now, &idText{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		l := p.(*llmdLike)
		for _, h := range hashes[:tc.heldBlocks] {
			l.lrus[2].add(h)
			l.lrus[3].add(h)
		}
		dest, err := l.pick(0, j)
		if err != nil {
			t.Fatal(err)
		}
		pre, _ := l.prefiller(0)
		if dest != 2 && dest != 3 {
			t.Fatalf("%+v: destination %d, a prefill-only engine", tc, dest)
		}
		if got := pre >= 0; got != tc.want {
			t.Errorf("%+v: split %v (prefiller %d), want %v", tc, got, pre, tc.want)
		}
		if pre >= 0 && pre != 0 && pre != 1 {
			t.Errorf("%+v: prefiller %d is not a prefill engine", tc, pre)
		}
		// The in-flight counts rise on both engines after the pick and
		// fall at the end.
		if l.active[dest] != 1 || pre >= 0 && l.active[pre] != 1 {
			t.Errorf("%+v: active counts %v after the pick", tc, l.active)
		}
		l.done(0, 1024, 0)
		if l.active[0]+l.active[1]+l.active[2]+l.active[3] != 0 {
			t.Errorf("%+v: active counts %v after the end", tc, l.active)
		}
	}
	// A pool without prefill engines never splits.
	cfg := pdConfig(16)
	cfg.Roles = nil
	p, _ := newPolicy(LLMDLike, cfg, &now, &idText{}, nil)
	p.pick(0, j)
	if pre, _ := p.(splitter).prefiller(0); pre >= 0 {
		t.Errorf("an unlabelled pool split a request onto %d", pre)
	}
}

// Only role-aware policies run on a pool with a prefill-only engine, and
// roles must name each engine's role.
func TestRolesAreChecked(t *testing.T) {
	var now time.Duration
	for _, p := range []string{RoundRobin, LeastRequest, UpstreamLike, ExactGreedy, ForecastGreedy} {
		if _, err := newPolicy(p, pdConfig(16), &now, &idText{}, nil); err == nil || !strings.Contains(err.Error(), "roles") {
			t.Errorf("%s on a P/D pool: %v, want an error naming the roles", p, err)
		}
	}
	for _, tc := range []struct {
		roles []string
		want  string
	}{
		{[]string{"prefill"}, "1 given for 4 engines"},
		{[]string{"prefill", "prefill", "decode", "encode"}, `"encode" is invalid`},
		{[]string{"prefill", "prefill", "prefill", "prefill"}, "no engine decodes"},
	} {
		c := pdConfig(16)
		c.Roles = tc.roles
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("roles %q: %v, want an error saying %q", tc.roles, err, tc.want)
		}
	}
	if err := pdConfig(16).Validate(); err != nil {
		t.Errorf("a valid P/D pool: %v", err)
	}
}
