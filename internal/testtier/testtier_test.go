package testtier

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// runChildEnv makes the test binary, run again by
// TestSkipIfShortSkipsOnlyUnderShort, run the child test instead of
// skipping it.
const runChildEnv = "TESTTIER_CHILD"

// TestChild is what TestSkipIfShortSkipsOnlyUnderShort runs in a child
// test binary: it says so when SkipIfShort lets it through.
func TestChild(t *testing.T) {
	if os.Getenv(runChildEnv) != "1" {
		t.Skip("run by TestSkipIfShortSkipsOnlyUnderShort only")
	}
	SkipIfShort(t, "a process of its own")
	t.Log("child ran past SkipIfShort")
}

// The flag is the test binary's own, so it is seen from a child binary
// run with and without it.
func TestSkipIfShortSkipsOnlyUnderShort(t *testing.T) {
	for _, c := range []struct {
		args       []string
		want, lack string
	}{
		{[]string{"-test.short"}, "skipped with -short (the unit tier): needs a process of its own", "child ran past"},
		{nil, "child ran past SkipIfShort", "skipped with -short"},
	} {
		cmd := exec.Command(os.Args[0], append([]string{"-test.run=^TestChild$", "-test.v", "-test.count=1"}, c.args...)...)
		cmd.Env = append(os.Environ(), runChildEnv+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("child test binary with %v: %v\n%s", c.args, err, out)
		}
		if !strings.Contains(string(out), c.want) || strings.Contains(string(out), c.lack) {
			t.Errorf("child test binary with %v said:\n%s\nwant %q and not %q", c.args, out, c.want, c.lack)
		}
	}
}
