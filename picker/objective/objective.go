// Package objective holds the priorities of an InferencePool's
// InferenceObjectives: the band a request's x-gateway-inference-objective
// header selects in the picker's flow control. The controllers write the
// set; the ext_proc streams read it, once per request, without a lock.
//
// The invariant not to break: the set is replaced whole and never changed in
// place, so a reader sees one version of it, old or new, never a mix.
package objective

import (
	"maps"
	"sync/atomic"
)

// Priorities maps the names of the pool's InferenceObjectives to their
// priorities. The controllers replace the whole map whenever an objective
// changes; readers never lock. The zero value knows no objective.
type Priorities struct {
	m atomic.Pointer[map[string]int]
}

// ReplaceObjectives makes priorities the whole set of objectives. It copies
// the map.
func (o *Priorities) ReplaceObjectives(priorities map[string]int) {
	m := maps.Clone(priorities)
	o.m.Store(&m)
}

// Priority returns the priority of the objective named name, and whether
// the pool has one of that name; an unknown objective has priority 0.
func (o *Priorities) Priority(name string) (int, bool) {
	m := o.m.Load()
	if m == nil {
		return 0, false
	}
	p, ok := (*m)[name]
	return p, ok
}

// Len is how many objectives the pool has.
func (o *Priorities) Len() int {
	if m := o.m.Load(); m != nil {
		return len(*m)
	}
	return 0
}
