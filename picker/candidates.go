package picker

import (
	"net/netip"
	"slices"
)

// candidatesLocked returns the rows the request may go to: every current
// endpoint, or those the subset hint names (each once). An entry names the
// endpoint at its address; one without a port (port 0), or whose port no
// endpoint at that IP has, names every endpoint at its IP, as the upstream
// picker matches hints by IP (it ignores the port altogether). It does not
// allocate: p.cand has room for every row.
func (p *Picker) candidatesLocked(req Request) []*row {
	if !req.HasSubset {
		return p.candidates
	}
	c := p.subsetLocked(req, false)
	if len(c) == 0 {
		// The hint names only endpoints failing their scrapes: they are
		// still better than none (scrapes correct the ledger, they do not
		// decide who may serve).
		c = p.subsetLocked(req, true)
	}
	return c
}

// subsetLocked returns the rows the subset hint names, each once, those
// excluded for failing scrapes only if withExcluded.
func (p *Picker) subsetLocked(req Request, withExcluded bool) []*row {
	p.mark++
	c := p.cand[:0]
	for _, a := range req.Subset {
		a = key(a)
		if r, ok := p.byAddr[a]; ok && a.Port() != 0 {
			c = p.addCandidateLocked(c, r, withExcluded)
			continue
		}
		ip := a.Addr()
		c = p.addIPLocked(c, ip, withExcluded)
		// A row may hold the IPv4-mapped form; IPv6 addresses sort after
		// IPv4 ones, so only a pool with some can.
		if n := len(p.rows); ip.Is4() && n > 0 && p.rows[n-1].ep.Address.Addr().Is6() {
			c = p.addIPLocked(c, netip.AddrFrom16(ip.As16()), withExcluded)
		}
	}
	return c
}

// addIPLocked appends the rows at ip. Rows are sorted by address, IP first,
// so they are contiguous: a binary search finds them.
func (p *Picker) addIPLocked(c []*row, ip netip.Addr, withExcluded bool) []*row {
	i, _ := slices.BinarySearchFunc(p.rows, ip, func(w *row, ip netip.Addr) int { return w.ep.Address.Addr().Compare(ip) })
	for ; i < len(p.rows) && p.rows[i].ep.Address.Addr() == ip; i++ {
		c = p.addCandidateLocked(c, p.rows[i], withExcluded)
	}
	return c
}

// addCandidateLocked appends r unless this pick has it already, or it is
// excluded for failing scrapes and withExcluded is false.
func (p *Picker) addCandidateLocked(c []*row, r *row, withExcluded bool) []*row {
	if r.mark == p.mark || r.engine.excluded && !withExcluded {
		return c
	}
	r.mark = p.mark
	return append(c, r)
}
