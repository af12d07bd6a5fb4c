package install

import (
	"encoding/json"
	"errors"
	"fmt"
	"github.com/tallyepp/tally/internal/testtier"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/strvals"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
)

// documentedFiles are the Markdown files whose commands TestDocCommands
// runs, in the order a reader meets them.
var documentedFiles = []string{"README.md", "docs/install.md", "charts/tally/README.md"}

// notRunnable lists the commands (by their first words) that cannot run
// here, each with the reason. A command that is neither run nor listed
// fails the test, so a new kind of command is never skipped in silence.
var notRunnable = map[string]string{
	"curl":             "needs a gateway and model servers; test/e2e sends such requests through the dev gateway and through a real NGINX",
	"gcloud":           "needs a Google Cloud project",
	"istioctl install": "installs Istio's control plane into a live cluster; the DestinationRule the chart renders for it is applied to the API server here",
	"kubectl get":      "reads state that controllers and gateways write in a live cluster",
	"kubectl describe": "reads state that controllers and gateways write in a live cluster",
	"kubectl wait":     "waits for state that controllers and gateways write in a live cluster",
	"kubectl logs":     "reads a running pod's log",
}

// externalCharts are charts the documentation installs from a registry this
// test cannot reach, by reference prefix, with what stands in for them here.
var externalCharts = map[string]string{
	"oci://ghcr.io/nginx/charts/nginx-gateway-fabric": "NGINX Gateway Fabric's chart (its exchange with the picker runs against real NGINX in test/e2e)",
	"oci://cr.agentgateway.dev/charts/":               "agentgateway's charts",
	"oci://docker.io/envoyproxy/gateway-helm":         "Envoy Gateway's chart",
	"oci://docker.io/envoyproxy/ai-gateway-helm":      "Envoy AI Gateway's chart",
	"oci://docker.io/envoyproxy/ai-gateway-crds-helm": "Envoy AI Gateway's CRD chart",
}

// upstreamChartRef is the upstream inferencepool chart; --version v1.5.0 of
// it is rendered from the Go module that holds it.
const upstreamChartRef = "oci://registry.k8s.io/gateway-api-inference-extension/charts/inferencepool"

// unservedGroups are API groups whose CRDs are not available to the test's
// API server; objects of them are rendered (so the chart's schema and
// templates are exercised) but not applied.
var unservedGroups = map[string]string{
	"networking.gke.io":         "GKE's CRDs are not published in any module; TestChartProviderGKE compares these objects with the upstream chart's",
	"monitoring.googleapis.com": "Google Cloud Managed Service for Prometheus's CRDs are not published in any module; TestChartProviderGKE compares the PodMonitoring with the upstream chart's",
	"cert-manager.io":           "cert-manager's CRDs are not installed here; the chart's use of the Secret it writes (picker.peer.existingSecret) is rendered from the values block that follows them, and TestChartPeering checks the credentials the chart needs",
}

// yamlFragments are yaml blocks that are neither Kubernetes objects nor
// values of the chart, matched by their first line, with what they are.
var yamlFragments = map[string]string{
	"# the model server Deployment's container": "a fragment of a model server's container spec (vLLM's own arguments)",
}

// maxLastAppliedBytes is the size past which a client-side `kubectl apply`
// fails: its last-applied-configuration annotation is limited to 256 KiB.
const maxLastAppliedBytes = 262144

