package main

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// version and commit are stamped at link time by `make image` and the
// Dockerfile (-ldflags "-X main.version=... -X main.commit=..."; the
// linker can set only package-level strings). Nothing writes them at run
// time: main reads them once into a build, which is what the rest of the
// binary is given.
var (
	version string
	commit  string
)

// build names the binary's build: what --version prints, the first log
// line says and inference_extension_info carries.
type build struct {
	Version   string // the release tag, or `git describe` of a checkout
	Commit    string // the full commit hash, with "-dirty" for a modified tree
	GoVersion string
}

// Fallbacks of readBuild when neither the linker nor the Go command
// stamped a value.
const (
	unknownCommit  = "unknown"
	develVersion   = "(devel)"
	dirtySuffix    = "-dirty"
	vcsRevisionKey = "vcs.revision"
	vcsModifiedKey = "vcs.modified"
)

// readBuild prefers the stamped values. Unstamped (`go build`, `go run`),
// the commit comes from the VCS settings the Go command records
// (vcs.revision, and vcs.modified as "-dirty"), the version from the main
// module's version ("(devel)" for a checkout).
func readBuild(stampedVersion, stampedCommit string, info *debug.BuildInfo) build {
	b := build{Version: stampedVersion, Commit: stampedCommit, GoVersion: runtime.Version()}
	if info == nil {
		info = &debug.BuildInfo{}
	}
	if b.Version == "" {
		b.Version = info.Main.Version
	}
	if b.Version == "" {
		b.Version = develVersion
	}
	if b.Commit == "" {
		var revision string
		dirty := false
		for _, s := range info.Settings {
			switch s.Key {
			case vcsRevisionKey:
				revision = s.Value
			case vcsModifiedKey:
				dirty = s.Value == "true"
			}
		}
		switch {
		case revision == "":
			b.Commit = unknownCommit
		case dirty:
			b.Commit = revision + dirtySuffix
		default:
			b.Commit = revision
		}
	}
	return b
}

// binaryBuild is this binary's build.
func binaryBuild() build {
	info, _ := debug.ReadBuildInfo()
	return readBuild(version, commit, info)
}

// String is what --version prints: one "key: value" line each, for
// people and for scripts.
func (b build) String() string {
	return fmt.Sprintf("version: %s\ncommit: %s\ngo: %s\n", b.Version, b.Commit, b.GoVersion)
}
