package replica

import (
	"cmp"
	"net/netip"
	"strconv"
	"strings"

	"github.com/tallyepp/tally/picker"
	pb "github.com/tallyepp/tally/picker/replica/replicapb"
)

// The peer protocol's forms of the picker's values.

func toRequest(pr picker.Prepared) *pb.Request {
	q := pr.Request
	m := &pb.Request{
		Model:           q.Model,
		PromptChars:     int64(q.PromptChars),
		Stream:          q.Stream,
		MaxTokens:       int64(q.MaxTokens),
		HasSubset:       q.HasSubset,
		Priority:        int32(q.Priority),
		FairnessId:      q.FairnessID,
		Bytes:           q.Bytes,
		Objective:       q.Objective,
		Hashes:          pr.Hashes,
		DestinationOnly: q.DestinationOnly,
	}
	for _, a := range q.Subset {
		m.Subset = append(m.Subset, a.String())
	}
	return m
}

func fromRequest(m *pb.Request) picker.Prepared {
	if m == nil {
		return picker.Prepared{}
	}
	q := picker.Request{
		Model:           m.Model,
		PromptChars:     int(m.PromptChars),
		Stream:          m.Stream,
		MaxTokens:       int(m.MaxTokens),
		HasSubset:       m.HasSubset,
		Priority:        int(m.Priority),
		FairnessID:      m.FairnessId,
		Bytes:           m.Bytes,
		Objective:       m.Objective,
		DestinationOnly: m.DestinationOnly,
	}
	for _, s := range m.Subset {
		if a, err := netip.ParseAddrPort(s); err == nil {
			q.Subset = append(q.Subset, a)
		}
	}
	return picker.Prepared{Request: q, Hashes: m.Hashes}
}

func toReservation(e *entry) *pb.Reservation {
	res := &pb.Reservation{Id: e.id, Origin: e.origin, Request: toRequest(e.pr), FirstByte: e.firstByte}
	if e.r != nil {
		res.Endpoints = toStrings(e.r.Endpoints())
		if a, ok := e.r.Prefiller(); ok {
			res.Prefiller = a.String()
		}
	}
	if e.servedBy.IsValid() {
		res.ServedBy = e.servedBy.String()
	}
	return res
}

func toOutcome(o picker.Outcome) *pb.Outcome {
	return &pb.Outcome{PromptTokens: int64(o.PromptTokens), CachedTokens: int64(o.CachedTokens),
		CompletionTokens: int64(o.CompletionTokens), Detached: o.Detached, ServerError: o.ServerError}
}

func fromOutcome(m *pb.Outcome) picker.Outcome {
	if m == nil {
		return picker.Outcome{}
	}
	return picker.Outcome{PromptTokens: int(m.PromptTokens), CachedTokens: int(m.CachedTokens),
		CompletionTokens: int(m.CompletionTokens), Detached: m.Detached, ServerError: m.ServerError}
}

func toStrings(as []netip.AddrPort) []string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return s
}

// toAddrs parses endpoint addresses; one that does not parse ends the list.
func toAddrs(s []string) []netip.AddrPort {
	as := make([]netip.AddrPort, 0, len(s))
	for _, v := range s {
		a, err := netip.ParseAddrPort(v)
		if err != nil {
			break
		}
		as = append(as, a)
	}
	return as
}

// compareIDs orders reservation ids "<replica>/<instance>/<n>" by replica
// and instance, then n.
func compareIDs(a, b string) int {
	i, j := strings.LastIndexByte(a, '/'), strings.LastIndexByte(b, '/')
	ra, na := a[:max(i, 0)], a[i+1:]
	rb, nb := b[:max(j, 0)], b[j+1:]
	if c := strings.Compare(ra, rb); c != 0 {
		return c
	}
	ia, _ := strconv.ParseUint(na, 10, 64)
	ib, _ := strconv.ParseUint(nb, 10, 64)
	return cmp.Compare(ia, ib)
}

// toAddr parses an optional address: "" (or one that does not parse) is
// the zero AddrPort.
func toAddr(s string) netip.AddrPort {
	a, _ := netip.ParseAddrPort(s)
	return a
}
