package main

import (
	"bytes"
	"context"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
)

var stamped = build{Version: "v1.2.3-4-gabcdef0", Commit: "abcdef0123456789abcdef0123456789abcdef01", GoVersion: "go1.99.1"}

func TestVersionFlagPrintsTheBuildAndExitsZero(t *testing.T) {
	// No --pool-name: --version needs none.
	for _, args := range [][]string{{"--version"}, {"-version"}, {"--version=true", "--grpc-port=0"}} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), args, stamped, env(nil), &stdout, &stderr)
		if code != exitOK {
			t.Fatalf("%v: exit %d, stderr %q", args, code, stderr.String())
		}
		want := "version: v1.2.3-4-gabcdef0\ncommit: abcdef0123456789abcdef0123456789abcdef01\ngo: go1.99.1\n"
		if stdout.String() != want {
			t.Errorf("%v: stdout %q, want %q", args, stdout.String(), want)
		}
		if stderr.Len() != 0 {
			t.Errorf("%v: stderr %q, want nothing", args, stderr.String())
		}
	}
}

func TestFirstLogLineNamesTheBuild(t *testing.T) {
	var stdout, stderr bytes.Buffer
	// A kubeconfig that does not exist stops the picker right after its
	// flags are accepted and the log is set up.
	code := run(context.Background(), []string{"--pool-name=p", "--kubeconfig=/does/not/exist", "--zap-encoder=json", "--tracing=false"},
		stamped, env(nil), &stdout, &stderr)
	if code != exitFailure {
		t.Fatalf("exit %d, want %d; stderr %q", code, exitFailure, stderr.String())
	}
	first, _, _ := strings.Cut(stderr.String(), "\n")
	for _, want := range []string{`"version":"v1.2.3-4-gabcdef0"`, `"commit":"abcdef0123456789abcdef0123456789abcdef01"`, `"go":"go1.99.1"`} {
		if !strings.Contains(first, want) {
			t.Errorf("first log line %q lacks %s", first, want)
		}
	}
	if stdout.Len() != 0 {
		t.Errorf("stdout %q, want nothing: the log goes to stderr", stdout.String())
	}
}

func TestReadBuildPrefersTheStampedValues(t *testing.T) {
	vcs := func(kv ...string) *debug.BuildInfo {
		info := &debug.BuildInfo{Main: debug.Module{Path: "github.com/tallyepp/tally", Version: "(devel)"}}
		for i := 0; i < len(kv); i += 2 {
			info.Settings = append(info.Settings, debug.BuildSetting{Key: kv[i], Value: kv[i+1]})
		}
		return info
	}
	const rev = "1111111111111111111111111111111111111111"
	for _, tc := range []struct {
		name                    string
		version, commit         string
		info                    *debug.BuildInfo
		wantVersion, wantCommit string
	}{
		{"stamped", "v0.2.0", "2222222222222222222222222222222222222222", vcs("vcs.revision", rev),
			"v0.2.0", "2222222222222222222222222222222222222222"},
		{"unstamped, clean checkout", "", "", vcs("vcs.revision", rev, "vcs.modified", "false"), "(devel)", rev},
		{"unstamped, modified checkout", "", "", vcs("vcs.revision", rev, "vcs.modified", "true"), "(devel)", rev + "-dirty"},
		{"unstamped, no VCS", "", "", vcs(), "(devel)", "unknown"},
		{"no build info", "", "", nil, "(devel)", "unknown"},
		{"installed at a module version", "", "",
			&debug.BuildInfo{Main: debug.Module{Version: "v0.3.0"}}, "v0.3.0", "unknown"},
		{"version stamped, commit from VCS", "v0.4.0", "", vcs("vcs.revision", rev), "v0.4.0", rev},
	} {
		got := readBuild(tc.version, tc.commit, tc.info)
		if got.Version != tc.wantVersion || got.Commit != tc.wantCommit || got.GoVersion != runtime.Version() {
			t.Errorf("%s: got %+v, want version %q, commit %q, go %q", tc.name, got, tc.wantVersion, tc.wantCommit, runtime.Version())
		}
	}
}
