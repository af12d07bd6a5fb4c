package install

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"helm.sh/helm/v3/pkg/chartutil"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	"github.com/tallyepp/tally/internal/chartdoc"
)

// spec returns o's spec, failing the test when it has none.
func spec(t *testing.T, o *unstructured.Unstructured) map[string]any {
	t.Helper()
	s, ok, err := unstructured.NestedMap(o.Object, "spec")
	if err != nil || !ok {
		t.Fatalf("%s %s has no spec (%v)", o.GetKind(), o.GetName(), err)
	}
	return s
}

// only returns r's one object of kind.
func only(t *testing.T, r rendered, kind string) *unstructured.Unstructured {
	t.Helper()
	objs := r.all(kind)
	if len(objs) != 1 {
		t.Fatalf("rendered %d objects of kind %s, want 1 (kinds: %v)", len(objs), kind, r.kinds())
	}
	return objs[0]
}

// The DestinationRule is the upstream chart's for the same pool, and it
// points at the picker's Service.
func TestChartProviderIstio(t *testing.T) {
	r := mustRender(t, testNamespace, requiredValues, `provider: {name: istio, istio: {destinationRule: {trafficPolicy: {connectionPool: {http: {maxRequestsPerConnection: 256000}}}}}}`)
	dr := only(t, r, "DestinationRule")
	var svc corev1.Service
	r.one(t, "Service", &svc)
	if dr.GetNamespace() != testNamespace || dr.GetAPIVersion() != "networking.istio.io/v1beta1" {
		t.Errorf("DestinationRule %s/%s of %s, want the release namespace and networking.istio.io/v1beta1", dr.GetNamespace(), dr.GetName(), dr.GetAPIVersion())
	}
	if host, _, _ := unstructured.NestedString(dr.Object, "spec", "host"); host != svc.Name+"."+testNamespace+".svc.cluster.local" {
		t.Errorf("host = %q, want the picker Service %s's cluster name", host, svc.Name)
	}

	// The upstream chart, installed as a release named after the pool,
	// renders the same rule.
	up := renderUpstreamObjects(t, upstreamChart(t, repoRoot(t)), "llama", testNamespace, upstreamRequiredValues,
		`provider: {name: istio, istio: {destinationRule: {trafficPolicy: {connectionPool: {http: {maxRequestsPerConnection: 256000}}}}}}`)
	if diff := cmp.Diff(spec(t, only(t, up, "DestinationRule")), spec(t, dr)); diff != "" {
		t.Errorf("DestinationRule spec (-upstream +tally):\n%s", diff)
	}
	if up := only(t, up, "DestinationRule"); up.GetAPIVersion() != dr.GetAPIVersion() || up.GetName() != dr.GetName() {
		t.Errorf("DestinationRule %s %s, upstream's %s %s", dr.GetAPIVersion(), dr.GetName(), up.GetAPIVersion(), up.GetName())
	}

	// Plain HTTP/2 to a picker without TLS; a host and a tls of the user's.
	plain := only(t, mustRender(t, testNamespace, requiredValues, `{provider: {name: istio}, picker: {secureServing: false}}`), "DestinationRule")
	if _, found, _ := unstructured.NestedMap(plain.Object, "spec", "trafficPolicy", "tls"); found {
		t.Errorf("picker.secureServing=false: the rule still sets TLS: %v", plain.Object["spec"])
	}
	own := only(t, mustRender(t, testNamespace, requiredValues,
		`provider: {name: istio, istio: {destinationRule: {host: epp.example, trafficPolicy: {tls: {mode: SIMPLE, caCertificates: /etc/ca.pem}}}}}`), "DestinationRule")
	wantSpec := map[string]any{"host": "epp.example", "trafficPolicy": map[string]any{"tls": map[string]any{"mode": "SIMPLE", "caCertificates": "/etc/ca.pem"}}}
	if diff := cmp.Diff(wantSpec, spec(t, own)); diff != "" {
		t.Errorf("DestinationRule with the user's host and tls (-want +got):\n%s", diff)
	}
	if len(mustRender(t, testNamespace, requiredValues).all("DestinationRule")) != 0 {
		t.Error("a DestinationRule is rendered with provider.name none")
	}
}