// TestDocCommands runs every command of README.md, docs/install.md and the
// chart's README against the real chart and a real API server, so that a
// wrong value, path, name or target in the documentation fails: each
// `helm install|upgrade|template` renders the chart with exactly the
// command's --set, --set-string, --set-json and -f values (the schema
// rejects an unknown key) and applies the result; each `kubectl apply` of a
// repository file, directory or kustomization, and each yaml block that
// holds Kubernetes objects, is applied with strict field validation; `make`
// targets must exist in the Makefile. What cannot run here is listed above
// with the reason; anything else fails.
func TestDocCommands(t *testing.T) {
	testtier.SkipIfShort(t, "a kube-apiserver and etcd (envtest)")
	root := repoRoot(t)
	d := &docRunner{t: t, root: root, c: startCluster(t, root), releases: map[string]map[string]any{}, created: map[string]bool{}, targets: makeTargets(t, root)}
	for _, file := range documentedFiles {
		blocks, err := readBlocks(root, file)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range blocks {
			if err := d.runBlock(b); err != nil {
				t.Errorf("%s: %v", b.where(), err)
			}
		}
	}
	if d.ran == 0 {
		t.Fatal("no command was run: are the documentation's blocks still fenced ```sh and ```yaml?")
	}
	t.Logf("ran %d commands and yaml blocks; %d listed as not runnable here", d.ran, d.skipped)

	// The checks can fail: copies of documented blocks, each with one
	// mistake a reader could be told, must each be refused.
	t.Run("a wrong step fails", func(t *testing.T) {
		blocks, err := readBlocks(root, "docs/install.md")
		if err != nil {
			t.Fatal(err)
		}
		var install docBlock
		for _, b := range blocks {
			if shellLangs[b.lang] && strings.Contains(b.text, "helm install llama charts/tally") {
				install = b
				break
			}
		}
		if install.text == "" {
			t.Fatal("docs/install.md has no `helm install llama charts/tally` block")
		}
		mistakes := []struct{ what, old, new, want string }{
			{"a misspelt value", "--set inferencePool.name=llama", "--set pool.name=llama", "pool"},
			{"a value of the wrong type", "targetPorts[0].number=8000", "targetPorts[0].number=http", "number"},
			{"a missing required value", "--set inferencePool.name=llama", "", "name"},
			{"a chart path that does not exist", "charts/tally", "charts/tallly", "charts/tallly"},
			{"an unknown helm flag", "--create-namespace", "--create-namespaces", "create-namespaces"},
			{"a Deployment that is not the picker's", "deployment/llama-epp", "deployment/llama-picker", "llama-picker"},
			{"a make target that does not exist", "kubectl -n llm rollout status deployment/llama-epp", "make install", "install"},
			{"an unknown command", "kubectl -n llm rollout status deployment/llama-epp", "kustomize build config/default", "kustomize"},
		}
		for _, m := range mistakes {
			wrong := install
			wrong.text = strings.Replace(install.text, m.old, m.new, 1)
			if wrong.text == install.text {
				t.Fatalf("%s: the block has no %q to change:\n%s", m.what, m.old, install.text)
			}
			err := d.runBlock(wrong)
			if err == nil || !strings.Contains(err.Error(), m.want) {
				t.Errorf("%s: running\n%s\ngave %v, want an error naming %q", m.what, wrong.text, err, m.want)
			}
		}
		yamlMistakes := []struct{ what, text, want string }{
			{"a misplaced field", "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: x, namespace: llm}\nspec:\n  rules: [{backendRef: {name: llama}}]\n", "backendRef"},
			{"a kind no CRD serves", "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: x, namespace: llm}\n", "Widget"},
			{"chart values with an unknown key", "picker: {replica: 2}\n", "replica"},
			{"neither objects nor values", "args: [--model, x]\n", "args"},
		}
		for _, wrong := range [][]string{
			{"kubectl", "-n", "llm", "delete", "secret", "llama-peer-tls"},
			{"kubectl", "-n", "llm", "rollout", "restart", "deployment/llama-picker"},
		} {
			if err := d.runCommand(wrong); err == nil {
				t.Errorf("`%s` (an object the steps never created) ran without error", strings.Join(wrong, " "))
			}
		}
		for _, m := range yamlMistakes {
			err := d.runBlock(docBlock{file: "test", line: 1, lang: "yaml", text: m.text})
			if err == nil || !strings.Contains(err.Error(), m.want) {
				t.Errorf("%s: yaml block\n%s\ngave %v, want an error naming %q", m.what, m.text, err, m.want)
			}
		}
	})
}

