package picker

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker/prefix"
	"github.com/tallyepp/tally/test/benchcpu"
)

// Benchmarks run in the steady state of a busy picker: every endpoint's
// prefix LRU is full (so each new block evicts one), and a ring of
// 2 x endpoints requests is in flight (so picks spread over the pool).
// The LRU capacity is cut to benchLRUBlocks per endpoint so that 128
// endpoints fit in memory and fill quickly; the work per pick does not depend
// on it.
const (
	benchLRUBlocks    = 10_000
	benchSharedTokens = 512
)

// The pool sizes and prompt lengths every benchmark covers.
func benchGrid() (endpoints, tokens []int) {
	// 8,388,608 tokens is a 32 MiB prompt: the block cap must keep its
	// critical section as short as a 32,000-token prompt's.
	return []int{3, 16, 128}, []int{1_000, 8_000, 32_000, 8 << 20}
}

func benchConfig() v1alpha1.PickerConfig {
	cfg := v1alpha1.Default()
	cfg.LRUCapacityBlocks = benchLRUBlocks
	return cfg
}

// pickLoad drives a picker with prompts of a shared 512-token prefix and a
// remainder made unique by writing a counter right after the prefix (the
// chained hashes of every later block then change too).
type pickLoad struct {
	p      *Picker
	prompt []byte
	ring   []*Reservation
	n      uint64
	// models, when set, are the requests' models in turn; else
	// "bench-model".
	models []string
	// splits counts the picks split onto a prefill pod.
	splits int
}

func newPickLoad(pool, tokens int) *pickLoad {
	return newPickLoadOn(benchConfig(), endpoints(pool), tokens)
}

// newPickLoadOn is newPickLoad over eps with cfg.
func newPickLoadOn(cfg v1alpha1.PickerConfig, eps []Endpoint, tokens int) *pickLoad {
	pool := len(eps)
	p := New(cfg, Options{Rand: rand.New(rand.NewPCG(1, 2))})
	p.Replace(eps)
	l := &pickLoad{p: p, prompt: text("bench", tokens*4), ring: make([]*Reservation, 2*pool)}
	// Fill every endpoint's LRU, with margin for an uneven spread.
	blocks := (tokens*4 - benchSharedTokens*4) / p.cfg.BlockSizeChars
	for range 2 * pool * benchLRUBlocks / blocks {
		l.step()
	}
	return l
}

func (l *pickLoad) step() {
	l.n++
	binary.LittleEndian.PutUint64(l.prompt[benchSharedTokens*4:], l.n)
	slot := &l.ring[l.n%uint64(len(l.ring))]
	if *slot != nil {
		l.p.End(*slot, Outcome{})
	}
	model := "bench-model"
	if len(l.models) > 0 {
		model = l.models[l.n%uint64(len(l.models))]
	}
	r, err := l.p.pick(Request{Model: model, Prompt: l.prompt})
	if err != nil {
		panic(err)
	}
	if r.prefiller.IsValid() {
		l.splits++
	}
	*slot = r
}

// BenchmarkPick measures a whole pick: hashing the prompt, then the critical
// section (score, choose, reserve, record), plus the release of a request
// picked 2 x endpoints picks earlier.
func BenchmarkPick(b *testing.B) {
	pools, lengths := benchGrid()
	for _, e := range pools {
		for _, tok := range lengths {
			var l *pickLoad
			b.Run(fmt.Sprintf("endpoints=%d/tokens=%s", e, tokensName(tok)), func(b *testing.B) {
				if l == nil {
					l = newPickLoad(e, tok)
				}
				b.ReportAllocs()
				cpu := startCPU()
				for b.Loop() {
					l.step()
				}
				cpu.report(b)
			})
		}
	}
}

// BenchmarkPickPD measures a whole pick, as BenchmarkPick, in a pool of
// two prefill and two decode endpoints with splitting on (split=on: the
// decode pod is chosen, then the prefill pod in the same critical
// section, and the prefill part is held there), beside the same four
// endpoints unlabelled with splitting off (split=off). split-share is the
// share of the measured picks that were split: the cold 1,000-token
// prompts are, while a prefill pod is no costlier than the decode pod.
func BenchmarkPickPD(b *testing.B) {
	const tok = 1_000
	for _, on := range []bool{false, true} {
		name := "off"
		cfg := benchConfig()
		eps := endpoints(4)
		if on {
			name = "on"
			cfg.Disaggregation.NonCachedTokens = 16
			for i, role := range []string{RolePrefill, RolePrefill, RoleDecode, RoleDecode} {
				eps[i].Role = role
			}
		}
		var l *pickLoad
		b.Run(fmt.Sprintf("endpoints=4/tokens=%s/split=%s", tokensName(tok), name), func(b *testing.B) {
			if l == nil {
				l = newPickLoadOn(cfg, eps, tok)
			}
			l.splits = 0
			b.ReportAllocs()
			cpu := startCPU()
			for b.Loop() {
				l.step()
			}
			cpu.report(b)
			b.ReportMetric(float64(l.splits)/float64(b.N), "split-share")
			if on && l.splits == 0 {
				b.Fatal("no pick was split")
			}
		})
	}
}