// The GKE objects are the upstream chart's, field by field, for the same
// pool: their CRDs are GKE's own, so the upstream render is the reference.
func TestChartProviderGKE(t *testing.T) {
	ch := upstreamChart(t, repoRoot(t))
	for _, autopilot := range []bool{false, true} {
		gke := map[bool]string{false: `provider: {name: gke}`, true: `provider: {name: gke, gke: {autopilot: true}}`}[autopilot]
		// Plain HTTP metrics, as upstream's picker serves them.
		r := mustRender(t, testNamespace, requiredValues, gke, `{serviceMonitor: {create: true, interval: 10s}, picker: {metrics: {secureServing: false}}}`)
		up := renderUpstreamObjects(t, ch, "llama", testNamespace, upstreamRequiredValues, gke,
			`inferenceExtension: {monitoring: {interval: 10s, prometheus: {enabled: true}}}`)

		for _, kind := range []string{"HealthCheckPolicy", "GCPBackendPolicy"} {
			ours, theirs := only(t, r, kind), only(t, up, kind)
			if ours.GetAPIVersion() != theirs.GetAPIVersion() || ours.GetName() != theirs.GetName() || ours.GetNamespace() != testNamespace {
				t.Errorf("%s %s/%s (%s), upstream's %s (%s)", kind, ours.GetNamespace(), ours.GetName(), ours.GetAPIVersion(), theirs.GetName(), theirs.GetAPIVersion())
			}
			if diff := cmp.Diff(spec(t, theirs), spec(t, ours)); diff != "" {
				t.Errorf("%s spec (-upstream +tally):\n%s", kind, diff)
			}
		}
		if n := len(r.all("ServiceMonitor")); n != 0 {
			t.Errorf("%d ServiceMonitors on GKE, want the PodMonitoring only", n)
		}

		// The PodMonitoring: upstream's endpoint, with our Secret and pods.
		pm, upPM := only(t, r, "PodMonitoring"), only(t, up, "PodMonitoring")
		if pm.GetAPIVersion() != upPM.GetAPIVersion() {
			t.Errorf("PodMonitoring %s, upstream's %s", pm.GetAPIVersion(), upPM.GetAPIVersion())
		}
		secret := tokenSecret(t, r)
		endpoint := func(o *unstructured.Unstructured) map[string]any {
			eps, _, _ := unstructured.NestedSlice(o.Object, "spec", "endpoints")
			if len(eps) != 1 {
				t.Fatalf("%s endpoints = %v, want one", o.GetName(), eps)
			}
			return eps[0].(map[string]any)
		}
		ep, upEP := endpoint(pm), endpoint(upPM)
		if name, _, _ := unstructured.NestedString(ep, "authorization", "credentials", "secret", "name"); name != secret.Name {
			t.Errorf("PodMonitoring reads the token of Secret %q, want the rendered %s", name, secret.Name)
		}
		_ = unstructured.SetNestedField(ep, "TOKEN-SECRET", "authorization", "credentials", "secret", "name")
		_ = unstructured.SetNestedField(upEP, "TOKEN-SECRET", "authorization", "credentials", "secret", "name")
		if diff := cmp.Diff(upEP, ep); diff != "" {
			t.Errorf("PodMonitoring endpoint (-upstream +tally):\n%s", diff)
		}
		d, c := pickerDeployment(t, r)
		sel, _, _ := unstructured.NestedStringMap(pm.Object, "spec", "selector", "matchLabels")
		if len(sel) == 0 || !labels.SelectorFromSet(sel).Matches(labels.Set(d.Spec.Template.Labels)) {
			t.Errorf("PodMonitoring selects %v, not the picker pods %v", sel, d.Spec.Template.Labels)
		}
		if !slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.Name == ep["port"] }) {
			t.Errorf("PodMonitoring scrapes port %v, which the picker container does not name: %v", ep["port"], c.Ports)
		}
		if reader := secret.Annotations["kubernetes.io/service-account.name"]; reader != metricsReader(t, r) {
			t.Errorf("the token Secret is %q's, want the ServiceAccount allowed to get /metrics", reader)
		}

		// GMP's collector may read that Secret and nothing else.
		var secretRole, upRole rbacv1.Role
		var rb, upRB rbacv1.RoleBinding
		for _, o := range r.all("Role") {
			if strings.HasSuffix(o.GetName(), "-secret-read") {
				decodeStrict(t, o, &secretRole)
			}
		}
		for _, o := range r.all("RoleBinding") {
			if strings.HasSuffix(o.GetName(), "-secret-read") {
				decodeStrict(t, o, &rb)
			}
		}
		for _, o := range up.all("Role") {
			if strings.HasSuffix(o.GetName(), "-metrics-reader-secret-read") {
				decodeStrict(t, o, &upRole)
			}
		}
		for _, o := range up.all("RoleBinding") {
			if strings.Contains(o.GetName(), ":collector:") {
				decodeStrict(t, o, &upRB)
			}
		}
		if len(upRole.Rules) == 0 || len(upRB.Subjects) == 0 {
			t.Fatalf("the upstream render has no GMP collector Role and RoleBinding: %v", up.kinds())
		}
		if len(secretRole.Rules) != 1 || !slices.Equal(secretRole.Rules[0].ResourceNames, []string{secret.Name}) {
			t.Errorf("GMP's Role rules = %+v, want one rule on the Secret %s", secretRole.Rules, secret.Name)
		}
		if len(secretRole.Rules) == 1 && len(upRole.Rules) == 1 {
			ours, theirs := secretRole.Rules[0], upRole.Rules[0]
			ours.ResourceNames, theirs.ResourceNames = nil, nil
			if diff := cmp.Diff(theirs, ours); diff != "" {
				t.Errorf("GMP's Role rule (-upstream +tally):\n%s", diff)
			}
		}
		if diff := cmp.Diff(upRB.Subjects, rb.Subjects); diff != "" || rb.RoleRef.Name != secretRole.Name {
			t.Errorf("GMP's RoleBinding binds %s to (-upstream +tally):\n%s", rb.RoleRef.Name, diff)
		}
	}

	// With the picker's default HTTPS metrics the scrape skips verifying
	// its self-signed certificate.
	r := mustRender(t, testNamespace, requiredValues, `{provider: {name: gke}, serviceMonitor: {create: true}}`)
	eps, _, _ := unstructured.NestedSlice(only(t, r, "PodMonitoring").Object, "spec", "endpoints")
	if ep := eps[0].(map[string]any); ep["scheme"] != "https" || !reflectTrue(ep, "tls", "insecureSkipVerify") {
		t.Errorf("PodMonitoring endpoint %v: want https with tls.insecureSkipVerify", ep)
	}
	if n := len(mustRender(t, testNamespace, requiredValues, `provider: {name: gke}`).all("PodMonitoring")); n != 0 {
		t.Errorf("%d PodMonitorings without serviceMonitor.create", n)
	}
	timeout, _, _ := unstructured.NestedFieldNoCopy(only(t, mustRender(t, testNamespace, requiredValues, `provider: {name: gke, gke: {timeoutSeconds: 3600}}`), "GCPBackendPolicy").Object, "spec", "default", "timeoutSec")
	if fmt.Sprint(timeout) != "3600" {
		t.Errorf("GCPBackendPolicy timeoutSec = %v, want provider.gke.timeoutSeconds 3600", timeout)
	}
}