// docRunner runs the documentation's blocks in order against one API
// server, as one reader following every step would.
type docRunner struct {
	t        *testing.T
	root     string
	c        *cluster
	releases map[string]map[string]any // "namespace/release" -> the values it was installed with
	targets  map[string]bool
	created  map[string]bool // "kind/namespace/name" created by `kubectl create` steps
	ran      int
	skipped  int
	upstream *chart.Chart
}

func (d *docRunner) runBlock(b docBlock) error {
	switch {
	case shellLangs[b.lang]:
		cmds, err := splitShell(b.text)
		if err != nil {
			return err
		}
		var errs []error
		for _, args := range cmds {
			if err := d.runCommand(args); err != nil {
				errs = append(errs, fmt.Errorf("`%s`: %w", strings.Join(args, " "), err))
			}
		}
		return errors.Join(errs...)
	case yamlLangs[b.lang]:
		d.ran++
		return d.runYAML(b)
	case inertLangs[b.lang] != "":
		return nil
	case b.lang == "":
		return errors.New("a fence without a language: mark it sh or yaml to have it run, or text for output")
	}
	return fmt.Errorf("fence language %q is neither run (sh, yaml) nor known to hold no command (%s)", b.lang, strings.Join(slices.Sorted(maps.Keys(inertLangs)), ", "))
}

func (d *docRunner) runCommand(args []string) error {
	for prefix, reason := range notRunnable {
		if hasWords(args, strings.Fields(prefix)...) {
			d.t.Logf("not run here (%s): %s", reason, strings.Join(args, " "))
			d.skipped++
			return nil
		}
	}
	d.ran++
	switch args[0] {
	case "helm":
		return d.helm(args[1:])
	case "kubectl":
		return d.kubectl(args[1:])
	case "make":
		return d.make(args[1:])
	}
	return fmt.Errorf("unknown command %q: teach TestDocCommands to run it, or list it in notRunnable with the reason", args[0])
}

// hasWords reports whether args start with words, kubectl's -n/--namespace
// flags aside (they may come before the subcommand).
func hasWords(args []string, words ...string) bool {
	var rest []string
	for i := 0; i < len(args); i++ {
		if i > 0 && (args[i] == "-n" || args[i] == "--namespace") {
			i++
			continue
		}
		if i > 0 && strings.HasPrefix(args[i], "--namespace=") {
			continue
		}
		rest = append(rest, args[i])
	}
	return len(rest) >= len(words) && slices.Equal(rest[:len(words)], words)
}

// flagSpec says which flags a command takes: true for those with a value.
type flagSpec map[string]bool

// parsedFlags are a command's flags (each value, in order) and positional
// arguments.
type parsedFlags struct {
	values map[string][]string
	args   []string
}

func (p parsedFlags) has(name string) bool { _, ok := p.values[name]; return ok }
func (p parsedFlags) last(name string) string {
	v := p.values[name]
	if len(v) == 0 {
		return ""
	}
	return v[len(v)-1]
}

// parseFlags reads --name=value, --name value, -x value and boolean flags;
// aliases map short names to long ones. A flag the spec does not know is
// an error naming it.
func parseFlags(args []string, spec flagSpec, aliases map[string]string) (parsedFlags, error) {
	p := parsedFlags{values: map[string][]string{}}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") || a == "-" {
			p.args = append(p.args, a)
			continue
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if long, ok := aliases[name]; ok {
			name = long
		}
		takesValue, known := spec[name]
		if !known {
			return p, fmt.Errorf("flag %s is not one this test knows: check it against the tool's help and add it to the command's flagSpec", a)
		}
		switch {
		case takesValue && !hasValue:
			if i+1 == len(args) {
				return p, fmt.Errorf("flag %s needs a value", a)
			}
			i++
			value = args[i]
		case !takesValue && !hasValue:
			value = "true"
		}
		p.values[name] = append(p.values[name], value)
	}
	return p, nil
}

var helmFlags = flagSpec{
	"namespace": true, "create-namespace": false, "set": true, "set-string": true, "set-json": true,
	"values": true, "reuse-values": false, "version": true, "wait": false, "install": false, "dry-run": false,
}

