package picker

import (
	"net/netip"
	"slices"
)

// candidates returns the rows the request may go to: every current
// endpoint, or those the subset hint names (each once). An entry names the
// endpoint at its address; one without a port (port 0), or whose port no
// endpoint at that IP has, names every endpoint at its IP, as the upstream
// picker matches hints by IP (it ignores the port altogether). It does not
// allocate: the scratch has room for every row.
func (l *ledger) candidates(req Request) []*row {
	if !req.HasSubset {
		return l.candidateRows
	}
	c := l.subset(req, false)
	if len(c) == 0 {
		// The hint names only endpoints failing their scrapes: they are
		// still better than none (scrapes correct the ledger, they do not
		// decide who may serve).
		c = l.subset(req, true)
	}
	return c
}

// subset returns the rows the subset hint names, each once, those excluded
// for failing scrapes only if withExcluded.
func (l *ledger) subset(req Request, withExcluded bool) []*row {
	s := &l.scratch
	s.mark++
	c := s.rows[:0]
	for _, a := range req.Subset {
		a = key(a)
		if r, ok := l.byAddr[a]; ok && a.Port() != 0 {
			c = l.addCandidate(c, r, withExcluded)
			continue
		}
		ip := a.Addr()
		c = l.addIP(c, ip, withExcluded)
		// A row may hold the IPv4-mapped form; IPv6 addresses sort after
		// IPv4 ones, so only a pool with some can.
		if n := len(l.rows); ip.Is4() && n > 0 && l.rows[n-1].ep.Address.Addr().Is6() {
			c = l.addIP(c, netip.AddrFrom16(ip.As16()), withExcluded)
		}
	}
	return c
}

// addIP appends the rows at ip. Rows are sorted by address, IP first, so
// they are contiguous: a binary search finds them.
func (l *ledger) addIP(c []*row, ip netip.Addr, withExcluded bool) []*row {
	i, _ := slices.BinarySearchFunc(l.rows, ip, func(w *row, ip netip.Addr) int { return w.ep.Address.Addr().Compare(ip) })
	for ; i < len(l.rows) && l.rows[i].ep.Address.Addr() == ip; i++ {
		c = l.addCandidate(c, l.rows[i], withExcluded)
	}
	return c
}

// addCandidate appends w unless this pick has it already, it does not
// decode (a prefill-only pod is never a destination), or it is excluded for
// failing scrapes and withExcluded is false.
func (l *ledger) addCandidate(c []*row, w *row, withExcluded bool) []*row {
	s := &l.scratch
	if s.seen[w.pos] == s.mark || !w.decodes || w.engine.excluded && !withExcluded {
		return c
	}
	s.seen[w.pos] = s.mark
	return append(c, w)
}
