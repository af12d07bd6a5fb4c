package picker

import (
	"errors"
	"net/netip"
	"slices"
	"testing"

	"github.com/tallyepp/tally/picker/prefix"
)

// TestSubsetMatchesByIP: a hint entry without a port, or with a port no
// endpoint at its IP has, names every endpoint at that IP (data-parallel
// ranks are one pod on several ports); an exact ip:port names that endpoint.
func TestSubsetMatchesByIP(t *testing.T) {
	ap := netip.MustParseAddrPort
	ip := func(s string) netip.AddrPort { return netip.AddrPortFrom(netip.MustParseAddr(s), 0) }
	eps := []Endpoint{
		{Pod: "a", Address: ap("127.0.0.2:3000")},
		{Pod: "a", Address: ap("127.0.0.2:3002")},
		{Pod: "a", Address: ap("127.0.0.2:3004")},
		{Pod: "b", Address: ap("127.0.0.3:3000")},
		{Pod: "c", Address: ap("[fd00::1]:3000")},
		{Pod: "c", Address: ap("[fd00::1]:3002")},
		{Pod: "d", Address: ap("127.0.0.4:3000")},
	}
	for _, tc := range []struct {
		name   string
		subset []netip.AddrPort
		want   []string // every endpoint a pick may land on; nil: ErrNoEndpoint
	}{
		{"bare IP names every rank", []netip.AddrPort{ip("127.0.0.2")}, []string{"127.0.0.2:3000", "127.0.0.2:3002", "127.0.0.2:3004"}},
		{"exact ip:port names one rank", []netip.AddrPort{ap("127.0.0.2:3002")}, []string{"127.0.0.2:3002"}},
		{"another port names the IP", []netip.AddrPort{ap("127.0.0.3:8000")}, []string{"127.0.0.3:3000"}},
		{"mixed", []netip.AddrPort{ip("127.0.0.3"), ap("127.0.0.2:3004"), ap("127.0.0.2:3000")},
			[]string{"127.0.0.3:3000", "127.0.0.2:3004", "127.0.0.2:3000"}},
		{"bare IPv6", []netip.AddrPort{ip("fd00::1")}, []string{"[fd00::1]:3000", "[fd00::1]:3002"}},
		{"IPv4-mapped bare IP", []netip.AddrPort{ip("::ffff:127.0.0.4")}, []string{"127.0.0.4:3000"}},
		{"the last IP in order", []netip.AddrPort{ip("127.0.0.4"), ip("127.0.0.4")}, []string{"127.0.0.4:3000"}},
		{"unknown IP", []netip.AddrPort{ip("127.0.0.9"), ap("127.0.0.9:3000")}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := New(testConfig(), Options{Clock: newFakeClock()})
			p.Replace(eps)
			var got []string
			for range 3 * len(eps) {
				r, err := p.pick(Request{Model: model, PromptChars: 640, Subset: tc.subset, HasSubset: true})
				if tc.want == nil {
					if !errors.Is(err, ErrNoEndpoint) {
						t.Fatalf("err %v, want ErrNoEndpoint", err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				for _, e := range r.Endpoints() {
					if !slices.Contains(tc.want, e.String()) {
						t.Fatalf("picked %v, want only endpoints of %v", r.Endpoints(), tc.want)
					}
				}
				got = append(got, endpointOf(r).String())
				// Held, and with no prefix to share: load spreads the
				// picks over every candidate.
			}
			for _, w := range tc.want {
				if !slices.Contains(got, w) {
					t.Errorf("no pick landed on %s (picks %v): every endpoint the hint names is a candidate", w, got)
				}
			}
		})
	}
}

func TestSubsetByIPDoesNotAllocate(t *testing.T) {
	p := newPicker(t, 16, testConfig(), Options{})
	req := Request{Model: model, Prompt: text("known", 8000), HasSubset: true,
		Subset: []netip.AddrPort{netip.AddrPortFrom(addr(3).Addr(), 0), netip.AddrPortFrom(addr(5).Addr(), 9), addr(7)}}
	hashes := prefix.HashSalted(nil, model, "", req.Prompt, p.cfg.BlockSizeChars)
	r := &Reservation{}
	place := func() {
		*r = Reservation{hashes: hashes, promptChars: len(req.Prompt)}
		p.mu.Lock()
		defer p.mu.Unlock()
		if err := p.l.place(r, req); err != nil {
			t.Fatal(err)
		}
		if e := r.endpoints[0]; e != addr(3) && e != addr(5) && e != addr(7) { // endpointOf(r) would take the lock held here
			t.Fatalf("picked %s, outside the hint", e)
		}
		p.l.release(r, 0)
	}
	place()
	if allocs := testing.AllocsPerRun(100, place); allocs != 0 {
		t.Errorf("a pick with a by-IP subset allocated %.1f times in its critical section, want 0", allocs)
	}
}

// BenchmarkCandidates measures the subset hint's share of a pick's critical
// section: 8 entries over a pool of 1,024 endpoints, named by ip:port
// (map lookups) or by bare IP (binary searches over the sorted rows). On the
// 2-core machine of docs/benchmarks.md: about 0.4 µs by ip:port and 3 µs by
// bare IP (each search step dereferences a row), without allocating.
func BenchmarkCandidates(b *testing.B) {
	p := New(testConfig(), Options{})
	eps := make([]Endpoint, 1024)
	for i := range eps {
		eps[i] = Endpoint{Pod: "pod", Address: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}), 8000)}
	}
	p.Replace(eps)
	for _, byIP := range []bool{false, true} {
		var subset []netip.AddrPort
		for i := range 8 {
			a := eps[i*127].Address
			if byIP {
				a = netip.AddrPortFrom(a.Addr(), 0)
			}
			subset = append(subset, a)
		}
		name := "ip:port"
		if byIP {
			name = "bare-ip"
		}
		b.Run(name, func(b *testing.B) {
			req := Request{Subset: subset, HasSubset: true}
			b.ReportAllocs()
			for b.Loop() {
				p.mu.Lock()
				if len(p.l.candidates(req)) != 8 {
					b.Fatal("wrong candidates")
				}
				p.mu.Unlock()
			}
		})
	}
}