func (d *docRunner) helm(args []string) error {
	if len(args) == 0 {
		return errors.New("helm without a subcommand")
	}
	sub := args[0]
	p, err := parseFlags(args[1:], helmFlags, map[string]string{"n": "namespace", "f": "values", "i": "install"})
	if err != nil {
		return err
	}
	ns := p.last("namespace")
	if ns == "" {
		ns = "default"
	}
	switch sub {
	case "uninstall":
		if len(p.args) != 1 {
			return fmt.Errorf("helm uninstall takes one release name, got %q", p.args)
		}
		if _, ok := d.releases[ns+"/"+p.args[0]]; !ok {
			return fmt.Errorf("no release %q was installed in namespace %s before", p.args[0], ns)
		}
		return nil
	case "install", "upgrade", "template":
	default:
		return fmt.Errorf("helm %s is not run by this test", sub)
	}
	if len(p.args) != 2 {
		return fmt.Errorf("helm %s takes a release name and a chart, got %q", sub, p.args)
	}
	release, ref := p.args[0], p.args[1]
	for prefix, what := range externalCharts {
		if strings.HasPrefix(ref, prefix) {
			d.t.Logf("not run here (%s, from a registry this test cannot reach): helm %s", what, strings.Join(args, " "))
			d.skipped++
			d.ran--
			return nil
		}
	}
	vals, err := d.helmValues(p)
	if err != nil {
		return err
	}
	key := ns + "/" + release
	if prev, ok := d.releases[key]; sub == "upgrade" && ok && (p.has("reuse-values") || len(vals) == 0) {
		// Helm merges the new values over the release's (and reuses them
		// when none are given).
		vals = chartutil.CoalesceTables(vals, deepCopyMap(prev))
	} else if sub == "upgrade" && p.has("reuse-values") {
		return fmt.Errorf("--reuse-values, but no release %q was installed in namespace %s before", release, ns)
	}
	var r rendered
	switch {
	case ref == "charts/tally":
		r, err = renderRelease(d.t, release, ns, deepCopyMap(vals))
		if err != nil {
			return fmt.Errorf("rendering charts/tally with the command's values: %w", err)
		}
	case ref == upstreamChartRef:
		if v := p.last("version"); v != "v1.5.0" {
			return fmt.Errorf("the upstream chart at --version %q: only v1.5.0 (the version Tally documents migrating from) is rendered here", v)
		}
		if d.upstream == nil {
			d.upstream = upstreamChart(d.t, d.root)
		}
		b, err := json.Marshal(vals)
		if err != nil {
			return err
		}
		r = renderUpstreamObjects(d.t, d.upstream, release, ns, string(b))
		for _, o := range r.objects {
			if o.GetNamespace() == "" && !clusterScoped(o.GetKind()) {
				o.SetNamespace(ns)
			}
		}
	default:
		return fmt.Errorf("chart %q is neither charts/tally, the upstream chart, nor listed in externalCharts", ref)
	}
	if sub == "template" {
		return nil
	}
	if err := d.ensureNamespace(ns, p.has("create-namespace") || sub == "upgrade" && p.has("install")); err != nil {
		return err
	}
	if err := d.apply(r.objects, true); err != nil {
		return err
	}
	d.releases[key] = vals
	return nil
}

