package main

import (
	"context"
	"fmt"
	"io"
	"sync"
	"time"
)

// staggerResult is how evenly requests arriving one every interval, each
// held at its endpoint for a while, were spread while they overlapped.
type staggerResult struct {
	n, tokens   int
	every, hold time.Duration
	placement   *placement
	refused     int
	errors      int
	firstError  string
	// worst is the highest count at one endpoint over the even share (the
	// requests held at all endpoints over their number), at the moment of
	// a placement once the pool is in its steady state (from the first
	// hold's end on, when as many requests end as arrive); worstAt the
	// counts then, in pool order.
	worst   float64
	worstAt []int64
	samples int
}

// runStagger sends n requests of tokens tokens, one every every, each held
// at its endpoint for hold, then answered (through NGF: no answer, the
// hold ends). After each placement it reads what every endpoint holds.
func runStagger(ctx context.Context, t *target, n, tokens int, every, hold time.Duration) (staggerResult, error) {
	res := staggerResult{n: n, tokens: tokens, every: every, hold: hold, placement: newPlacement(t.endpoints)}
	nonce := t.prompts.newNonce()
	var (
		errs errorsSeen
		mu   sync.Mutex
		wg   sync.WaitGroup
	)
	start := time.Now()
	steady := start.Add(hold)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for i := range n {
		if i > 0 {
			select {
			case <-tick.C:
			case <-ctx.Done():
				wg.Wait()
				return res, ctx.Err()
			}
		}
		req := request{id: fmt.Sprintf("stagger-%d-%d", nonce, i), path: completionsPath, body: t.prompts.body(nonce, nil, i, tokens)}
		wg.Go(func() {
			x, err := t.client.Open(ctx)
			if err != nil {
				errs.add(err)
				return
			}
			defer x.Cancel()
			p, err := t.send(x, req)
			if err != nil {
				errs.add(err)
				return
			}
			if p.status != 0 {
				mu.Lock()
				res.refused++
				mu.Unlock()
				return
			}
			release := t.pods.hold(p.endpoint)
			defer release()
			mu.Lock()
			res.placement.add(p.endpoint)
			if time.Now().After(steady) {
				res.sample(t.pods.counts(res.placement.endpoints))
			}
			mu.Unlock()
			sleepCtx(ctx, hold)
			if t.ngf() {
				return // the engine ends it; the picker was never told
			}
			if err := x.Respond(okResponse(p.endpoint, tokens)); err != nil {
				errs.add(err)
			}
		})
	}
	wg.Wait()
	res.errors, res.firstError = errs.summary()
	return res, ctx.Err()
}

// sample records counts if they are the most uneven seen so far.
func (r *staggerResult) sample(counts []int64) {
	var total, most int64
	for _, c := range counts {
		total += c
		most = max(most, c)
	}
	if total == 0 {
		return
	}
	r.samples++
	if ratio := float64(most) * float64(len(counts)) / float64(total); ratio > r.worst {
		r.worst, r.worstAt = ratio, counts
	}
}

func printStagger(w io.Writer, r staggerResult) {
	fmt.Fprintf(w, "stagger: %d requests of %d tokens, one every %v, each held %v\n", r.n, r.tokens, r.every, r.hold)
	fmt.Fprintf(w, "placement: %s\n", r.placement.spread())
	fmt.Fprintf(w, "busiest endpoint over the even share, at the worst of %d placements in the steady state: %.2f (held then: %v)\n", r.samples, r.worst, r.worstAt)
	fmt.Fprintf(w, "placed %d, refused %d, failed %d\n", r.placement.total(), r.refused, r.errors)
	if r.firstError != "" {
		fmt.Fprintf(w, "first failure: %s\n", r.firstError)
	}
}
