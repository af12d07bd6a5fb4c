// Package testenv starts the real kube-apiserver and etcd (envtest) that the
// controllers suites, the e2e suite and the install tests run against, with
// the CRDs of config/crd/bases (InferencePool, InferenceObjective,
// InferenceModelRewrite) installed.
//
// The invariant not to break: the binaries come from hack/envtest-assets.sh
// (or $KUBEBUILDER_ASSETS), never from a download at test time; no binary
// bucket is reachable from CI.
package testenv

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/mod/modfile"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// ModulePath is the module whose go.mod marks the repository root.
const ModulePath = "github.com/tallyepp/tally"

// RepoRoot returns the repository root: the nearest directory, from the
// working directory up, whose go.mod declares ModulePath.
func RepoRoot() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("finding the repository root: %w", err)
	}
	for dir := wd; ; {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && modfile.ModulePath(data) == ModulePath {
			return dir, nil
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("finding the repository root: %w", err)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod of module %s in %s or any parent directory", ModulePath, wd)
		}
		dir = parent
	}
}

// AssetsDir returns the directory holding kube-apiserver, etcd and kubectl:
// $KUBEBUILDER_ASSETS when set, otherwise the directory that
// hack/envtest-assets.sh prints (it builds the binaries on first use, which
// takes minutes, and caches them under bin/). The script's progress goes to
// this process's stderr.
func AssetsDir() (string, error) {
	if dir := os.Getenv("KUBEBUILDER_ASSETS"); dir != "" {
		return dir, nil
	}
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	script := filepath.Join(root, "hack", "envtest-assets.sh")
	cmd := exec.Command("bash", script)
	cmd.Dir = root
	cmd.Stderr = os.Stderr
	var out bytes.Buffer
	cmd.Stdout = &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("running %s (or set KUBEBUILDER_ASSETS to a directory with kube-apiserver, etcd and kubectl): %w", script, err)
	}
	// The directory is the script's last line of output.
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	dir := strings.TrimSpace(lines[len(lines)-1])
	if dir == "" {
		return "", fmt.Errorf("%s printed no asset directory", script)
	}
	if _, err := os.Stat(filepath.Join(dir, "kube-apiserver")); err != nil {
		return "", fmt.Errorf("%s printed %q, which holds no kube-apiserver: %w", script, dir, err)
	}
	return dir, nil
}

// Start starts an API server and etcd with the CRDs from config/crd/bases
// (InferencePool, InferenceObjective, InferenceModelRewrite) and any CRDs in
// extraCRDPaths (files or directories) installed. The caller stops the
// returned environment.
func Start(extraCRDPaths ...string) (*envtest.Environment, *rest.Config, error) {
	assets, err := AssetsDir()
	if err != nil {
		return nil, nil, err
	}
	root, err := RepoRoot()
	if err != nil {
		return nil, nil, err
	}
	env := &envtest.Environment{
		BinaryAssetsDirectory: assets,
		CRDDirectoryPaths:     append([]string{filepath.Join(root, "config", "crd", "bases")}, extraCRDPaths...),
		ErrorIfCRDPathMissing: true,
	}
	cfg, err := env.Start()
	if err != nil {
		// Start can fail after etcd or the API server is already running;
		// stopping a half-started environment is what releases them.
		stopErr := env.Stop()
		return nil, nil, errors.Join(fmt.Errorf("starting envtest with assets from %s: %w", assets, err), stopErr)
	}
	return env, cfg, nil
}