// helmValues merges a helm command's values as Helm does (its
// cli/values.Options.MergeValues): -f files in order, then --set-json,
// --set and --set-string, each parsed by Helm's own strvals.
func (d *docRunner) helmValues(p parsedFlags) (map[string]any, error) {
	base := map[string]any{}
	for _, f := range p.values["values"] {
		if strings.Contains(f, "://") {
			return nil, fmt.Errorf("-f %s: a values file from a URL cannot be checked; use a file in the repository", f)
		}
		data, err := os.ReadFile(filepath.Join(d.root, f))
		if err != nil {
			return nil, fmt.Errorf("-f %s: %w", f, err)
		}
		v, err := chartutil.ReadValues(data)
		if err != nil {
			return nil, fmt.Errorf("-f %s: %w", f, err)
		}
		base = chartutil.MergeTables(v.AsMap(), base)
	}
	for _, v := range p.values["set-json"] {
		if err := strvals.ParseJSON(v, base); err != nil {
			return nil, fmt.Errorf("--set-json %s: %w", v, err)
		}
	}
	for _, v := range p.values["set"] {
		if err := strvals.ParseInto(v, base); err != nil {
			return nil, fmt.Errorf("--set %s: %w", v, err)
		}
	}
	for _, v := range p.values["set-string"] {
		if err := strvals.ParseIntoString(v, base); err != nil {
			return nil, fmt.Errorf("--set-string %s: %w", v, err)
		}
	}
	return base, nil
}

func clusterScoped(kind string) bool {
	switch kind {
	case "ClusterRole", "ClusterRoleBinding", "Namespace", "CustomResourceDefinition":
		return true
	}
	return false
}

// ensureNamespace creates ns if create is set, else fails unless it exists,
// as helm install does.
func (d *docRunner) ensureNamespace(ns string, create bool) error {
	_, err := d.c.kube.CoreV1().Namespaces().Get(d.t.Context(), ns, metav1.GetOptions{})
	switch {
	case err == nil:
		return nil
	case !apierrors.IsNotFound(err):
		return err
	case !create:
		return fmt.Errorf("namespace %s does not exist (no step before creates it; add --create-namespace)", ns)
	}
	_, err = d.c.kube.CoreV1().Namespaces().Create(d.t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	return err
}

// apply server-side applies objs with strict field validation; force takes
// fields over from other managers (Helm replaces its objects whole).
func (d *docRunner) apply(objs []*unstructured.Unstructured, force bool) error {
	sorted := slices.Clone(objs)
	slices.SortStableFunc(sorted, func(a, b *unstructured.Unstructured) int { return applyRank(a.GetKind()) - applyRank(b.GetKind()) })
	var errs []error
	for _, o := range sorted {
		if reason, ok := unservedGroups[o.GroupVersionKind().Group]; ok {
			d.t.Logf("%s %s rendered, not applied: %s", o.GetKind(), o.GetName(), reason)
			continue
		}
		ri, err := d.c.resourceFor(o)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s %s: %w", o.GetKind(), o.GetName(), err))
			continue
		}
		data, err := json.Marshal(o)
		if err != nil {
			return err
		}
		if _, err := ri.Patch(d.t.Context(), o.GetName(), types.ApplyPatchType, data, metav1.PatchOptions{
			FieldManager: fieldManager, FieldValidation: metav1.FieldValidationStrict, Force: &force,
		}); err != nil {
			errs = append(errs, fmt.Errorf("the API server refused %s %s/%s: %w", o.GetKind(), o.GetNamespace(), o.GetName(), err))
		}
	}
	return errors.Join(errs...)
}

var kubectlFlags = flagSpec{
	"namespace": true, "filename": true, "kustomize": true, "server-side": false, "force-conflicts": false,
	"ignore-not-found": false, "clusterrole": true, "serviceaccount": true, "timeout": true,
}

