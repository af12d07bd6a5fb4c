package install

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tallyepp/tally/internal/ociimage"
)

// TestDockerContextHoldsThePickerSources checks the Dockerfile, kept for
// those who build with Docker, against the image `make image` builds (which
// TestImageIsReproducibleAndRunsTheStampedPicker builds and runs without a
// container engine; no Docker engine is here to run this file): .dockerignore
// leaves in the build context every package of this module that cmd/epp is
// built from, and the Dockerfile builds that binary with internal/ociimage's
// flags (static, trimmed, the version and commit stamped from its build
// arguments) and runs it as the same user with the same entrypoint.
func TestDockerContextHoldsThePickerSources(t *testing.T) {
	root := repoRoot(t)
	patterns := dockerignore(t, filepath.Join(root, ".dockerignore"))

	cmd := exec.Command("go", "list", "-deps", "-f", "{{if .Module}}{{if .Module.Main}}{{.Dir}}{{end}}{{end}}", "./cmd/epp")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/epp: %v", err)
	}
	var dirs []string
	for _, dir := range strings.Fields(string(out)) {
		rel, err := filepath.Rel(root, dir)
		if err != nil {
			t.Fatal(err)
		}
		dirs = append(dirs, filepath.ToSlash(rel))
	}
	if len(dirs) < 2 {
		t.Fatalf("go list found only %v in the module: cannot be cmd/epp's dependencies", dirs)
	}
	for _, dir := range append(dirs, "go.mod", "go.sum") {
		if p, ok := excluded(patterns, dir); ok {
			t.Errorf("%s is needed to build cmd/epp but .dockerignore excludes it (pattern %q)", dir, p)
		}
	}

	dockerfile, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"CGO_ENABLED=0",
		`go build -trimpath -buildvcs=false -ldflags "` + ociimage.LDFlags("${VERSION}", "${COMMIT}") + `" -o /out/epp ./cmd/epp`,
		"FROM gcr.io/distroless/static-debian12:nonroot",
		"COPY --from=builder /out/epp /epp",
		"USER " + ociimage.User,
		`ENTRYPOINT ["` + ociimage.BinaryPath + `"]`,
	} {
		if !strings.Contains(string(dockerfile), want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
}

func dockerignore(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var patterns []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.HasPrefix(line, "!") {
			t.Fatalf(".dockerignore uses an exception (%q), which this check does not understand", line)
		}
		patterns = append(patterns, strings.TrimSuffix(line, "/"))
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	return patterns
}

// excluded reports whether a pattern excludes path or one of its parent
// directories, in Docker's terms: a pattern matches a path from the context
// root, "**/" matches any number of leading directories, and excluding a
// directory excludes what is inside it.
func excluded(patterns []string, path string) (string, bool) {
	parts := strings.Split(path, "/")
	for _, p := range patterns {
		for end := 1; end <= len(parts); end++ {
			prefix := strings.Join(parts[:end], "/")
			if rest, ok := strings.CutPrefix(p, "**/"); ok {
				for start := 0; start < end; start++ {
					if m, _ := filepath.Match(rest, strings.Join(parts[start:end], "/")); m {
						return p, true
					}
				}
				continue
			}
			if m, _ := filepath.Match(p, prefix); m {
				return p, true
			}
		}
	}
	return "", false
}
