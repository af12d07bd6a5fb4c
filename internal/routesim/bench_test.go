package routesim

import "testing"

// BenchmarkRun measures one policy's run over the sample trace: the
// simulated requests per second of wall time.
func BenchmarkRun(b *testing.B) {
	reqs, err := LoadMooncakeFile(sampleTrace)
	if err != nil {
		b.Fatal(err)
	}
	w, err := Prepare(reqs, Config{Engines: 4, KVBlocks: 25_000, LoadFactor: 1, Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	for _, p := range Policies() {
		b.Run(p, func(b *testing.B) {
			for b.Loop() {
				if _, err := w.Run(p); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(w.Len()*b.N)/b.Elapsed().Seconds(), "requests/s")
		})
	}
}
