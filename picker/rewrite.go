package picker

import (
	"sync/atomic"
)

// RewriteRule is one rule of the pool's InferenceModelRewrites: a request
// whose model is one of Models (any model, when Models is empty: a
// catch-all) is sent on with its model rewritten to one of Targets, drawn by
// weight.
type RewriteRule struct {
	// Name names the InferenceModelRewrite the rule came from (the metrics'
	// model_rewrite_name).
	Name   string
	Models []string
	// Targets with their weights; all zero weights mean equal weights. A
	// rule without targets matches and rewrites nothing.
	Targets []RewriteTarget
}

// RewriteTarget is one weighted model a rule rewrites to.
type RewriteTarget struct {
	Model  string
	Weight int
}

// Rewrites holds the pool's rewrite rules; readers never lock. The zero
// value rewrites nothing.
type Rewrites struct {
	t atomic.Pointer[rewriteTable]
}

type rewriteTable struct {
	exact    map[string]*rewriteRule
	catchAll *rewriteRule
}

type rewriteRule struct {
	name    string
	targets []RewriteTarget
	// cumulative weights, for the draw; total is the last.
	cum []int
}

// ReplaceRewrites makes rules the whole set, in precedence order: the
// rules of the oldest InferenceModelRewrite first, each resource's in list
// order. An exact match wins over a catch-all wherever either comes; among
// exact matches for one model, and among catch-alls, the first wins.
func (r *Rewrites) ReplaceRewrites(rules []RewriteRule) {
	t := &rewriteTable{exact: map[string]*rewriteRule{}}
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

func compileRule(rule RewriteRule) *rewriteRule {
	c := &rewriteRule{name: rule.Name}
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
func (r *Rewrites) Rewrite(model string, draw func(n int) int) (target, rewrite string, ok bool) {
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