func reflectTrue(m map[string]any, fields ...string) bool {
	v, _, _ := unstructured.NestedBool(m, fields...)
	return v
}

// Extra env, volumes and mounts reach the picker container, and the
// security contexts can be overridden key by key.
func TestChartPodOptions(t *testing.T) {
	r := mustRender(t, testNamespace, requiredValues, `
picker:
  env: [{name: GODEBUG, value: tlsrsakex=0}]
  extraVolumes: [{name: epp-tls, secret: {secretName: llama-epp-tls}}]
  extraVolumeMounts: [{name: epp-tls, mountPath: /etc/epp-tls, readOnly: true}]
  extraArgs: [--cert-path=/etc/epp-tls]
  podSecurityContext: {runAsUser: null, runAsGroup: null, fsGroup: 1000}
  securityContext: {readOnlyRootFilesystem: false}
`)
	d, c := pickerDeployment(t, r)
	if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "GODEBUG" && e.Value == "tlsrsakex=0" }) ||
		!slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "NAMESPACE" }) {
		t.Errorf("env = %+v, want GODEBUG beside the chart's own", c.Env)
	}
	certDir := flagValue(t, c.Args, "--cert-path")
	var mount *corev1.VolumeMount
	for i := range c.VolumeMounts {
		if c.VolumeMounts[i].MountPath == certDir {
			mount = &c.VolumeMounts[i]
		}
	}
	if mount == nil || !mount.ReadOnly {
		t.Fatalf("--cert-path=%s is not a read-only mount: %+v", certDir, c.VolumeMounts)
	}
	if !slices.ContainsFunc(d.Spec.Template.Spec.Volumes, func(v corev1.Volume) bool {
		return v.Name == mount.Name && v.Secret != nil && v.Secret.SecretName == "llama-epp-tls"
	}) || len(d.Spec.Template.Spec.Volumes) != 4 {
		t.Errorf("volumes = %+v, want config, tmp, peer-tls and the Secret llama-epp-tls mounted at %s", d.Spec.Template.Spec.Volumes, certDir)
	}
	psc := d.Spec.Template.Spec.SecurityContext
	if psc == nil || psc.RunAsUser != nil || psc.RunAsGroup != nil || psc.FSGroup == nil || *psc.FSGroup != 1000 ||
		psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.SeccompProfile == nil {
		t.Errorf("pod securityContext %+v: want no runAsUser or runAsGroup (the platform assigns them), fsGroup 1000, and the defaults' runAsNonRoot and seccomp kept", psc)
	}
	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || *sc.ReadOnlyRootFilesystem || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("container securityContext %+v: want readOnlyRootFilesystem false and the defaults' capabilities kept", sc)
	}

	// The defaults: user 65532, read-only root.
	d, c = pickerDeployment(t, mustRender(t, testNamespace, requiredValues))
	if psc := d.Spec.Template.Spec.SecurityContext; psc.RunAsUser == nil || *psc.RunAsUser != 65532 || psc.RunAsGroup == nil || *psc.RunAsGroup != 65532 {
		t.Errorf("default pod securityContext %+v: want user and group 65532", psc)
	}
	if len(d.Spec.Template.Spec.Volumes) != 3 || len(c.VolumeMounts) != 3 {
		t.Errorf("default volumes %+v, mounts %+v: want only config, tmp and peer-tls", d.Spec.Template.Spec.Volumes, c.VolumeMounts)
	}
}