func (d *docRunner) kubectl(args []string) error {
	p, err := parseFlags(args, kubectlFlags, map[string]string{"n": "namespace", "f": "filename", "k": "kustomize"})
	if err != nil {
		return err
	}
	if len(p.args) == 0 {
		return errors.New("kubectl without a subcommand")
	}
	ns := p.last("namespace")
	if ns == "" {
		ns = "default"
	}
	ctx := d.t.Context()
	switch sub := p.args[0]; sub {
	case "delete":
		if len(p.values["filename"]) == 0 && len(p.values["kustomize"]) == 0 {
			return d.deleteNamed(ns, p.args[1:])
		}
		objs, err := d.kubectlObjects(p)
		if err != nil {
			return err
		}
		return d.dryRunDelete(objs)
	case "apply":
		objs, err := d.kubectlObjects(p)
		if err != nil {
			return err
		}
		if !p.has("server-side") {
			for _, o := range objs {
				if b, _ := json.Marshal(o); len(b) > maxLastAppliedBytes {
					return fmt.Errorf("%s %s is %d bytes, too large for a client-side apply's last-applied annotation (%d): add --server-side", o.GetKind(), o.GetName(), len(b), maxLastAppliedBytes)
				}
			}
		}
		// A client-side apply overwrites; a server-side one conflicts with
		// other managers unless --force-conflicts.
		return d.apply(objs, !p.has("server-side") || p.has("force-conflicts"))
	case "rollout", "port-forward":
		// Both name the picker's Deployment: it must be one the steps
		// before created.
		target := ""
		switch {
		case sub == "rollout" && len(p.args) == 3 && (p.args[1] == "status" || p.args[1] == "restart"):
			target = p.args[2]
		case sub == "port-forward" && len(p.args) >= 3:
			target = p.args[1]
		default:
			return fmt.Errorf("kubectl %s %q: not a form this test knows", sub, p.args[1:])
		}
		kind, name, ok := strings.Cut(target, "/")
		if !ok || (kind != "deployment" && kind != "deploy" && kind != "deployments") {
			return fmt.Errorf("kubectl %s of %q: only deployment/NAME is checked here", sub, target)
		}
		if _, err := d.c.kube.AppsV1().Deployments(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("no Deployment %s/%s from the steps before: %w", ns, name, err)
		}
		return nil
	case "create":
		if len(p.args) < 3 {
			return fmt.Errorf("kubectl create %q: want a kind and a name", p.args[1:])
		}
		kind, name := p.args[1], p.args[2]
		// Two documents may show the same step; following both, a reader
		// meets "already exists" the second time, which is no error of
		// either.
		id := kind + "/" + ns + "/" + name
		again := func(err error) error {
			if apierrors.IsAlreadyExists(err) && d.created[id] {
				return nil
			}
			if err == nil {
				d.created[id] = true
			}
			return err
		}
		switch kind {
		case "serviceaccount", "sa":
			_, err := d.c.kube.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}}, metav1.CreateOptions{})
			return again(err)
		case "clusterrolebinding":
			role := p.last("clusterrole")
			if _, err := d.c.kube.RbacV1().ClusterRoles().Get(ctx, role, metav1.GetOptions{}); err != nil {
				return fmt.Errorf("--clusterrole=%s: no such ClusterRole from the steps before: %w", role, err)
			}
			saNS, sa, ok := strings.Cut(p.last("serviceaccount"), ":")
			if !ok {
				return fmt.Errorf("--serviceaccount=%q: want NAMESPACE:NAME", p.last("serviceaccount"))
			}
			if _, err := d.c.kube.CoreV1().ServiceAccounts(saNS).Get(ctx, sa, metav1.GetOptions{}); err != nil {
				return fmt.Errorf("--serviceaccount=%s:%s: %w", saNS, sa, err)
			}
			crb := &rbacv1.ClusterRoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: name},
				RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role},
				Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: saNS, Name: sa}},
			}
			_, err := d.c.kube.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{})
			return again(err)
		default:
			return fmt.Errorf("kubectl create %s is not run by this test", kind)
		}
	}
	return fmt.Errorf("kubectl %s is not run by this test: teach it, or list it in notRunnable with the reason", p.args[0])
}

