package install

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/api/v1alpha1"
)

// kustomizeNamespace and kustomizePool are what config/default and
// config/samples install.
const (
	kustomizeNamespace = "tally-system"
	kustomizePool      = "vllm-llama3-8b-instruct"
)

// kubectlPath returns the kubectl whose embedded kustomize builds config/
// (the one hack/envtest-assets.sh builds beside kube-apiserver first), or
// skips the test: kustomize is not a Go dependency of the module.
func kubectlPath(t *testing.T) string {
	t.Helper()
	var assets string
	if dir := os.Getenv("KUBEBUILDER_ASSETS"); dir != "" {
		assets = filepath.Join(dir, "kubectl")
	}
	for _, p := range []string{os.Getenv("KUBECTL"), assets, "/usr/bin/kubectl"} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if p, err := exec.LookPath("kubectl"); err == nil {
		return p
	}
	t.Skip("no kubectl (/usr/bin/kubectl, $KUBECTL or on PATH): cannot run `kubectl kustomize` on config/")
	return ""
}

// kustomizeBuild runs `kubectl kustomize` on dir (relative to the repository
// root) and decodes its output.
func kustomizeBuild(t *testing.T, dir string) rendered {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(kubectlPath(t), "kustomize", filepath.Join(repoRoot(t), dir))
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("kubectl kustomize %s: %v\n%s", dir, err, stderr.String())
	}
	objs, err := decodeManifests(stdout.String())
	if err != nil {
		t.Fatalf("kubectl kustomize %s: %v", dir, err)
	}
	return rendered{objects: objs}
}

// TestKustomizeMatchesChart keeps config/ and the chart in step: the same
// picker container, Service and permissions, and a valid configuration.
func TestKustomizeMatchesChart(t *testing.T) {
	k := kustomizeBuild(t, "config/default")
	wantKinds := []string{"ClusterRole", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "CustomResourceDefinition", "CustomResourceDefinition", "CustomResourceDefinition", "Deployment", "Namespace", "Role", "RoleBinding", "Service", "ServiceAccount"}
	if diff := cmp.Diff(wantKinds, k.kinds()); diff != "" {
		t.Fatalf("config/default kinds (-want +got):\n%s", diff)
	}
	for _, o := range k.objects {
		if o.GetKind() != "Namespace" && o.GetKind() != "CustomResourceDefinition" && !strings.HasPrefix(o.GetKind(), "Cluster") && o.GetNamespace() != kustomizeNamespace {
			t.Errorf("%s %s is in namespace %q, want %s", o.GetKind(), o.GetName(), o.GetNamespace(), kustomizeNamespace)
		}
	}
	var rb rbacv1.RoleBinding
	k.one(t, "RoleBinding", &rb)
	if len(rb.Subjects) != 1 || rb.Subjects[0].Namespace != kustomizeNamespace {
		t.Errorf("RoleBinding subjects = %+v, want the ServiceAccount in %s", rb.Subjects, kustomizeNamespace)
	}

	// config/manager runs one replica: no lease, no peers. The chart's
	// default of two active-active replicas adds only what
	// TestChartPeering checks.
	chart := mustRender(t, kustomizeNamespace, requiredValues, "inferencePool: {name: "+kustomizePool+"}", "picker: {replicas: 1}")
	kd, kc := pickerDeployment(t, k)
	cd, cc := pickerDeployment(t, chart)

	// Names, labels and the image differ by design; what the picker runs
	// with must not.
	ignore := cmpopts.IgnoreFields(corev1.Container{}, "Image")
	if diff := cmp.Diff(cc, kc, ignore); diff != "" {
		t.Errorf("picker container (-chart +config/manager):\n%s", diff)
	}
	cpod, kpod := cd.Spec.Template.Spec, kd.Spec.Template.Spec
	for _, field := range []struct {
		name          string
		chart, kustom any
	}{
		{"securityContext", cpod.SecurityContext, kpod.SecurityContext},
		{"terminationGracePeriodSeconds", cpod.TerminationGracePeriodSeconds, kpod.TerminationGracePeriodSeconds},
		{"replicas", cd.Spec.Replicas, kd.Spec.Replicas},
	} {
		if diff := cmp.Diff(field.chart, field.kustom); diff != "" {
			t.Errorf("pod %s (-chart +config/manager):\n%s", field.name, diff)
		}
	}
	var ksvc, csvc corev1.Service
	k.one(t, "Service", &ksvc)
	chart.one(t, "Service", &csvc)
	if diff := cmp.Diff(csvc.Spec.Ports, ksvc.Spec.Ports); diff != "" {
		t.Errorf("Service ports (-chart +config/manager):\n%s", diff)
	}
	if diff := cmp.Diff(v1alpha1.Default(), pickerConfig(t, k)); diff != "" {
		t.Errorf("config/manager/picker.yaml differs from the defaults (-want +got):\n%s", diff)
	}

	// config/rbac/role.yaml is generated from the controllers' markers; the
	// chart must grant the same, leases and the core group's events (which
	// leader election records) only with leader election.
	var generated rbacv1.Role
	k.one(t, "Role", &generated)
	// The ClusterRole generated from cmd/epp's markers equals the chart's
	// for metrics auth.
	var generatedCluster, chartCluster rbacv1.ClusterRole
	for _, o := range k.all("ClusterRole") {
		if o.GetName() == "tally-picker" {
			decodeStrict(t, o, &generatedCluster)
		}
	}
	for _, o := range chart.all("ClusterRole") {
		if strings.HasSuffix(o.GetName(), "-auth") {
			decodeStrict(t, o, &chartCluster)
		}
	}
	if diff := cmp.Diff(normalRules(generatedCluster.Rules), normalRules(chartCluster.Rules)); diff != "" || len(generatedCluster.Rules) == 0 {
		t.Errorf("chart ClusterRole for metrics auth differs from config/rbac/role.yaml's (-generated +chart):\n%s", diff)
	}
	var withLE, withoutLE rbacv1.Role
	mustRender(t, kustomizeNamespace, requiredValues, "picker: {replicas: 2}").one(t, "Role", &withLE)
	chart.one(t, "Role", &withoutLE)
	if diff := cmp.Diff(normalRules(generated.Rules), normalRules(withLE.Rules)); diff != "" {
		t.Errorf("chart Role with leader election differs from config/rbac/role.yaml (-generated +chart):\n%s", diff)
	}
	var generatedWithoutLE []rbacv1.PolicyRule
	for _, r := range normalRules(generated.Rules) {
		if !slices.Contains(r.Resources, "leases") && !(r.APIGroups[0] == "" && slices.Contains(r.Resources, "events")) {
			generatedWithoutLE = append(generatedWithoutLE, r)
		}
	}
	if diff := cmp.Diff(normalRules(generatedWithoutLE), normalRules(withoutLE.Rules)); diff != "" {
		t.Errorf("chart Role without leader election differs from config/rbac/role.yaml less leases and the core group's events (-generated +chart):\n%s", diff)
	}
}

