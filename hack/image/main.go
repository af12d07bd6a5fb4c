// Command image builds the picker's container image without a container
// engine (`make image`): an OCI image layout of one image per platform,
// and a tarball of one of them for `docker load` or `kind load
// image-archive`. See internal/ociimage for what is in the image and why
// the same source gives the same digests.
//
// Unset, the version, commit and creation time come from the checkout:
// git describe --tags --always --dirty, git rev-parse HEAD, and the
// commit's time (or $SOURCE_DATE_EPOCH).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"

	"github.com/tallyepp/tally/internal/ociimage"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "image: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", ".", "the module root")
	pkg := fs.String("package", "./cmd/epp", "the main package to build")
	platforms := fs.String("platforms", "linux/amd64,linux/arm64", "the platforms of the image index, comma-separated")
	version := fs.String("version", "", "the version stamped into the binary and the labels, and the tarball's tag (default: git describe --tags --always --dirty)")
	commit := fs.String("commit", "", "the commit stamped into the binary and the labels (default: git rev-parse HEAD)")
	epoch := fs.String("source-date-epoch", getenv("SOURCE_DATE_EPOCH"), "the creation time and every file's mtime, in seconds since 1970 UTC (default: $SOURCE_DATE_EPOCH, else the commit's time)")
	out := fs.String("out", "bin/image", "the OCI image layout directory to write (replaced if it is one already)")
	tarPath := fs.String("tarball", "bin/image.tar", "the docker-load tarball to write, of --tarball-platform's image (\"\": none)")
	tarPlatform := fs.String("tarball-platform", "linux/"+runtime.GOARCH, "the platform of the tarball's image, one of --platforms")
	repository := fs.String("repository", "ghcr.io/tallyepp/tally", "the repository the tarball's image is tagged in (the tag is --version)")
	source := fs.String("source", "https://github.com/tallyepp/tally", "the org.opencontainers.image.source label")
	licenses := fs.String("licenses", "Apache-2.0", "the org.opencontainers.image.licenses label (SPDX)")
	title := fs.String("title", "tally-epp", "the org.opencontainers.image.title label")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q: image takes flags only", fs.Arg(0))
	}

	ps, err := ociimage.ParsePlatforms(*platforms)
	if err != nil {
		return fmt.Errorf("flag --platforms: %w", err)
	}
	var tarballPlatform ociimage.Platform
	if *tarPath != "" {
		tp, err := ociimage.ParsePlatforms(*tarPlatform)
		if err != nil || len(tp) != 1 {
			return fmt.Errorf("flag --tarball-platform %q: want one OS/ARCH, such as linux/amd64", *tarPlatform)
		}
		tarballPlatform = tp[0]
		found := false
		for _, p := range ps {
			found = found || p == tarballPlatform
		}
		if !found {
			return fmt.Errorf("flag --tarball-platform %s is not one of --platforms %s", tarballPlatform, *platforms)
		}
	}

	opts := ociimage.Options{
		Dir: *dir, Package: *pkg, Platforms: ps,
		Version: *version, Commit: *commit,
		Source: *source, Licenses: *licenses, Title: *title,
		Log: stderr,
	}
	if *epoch != "" {
		if opts.Created, err = ociimage.ParseEpoch(*epoch); err != nil {
			return fmt.Errorf("flag --source-date-epoch: %w", err)
		}
	}
	if opts.Version == "" || opts.Commit == "" || opts.Created.IsZero() {
		g, err := ociimage.ReadGit(ctx, *dir)
		if err != nil {
			return fmt.Errorf("reading the version, commit and time the flags leave unset: %w", err)
		}
		if opts.Version == "" {
			opts.Version = g.Version
		}
		if opts.Commit == "" {
			opts.Commit = g.Commit
		}
		if opts.Created.IsZero() {
			opts.Created = g.CommitTime
		}
	}

	fmt.Fprintf(stderr, "building %s %s (commit %s, created %s) for %s\n", *repository, opts.Version, opts.Commit, opts.Created.Format(time.RFC3339), *platforms)
	idx, err := ociimage.Build(ctx, opts)
	if err != nil {
		return err
	}
	if err := ociimage.WriteLayout(*out, idx, opts.Version); err != nil {
		return err
	}
	digest, err := idx.Digest()
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s\t%s@%s\n", *out, *repository, digest)
	if *tarPath != "" {
		img, err := ociimage.PlatformImage(idx, tarballPlatform)
		if err != nil {
			return err
		}
		if err := ociimage.WriteTarball(*tarPath, img, *repository, opts.Version); err != nil {
			return err
		}
		imgDigest, err := img.Digest()
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%s\t%s:%s (%s, %s)\n", *tarPath, *repository, opts.Version, tarballPlatform, imgDigest)
	}
	return nil
}
