package install

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"errors"
	"github.com/tallyepp/tally/internal/testtier"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/tallyepp/tally/internal/ociimage"
)

// imageOptions are what `make image` gives internal/ociimage, for this
// machine's platform only: the version and commit git reports for the
// checkout, read the same way hack/image reads them, and a fixed time.
func imageOptions(t *testing.T) ociimage.Options {
	t.Helper()
	root := repoRoot(t)
	g, err := ociimage.ReadGit(t.Context(), root)
	if err != nil {
		t.Fatal(err)
	}
	return ociimage.Options{
		Dir:       root,
		Package:   "./cmd/epp",
		Platforms: []ociimage.Platform{{OS: "linux", Arch: runtime.GOARCH}},
		Version:   g.Version,
		Commit:    g.Commit,
		Created:   time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
		Source:    "https://github.com/tallyepp/tally",
		Licenses:  "Apache-2.0",
		Title:     "tally-epp",
	}
}

// TestImageIsReproducibleAndRunsTheStampedPicker builds the image as `make
// image` does, twice, and reads the layout the way a runtime would: the
// index, the manifest, the config, then the layers' files. The binary taken
// out of the layer is run with --version, which must print what was stamped.
func TestImageIsReproducibleAndRunsTheStampedPicker(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the image's binary runs only on linux")
	}
	testtier.SkipIfShort(t, "two static builds of cmd/epp (minutes with a cold build cache)")
	opts := imageOptions(t)
	start := time.Now()
	first, err := ociimage.Build(t.Context(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first build: %s", time.Since(start).Round(time.Second))
	start = time.Now()
	second, err := ociimage.Build(t.Context(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("second build: %s", time.Since(start).Round(time.Second))
	d1, err := first.Digest()
	if err != nil {
		t.Fatal(err)
	}
	d2, err := second.Digest()
	if err != nil {
		t.Fatal(err)
	}
	if d1 != d2 {
		t.Fatalf("two builds of the same source gave index digests %s and %s", d1, d2)
	}
	layoutDirs := []string{filepath.Join(t.TempDir(), "image"), filepath.Join(t.TempDir(), "image")}
	for i, idx := range []v1.ImageIndex{first, second} {
		if err := ociimage.WriteLayout(layoutDirs[i], idx, opts.Version); err != nil {
			t.Fatal(err)
		}
	}
	if a, b := readFile(t, filepath.Join(layoutDirs[0], "index.json")), readFile(t, filepath.Join(layoutDirs[1], "index.json")); !bytes.Equal(a, b) {
		t.Fatalf("the two layouts' index.json differ:\n%s\n%s", a, b)
	}
	// Written again over itself, the layout is replaced, not added to.
	if err := ociimage.WriteLayout(layoutDirs[0], first, opts.Version); err != nil {
		t.Fatal(err)
	}

	img := openLayout(t, layoutDirs[0], opts, d1)
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.OS != "linux" || cfg.Architecture != runtime.GOARCH {
		t.Errorf("config platform %s/%s, want linux/%s", cfg.OS, cfg.Architecture, runtime.GOARCH)
	}
	if !cfg.Created.Time.Equal(opts.Created) {
		t.Errorf("config created %s, want %s", cfg.Created.Time, opts.Created)
	}
	if cfg.Config.User != "65532:65532" {
		t.Errorf("config user %q, want 65532:65532 (the chart's runAsUser and runAsGroup)", cfg.Config.User)
	}
	if !slices.Equal(cfg.Config.Entrypoint, []string{"/epp"}) || len(cfg.Config.Cmd) != 0 {
		t.Errorf("entrypoint %q, cmd %q: want [/epp] alone (the chart passes the flags as args)", cfg.Config.Entrypoint, cfg.Config.Cmd)
	}
	wantLabels := map[string]string{
		"org.opencontainers.image.created":  "2026-01-02T03:04:05Z",
		"org.opencontainers.image.source":   "https://github.com/tallyepp/tally",
		"org.opencontainers.image.version":  opts.Version,
		"org.opencontainers.image.revision": opts.Commit,
		"org.opencontainers.image.licenses": "Apache-2.0",
		"org.opencontainers.image.title":    "tally-epp",
	}
	if !maps.Equal(cfg.Config.Labels, wantLabels) {
		t.Errorf("labels %v, want %v", cfg.Config.Labels, wantLabels)
	}
	if cfg.RootFS.Type != "layers" || len(cfg.History) != 2 || len(cfg.RootFS.DiffIDs) != 2 {
		t.Errorf("rootfs type %q, history %d entries, diff_ids %d: want layers, 2 of each (root filesystem, binary)", cfg.RootFS.Type, len(cfg.History), len(cfg.RootFS.DiffIDs))
	}

	start = time.Now()
	files := imageFiles(t, img)
	t.Logf("extracting the files: %s", time.Since(start).Round(time.Second))
	var names []string
	for name, f := range files {
		names = append(names, name)
		if !f.ModTime.Equal(opts.Created) {
			t.Errorf("%s: mtime %s, want the creation time %s", name, f.ModTime, opts.Created)
		}
	}
	slices.Sort(names)
	// No shell, no package manager: the picker and what Go needs to name
	// its user.
	want := []string{"epp", "etc", "etc/group", "etc/nsswitch.conf", "etc/passwd", "home", "home/nonroot", "tmp"}
	if !slices.Equal(names, want) {
		t.Errorf("files %q, want %q", names, want)
	}
	if passwd := string(files["etc/passwd"].body); !strings.Contains(passwd, "\nnonroot:x:65532:65532:") {
		t.Errorf("/etc/passwd has no nonroot user 65532:\n%s", passwd)
	}
	if h := files["home/nonroot"]; h.Uid != 65532 || h.Gid != 65532 {
		t.Errorf("/home/nonroot owned by %d:%d, want 65532:65532", h.Uid, h.Gid)
	}
	bin := files["epp"]
	if bin.Uid != 0 || bin.Mode&0o022 != 0 || bin.Mode&0o111 == 0 {
		t.Errorf("/epp: owner %d, mode %o: want root's, executable, writable by no one else", bin.Uid, bin.Mode)
	}

	path := filepath.Join(t.TempDir(), "epp")
	if err := os.WriteFile(path, bin.body, 0o755); err != nil {
		t.Fatal(err)
	}
	assertStatic(t, path)
	out, err := exec.CommandContext(t.Context(), path, "--version").Output()
	if err != nil {
		t.Fatalf("epp --version: %v", err)
	}
	wantOut := "version: " + opts.Version + "\ncommit: " + opts.Commit + "\ngo: " + goVersion(t) + "\n"
	if string(out) != wantOut {
		t.Errorf("epp --version printed %q, want %q", out, wantOut)
	}

	// The tarball holds the same config and layers as the layout's image.
	tarPath := filepath.Join(t.TempDir(), "image.tar")
	if err := ociimage.WriteTarball(tarPath, img, "ghcr.io/tallyepp/tally", opts.Version); err != nil {
		t.Fatal(err)
	}
	loaded, err := tarball.ImageFromPath(tarPath, nil)
	if err != nil {
		t.Fatalf("reading the tarball back: %v", err)
	}
	if a, b := configDigest(t, img), configDigest(t, loaded); a != b {
		t.Errorf("tarball config %s, layout config %s: want the same", b, a)
	}
	if a, b := layerDigests(t, img), layerDigests(t, loaded); !slices.Equal(a, b) {
		t.Errorf("tarball layers %v, layout layers %v: want the same", b, a)
	}
}

// openLayout reads dir as an OCI image layout: one index named version
// whose digest is want, holding one image for this platform, in OCI media
// types throughout.
func openLayout(t *testing.T, dir string, opts ociimage.Options, want v1.Hash) v1.Image {
	t.Helper()
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	tm, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(tm.Manifests) != 1 {
		t.Fatalf("index.json lists %d entries, want 1 (the image index)", len(tm.Manifests))
	}
	desc := tm.Manifests[0]
	if desc.MediaType != types.OCIImageIndex || desc.Digest != want || desc.Annotations["org.opencontainers.image.ref.name"] != opts.Version {
		t.Fatalf("index.json entry %+v, want an OCI image index %s named %s", desc, want, opts.Version)
	}
	idx, err := top.ImageIndex(desc.Digest)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if im.Annotations["org.opencontainers.image.revision"] != opts.Commit {
		t.Errorf("index annotations %v, want the revision %s", im.Annotations, opts.Commit)
	}
	if len(im.Manifests) != 1 || im.Manifests[0].Platform == nil ||
		im.Manifests[0].Platform.OS != "linux" || im.Manifests[0].Platform.Architecture != runtime.GOARCH {
		t.Fatalf("image index manifests %+v, want one for linux/%s", im.Manifests, runtime.GOARCH)
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	if m.MediaType != types.OCIManifestSchema1 || m.Config.MediaType != types.OCIConfigJSON {
		t.Errorf("manifest %s with config %s, want OCI media types", m.MediaType, m.Config.MediaType)
	}
	for _, l := range m.Layers {
		if l.MediaType != types.OCILayer {
			t.Errorf("layer %s is %s, want %s", l.Digest, l.MediaType, types.OCILayer)
		}
	}
	return img
}

type imageFile struct {
	*tar.Header
	body []byte
}

// imageFiles is the image's filesystem, its layers applied in order.
func imageFiles(t *testing.T, img v1.Image) map[string]imageFile {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	files := map[string]imageFile{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = imageFile{Header: h, body: body}
	}
}

// assertStatic fails unless path is an ELF executable with no program
// interpreter: it needs no libc, which the image does not have.
func assertStatic(t *testing.T, path string) {
	t.Helper()
	f, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Fatalf("%s is dynamically linked: the image has no libc", path)
		}
	}
}

func goVersion(t *testing.T) string {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), "go", "env", "GOVERSION")
	cmd.Dir = repoRoot(t)
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(out))
}

func configDigest(t *testing.T, img v1.Image) v1.Hash {
	t.Helper()
	h, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func layerDigests(t *testing.T, img v1.Image) []string {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	var ds []string
	for _, l := range layers {
		d, err := l.Digest()
		if err != nil {
			t.Fatal(err)
		}
		ds = append(ds, d.String())
	}
	return ds
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
