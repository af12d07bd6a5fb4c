package routesim

import (
	"math/rand/v2"
	"time"

	"github.com/tallyepp/tally/internal/lru"
	"github.com/tallyepp/tally/internal/modelsim/engine"
)

// An approximate model of the upstream picker's default scheduling
// (gateway-api-inference-extension v1.5.0), written from its documented
// behaviour, not its code: every load signal comes from a metrics scrape,
// and the prefix index learns a placement only after the pick, so picks
// made at the same instant do not see each other. With LoRA adapters it
// adds the lora-affinity-scorer (lora.go), on the same scrape.
const (
	upstreamQueueWeight  = 2
	upstreamKVWeight     = 2
	upstreamPrefixWeight = 3
	// The documented defaults of its prefix plugin: prompt blocks of 64
	// characters (16 tokens), at most 256 matched (the first 16,384
	// characters), 31,250 remembered per server (500,000 tokens).
	upstreamBlockChars     = 64
	upstreamMaxBlocks      = 256
	upstreamCapacityBlocks = 31_250
)

type upstreamLike struct {
	rng     *rand.Rand
	all     []int // every engine, in order
	waiting []int
	kvUsage []float64
	lrus    []*blockLRU
	scores  []float64
	// Records of the picks made at pendingAt, applied once virtual time
	// moves past it.
	pending   []pendingRecord
	pendingAt time.Duration
	now       *time.Duration // the simulation's clock
	// lora is every engine's lora_requests_info at the last scrape, and
	// maxLoRAs its max_lora; nil without adapters.
	lora     []loraInfo
	maxLoRAs int
}

type pendingRecord struct {
	engine int
	hashes []uint64
}

func newUpstreamLike(engines int, rng *rand.Rand, now *time.Duration, cfg Config) *upstreamLike {
	p := &upstreamLike{
		rng:     rng,
		now:     now,
		waiting: make([]int, engines),
		kvUsage: make([]float64, engines),
		lrus:    make([]*blockLRU, engines),
		scores:  make([]float64, engines),
	}
	for i := range p.lrus {
		p.lrus[i] = newBlockLRU(upstreamCapacityBlocks)
		p.all = append(p.all, i)
	}
	if cfg.lora() {
		p.lora, p.maxLoRAs = make([]loraInfo, engines), cfg.MaxLoRAs
	}
	return p
}

// applyRecords writes the records of the picks made before now.
func (p *upstreamLike) applyRecords() {
	if len(p.pending) > 0 && *p.now > p.pendingAt {
		for _, r := range p.pending {
			for _, h := range r.hashes {
				p.lrus[r.engine].add(h)
			}
		}
		clear(p.pending)
		p.pending = p.pending[:0]
	}
}

func (p *upstreamLike) pick(_ int, j *job) (int, error) {
	p.applyRecords()
	best := p.choose(j, p.all, nil)
	p.record(best, j)
	return best, nil
}

// choose scores the engines cands (their indices, in order; at least one)
// for j and returns the best, ties broken uniformly by the run's seed.
// The queue score is normalised over cands, as the upstream queue-scorer
// normalises over the endpoints its filters left; extra, when set, adds
// a policy's own terms to an engine's score.
func (p *upstreamLike) choose(j *job, cands []int, extra func(e int) float64) int {
	minQ, maxQ := p.waiting[cands[0]], p.waiting[cands[0]]
	for _, e := range cands {
		q := p.waiting[e]
		minQ, maxQ = min(minQ, q), max(maxQ, q)
	}
	for _, e := range cands {
		queue := 1.0
		if maxQ > minQ {
			queue = float64(maxQ-p.waiting[e]) / float64(maxQ-minQ)
		}
		prefix := 0.0
		if n := len(j.upstreamHashes); n > 0 {
			prefix = float64(p.lrus[e].leading(j.upstreamHashes)) / float64(n)
		}
		p.scores[e] = upstreamQueueWeight*queue + upstreamKVWeight*(1-p.kvUsage[e]) + upstreamPrefixWeight*prefix
		if p.lora != nil {
			p.scores[e] += upstreamLoRAWeight * upstreamLoRAScore(p.lora[e], p.maxLoRAs, j.Adapter)
		}
		if extra != nil {
			p.scores[e] += extra(e)
		}
	}
	best, ties := cands[0], 0
	for _, e := range cands {
		switch s := p.scores[e]; {
		case ties == 0 || s > p.scores[best]:
			best, ties = e, 1
		case s == p.scores[best]:
			ties++
			if p.rng.IntN(ties) == 0 {
				best = e
			}
		}
	}
	return best
}

// record remembers, once virtual time moves on, that j's prompt went to
// engine e: the prefix plugin's index learns after the pick.
func (p *upstreamLike) record(e int, j *job) {
	p.pending = append(p.pending, pendingRecord{engine: e, hashes: j.upstreamHashes})
	p.pendingAt = *p.now
}

func (p *upstreamLike) firstByte(int)                  {}
func (p *upstreamLike) done(int, int, int)             {}
func (p *upstreamLike) observeEvery() time.Duration    { return scrapeInterval }
func (p *upstreamLike) observeLoRA(engines []loraInfo) { copy(p.lora, engines) }
func (p *upstreamLike) observe(stats []engine.Stats) {
	for i, s := range stats {
		p.waiting[i] = s.WaitingRequests
		p.kvUsage[i] = s.KVCacheUsage()
	}
}

// blockLRU is one server's approximate prefix memory: a set of block
// hashes of bounded size, the least recently added or matched forgotten
// first. Invariant: idx and order hold the same entries, at most cap.
type blockLRU struct {
	cap    int
	idx    map[uint64]int32 // hash -> its entry in hashes and order
	hashes []uint64
	order  *lru.List
}

func newBlockLRU(capacity int) *blockLRU {
	return &blockLRU{cap: capacity, idx: make(map[uint64]int32), order: lru.New(0)}
}

// leading counts the leading hashes held; a lookup is not a use (only
// a record after a pick is).
func (l *blockLRU) leading(hashes []uint64) int {
	n := 0
	for _, h := range hashes {
		if _, ok := l.idx[h]; !ok {
			break
		}
		n++
	}
	return n
}

func (l *blockLRU) add(h uint64) {
	if i, ok := l.idx[h]; ok {
		l.order.Remove(i)
		l.order.PushBack(i)
		return
	}
	var i int32
	switch {
	case len(l.idx) >= l.cap:
		i, _ = l.order.Oldest()
		l.order.Remove(i)
		delete(l.idx, l.hashes[i])
	default:
		l.hashes = append(l.hashes, 0)
		i = int32(len(l.hashes) - 1)
	}
	l.hashes[i] = h
	l.idx[h] = i
	l.order.PushBack(i)
}
