package ociimage_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"

	"github.com/tallyepp/tally/internal/ociimage"
)

func TestParsePlatforms(t *testing.T) {
	got, err := ociimage.ParsePlatforms("linux/amd64, linux/arm64")
	if err != nil {
		t.Fatal(err)
	}
	if want := []ociimage.Platform{{OS: "linux", Arch: "amd64"}, {OS: "linux", Arch: "arm64"}}; !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	for _, bad := range []string{"", "amd64", "linux/", "linux/arm/v7", "windows/amd64", "linux/amd64,linux/amd64"} {
		if _, err := ociimage.ParsePlatforms(bad); err == nil {
			t.Errorf("%q: no error", bad)
		} else if bad != "" && !strings.Contains(err.Error(), strings.Split(bad, ",")[0]) {
			t.Errorf("%q: error %q does not name it", bad, err)
		}
	}
}

func TestParseEpoch(t *testing.T) {
	got, err := ociimage.ParseEpoch("1767225600\n")
	if err != nil || !got.Equal(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("got %s, %v; want 2026-01-01T00:00:00Z", got, err)
	}
	for _, bad := range []string{"", "-1", "2026-01-01", "1.5"} {
		if _, err := ociimage.ParseEpoch(bad); err == nil || !strings.Contains(err.Error(), "SOURCE_DATE_EPOCH") {
			t.Errorf("%q: error %v, want one naming SOURCE_DATE_EPOCH", bad, err)
		}
	}
}

// Bad options are refused before anything is compiled, each naming what is
// wrong with it.
func TestBuildRefusesBadOptions(t *testing.T) {
	good := ociimage.Options{
		Dir: t.TempDir(), Package: "./cmd/epp", Platforms: []ociimage.Platform{{OS: "linux", Arch: "amd64"}},
		Version: "v0.1.0", Commit: "0123456789abcdef0123456789abcdef01234567", Created: time.Unix(1767225600, 0),
		Source: "https://github.com/tallyepp/tally", Licenses: "Apache-2.0", Title: "tally-epp",
	}
	for _, tc := range []struct {
		change func(*ociimage.Options)
		want   string
	}{
		{func(o *ociimage.Options) { o.Version = "v0.1.0 -X main.commit=evil" }, `version "v0.1.0 -X main.commit=evil"`},
		{func(o *ociimage.Options) { o.Version = "(devel)" }, `version "(devel)"`},
		{func(o *ociimage.Options) { o.Commit = "HEAD" }, `commit "HEAD"`},
		{func(o *ociimage.Options) { o.Created = time.Time{} }, "SOURCE_DATE_EPOCH"},
		{func(o *ociimage.Options) { o.Package = "cmd/epp" }, `Package "cmd/epp"`},
		{func(o *ociimage.Options) { o.Platforms = nil }, "Platforms"},
		{func(o *ociimage.Options) { o.Licenses = "" }, "Licenses"},
	} {
		o := good
		tc.change(&o)
		_, err := ociimage.Build(t.Context(), o)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("error %v, want one naming %s", err, tc.want)
		}
	}
}

// WriteLayout replaces a layout but never a directory that is not one.
func TestWriteLayoutReplacesOnlyALayout(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "out")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	keep := filepath.Join(dir, "keep.txt")
	if err := os.WriteFile(keep, []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := ociimage.WriteLayout(dir, empty.Index, "v0.1.0")
	if err == nil || !strings.Contains(err.Error(), "not an OCI image layout") {
		t.Fatalf("error %v, want a refusal naming the directory", err)
	}
	if _, err := os.Stat(keep); err != nil {
		t.Fatalf("the directory's file is gone: %v", err)
	}

	layoutDir := filepath.Join(t.TempDir(), "image")
	if err := ociimage.WriteLayout(layoutDir, empty.Index, "v0.1.0"); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(layoutDir, "blobs", "sha256", "stale")
	if err := os.MkdirAll(filepath.Dir(stale), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(stale, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := ociimage.WriteLayout(layoutDir, empty.Index, "v0.1.0"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("a blob of the previous layout is still there (%v)", err)
	}
}
