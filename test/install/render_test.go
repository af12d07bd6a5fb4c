package install

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"
)

// releaseName is the Helm release every test renders; names in the chart
// derive from the pool name, not from it.
const releaseName = "tally"

// requiredValues are the three values a user must set.
const requiredValues = `
inferencePool:
  name: llama
  modelServers:
    matchLabels:
      app: vllm-llama
  targetPorts:
    - number: 8000
`

// rendered is what `helm install` would send to the API server, plus the
// notes it would print.
type rendered struct {
	objects []*unstructured.Unstructured
	notes   string
}

// kinds returns the kinds of r's objects, sorted.
func (r rendered) kinds() []string {
	var ks []string
	for _, o := range r.objects {
		ks = append(ks, o.GetKind())
	}
	sort.Strings(ks)
	return ks
}

// all returns r's objects of kind.
func (r rendered) all(kind string) []*unstructured.Unstructured {
	var out []*unstructured.Unstructured
	for _, o := range r.objects {
		if o.GetKind() == kind {
			out = append(out, o)
		}
	}
	return out
}

// one decodes r's only object of kind into into, failing the test unless
// there is exactly one and it decodes without unknown fields.
func (r rendered) one(t *testing.T, kind string, into any) {
	t.Helper()
	objs := r.all(kind)
	if len(objs) != 1 {
		t.Fatalf("rendered %d objects of kind %s, want 1 (kinds: %v)", len(objs), kind, r.kinds())
	}
	decodeStrict(t, objs[0], into)
}

func decodeStrict(t *testing.T, obj *unstructured.Unstructured, into any) {
	t.Helper()
	if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(obj.Object, into, true); err != nil {
		t.Fatalf("decoding %s %q: %v", obj.GetKind(), obj.GetName(), err)
	}
}

func repoRoot(t *testing.T) string {
	t.Helper()
	// Tests run in their package directory, two levels below the root.
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "charts", "tally", "Chart.yaml")); err != nil {
		t.Fatalf("repository root %s has no chart: %v", root, err)
	}
	return root
}

func chartDir(t *testing.T) string {
	return filepath.Join(repoRoot(t), "charts", "tally")
}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir(t))
	if err != nil {
		t.Fatalf("loading the chart: %v", err)
	}
	return c
}

// values parses each YAML document and merges them, later ones winning.
func values(t *testing.T, docs ...string) map[string]any {
	t.Helper()
	merged := map[string]any{}
	for _, doc := range docs {
		v, err := chartutil.ReadValues([]byte(doc))
		if err != nil {
			t.Fatalf("parsing test values %q: %v", doc, err)
		}
		merged = chartutil.CoalesceTables(v.AsMap(), merged)
	}
	return merged
}

// render renders the chart as `helm install --dry-run` does: values are
// coalesced with values.yaml and checked against values.schema.json, then
// the templates are rendered. It returns the error Helm would print.
func render(t *testing.T, namespace string, vals map[string]any) (rendered, error) {
	t.Helper()
	return renderRelease(t, releaseName, namespace, vals)
}

// renderRelease is render for the release called release.
func renderRelease(t *testing.T, release, namespace string, vals map[string]any) (rendered, error) {
	t.Helper()
	return renderOn(t, nil, release, namespace, vals)
}

// renderOn renders as `helm install` or `helm upgrade` against the API
// server of cfg does: the templates' lookup reads what is there. Without
// cfg, lookup finds nothing, as in `helm template`.
func renderOn(t *testing.T, cfg *rest.Config, release, namespace string, vals map[string]any) (rendered, error) {
	t.Helper()
	c := loadChart(t)
	opts := chartutil.ReleaseOptions{Name: release, Namespace: namespace, Revision: 1, IsInstall: true}
	top, err := chartutil.ToRenderValues(c, vals, opts, chartutil.DefaultCapabilities)
	if err != nil {
		return rendered{}, err
	}
	var files map[string]string
	if cfg != nil {
		files, err = engine.RenderWithClient(c, top, cfg)
	} else {
		files, err = engine.Render(c, top)
	}
	if err != nil {
		return rendered{}, err
	}
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	var r rendered
	for _, name := range names {
		base := filepath.Base(name)
		switch {
		case base == "NOTES.txt":
			r.notes = files[name]
			continue
		case strings.HasPrefix(base, "_"):
			continue
		}
		objs, err := decodeManifests(files[name])
		if err != nil {
			return rendered{}, fmt.Errorf("%s: %w", name, err)
		}
		r.objects = append(r.objects, objs...)
	}
	return r, nil
}

// mustRender renders and fails the test on any error.
func mustRender(t *testing.T, namespace string, docs ...string) rendered {
	t.Helper()
	r, err := render(t, namespace, values(t, docs...))
	if err != nil {
		t.Fatalf("rendering the chart: %v", err)
	}
	return r
}

// decodeManifests splits a multi-document YAML stream into objects, skipping
// empty documents.
func decodeManifests(text string) ([]*unstructured.Unstructured, error) {
	reader := k8syaml.NewYAMLReader(bufio.NewReader(strings.NewReader(text)))
	var out []*unstructured.Unstructured
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		var m map[string]any
		if err := yaml.UnmarshalStrict(doc, &m); err != nil {
			return nil, fmt.Errorf("parsing %q: %w", doc, err)
		}
		if m == nil {
			// A document of comments only.
			continue
		}
		out = append(out, &unstructured.Unstructured{Object: m})
	}
}