// kubectlObjects reads the objects of a kubectl command's -f (repository
// files or directories) and -k (kustomizations) arguments.
func (d *docRunner) kubectlObjects(p parsedFlags) ([]*unstructured.Unstructured, error) {
	var objs []*unstructured.Unstructured
	for _, f := range p.values["filename"] {
		if strings.Contains(f, "://") || f == "-" {
			return nil, fmt.Errorf("-f %s: only files in the repository are applied here; list a gateway's own manifest URL in the guide's prose, or add the file", f)
		}
		path := filepath.Join(d.root, f)
		info, err := os.Stat(path)
		if err != nil {
			return nil, err
		}
		files := []string{path}
		if info.IsDir() {
			files = nil
			entries, err := os.ReadDir(path)
			if err != nil {
				return nil, err
			}
			for _, e := range entries {
				if ext := filepath.Ext(e.Name()); !e.IsDir() && (ext == ".yaml" || ext == ".yml" || ext == ".json") {
					files = append(files, filepath.Join(path, e.Name()))
				}
			}
			if len(files) == 0 {
				return nil, fmt.Errorf("-f %s: no manifests in the directory", f)
			}
		}
		for _, file := range files {
			data, err := os.ReadFile(file)
			if err != nil {
				return nil, err
			}
			o, err := decodeManifests(string(data))
			if err != nil {
				return nil, fmt.Errorf("%s: %w", file, err)
			}
			objs = append(objs, o...)
		}
	}
	for _, k := range p.values["kustomize"] {
		if strings.Contains(k, "://") {
			return nil, fmt.Errorf("-k %s: only kustomizations in the repository are applied here", k)
		}
		objs = append(objs, kustomizeBuild(d.t, k).objects...)
	}
	if len(objs) == 0 {
		return nil, errors.New("no -f or -k objects")
	}
	if ns := p.last("namespace"); ns != "" {
		for _, o := range objs {
			if o.GetNamespace() == "" && !clusterScoped(o.GetKind()) {
				o.SetNamespace(ns)
			}
		}
	}
	return objs, nil
}

// dryRunDelete asks the API server to delete objs without doing it: each
// must exist (a later step may still need it).
// deleteNamed runs `kubectl delete KIND NAME` as a dry run: the object
// must be one the steps before created. Only kinds a reader is told to
// delete by name are known.
func (d *docRunner) deleteNamed(ns string, args []string) error {
	if len(args) != 2 {
		return fmt.Errorf("kubectl delete %q: want KIND NAME, or -f", args)
	}
	kind, name := args[0], args[1]
	switch kind {
	case "secret", "secrets":
		if _, err := d.c.kube.CoreV1().Secrets(ns).Get(d.t.Context(), name, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("no Secret %s/%s from the steps before: %w", ns, name, err)
		}
		return d.c.kube.CoreV1().Secrets(ns).Delete(d.t.Context(), name, metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}})
	}
	return fmt.Errorf("kubectl delete %s NAME is not run by this test: teach it, or use -f", kind)
}

func (d *docRunner) dryRunDelete(objs []*unstructured.Unstructured) error {
	var errs []error
	for _, o := range objs {
		ri, err := d.c.resourceFor(o)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := ri.Delete(d.t.Context(), o.GetName(), metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
			errs = append(errs, fmt.Errorf("deleting %s %s (dry run): %w", o.GetKind(), o.GetName(), err))
		}
	}
	return errors.Join(errs...)
}

func (d *docRunner) make(args []string) error {
	if len(args) == 0 {
		return errors.New("make without a target: name one")
	}
	for _, a := range args {
		if strings.Contains(a, "=") {
			continue // a variable, e.g. DEMO_ARGS=--keep
		}
		if strings.HasPrefix(a, "-") {
			return fmt.Errorf("make flag %s is not checked here", a)
		}
		if !d.targets[a] {
			return fmt.Errorf("make target %q is not in the Makefile", a)
		}
	}
	return nil
}

