package ociimage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// WriteLayout writes idx as an OCI image layout in dir, replacing the
// layout a previous build left there (blobs of an older build would
// otherwise stay). The index is named version (ref.name), as a tag would
// name it. dir must not exist or be an image layout: nothing else is
// removed.
func WriteLayout(dir string, idx v1.ImageIndex, version string) error {
	if err := removeLayout(dir); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("writing the image layout %s: %w", dir, err)
	}
	// layout.Write leaves blobs/ to the first image written; an index
	// with no images needs it too.
	if err := os.MkdirAll(filepath.Join(dir, "blobs", "sha256"), 0o755); err != nil {
		return fmt.Errorf("writing the image layout %s: %w", dir, err)
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{LabelRefName: version})); err != nil {
		return fmt.Errorf("writing the image layout %s: %w", dir, err)
	}
	return nil
}

func removeLayout(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("image layout %s: %w", dir, err)
	}
	if len(entries) == 0 {
		return nil
	}
	if _, err := os.Stat(filepath.Join(dir, "oci-layout")); err != nil {
		return fmt.Errorf("image layout %s: the directory exists and is not an OCI image layout (no oci-layout file): not replacing it", dir)
	}
	return os.RemoveAll(dir)
}

// PlatformImage is the image of idx for p.
func PlatformImage(idx v1.ImageIndex, p Platform) (v1.Image, error) {
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	var have []string
	for _, d := range m.Manifests {
		if d.Platform != nil && d.Platform.OS == p.OS && d.Platform.Architecture == p.Arch {
			return idx.Image(d.Digest)
		}
		if d.Platform != nil {
			have = append(have, d.Platform.OS+"/"+d.Platform.Architecture)
		}
	}
	return nil, fmt.Errorf("platform %s: the index has no image for it (it has %s)", p, strings.Join(have, ", "))
}

// WriteTarball writes img as a tarball `docker load` (and `kind load
// image-archive`) reads, tagged repository:version.
func WriteTarball(path string, img v1.Image, repository, version string) error {
	tag, err := name.NewTag(repository + ":" + version)
	if err != nil {
		return fmt.Errorf("tagging the tarball's image: %w", err)
	}
	if err := tarball.WriteToFile(path, tag, img); err != nil {
		return fmt.Errorf("writing the image tarball %s: %w", path, err)
	}
	return nil
}

// Git is what the checkout in a directory says about the build: the
// version (git describe --tags --always --dirty), the commit (git
// rev-parse HEAD) and the commit's time, the default SOURCE_DATE_EPOCH.
type Git struct {
	Version, Commit string
	CommitTime      time.Time
}

// ReadGit asks git about the checkout in dir.
func ReadGit(ctx context.Context, dir string) (Git, error) {
	run := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, "git", args...)
		cmd.Dir = dir
		out, err := cmd.Output()
		if err != nil {
			var exit *exec.ExitError
			if errors.As(err, &exit) {
				err = fmt.Errorf("%w: %s", err, strings.TrimSpace(string(exit.Stderr)))
			}
			return "", fmt.Errorf("git %s in %s: %w", strings.Join(args, " "), dir, err)
		}
		return strings.TrimSpace(string(out)), nil
	}
	var g Git
	var err error
	if g.Version, err = run("describe", "--tags", "--always", "--dirty"); err != nil {
		return Git{}, err
	}
	if g.Commit, err = run("rev-parse", "HEAD"); err != nil {
		return Git{}, err
	}
	ct, err := run("log", "-1", "--format=%ct")
	if err != nil {
		return Git{}, err
	}
	if g.CommitTime, err = ParseEpoch(ct); err != nil {
		return Git{}, fmt.Errorf("the commit time git gave: %w", err)
	}
	return g, nil
}

// ParseEpoch reads a SOURCE_DATE_EPOCH: seconds since 1970 UTC.
func ParseEpoch(s string) (time.Time, error) {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n < 0 {
		return time.Time{}, fmt.Errorf("%q is not a SOURCE_DATE_EPOCH: want seconds since 1970-01-01 UTC, such as 1767225600", s)
	}
	return time.Unix(n, 0).UTC(), nil
}
