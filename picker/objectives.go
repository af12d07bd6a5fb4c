package picker

import (
	"maps"
	"sync/atomic"
)

// Objectives maps the names of the pool's InferenceObjectives to their
// priorities: what a request's x-gateway-inference-objective header selects
// (flow.go). The controllers replace the whole map whenever an objective
// changes; readers never lock. The zero value knows no objective.
type Objectives struct {
	m atomic.Pointer[map[string]int]
}

// ReplaceObjectives makes priorities the whole set of objectives. It copies
// the map.
func (o *Objectives) ReplaceObjectives(priorities map[string]int) {
	m := maps.Clone(priorities)
	o.m.Store(&m)
}

// Priority returns the priority of the objective named name, and whether
// the pool has one of that name; an unknown objective has priority 0.
func (o *Objectives) Priority(name string) (int, bool) {
	m := o.m.Load()
	if m == nil {
		return 0, false
	}
	p, ok := (*m)[name]
	return p, ok
}

// Len is how many objectives the pool has.
func (o *Objectives) Len() int {
	if m := o.m.Load(); m != nil {
		return len(*m)
	}
	return 0
}
