// Package rewrite applies an InferencePool's InferenceModelRewrites: the
// model a request names is sent on as another, drawn by weight from a
// rule's targets. The controllers write the rules; the ext_proc streams read
// them, once per request, without a lock.
//
// The invariant not to break: the rules are compiled into a table that is
// replaced whole and never changed in place, so a reader sees one version of
// them, old or new, never a mix.
package rewrite

import (
	"sync/atomic"
)

// Rule is one rule of the pool's InferenceModelRewrites: a request
// whose model is one of Models (any model, when Models is empty: a
// catch-all) is sent on with its model rewritten to one of Targets, drawn by
// weight.
type Rule struct {
	// Name names the InferenceModelRewrite the rule came from (the metrics'
	// model_rewrite_name).
	Name   string
	Models []string
	// Targets with their weights; all zero weights mean equal weights. A
	// rule without targets matches and rewrites nothing.
	Targets []Target
}

// Target is one weighted model a rule rewrites to.
type Target struct {
	Model  string
	Weight int
}

// Table holds the pool's rewrite rules; readers never lock. The zero
// value rewrites nothing.
type Table struct {
	t atomic.Pointer[table]
}

type table struct {
	exact    map[string]*compiled
	catchAll *compiled
}

type compiled struct {
	name    string
	targets []Target
	// cumulative weights, for the draw; total is the last.
	cum []int
}

// ReplaceRewrites makes rules the whole set, in precedence order: the
// rules of the oldest InferenceModelRewrite first, each resource's in list
// order. An exact match wins over a catch-all wherever either comes; among
// exact matches for one model, and among catch-alls, the first wins.
func (r *Table) ReplaceRewrites(rules []Rule) {
	t := &table{exact: map[string]*compiled{}}
	for _, rule := range rules {
		c := compileRule(rule)
		if len(rule.Models) == 0 {
			if t.catchAll == nil {
				t.catchAll = c
			}
			continue
		}
		for _, m := range rule.Models {
			if _, ok := t.exact[m]; !ok {
				t.exact[m] = c
			}
		}
	}
	r.t.Store(t)
}

func compileRule(rule Rule) *compiled {
	c := &compiled{name: rule.Name}
	equal := true
	for _, t := range rule.Targets {
		if t.Weight > 0 {
			equal = false
		}
	}
	total := 0
	for _, t := range rule.Targets {
		w := max(t.Weight, 0)
		if equal {
			w = 1
		}
		if w == 0 {
			continue // weight 0 among weighted targets: never drawn
		}
		total += w
		c.targets = append(c.targets, t)
		c.cum = append(c.cum, total)
	}
	return c
}

// Rewrite returns the model a request for model goes to, and the name of
// the rule's InferenceModelRewrite; ok is false when no rule rewrites it.
// draw(n) must return a uniform number in [0, n).
func (r *Table) Rewrite(model string, draw func(n int) int) (target, rewrite string, ok bool) {
	t := r.t.Load()
	if t == nil {
		return model, "", false
	}
	rule := t.exact[model]
	if rule == nil {
		rule = t.catchAll
	}
	if rule == nil || len(rule.targets) == 0 {
		return model, "", false
	}
	i := 0
	if n := len(rule.cum); n > 1 {
		x := draw(rule.cum[n-1])
		for rule.cum[i] <= x {
			i++
		}
	}
	return rule.targets[i].Model, rule.name, true
}
