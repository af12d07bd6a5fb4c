// Package benchcpu measures the process's CPU time for benchmarks. They
// report it per operation next to ns/op because the machines they run on are
// often shared: wall time includes waiting for a core, CPU time does not.
package benchcpu