// BenchmarkPickInAdapterPool measures a whole pick, as BenchmarkPick, in a
// pool whose engines serve LoRA adapters (max_lora 2, each running two of
// 8): model=base asks for the base model, model=adapter for the 8 adapters
// in turn.
func BenchmarkPickInAdapterPool(b *testing.B) {
	const pool, tok = 128, 1_000
	adapters := make([]string, 8)
	for i := range adapters {
		adapters[i] = fmt.Sprint("lora-", i)
	}
	for _, m := range []struct {
		name   string
		models []string
	}{{"base", []string{"bench-model"}}, {"adapter", adapters}} {
		var l *pickLoad
		b.Run(fmt.Sprintf("endpoints=%d/tokens=%s/model=%s", pool, tokensName(tok), m.name), func(b *testing.B) {
			if l == nil {
				l = newPickLoad(pool, tok)
				for i := range pool {
					l.p.ObserveEngine(addr(i), EngineStats{Model: "bench-model", HasLoRA: true, MaxLoRAs: 2,
						RunningAdapters: []string{adapters[i%8], adapters[(i+3)%8]}})
				}
				l.models = m.models
			}
			b.ReportAllocs()
			cpu := startCPU()
			for b.Loop() {
				l.step()
			}
			cpu.report(b)
		})
	}
}

// BenchmarkCriticalSection measures the locked part of a pick with the
// prompt already hashed: critical-ns/op is placeLocked alone (score, choose,
// reserve, record), the pick's critical section; ns/op adds the release
// under the same lock and the evictions the records owe (Tidy, in its own
// short holds of the lock, as Pick does).
//
//   - known: the same prompt every time, so every block is known and only
//     touched; this must not allocate.
//   - new: every block after the 512-token prefix is new, so each pick
//     inserts its blocks and evicts as many from a full LRU. The time
//     includes rewriting the hashes (about a nanosecond per block).
func BenchmarkCriticalSection(b *testing.B) {
	pools, lengths := benchGrid()
	for _, mode := range []string{"known", "new"} {
		for _, e := range pools {
			for _, tok := range lengths {
				b.Run(fmt.Sprintf("%s/endpoints=%d/tokens=%s", mode, e, tokensName(tok)), func(b *testing.B) {
					p := New(benchConfig(), Options{Rand: rand.New(rand.NewPCG(1, 2))})
					p.Replace(endpoints(e))
					prompt := text("bench", tok*4)
					req := Request{Model: "bench-model", Prompt: prompt}
					base := prefix.HashTiered(nil, req.Model, "", prompt, p.cfg.BlockSizeChars, p.blocks.fine, p.blocks.coarseChars, p.cfg.MaxPromptBlocks)
					hashes := append([]uint64(nil), base...)
					shared := benchSharedTokens * 4 / p.cfg.BlockSizeChars
					r := &Reservation{}
					var n uint64
					var critical time.Duration
					place := func() {
						if mode == "new" {
							n++
							for i := shared; i < len(hashes); i++ {
								hashes[i] = base[i] ^ n<<40
							}
						}
						*r = Reservation{hashes: hashes, promptChars: len(prompt)}
						p.mu.Lock()
						start := time.Now()
						if err := p.l.place(r, req); err != nil {
							panic(err)
						}
						critical += time.Since(start)
						p.l.release(r, 0)
						p.mu.Unlock()
						p.tidy()
					}
					for range 2 * benchLRUBlocks / len(hashes) { // fill the LRU
						place()
					}
					critical = 0
					b.ReportAllocs()
					cpu := startCPU()
					for b.Loop() {
						place()
					}
					cpu.report(b)
					b.ReportMetric(float64(critical.Nanoseconds())/float64(b.N), "critical-ns/op")
				})
			}
		}
	}
}

type cpuMeter struct {
	start time.Duration
	ok    bool
}

func startCPU() cpuMeter {
	t, ok := benchcpu.ProcessCPU()
	return cpuMeter{t, ok}
}

// report adds cpu-ns/op: the process's CPU time per operation (GC included).
func (m cpuMeter) report(b *testing.B) {
	if end, ok := benchcpu.ProcessCPU(); ok && m.ok && b.N > 0 {
		b.ReportMetric(float64(end-m.start)/float64(b.N), "cpu-ns/op")
	}
}

// BenchmarkSmallPicksBesideHugePrompts measures the latency of small picks
// (1,000-token prompts, 16 endpoints) alone and while another goroutine
// places 8 MiB prompts one after another: the prompt block cap must keep a
// huge prompt's hold of the lock as short as a 32,000-token one's. It
// reports the small picks' p50 and p99 (ns); compare the two sub-benchmarks.
func BenchmarkSmallPicksBesideHugePrompts(b *testing.B) {
	for _, beside := range []bool{false, true} {
		name := "alone"
		if beside {
			name = "beside-8MiB-prompts"
		}
		b.Run(name, func(b *testing.B) {
			p := New(benchConfig(), Options{Rand: rand.New(rand.NewPCG(1, 2))})
			p.Replace(endpoints(16))
			stop := make(chan struct{})
			done := make(chan struct{})
			if beside {
				huge := text("huge", 8<<20)
				go func() {
					defer close(done)
					for n := uint64(0); ; n++ {
						select {
						case <-stop:
							return
						default:
						}
						binary.LittleEndian.PutUint64(huge, n) // a fresh prompt each time
						r, err := p.pick(Request{Model: "bench-model", Prompt: huge})
						if err != nil {
							panic(err)
						}
						p.End(r, Outcome{})
					}
				}()
			} else {
				close(done)
			}
			small := text("small", 4000)
			lat := make([]time.Duration, 0, b.N)
			var n uint64
			for b.Loop() {
				n++
				binary.LittleEndian.PutUint64(small, n)
				start := time.Now()
				r, err := p.pick(Request{Model: "bench-model", Prompt: small})
				lat = append(lat, time.Since(start))
				if err != nil {
					panic(err)
				}
				p.End(r, Outcome{})
			}
			close(stop)
			<-done
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2]), "p50-ns")
			b.ReportMetric(float64(lat[len(lat)*99/100]), "p99-ns")
		})
	}
}

func tokensName(tok int) string {
	if tok >= 1<<20 {
		return fmt.Sprintf("%dMiB", tok*4>>20)
	}
	return fmt.Sprintf("%dk", tok/1000)
}