func TestKustomizeSamples(t *testing.T) {
	s := kustomizeBuild(t, "config/samples")
	var pool infv1.InferencePool
	s.one(t, "InferencePool", &pool)
	if pool.Name != kustomizePool || pool.Namespace != kustomizeNamespace {
		t.Errorf("sample pool = %s/%s, want %s/%s (what config/manager's --pool-name names)", pool.Namespace, pool.Name, kustomizeNamespace, kustomizePool)
	}
	var svc corev1.Service
	kustomizeBuild(t, "config/default").one(t, "Service", &svc)
	ref := pool.Spec.EndpointPickerRef
	if ref == nil || string(ref.Name) != svc.Name || ref.Port == nil || ref.Port.Number != 9002 {
		t.Errorf("sample pool endpointPickerRef = %+v, want Service %s port 9002", ref, svc.Name)
	}

	// The PickerConfig sample documents every field at its default.
	data, err := os.ReadFile(filepath.Join(repoRoot(t), "config", "samples", "tally_v1alpha1_pickerconfig.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := v1alpha1.Load(data)
	if err != nil {
		t.Fatalf("the PickerConfig sample does not load: %v", err)
	}
	if diff := cmp.Diff(v1alpha1.Default(), cfg); diff != "" {
		t.Errorf("the PickerConfig sample differs from the defaults (-want +got):\n%s", diff)
	}
	for _, field := range jsonFields(reflect.TypeFor[v1alpha1.PickerConfig]()) {
		if !strings.Contains(string(data), "\n"+field+":") {
			t.Errorf("the PickerConfig sample does not show the field %s", field)
		}
	}
	for _, field := range jsonFields(reflect.TypeFor[v1alpha1.Saturation]()) {
		if !strings.Contains(string(data), "\n  "+field+":") {
			t.Errorf("the PickerConfig sample does not show the field saturation.%s", field)
		}
	}
}

// normalRules sorts rules and their lists, so that equal grants compare equal.
func normalRules(rules []rbacv1.PolicyRule) []rbacv1.PolicyRule {
	out := make([]rbacv1.PolicyRule, 0, len(rules))
	for _, r := range rules {
		// One rule per API group: controller-gen merges the groups of
		// rules with equal resources and verbs, a hand-written Role may not.
		groups := r.APIGroups
		if len(groups) == 0 {
			groups = []string{""} // a rule without groups (nonResourceURLs)
		}
		for _, g := range groups {
			r := *r.DeepCopy()
			if len(r.APIGroups) > 0 {
				r.APIGroups = []string{g}
			}
			slices.Sort(r.Resources)
			slices.Sort(r.Verbs)
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b rbacv1.PolicyRule) int {
		return strings.Compare(strings.Join(a.APIGroups, ",")+"/"+strings.Join(a.Resources, ","), strings.Join(b.APIGroups, ",")+"/"+strings.Join(b.Resources, ","))
	})
	return out
}
