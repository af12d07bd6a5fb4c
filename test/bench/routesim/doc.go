// Package routesim replays an LLM-serving trace against simulated vLLM
// engines (package test/modelsim/engine) in virtual time, routed by one of
// several policies, one of them the real picker package, and reports the
// latency each policy gives beside the no-queueing bound: each request
// alone on an idle engine with an unbounded cache.
//
// A run is a discrete-event simulation in one goroutine: the next event is
// the earliest of the next arrival, the end of an engine's step and the
// policy's next metrics observation, and nothing reads the wall clock but
// the report of how long the run took. The picker's clock (picker.Options.Now)
// is the simulation's.
//
// The invariant not to break: a run is a function of the workload, the
// configuration and the seed. Same inputs, same numbers, to the token;
// policies see the engines only through what a real router would see
// (scraped gauges, first bytes, usage at the end of a response).
package routesim
