package routesim

import (
	"math/rand/v2"
	"time"
)

// An approximate model of llm-d's prefill/decode disaggregation (its
// disagg-profile-handler with the prefix-based-pd-decider), written from
// its plugins' documented behaviour, on upstream-like's view of the pool
// (upstream.go): the engines' queues and KV usage from a scrape every
// 50 ms, and a prefix index that learns a placement after the pick.
//
//  1. The decode profile scores the decode-capable engines: upstream-like's
//     queue 2 + KV usage 2 + prefix 3, plus llm-d's active-request-scorer
//     at weight 2 (requests in flight on an engine, counted from the pick
//     of any profile that chose it to the end of the response; an engine
//     with none scores 1, the others (max-count)/max over every engine).
//  2. The decider splits the request when the chosen engine lacks at least
//     Picker.Disaggregation.NonCachedTokens of the prompt, by the prefix
//     index: the prompt's tokens less its leading blocks the index holds
//     there. The index matches at most upstreamMaxBlocks blocks (4,096
//     tokens), so a longer prompt is always split. llm-d has no
//     promptTokens threshold, so Disaggregation.PromptTokens is not read.
//  3. The prefill profile scores the prefill-capable engines but the
//     destination with the same scorer and takes the best.
//
// The index records the prompt on both engines of a split request (each
// holds its KV afterwards), and the active counts rise on both.
const llmdActiveWeight = 2

type llmdLike struct {
	*upstreamLike
	decoders, prefillers []int
	nonCachedTokens      int
	// active counts each engine's requests in flight as the
	// active-request-scorer does; legs holds, for each request placed and
	// not ended, the engines it counted on (-1: none) and so its prefill
	// engine.
	active []int
	legs   map[int][2]int
	cands  []int // scratch: the prefill candidates
}

func newLLMDLike(cfg Config, rng *rand.Rand, now *time.Duration) *llmdLike {
	p := &llmdLike{
		upstreamLike:    newUpstreamLike(cfg.Engines, rng, now, cfg),
		nonCachedTokens: cfg.Picker.Disaggregation.NonCachedTokens,
		active:          make([]int, cfg.Engines),
		legs:            make(map[int][2]int),
	}
	for e := range cfg.Engines {
		if cfg.decodes(e) {
			p.decoders = append(p.decoders, e)
		}
		if cfg.prefills(e) {
			p.prefillers = append(p.prefillers, e)
		}
	}
	return p
}

// activeScore is the active-request-scorer's score of engine e.
func (p *llmdLike) activeScore(e int) float64 {
	most := 0
	for _, n := range p.active {
		most = max(most, n)
	}
	if n := p.active[e]; n > 0 && most > 0 {
		return llmdActiveWeight * float64(most-n) / float64(most)
	}
	return llmdActiveWeight
}

func (p *llmdLike) pick(i int, j *job) (int, error) {
	p.applyRecords()
	d := p.choose(j, p.decoders, p.activeScore)
	pre := -1
	if p.split(j, d) {
		p.cands = p.cands[:0]
		for _, e := range p.prefillers {
			if e != d {
				p.cands = append(p.cands, e)
			}
		}
		if len(p.cands) > 0 {
			pre = p.choose(j, p.cands, p.activeScore)
		}
	}
	// After the decision, as the plugins' PreRequest hooks run.
	p.record(d, j)
	p.active[d]++
	if pre >= 0 {
		p.record(pre, j)
		p.active[pre]++
	}
	p.legs[i] = [2]int{d, pre}
	return d, nil
}

// split is the prefix-based-pd-decider: j lacks at least nonCachedTokens
// of its prompt on d, by the prefix index.
func (p *llmdLike) split(j *job, d int) bool {
	if p.nonCachedTokens <= 0 || len(p.prefillers) == 0 {
		return false
	}
	cached := p.lrus[d].leading(j.upstreamHashes) * upstreamBlockChars / charsPerToken
	return j.InputTokens-cached >= p.nonCachedTokens
}

func (p *llmdLike) prefiller(i int) (int, error) {
	if l, ok := p.legs[i]; ok {
		return l[1], nil
	}
	return -1, nil
}

// done ends the request's active counts, as the scorer's ResponseComplete.
func (p *llmdLike) done(i, _, _ int) {
	l, ok := p.legs[i]
	if !ok {
		return
	}
	delete(p.legs, i)
	for _, e := range l {
		if e >= 0 {
			p.active[e]--
		}
	}
}
