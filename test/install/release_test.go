package install

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
	"golang.org/x/mod/modfile"
)

// releaseWorkflow is the part of .github/workflows/release.yaml checked
// here. (YAML 1.2: the key "on" is a string, not true.)
type releaseWorkflow struct {
	On struct {
		Push struct {
			Tags []string `yaml:"tags"`
		} `yaml:"push"`
	} `yaml:"on"`
	Permissions map[string]string `yaml:"permissions"`
	Env         map[string]string `yaml:"env"`
	Jobs        map[string]struct {
		Steps []struct {
			Name string `yaml:"name"`
			Run  string `yaml:"run"`
		} `yaml:"steps"`
	} `yaml:"jobs"`
}

// TestReleaseWorkflow checks what the release workflow cannot check by
// running here (it pushes to ghcr.io, which this machine cannot reach):
// that it runs on version tags, builds with `make image` for both
// platforms, runs the image test, pushes to the repository the chart
// deploys, and runs the tool versions go.mod pins; and that `make image`
// runs hack/image with the platforms and version it is given.
func TestReleaseWorkflow(t *testing.T) {
	root := repoRoot(t)
	var wf releaseWorkflow
	if err := yaml.Unmarshal(readFile(t, filepath.Join(root, ".github", "workflows", "release.yaml")), &wf); err != nil {
		t.Fatal(err)
	}
	if strings.Join(wf.On.Push.Tags, ",") != "v*" {
		t.Errorf("on.push.tags %q, want [v*]", wf.On.Push.Tags)
	}
	if wf.Permissions["packages"] != "write" || wf.Permissions["contents"] != "write" {
		t.Errorf("permissions %v, want packages and contents write", wf.Permissions)
	}
	if wf.Env["PLATFORMS"] != "linux/amd64,linux/arm64" {
		t.Errorf("env PLATFORMS %q, want linux/amd64,linux/arm64", wf.Env["PLATFORMS"])
	}
	if values := string(readFile(t, filepath.Join(root, "charts", "tally", "values.yaml"))); !strings.Contains(values, "repository: "+wf.Env["IMAGE"]+"\n") {
		t.Errorf("env IMAGE %q is not the chart's image repository", wf.Env["IMAGE"])
	}

	mod, err := modfile.Parse("go.mod", readFile(t, filepath.Join(root, "go.mod")), nil)
	if err != nil {
		t.Fatal(err)
	}
	pinned := map[string]string{}
	for _, r := range mod.Require {
		pinned[r.Mod.Path] = r.Mod.Version
	}
	for env, module := range map[string]string{"CRANE": "github.com/google/go-containerregistry", "HELM": "helm.sh/helm/v3"} {
		_, version, _ := strings.Cut(wf.Env[env], "@")
		if version == "" || version != pinned[module] {
			t.Errorf("env %s %q: want %s at go.mod's version %s", env, wf.Env[env], module, pinned[module])
		}
	}

	var steps []string
	for _, job := range wf.Jobs {
		for _, s := range job.Steps {
			steps = append(steps, s.Run)
		}
	}
	all := strings.Join(steps, "\n")
	for _, want := range []string{
		`make image VERSION="$GITHUB_REF_NAME" PLATFORMS="$PLATFORMS"`,
		"TestImageIsReproducibleAndRunsTheStampedPicker",
		`push bin/image "$IMAGE:$GITHUB_REF_NAME"`,
		`helm push`,
		`"$SYFT" scan "oci-dir:bin/image"`,
	} {
		if !strings.Contains(all, want) {
			t.Errorf("no step runs %q", want)
		}
	}

	// What `make image` runs, without running it.
	cmd := exec.CommandContext(t.Context(), "make", "-n", "image", "VERSION=v9.8.7", "PLATFORMS=linux/arm64", "COMMIT=0123456789abcdef0123456789abcdef01234567")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "MAKEFLAGS=")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("make -n image: %v", err)
	}
	for _, want := range []string{"go run ./hack/image", "--platforms=linux/arm64", "--version=v9.8.7", "--commit=0123456789abcdef0123456789abcdef01234567", "--out=bin/image", "--tarball=bin/image.tar"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("make -n image prints %q, without %s", out, want)
		}
	}
}
