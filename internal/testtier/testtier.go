// Package testtier sorts Tally's tests into the tiers `make help` lists. A
// unit test runs inside its test binary alone, on loopback at most, in
// seconds. An integration or end-to-end test needs a process from outside
// it (a kube-apiserver and etcd from envtest, NGINX, or the binaries of
// cmd/ built into bin/), or tens of seconds of CPU under -race (a
// simulation at full scale), which would keep the unit tier from running
// in two minutes on two cores. Those call SkipIfShort where they start, so
// `go test -short` is the unit tier.
//
// The invariant not to break: the Makefile's integration tier is the
// packages whose tests import this package, so a test that skips under
// -short by any other means than SkipIfShort is run by no tier of
// `make test`.
//
// It is a package of its own, not part of internal/testenv, because the
// demo and extproc-load binaries import testenv and should not link the
// testing package.
package testtier

import "testing"

// SkipIfShort skips t under `go test -short`, saying what it needs that the
// unit tier does not give it, e.g. "a kube-apiserver and etcd (envtest)".
func SkipIfShort(t testing.TB, needs string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("skipped with -short (the unit tier): needs %s", needs)
	}
}