// By default the memory limit is set, GOMEMLIMIT follows it, and half of it
// (the picker's budget of buffered bodies) is the 1 GiB the picker would
// take without a limit.
func TestChartMemoryLimitSetsTheBufferBudget(t *testing.T) {
	const defaultBudgetBytes = 1 << 30 // cmd/epp: defaultBufferBudgetBytes
	d, c := pickerDeployment(t, mustRender(t, testNamespace, requiredValues))
	limit, ok := c.Resources.Limits[corev1.ResourceMemory]
	if !ok {
		t.Fatalf("limits = %v, want a memory limit by default", c.Resources.Limits)
	}
	if got := limit.Value() / 2; got != defaultBudgetBytes {
		t.Errorf("memory limit %s: half of it is %d bytes, want the picker's default budget %d", limit.String(), got, defaultBudgetBytes)
	}
	if req := c.Resources.Requests[corev1.ResourceMemory]; req.Cmp(limit) > 0 {
		t.Errorf("memory request %s above the limit %s", req.String(), limit.String())
	}
	var gomemlimit *corev1.EnvVar
	for i := range c.Env {
		if c.Env[i].Name == "GOMEMLIMIT" {
			gomemlimit = &c.Env[i]
		}
	}
	if gomemlimit == nil || gomemlimit.ValueFrom == nil || gomemlimit.ValueFrom.ResourceFieldRef == nil {
		t.Fatalf("env = %+v, want GOMEMLIMIT from the container's memory limit", c.Env)
	}
	if got := resourceFieldValue(t, d, gomemlimit.ValueFrom.ResourceFieldRef); got != "2147483648" {
		t.Errorf("GOMEMLIMIT resolves to %s, want the limit in bytes (2147483648)", got)
	}

	// A bigger limit raises GOMEMLIMIT with it; no limit, no GOMEMLIMIT.
	d, c = pickerDeployment(t, mustRender(t, testNamespace, requiredValues, `picker: {resources: {limits: {memory: 8Gi}}}`))
	if i := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "GOMEMLIMIT" }); i < 0 ||
		resourceFieldValue(t, d, c.Env[i].ValueFrom.ResourceFieldRef) != strconv.FormatInt(8<<30, 10) {
		t.Errorf("env %+v with an 8Gi limit: want GOMEMLIMIT of 8 GiB", c.Env)
	}
	_, c = pickerDeployment(t, mustRender(t, testNamespace, requiredValues, `picker: {resources: {limits: {memory: null}}}`))
	if _, ok := c.Resources.Limits[corev1.ResourceMemory]; ok || slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "GOMEMLIMIT" }) {
		t.Errorf("limits.memory null: limits %v, env %+v; want neither a limit nor GOMEMLIMIT", c.Resources.Limits, c.Env)
	}
}

