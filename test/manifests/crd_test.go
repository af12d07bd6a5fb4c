// Package manifests checks the manifests Tally ships against their sources.
package manifests

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tallyepp/tally/internal/testenv"
)

const (
	inferenceModule = "sigs.k8s.io/gateway-api-inference-extension"
	poolCRDFile     = "inference.networking.k8s.io_inferencepools.yaml"
	// v1alpha2Version is the release whose InferenceObjective and
	// InferenceModelRewrite CRDs Tally ships (api/v1alpha2 declares their
	// types): the version go.mod pins no longer has them.
	v1alpha2Version = "v1.5.0"
)

// v1alpha2CRDFiles are the CRDs copied from v1alpha2Version.
var v1alpha2CRDFiles = []string{
	"inference.networking.x-k8s.io_inferenceobjectives.yaml",
	"inference.networking.x-k8s.io_inferencemodelrewrites.yaml",
}

// TestInferencePoolCRDMatchesModule fails when a copy of the InferencePool CRD
// in this repository differs from the one shipped in the module version that
// go.mod pins: the controllers are compiled against that version's types, so
// the cluster must serve that version's schema.
func TestInferencePoolCRDMatchesModule(t *testing.T) {
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	modDir := moduleDir(t, root, inferenceModule)
	shipped := filepath.Join(modDir, "config", "crd", "bases", poolCRDFile)
	want, err := os.ReadFile(shipped)
	if err != nil {
		t.Fatalf("reading the CRD shipped in %s: %v", inferenceModule, err)
	}

	copies := []struct {
		path     string
		optional bool // the chart may not carry CRDs yet
	}{
		{path: filepath.Join("config", "crd", "bases", poolCRDFile)},
		{path: filepath.Join("charts", "tally", "crds", poolCRDFile), optional: true},
	}
	for _, c := range copies {
		t.Run(c.path, func(t *testing.T) {
			got, err := os.ReadFile(filepath.Join(root, c.path))
			if c.optional && errors.Is(err, os.ErrNotExist) {
				t.Skipf("%s does not exist", c.path)
			}
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("%s differs from %s, the CRD of the version go.mod pins; copy it from there.\n%s",
					c.path, shipped, firstDifference(got, want))
			}
		})
	}
}

// TestV1alpha2CRDsMatchV150 fails when a copy of the InferenceObjective or
// InferenceModelRewrite CRD differs from upstream v1.5.0's below its first
// line, or when that line does not name the source.
func TestV1alpha2CRDsMatchV150(t *testing.T) {
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	modDir := downloadedModuleDir(t, root, inferenceModule+"@"+v1alpha2Version)
	for _, file := range v1alpha2CRDFiles {
		shipped := filepath.Join(modDir, "config", "crd", "bases", file)
		want, err := os.ReadFile(shipped)
		if err != nil {
			t.Fatalf("reading the CRD shipped in %s %s: %v", inferenceModule, v1alpha2Version, err)
		}
		for _, path := range []string{
			filepath.Join("config", "crd", "bases", file),
			filepath.Join("charts", "tally", "crds", file),
		} {
			t.Run(path, func(t *testing.T) {
				got, err := os.ReadFile(filepath.Join(root, path))
				if err != nil {
					t.Fatal(err)
				}
				header, body, _ := bytes.Cut(got, []byte("\n"))
				if wantHeader := "# Source: gateway-api-inference-extension " + v1alpha2Version + " config/crd/bases/" + file; !bytes.HasPrefix(header, []byte(wantHeader)) {
					t.Errorf("%s starts with %q, want a comment line starting %q", path, header, wantHeader)
				}
				if !bytes.Equal(body, want) {
					t.Errorf("%s differs below its first line from %s; run hack/manifests.sh.\n%s",
						path, shipped, firstDifference(body, want))
				}
			})
		}
	}
}

// downloadedModuleDir returns the module cache directory of module@version,
// downloading it when it is not there yet.
func downloadedModuleDir(t *testing.T, root, moduleAtVersion string) string {
	t.Helper()
	cmd := exec.Command("go", "mod", "download", "-json", moduleAtVersion)
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go mod download %s: %v\n%s", moduleAtVersion, err, out)
	}
	var m struct{ Dir string }
	if err := json.Unmarshal(out, &m); err != nil || m.Dir == "" {
		t.Fatalf("go mod download -json %s gave no directory (%v):\n%s", moduleAtVersion, err, out)
	}
	return m.Dir
}

func moduleDir(t *testing.T, root, module string) string {
	t.Helper()
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", module)
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := errors.AsType[*exec.ExitError](err); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("go list -m %s: %v\n%s", module, err, stderr)
	}
	dir := strings.TrimSpace(string(out))
	if dir == "" {
		t.Fatalf("go list -m %s gave no directory: is the module downloaded (go mod download %s)?", module, module)
	}
	return dir
}

// firstDifference describes the first line at which got and want differ.
func firstDifference(got, want []byte) string {
	g := strings.Split(string(got), "\n")
	w := strings.Split(string(want), "\n")
	for i := 0; i < len(g) || i < len(w); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if i >= len(g) || i >= len(w) || gl != wl {
			return fmt.Sprintf("first difference at line %d:\n  repository: %q\n  module:     %q", i+1, gl, wl)
		}
	}
	return "the files differ only in line endings or trailing bytes"
}