// makeTargets returns the targets the Makefile defines.
func makeTargets(t *testing.T, root string) map[string]bool {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	targets := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^([A-Za-z0-9_.-]+):([^=]|$)`).FindAllStringSubmatch(string(data), -1) {
		targets[m[1]] = true
	}
	if !targets["help"] || !targets["test"] {
		t.Fatalf("read no help or test target from the Makefile: %v", slices.Sorted(maps.Keys(targets)))
	}
	return targets
}

// runYAML applies a yaml block of Kubernetes objects, renders the chart
// with a yaml block of its values (over the three required values), and
// accepts only the fragments listed in yamlFragments otherwise.
func (d *docRunner) runYAML(b docBlock) error {
	first, _, _ := strings.Cut(strings.TrimSpace(b.text), "\n")
	if reason, ok := yamlFragments[strings.TrimSpace(first)]; ok {
		d.t.Logf("%s: not run (%s)", b.where(), reason)
		d.ran--
		d.skipped++
		return nil
	}
	objs, err := decodeManifests(b.text)
	if err != nil {
		return err
	}
	if len(objs) == 0 {
		return errors.New("an empty yaml block")
	}
	isObject := func(o *unstructured.Unstructured) bool { return o.GetAPIVersion() != "" && o.GetKind() != "" }
	if slices.ContainsFunc(objs, isObject) {
		if !slices.ContainsFunc(objs, func(o *unstructured.Unstructured) bool { return !isObject(o) }) {
			return d.apply(objs, false)
		}
		return errors.New("a yaml block mixes Kubernetes objects with other documents")
	}
	// Chart values: every top-level key must be one of values.yaml's.
	top := loadChart(d.t).Values
	var keys []string
	for _, o := range objs {
		for k := range o.Object {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		if _, ok := top[k]; !ok {
			return fmt.Errorf("a yaml block that is neither Kubernetes objects nor chart values (top-level key %q is not in values.yaml); if it is a fragment, list it in yamlFragments with what it is", k)
		}
	}
	if len(objs) != 1 {
		return errors.New("chart values in more than one document")
	}
	vals := values(d.t, requiredValues)
	vals = chartutil.CoalesceTables(objs[0].Object, vals)
	if _, err := renderRelease(d.t, releaseName, "llm", vals); err != nil {
		return fmt.Errorf("rendering charts/tally with this block as values: %w", err)
	}
	return nil
}

// deepCopyMap copies values, so that rendering (which may modify them)
// leaves a release's recorded values as they were.
func deepCopyMap(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = deepCopyValue(v)
	}
	return out
}

func deepCopyValue(v any) any {
	switch v := v.(type) {
	case map[string]any:
		return deepCopyMap(v)
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = deepCopyValue(x)
		}
		return out
	}
	return v
}

// TestDocsNameTheShippedCRDs keeps docs/install.md and the CRD files in
// step: charts/tally/crds and config/crd/bases hold the same files, and the
// documentation names each CRD's release as its bundle-version annotation
// says ("the InferencePool CRD of gateway-api-inference-extension v1.6.0").
func TestDocsNameTheShippedCRDs(t *testing.T) {
	root := repoRoot(t)
	doc, err := os.ReadFile(filepath.Join(root, "docs", "install.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(strings.Fields(string(doc)), " ")
	files, err := filepath.Glob(filepath.Join(root, "charts", "tally", "crds", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no CRDs in charts/tally/crds: %v", err)
	}
	for _, f := range files {
		chartCopy, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		kustomizeCopy, err := os.ReadFile(filepath.Join(root, "config", "crd", "bases", filepath.Base(f)))
		if err != nil {
			t.Errorf("config/crd/bases has no copy of %s: %v", filepath.Base(f), err)
		} else if string(chartCopy) != string(kustomizeCopy) {
			t.Errorf("charts/tally/crds/%s and config/crd/bases/%[1]s differ: run make manifests", filepath.Base(f))
		}
		objs, err := decodeManifests(string(chartCopy))
		if err != nil || len(objs) != 1 {
			t.Fatalf("%s: want one CRD, got %d (%v)", f, len(objs), err)
		}
		kind, _, _ := unstructured.NestedString(objs[0].Object, "spec", "names", "kind")
		version := objs[0].GetAnnotations()["inference.networking.k8s.io/bundle-version"]
		if kind == "" || version == "" {
			t.Fatalf("%s: no kind (%q) or bundle-version annotation (%q)", f, kind, version)
		}
		if want := fmt.Sprintf("%s CRD of gateway-api-inference-extension %s", kind, version); !strings.Contains(text, want) {
			t.Errorf("docs/install.md does not say %q, which %s ships", want, filepath.Base(f))
		}
	}
}