// `helm template` without --kube-version checks the chart's kubeVersion
// against Helm's built-in Kubernetes version (v1.20.0 in a helm built from
// source, as in this test binary), not a cluster's, and refuses to render
// when it falls outside. This is the check helm's install action makes.
func TestChartTemplateWithoutKubeVersion(t *testing.T) {
	c := loadChart(t)
	builtIn := chartutil.DefaultCapabilities.KubeVersion.String()
	if c.Metadata.KubeVersion != "" && !chartutil.IsCompatibleRange(c.Metadata.KubeVersion, builtIn) {
		t.Fatalf("Chart.yaml's kubeVersion %q excludes Helm's built-in %s: `helm template` without --kube-version fails", c.Metadata.KubeVersion, builtIn)
	}
	if c.Metadata.KubeVersion != "" {
		t.Logf("kubeVersion %q admits Helm's built-in %s", c.Metadata.KubeVersion, builtIn)
	}
	for _, tpl := range c.Templates {
		if strings.Contains(string(tpl.Data), ".Capabilities.KubeVersion") {
			t.Errorf("%s reads .Capabilities.KubeVersion, which `helm template` fills with Helm's built-in version, not the cluster's", tpl.Name)
		}
	}
}

// The dashboard and the rules are off by default; on, they are the ones
// docs/metrics.md documents.
func TestChartDashboardAndAlertRules(t *testing.T) {
	root := repoRoot(t)
	r := mustRender(t, testNamespace, requiredValues, `{grafanaDashboard: {create: true, annotations: {grafana_folder: Inference}}, prometheusRule: {create: true, labels: {release: prometheus}}}`)

	var dashboards []corev1.ConfigMap
	for _, o := range r.all("ConfigMap") {
		var cm corev1.ConfigMap
		decodeStrict(t, o, &cm)
		if cm.Labels["grafana_dashboard"] == "1" {
			dashboards = append(dashboards, cm)
		}
	}
	if len(dashboards) != 1 {
		t.Fatalf("%d ConfigMaps labelled grafana_dashboard=1, want 1", len(dashboards))
	}
	cm := dashboards[0]
	if cm.Annotations["grafana_folder"] != "Inference" {
		t.Errorf("dashboard ConfigMap annotations = %v, want grafana_folder", cm.Annotations)
	}
	original, err := os.ReadFile(filepath.Join(root, "config", "grafana", "tally-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	copied, err := os.ReadFile(filepath.Join(chartDir(t), "files", "tally-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	if string(copied) != string(original) {
		t.Errorf("charts/tally/files/tally-dashboard.json differs from config/grafana/tally-dashboard.json: copy it again")
	}
	if len(cm.Data) != 1 {
		t.Fatalf("dashboard ConfigMap keys %v, want one", sortedKeys(cm.Data))
	}
	for key, data := range cm.Data {
		var got, want any
		if err := json.Unmarshal([]byte(data), &got); err != nil {
			t.Fatalf("dashboard %s is not JSON: %v", key, err)
		}
		_ = json.Unmarshal(original, &want)
		if !strings.HasSuffix(key, ".json") || !cmp.Equal(want, got) {
			t.Errorf("dashboard ConfigMap key %s: want the JSON of config/grafana/tally-dashboard.json", key)
		}
	}

	rule := only(t, r, "PrometheusRule")
	if rule.GetLabels()["release"] != "prometheus" || rule.GetAPIVersion() != "monitoring.coreos.com/v1" {
		t.Errorf("PrometheusRule %s labels %v, want monitoring.coreos.com/v1 with release=prometheus", rule.GetAPIVersion(), rule.GetLabels())
	}
	type alert struct {
		Alert       string            `json:"alert"`
		Expr        string            `json:"expr"`
		For         string            `json:"for"`
		Labels      map[string]string `json:"labels"`
		Annotations map[string]string `json:"annotations"`
	}
	type group struct {
		Name  string  `json:"name"`
		Rules []alert `json:"rules"`
	}
	var got struct{ Groups []group }
	b, _ := json.Marshal(spec(t, rule))
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	// The drift group of docs/metrics.md, exactly.
	doc, err := os.ReadFile(filepath.Join(root, "docs", "metrics.md"))
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile("(?s)```yaml\n(groups:\n.*?)```").FindSubmatch(doc)
	if block == nil {
		t.Fatal("docs/metrics.md shows no rule file (a yaml block starting with groups:)")
	}
	var documented struct{ Groups []group }
	if err := yaml.UnmarshalStrict(block[1], &documented); err != nil {
		t.Fatalf("docs/metrics.md's rule file: %v", err)
	}
	for _, dg := range documented.Groups {
		i := slices.IndexFunc(got.Groups, func(g group) bool { return g.Name == dg.Name })
		if i < 0 {
			t.Errorf("the PrometheusRule lacks the group %s of docs/metrics.md", dg.Name)
			continue
		}
		if diff := cmp.Diff(dg, got.Groups[i]); diff != "" {
			t.Errorf("group %s (-docs/metrics.md +chart):\n%s", dg.Name, diff)
		}
	}
	// Every rule alerts on metrics the picker exports (docs/metrics.md
	// lists each, and a test of picker/extproc keeps that list complete),
	// with a duration, a severity and a summary.
	exported := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `([a-z_:]+)` \\|").FindAllSubmatch(doc, -1) {
		exported[string(m[1])] = true
	}
	metricName := regexp.MustCompile(`\b(?:tally|inference)_[a-z_]+\b`)
	var alerts int
	for _, g := range got.Groups {
		for _, a := range g.Rules {
			alerts++
			names := metricName.FindAllString(a.Expr, -1)
			if len(names) == 0 {
				t.Errorf("alert %s: expression %q names no picker metric", a.Alert, a.Expr)
			}
			for _, n := range names {
				if !exported[n] {
					t.Errorf("alert %s uses %s, which docs/metrics.md does not list as a picker metric", a.Alert, n)
				}
			}
			if a.Alert == "" || a.For == "" || a.Labels["severity"] == "" || a.Annotations["summary"] == "" || strings.Count(a.Expr, "(") != strings.Count(a.Expr, ")") {
				t.Errorf("alert %+v: want a name, balanced parentheses, for, a severity and a summary", a)
			}
		}
	}
	if alerts < 8 {
		t.Errorf("%d alerts, want the 3 of the drift group and the 5 of the picker's own metrics", alerts)
	}
	if d := mustRender(t, testNamespace, requiredValues); len(d.all("PrometheusRule")) != 0 || len(d.all("ConfigMap")) != 1 {
		t.Errorf("defaults render %v: want no PrometheusRule and only the picker's ConfigMap", d.kinds())
	}
}

// Chart.yaml's Artifact Hub annotations say what the chart holds.
func TestChartArtifactHubAnnotations(t *testing.T) {
	c := loadChart(t)
	ann := c.Metadata.Annotations
	if ann["artifacthub.io/license"] != "Apache-2.0" {
		t.Errorf("artifacthub.io/license = %q, want Apache-2.0", ann["artifacthub.io/license"])
	}
	if lic, err := os.ReadFile(filepath.Join(repoRoot(t), "LICENSE")); err != nil || !strings.Contains(string(lic), "Apache License") || !strings.Contains(string(lic), "Version 2.0") {
		t.Errorf("LICENSE is not Apache 2.0 (%v), which the annotation says", err)
	}
	var images []struct{ Name, Image string }
	if err := yaml.UnmarshalStrict([]byte(ann["artifacthub.io/images"]), &images); err != nil {
		t.Fatalf("artifacthub.io/images: %v", err)
	}
	_, ctr := pickerDeployment(t, mustRender(t, testNamespace, requiredValues))
	if len(images) != 1 || images[0].Image != ctr.Image {
		t.Errorf("artifacthub.io/images = %+v, want the image the chart deploys, %s", images, ctr.Image)
	}
	var crds []struct{ Kind, Version, Name, DisplayName, Description string }
	if err := yaml.UnmarshalStrict([]byte(ann["artifacthub.io/crds"]), &crds); err != nil {
		t.Fatalf("artifacthub.io/crds: %v", err)
	}
	var want, listed []string
	for _, f := range c.CRDObjects() {
		var crd struct {
			Metadata struct{ Name string }
			Spec     struct {
				Names    struct{ Kind string }
				Versions []struct {
					Name    string
					Storage bool
				}
			}
		}
		if err := yaml.Unmarshal(f.File.Data, &crd); err != nil {
			t.Fatalf("%s: %v", f.Filename, err)
		}
		for _, v := range crd.Spec.Versions {
			if v.Storage {
				want = append(want, crd.Spec.Names.Kind+" "+v.Name+" "+crd.Metadata.Name)
			}
		}
	}
	for _, crd := range crds {
		listed = append(listed, crd.Kind+" "+crd.Version+" "+crd.Name)
		if crd.Description == "" || crd.DisplayName == "" {
			t.Errorf("artifacthub.io/crds entry %+v lacks a displayName or description", crd)
		}
	}
	slices.Sort(want)
	slices.Sort(listed)
	if diff := cmp.Diff(want, listed); diff != "" {
		t.Errorf("artifacthub.io/crds differs from crds/ (-crds/ +annotation):\n%s", diff)
	}
	var links []struct{ Name, URL string }
	if err := yaml.UnmarshalStrict([]byte(ann["artifacthub.io/links"]), &links); err != nil || len(links) == 0 {
		t.Errorf("artifacthub.io/links %v: %v", links, err)
	}
	for _, l := range links {
		if l.Name == "" || !strings.HasPrefix(l.URL, "https://") {
			t.Errorf("link %+v: want a name and an https URL", l)
		}
	}
	var changes []struct{ Kind, Description string }
	if err := yaml.UnmarshalStrict([]byte(ann["artifacthub.io/changes"]), &changes); err != nil || len(changes) == 0 {
		t.Errorf("artifacthub.io/changes %v: %v", changes, err)
	}
	for _, ch := range changes {
		if !slices.Contains([]string{"added", "changed", "deprecated", "removed", "fixed", "security"}, ch.Kind) || ch.Description == "" {
			t.Errorf("change %+v: want a kind Artifact Hub knows and a description", ch)
		}
	}
}

// charts/tally/README.md's values table is what `make chart-readme` makes
// of values.yaml, and it lists every value.
func TestChartReadmeIsCurrent(t *testing.T) {
	dir := chartDir(t)
	valuesYAML, err := os.ReadFile(filepath.Join(dir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(dir, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	want, err := chartdoc.Update(string(readme), valuesYAML)
	if err != nil {
		t.Fatal(err)
	}
	if want != string(readme) {
		t.Errorf("charts/tally/README.md is stale: run `make chart-readme`\n%s", cmp.Diff(string(readme), want))
	}
	// Every value (a leaf of values.yaml, or a map shown whole) has a row.
	rows, err := chartdoc.Rows(valuesYAML)
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, r := range rows {
		documented[r.Key] = true
	}
	var defaults map[string]any
	if err := yaml.Unmarshal(valuesYAML, &defaults); err != nil {
		t.Fatal(err)
	}
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			path := prefix + k
			if documented[path] && !hasDocumentedChild(documented, path) {
				continue
			}
			if sub, ok := v.(map[string]any); ok && len(sub) > 0 {
				walk(path+".", sub)
				continue
			}
			t.Errorf("value %s has no row in the README's table", path)
		}
	}
	walk("", defaults)
	for _, key := range []string{"provider.name", "picker.env", "picker.extraVolumes", "picker.extraVolumeMounts", "picker.podSecurityContext", "picker.securityContext", "grafanaDashboard.create", "prometheusRule.create"} {
		if !strings.Contains(string(readme), "| `"+key+"` |") {
			t.Errorf("the README's table has no row for %s", key)
		}
	}
	for _, want := range []string{"kubectl apply --server-side -f charts/tally/crds/", "helm uninstall", "agentgateway", "Envoy AI Gateway"} {
		if !strings.Contains(string(readme), want) {
			t.Errorf("the chart README does not mention %q", want)
		}
	}
}

func hasDocumentedChild(documented map[string]bool, path string) bool {
	for k := range documented {
		if strings.HasPrefix(k, path+".") {
			return true
		}
	}
	return false
}
