package install

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/tallyepp/tally/api/v1alpha1"
)

const testNamespace = "inference"

// pickerDeployment returns the picker's Deployment and its container from r.
func pickerDeployment(t *testing.T, r rendered) (appsv1.Deployment, corev1.Container) {
	t.Helper()
	var d appsv1.Deployment
	r.one(t, "Deployment", &d)
	if n := len(d.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("Deployment has %d containers, want 1", n)
	}
	return d, d.Spec.Template.Spec.Containers[0]
}

// pickerConfig loads the PickerConfig that the rendered ConfigMap mounts at
// the path the Deployment's --config-file names, as the picker would.
func pickerConfig(t *testing.T, r rendered) v1alpha1.PickerConfig {
	t.Helper()
	_, c := pickerDeployment(t, r)
	path := flagValue(t, c.Args, "--config-file")
	cm, mount := configFileMap(t, r)
	key := strings.TrimPrefix(path, mount.MountPath+"/")
	data, ok := cm.Data[key]
	if !ok {
		t.Fatalf("ConfigMap %s has no key %q (the file --config-file names); keys: %v", cm.Name, key, cm.Data)
	}
	cfg, err := v1alpha1.Load([]byte(data))
	if err != nil {
		t.Fatalf("the picker would refuse the rendered configuration:\n%s\n%v", data, err)
	}
	return cfg
}

// configFileMap returns the rendered ConfigMap that holds the file the
// picker's --config-file names, and the mount it is read through.
func configFileMap(t *testing.T, r rendered) (corev1.ConfigMap, *corev1.VolumeMount) {
	t.Helper()
	d, c := pickerDeployment(t, r)
	path := flagValue(t, c.Args, "--config-file")
	var mount *corev1.VolumeMount
	for i := range c.VolumeMounts {
		if strings.HasPrefix(path, c.VolumeMounts[i].MountPath+"/") {
			mount = &c.VolumeMounts[i]
		}
	}
	if mount == nil {
		t.Fatalf("--config-file=%s is under no volume mount of %v", path, c.VolumeMounts)
	}
	var fromConfigMap string
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.Name == mount.Name && v.ConfigMap != nil {
			fromConfigMap = v.ConfigMap.Name
		}
	}
	for _, o := range r.all("ConfigMap") {
		if o.GetName() == fromConfigMap {
			var cm corev1.ConfigMap
			decodeStrict(t, o, &cm)
			return cm, mount
		}
	}
	t.Fatalf("--config-file=%s is in volume %q of ConfigMap %q, which the chart does not render", path, mount.Name, fromConfigMap)
	return corev1.ConfigMap{}, nil
}

// flagValue returns the value of the --name=value argument; it fails the
// test unless the flag is given exactly once.
func flagValue(t *testing.T, args []string, name string) string {
	t.Helper()
	var found []string
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			found = append(found, v)
		}
		if a == name {
			found = append(found, "")
		}
	}
	if len(found) != 1 {
		t.Fatalf("flag %s given %d times in %q, want once", name, len(found), args)
	}
	return found[0]
}

func TestChartDefaults(t *testing.T) {
	r := mustRender(t, testNamespace, requiredValues)

	wantKinds := []string{"ClusterRole", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "InferencePool", "PodDisruptionBudget", "Role", "RoleBinding", "Secret", "Service", "ServiceAccount"}
	if diff := cmp.Diff(wantKinds, r.kinds()); diff != "" {
		t.Fatalf("rendered kinds (-want +got):\n%s", diff)
	}
	for _, o := range r.objects {
		if strings.HasPrefix(o.GetKind(), "Cluster") {
			if !strings.HasPrefix(o.GetName(), testNamespace+"-llama-epp-") {
				t.Errorf("%s %s: want a name with the release namespace and the picker's name, so releases never share it", o.GetKind(), o.GetName())
			}
			continue
		}
		if o.GetNamespace() != testNamespace {
			t.Errorf("%s %s is in namespace %q, want the release namespace %q", o.GetKind(), o.GetName(), o.GetNamespace(), testNamespace)
		}
	}

	d, c := pickerDeployment(t, r)
	if d.Name != "llama-epp" {
		t.Errorf("Deployment name = %q, want llama-epp", d.Name)
	}
	// Two active-active replicas: both are Ready, so the default rolling
	// update replaces them one at a time.
	if *d.Spec.Replicas != 2 || d.Spec.Strategy.Type != "" {
		t.Errorf("replicas = %d, strategy %q; want 2 and the default rolling update", *d.Spec.Replicas, d.Spec.Strategy.Type)
	}
	if want := "ghcr.io/tallyepp/tally:" + loadChart(t).Metadata.AppVersion; c.Image != want {
		t.Errorf("image = %q, want %q (the tag defaults to appVersion)", c.Image, want)
	}
	wantArgs := []string{
		"--pool-name=llama",
		"--pool-namespace=" + testNamespace,
		"--grpc-port=9002",
		"--grpc-health-port=9003",
		"--metrics-port=9090",
		"--secure-serving=true",
		"--config-file=/config/picker.yaml",
		"--metrics-endpoint-auth=true",
		"--metrics-secure-serving=true",
		"--enable-pprof=true",
		"--shutdown-delay=5s",
		"--shutdown-grace=600s",
		"--ha-enable-leader-election",
		"--ha-lease-duration=15s",
		"--ha-renew-deadline=10s",
		"--ha-retry-period=2s",
		"--peer-selector=app.kubernetes.io/component=endpoint-picker,app.kubernetes.io/instance=" + releaseName + ",app.kubernetes.io/name=tally",
		"--peer-port=9004",
		"--peer-cert-path=/etc/tally/peer-tls",
		"--peer-pick-timeout=250ms",
		"-v=0",
	}
	if diff := cmp.Diff(wantArgs, c.Args); diff != "" {
		t.Errorf("args (-want +got):\n%s", diff)
	}
	if g := d.Spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || *g <= 5+600 {
		t.Errorf("terminationGracePeriodSeconds = %v, want above the drain (5 s delay + 600 s grace)", g)
	}
	// The picker asks the API server about scrapers: the only cluster-wide
	// rights it gets.
	for _, o := range r.all("ClusterRoleBinding") {
		var b rbacv1.ClusterRoleBinding
		decodeStrict(t, o, &b)
		var role rbacv1.ClusterRole
		for _, cr := range r.all("ClusterRole") {
			if cr.GetName() == b.RoleRef.Name {
				decodeStrict(t, cr, &role)
			}
		}
		wantRules := []rbacv1.PolicyRule{
			{APIGroups: []string{"authentication.k8s.io"}, Resources: []string{"tokenreviews"}, Verbs: []string{"create"}},
			{APIGroups: []string{"authorization.k8s.io"}, Resources: []string{"subjectaccessreviews"}, Verbs: []string{"create"}},
		}
		if diff := cmp.Diff(wantRules, role.Rules); diff != "" || b.Subjects[0].Name != d.Spec.Template.Spec.ServiceAccountName {
			t.Errorf("ClusterRoleBinding %s binds %s to rules (-want +got):\n%s", b.Name, b.Subjects[0].Name, diff)
		}
	}
	for _, p := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe} {
		if p == nil || p.GRPC == nil || p.GRPC.Port != 9003 {
			t.Fatalf("probe %+v: want a gRPC probe on port 9003", p)
		}
	}
	if *c.LivenessProbe.GRPC.Service != "liveness" || *c.ReadinessProbe.GRPC.Service != "readiness" {
		t.Errorf("probe services = %q, %q; want liveness, readiness", *c.LivenessProbe.GRPC.Service, *c.ReadinessProbe.GRPC.Service)
	}
	sc := c.SecurityContext
	switch {
	case sc == nil:
		t.Fatal("container has no securityContext")
	case sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot,
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem,
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation,
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) > 0,
		sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault:
		t.Errorf("container securityContext %+v: want non-root, read-only root, no privilege escalation, drop ALL, seccomp RuntimeDefault", *sc)
	}
	if psc := d.Spec.Template.Spec.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
		t.Errorf("pod securityContext %+v: want runAsNonRoot", psc)
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
		t.Errorf("resource requests = %v, want cpu and memory", c.Resources.Requests)
	}
	podLabels := labels.Set(d.Spec.Template.Labels)
	if sel := labels.SelectorFromSet(d.Spec.Selector.MatchLabels); !sel.Matches(podLabels) {
		t.Errorf("Deployment selector %v does not match its pod labels %v", sel, podLabels)
	}

	var sa corev1.ServiceAccount
	r.one(t, "ServiceAccount", &sa)
	if d.Spec.Template.Spec.ServiceAccountName != sa.Name {
		t.Errorf("pod runs as ServiceAccount %q, want the rendered %q", d.Spec.Template.Spec.ServiceAccountName, sa.Name)
	}

	var svc corev1.Service
	r.one(t, "Service", &svc)
	if sel := labels.SelectorFromSet(svc.Spec.Selector); !sel.Matches(podLabels) {
		t.Errorf("Service selector %v does not match the pod labels %v", sel, podLabels)
	}
	wantPorts := []corev1.ServicePort{
		{Name: "grpc-ext-proc", Port: 9002, TargetPort: intstr.FromString("grpc-ext-proc"), Protocol: corev1.ProtocolTCP, AppProtocol: ptr("http2")},
		{Name: "metrics", Port: 9090, TargetPort: intstr.FromString("metrics"), Protocol: corev1.ProtocolTCP},
	}
	if diff := cmp.Diff(wantPorts, svc.Spec.Ports); diff != "" {
		t.Errorf("Service ports (-want +got):\n%s", diff)
	}
	for _, sp := range svc.Spec.Ports {
		if !slices.ContainsFunc(c.Ports, func(cp corev1.ContainerPort) bool {
			return cp.Name == sp.TargetPort.StrVal && cp.ContainerPort == sp.Port
		}) {
			t.Errorf("Service port %s targets %q, which is not a container port of that number: %v", sp.Name, sp.TargetPort.StrVal, c.Ports)
		}
	}

	var role rbacv1.Role
	r.one(t, "Role", &role)
	wantRules := []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"inference.networking.k8s.io"}, Resources: []string{"inferencepools"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"inference.networking.x-k8s.io"}, Resources: []string{"inferencemodelrewrites", "inferenceobjectives"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"inference.networking.x-k8s.io"}, Resources: []string{"inferencemodelrewrites/status", "inferenceobjectives/status"}, Verbs: []string{"get", "patch"}},
		// Events on the pool say why it offers no endpoint.
		{APIGroups: []string{"events.k8s.io"}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
		// Leader election: the lease, and its transitions as events.
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
	}
	if diff := cmp.Diff(wantRules, role.Rules); diff != "" {
		t.Errorf("Role rules (-want +got):\n%s", diff)
	}
	// One replica takes no lease: the Role drops what leader election
	// needs. Peers find each other through the pods it already lists.
	var single rbacv1.Role
	mustRender(t, testNamespace, requiredValues, "picker: {replicas: 1}").one(t, "Role", &single)
	if diff := cmp.Diff(wantRules[:5], single.Rules); diff != "" {
		t.Errorf("Role rules with one replica (-want +got):\n%s", diff)
	}

	// Every replica is Ready, so the budget lets a drain evict one at a
	// time and no more.
	var pdb policyv1.PodDisruptionBudget
	r.one(t, "PodDisruptionBudget", &pdb)
	if pdb.Spec.MinAvailable != nil || pdb.Spec.MaxUnavailable == nil || *pdb.Spec.MaxUnavailable != intstr.FromInt32(1) ||
		!labels.SelectorFromSet(pdb.Spec.Selector.MatchLabels).Matches(podLabels) {
		t.Errorf("PDB %+v: want maxUnavailable 1 over the picker pods", pdb.Spec)
	}
	var rb rbacv1.RoleBinding
	r.one(t, "RoleBinding", &rb)
	wantRB := rbacv1.RoleBinding{
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: role.Name},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa.Name, Namespace: testNamespace}},
	}
	if diff := cmp.Diff(wantRB.RoleRef, rb.RoleRef); diff != "" {
		t.Errorf("RoleBinding roleRef (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantRB.Subjects, rb.Subjects); diff != "" {
		t.Errorf("RoleBinding subjects (-want +got):\n%s", diff)
	}

	var pool infv1.InferencePool
	r.one(t, "InferencePool", &pool)
	wantSpec := infv1.InferencePoolSpec{
		Selector:    infv1.LabelSelector{MatchLabels: map[infv1.LabelKey]infv1.LabelValue{"app": "vllm-llama"}},
		TargetPorts: []infv1.Port{{Number: 8000}},
		EndpointPickerRef: &infv1.EndpointPickerRef{
			Name:        infv1.ObjectName(svc.Name),
			Port:        &infv1.Port{Number: 9002},
			FailureMode: infv1.EndpointPickerFailClose,
		},
	}
	if pool.Name != "llama" {
		t.Errorf("InferencePool name = %q, want llama", pool.Name)
	}
	if diff := cmp.Diff(wantSpec, pool.Spec); diff != "" {
		t.Errorf("InferencePool spec (-want +got):\n%s", diff)
	}

	if diff := cmp.Diff(v1alpha1.Default(), pickerConfig(t, r)); diff != "" {
		t.Errorf("picker configuration differs from the picker's defaults (-want +got):\n%s", diff)
	}

	for _, want := range []string{"llama", "llama-epp", testNamespace, "rollout status deployment/llama-epp", "httpRoute.create=true", "all 2 replicas are Ready"} {
		if !strings.Contains(r.notes, want) {
			t.Errorf("NOTES.txt does not mention %q:\n%s", want, r.notes)
		}
	}
	if strings.Contains(r.notes, "<no value>") {
		t.Errorf("NOTES.txt renders a missing value:\n%s", r.notes)
	}
}

func TestChartLeaderElectionWithReplicas(t *testing.T) {
	r := mustRender(t, testNamespace, requiredValues, "picker: {replicas: 3}")
	d, c := pickerDeployment(t, r)
	if *d.Spec.Replicas != 3 {
		t.Errorf("replicas = %d, want 3", *d.Spec.Replicas)
	}
	// Active-active: every replica is Ready, so the default rolling
	// update serves throughout.
	if st := d.Spec.Strategy; st.Type != "" || st.RollingUpdate != nil {
		t.Errorf("strategy = %+v, want the default rolling update: every replica is Ready with peering", st)
	}
	// Warm standbys: new pods start at once while the old ones drain; one
	// of them leads once the old leader releases the lease on SIGTERM.
	// Replicas prefer nodes of their own, unless picker.affinity says
	// otherwise; one replica has no such preference.
	aa := d.Spec.Template.Spec.Affinity
	if aa == nil || aa.PodAntiAffinity == nil || len(aa.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) != 1 {
		t.Fatalf("affinity %+v, want one preferred pod anti-affinity", aa)
	}
	term := aa.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution[0].PodAffinityTerm
	if term.TopologyKey != "kubernetes.io/hostname" || !labels.SelectorFromSet(term.LabelSelector.MatchLabels).Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("anti-affinity term %+v: want the picker pods, by kubernetes.io/hostname", term)
	}
	own, _ := pickerDeployment(t, mustRender(t, testNamespace, requiredValues, "picker: {replicas: 3, affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: pool, operator: In, values: [epp]}]}]}}}}"))
	if a := own.Spec.Template.Spec.Affinity; a == nil || a.PodAntiAffinity != nil || a.NodeAffinity == nil {
		t.Errorf("affinity %+v with picker.affinity set, want picker.affinity alone", a)
	}
	one, _ := pickerDeployment(t, mustRender(t, testNamespace, requiredValues, "picker: {replicas: 1}"))
	if a := one.Spec.Template.Spec.Affinity; a != nil {
		t.Errorf("affinity %+v with one replica, want none", a)
	}
	standby := mustRender(t, testNamespace, requiredValues, "picker: {replicas: 3, peer: {enabled: false}}")
	sd, sc := pickerDeployment(t, standby)
	all := intstr.FromString("100%")
	if st := sd.Spec.Strategy; st.Type != appsv1.RollingUpdateDeploymentStrategyType || st.RollingUpdate == nil ||
		*st.RollingUpdate.MaxSurge != all || *st.RollingUpdate.MaxUnavailable != all {
		t.Errorf("strategy without peering = %+v, want a rolling update with maxSurge and maxUnavailable 100%%: a new pod cannot become Ready while the old leader holds the lease", st)
	}
	if flagValue(t, sc.Args, "--ha-enable-leader-election") != "" {
		t.Errorf("--ha-enable-leader-election takes no value in %q", sc.Args)
	}
	if kinds := standby.kinds(); slices.Contains(kinds, "PodDisruptionBudget") {
		t.Errorf("warm standbys render a PodDisruptionBudget (kinds %v): only the leader is Ready, so it could never be evicted", kinds)
	}
	if !strings.Contains(standby.notes, "only the leader is Ready") {
		t.Errorf("NOTES.txt without peering does not explain leader-only readiness:\n%s", standby.notes)
	}
	if flagValue(t, c.Args, "--ha-enable-leader-election") != "" {
		t.Errorf("--ha-enable-leader-election takes no value in %q", c.Args)
	}
	for flag, want := range map[string]string{"--ha-lease-duration": "15s", "--ha-renew-deadline": "10s", "--ha-retry-period": "2s"} {
		if got := flagValue(t, c.Args, flag); got != want {
			t.Errorf("%s = %q, want %q (the chart's default)", flag, got, want)
		}
	}
	_, c = pickerDeployment(t, mustRender(t, testNamespace, requiredValues,
		"picker: {replicas: 2, leaderElection: {leaseDurationSeconds: 8, renewDeadlineSeconds: 5, retryPeriodSeconds: 1}}"))
	if got := flagValue(t, c.Args, "--ha-lease-duration"); got != "8s" {
		t.Errorf("--ha-lease-duration = %q, want the value's 8s", got)
	}
	var role rbacv1.Role
	r.one(t, "Role", &role)
	want := []rbacv1.PolicyRule{
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
	}
	for _, rule := range want {
		if !slices.ContainsFunc(role.Rules, func(got rbacv1.PolicyRule) bool { return reflect.DeepEqual(got, rule) }) {
			t.Errorf("Role rules %+v lack %+v, which leader election needs", role.Rules, rule)
		}
	}
	if !strings.Contains(r.notes, "all 3 replicas are Ready") {
		t.Errorf("NOTES.txt does not say every replica is Ready:\n%s", r.notes)
	}
}

// TestChartOptionalResources switches each optional resource on and checks
// what it renders and that it points at the objects it must.
func TestChartOptionalResources(t *testing.T) {
	cases := []struct {
		name   string
		values []string
		// The kinds rendered besides ConfigMap, Deployment,
		// PodDisruptionBudget, Role, RoleBinding, Secret (the peers') and
		// Service (and, unless noAuth, the ClusterRoles and
		// ClusterRoleBinding of metrics auth).
		wantKinds []string
		noAuth    bool
		check     func(t *testing.T, r rendered)
	}{{
		name: "HTTPRoute to the pool",
		values: []string{requiredValues, `
httpRoute:
  create: true
  gateway: {name: inference-gateway, namespace: gateways, sectionName: http}
  hostnames: [llm.example.com]
  pathPrefix: /v1
  requestTimeout: 300s
`},
		wantKinds: []string{"HTTPRoute", "InferencePool", "ServiceAccount"},
		check: func(t *testing.T, r rendered) {
			var route gwv1.HTTPRoute
			r.one(t, "HTTPRoute", &route)
			parent := route.Spec.ParentRefs
			if len(parent) != 1 || parent[0].Name != "inference-gateway" || *parent[0].Namespace != "gateways" ||
				*parent[0].SectionName != "http" || *parent[0].Kind != "Gateway" {
				t.Errorf("parentRefs = %+v, want the Gateway gateways/inference-gateway, section http", parent)
			}
			if len(route.Spec.Rules) != 1 || len(route.Spec.Rules[0].BackendRefs) != 1 {
				t.Fatalf("rules = %+v, want one rule with one backendRef", route.Spec.Rules)
			}
			rule := route.Spec.Rules[0]
			ref := rule.BackendRefs[0].BackendObjectReference
			if *ref.Group != "inference.networking.k8s.io" || *ref.Kind != "InferencePool" || ref.Name != "llama" {
				t.Errorf("backendRef = %s/%s %s, want inference.networking.k8s.io/InferencePool llama", *ref.Group, *ref.Kind, ref.Name)
			}
			if *rule.Matches[0].Path.Value != "/v1" || rule.Timeouts == nil || *rule.Timeouts.Request != "300s" {
				t.Errorf("rule = %+v, want path prefix /v1 and a 300s request timeout", rule)
			}
			if slices.Equal(route.Spec.Hostnames, []gwv1.Hostname{"llm.example.com"}) == false {
				t.Errorf("hostnames = %v", route.Spec.Hostnames)
			}
		},
	}, {
		name:      "ServiceMonitor on the metrics port",
		values:    []string{requiredValues, `serviceMonitor: {create: true, interval: 15s, labels: {release: prometheus}}`},
		wantKinds: []string{"ClusterRoleBinding", "InferencePool", "Secret", "ServiceAccount", "ServiceAccount", "ServiceMonitor"},
		check: func(t *testing.T, r rendered) {
			sm := r.all("ServiceMonitor")[0]
			if sm.GetLabels()["release"] != "prometheus" {
				t.Errorf("ServiceMonitor labels = %v, want release=prometheus", sm.GetLabels())
			}
			var svc corev1.Service
			r.one(t, "Service", &svc)
			var spec struct {
				Selector struct {
					MatchLabels map[string]string `json:"matchLabels"`
				} `json:"selector"`
				Endpoints []struct {
					Port, Path, Scheme, Interval string
					TLSConfig                    struct{ InsecureSkipVerify bool } `json:"tlsConfig"`
					Authorization                struct {
						Type        string
						Credentials struct{ Name, Key string }
					} `json:"authorization"`
				} `json:"endpoints"`
			}
			b, err := json.Marshal(sm.Object["spec"])
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(b, &spec); err != nil {
				t.Fatal(err)
			}
			if !labels.SelectorFromSet(spec.Selector.MatchLabels).Matches(labels.Set(svc.Labels)) {
				t.Errorf("ServiceMonitor selects %v, which the Service's labels %v do not match", spec.Selector.MatchLabels, svc.Labels)
			}
			if len(spec.Endpoints) != 1 || spec.Endpoints[0].Port != "metrics" || spec.Endpoints[0].Path != "/metrics" || spec.Endpoints[0].Interval != "15s" {
				t.Errorf("endpoints = %+v, want port metrics, path /metrics, interval 15s", spec.Endpoints)
			}
			if !slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == "metrics" }) {
				t.Errorf("the Service has no port named metrics: %+v", svc.Spec.Ports)
			}
			// Over HTTPS (self-signed) with the metrics reader's token.
			ep := spec.Endpoints[0]
			secret := tokenSecret(t, r)
			if ep.Scheme != "https" || !ep.TLSConfig.InsecureSkipVerify || ep.Authorization.Type != "Bearer" ||
				ep.Authorization.Credentials.Name != secret.Name || ep.Authorization.Credentials.Key != "token" {
				t.Errorf("endpoint %+v: want https, insecureSkipVerify and the bearer token of Secret %s", ep, secret.Name)
			}
			reader := secret.Annotations["kubernetes.io/service-account.name"]
			if secret.Type != corev1.SecretTypeServiceAccountToken || metricsReader(t, r) != reader {
				t.Errorf("Secret %s (%s) holds the token of %q; want a ServiceAccount token of the one the chart lets get /metrics", secret.Name, secret.Type, reader)
			}
		},
	}, {
		name:      "metrics without auth, over plain HTTP",
		values:    []string{requiredValues, `{picker: {metrics: {auth: false, secureServing: false, pprof: false}}, serviceMonitor: {create: true}}`},
		wantKinds: []string{"InferencePool", "ServiceAccount", "ServiceMonitor"},
		noAuth:    true,
		check: func(t *testing.T, r rendered) {
			_, c := pickerDeployment(t, r)
			for _, f := range []string{"--metrics-endpoint-auth", "--metrics-secure-serving", "--enable-pprof"} {
				if got := flagValue(t, c.Args, f); got != "false" {
					t.Errorf("%s = %q, want false", f, got)
				}
			}
			sm := r.all("ServiceMonitor")[0]
			eps, _, _ := unstructuredSlice(sm.Object, "spec", "endpoints")
			if ep := eps[0].(map[string]any); ep["scheme"] != "http" || ep["authorization"] != nil {
				t.Errorf("ServiceMonitor endpoint %v: want plain http without a token", ep)
			}
		},
	}, {
		name:      "NetworkPolicy",
		values:    []string{requiredValues, `networkPolicy: {create: true, extProcFrom: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: gateways}}}]}`},
		wantKinds: []string{"InferencePool", "NetworkPolicy", "ServiceAccount"},
		check: func(t *testing.T, r rendered) {
			var np networkingv1.NetworkPolicy
			r.one(t, "NetworkPolicy", &np)
			d, _ := pickerDeployment(t, r)
			if !labels.SelectorFromSet(np.Spec.PodSelector.MatchLabels).Matches(labels.Set(d.Spec.Template.Labels)) {
				t.Errorf("NetworkPolicy selects %v, not the picker pods", np.Spec.PodSelector.MatchLabels)
			}
			// The third rule, the peer port, is TestChartNetworkPolicyAdmitsPeers's.
			if len(np.Spec.Ingress) != 3 || len(np.Spec.Ingress[0].From) != 1 || len(np.Spec.Ingress[1].From) != 0 ||
				len(np.Spec.Ingress[0].Ports) != 2 || np.Spec.Ingress[0].Ports[0].Port.IntValue() != 9002 || np.Spec.Ingress[1].Ports[0].Port.IntValue() != 9090 {
				t.Errorf("ingress = %+v, want 9002/9003 from the gateways' namespace and 9090 from anywhere", np.Spec.Ingress)
			}
		},
	}, {
		name:      "drain longer than the default",
		values:    []string{requiredValues, `picker: {shutdown: {delaySeconds: 10, graceSeconds: 3600}}`},
		wantKinds: []string{"InferencePool", "ServiceAccount"},
		check: func(t *testing.T, r rendered) {
			d, c := pickerDeployment(t, r)
			if flagValue(t, c.Args, "--shutdown-delay") != "10s" || flagValue(t, c.Args, "--shutdown-grace") != "3600s" {
				t.Errorf("args %q, want --shutdown-delay=10s --shutdown-grace=3600s", c.Args)
			}
			if g := *d.Spec.Template.Spec.TerminationGracePeriodSeconds; g != 3625 {
				t.Errorf("terminationGracePeriodSeconds = %d, want 10 + 3600 + 15", g)
			}
		},
	}, {
		name:      "PodDisruptionBudget with the default maxUnavailable",
		values:    []string{requiredValues, `podDisruptionBudget: {create: true}`},
		wantKinds: []string{"InferencePool", "ServiceAccount"},
		check: func(t *testing.T, r rendered) {
			var pdb policyv1.PodDisruptionBudget
			r.one(t, "PodDisruptionBudget", &pdb)
			d, _ := pickerDeployment(t, r)
			if !labels.SelectorFromSet(pdb.Spec.Selector.MatchLabels).Matches(labels.Set(d.Spec.Template.Labels)) {
				t.Errorf("PDB selects %v, not the picker pods %v", pdb.Spec.Selector.MatchLabels, d.Spec.Template.Labels)
			}
			if pdb.Spec.MinAvailable != nil || pdb.Spec.MaxUnavailable == nil || *pdb.Spec.MaxUnavailable != intstr.FromInt32(1) {
				t.Errorf("PDB minAvailable %v, maxUnavailable %v; want only maxUnavailable 1", pdb.Spec.MinAvailable, pdb.Spec.MaxUnavailable)
			}
			if pdb.Spec.UnhealthyPodEvictionPolicy == nil || *pdb.Spec.UnhealthyPodEvictionPolicy != policyv1.AlwaysAllow {
				t.Errorf("unhealthyPodEvictionPolicy = %v, want AlwaysAllow (a replica that is not Ready serves nothing)", pdb.Spec.UnhealthyPodEvictionPolicy)
			}
		},
	}, {
		name:      "PodDisruptionBudget with minAvailable",
		values:    []string{requiredValues, `podDisruptionBudget: {create: true, minAvailable: "50%"}`},
		wantKinds: []string{"InferencePool", "ServiceAccount"},
		check: func(t *testing.T, r rendered) {
			var pdb policyv1.PodDisruptionBudget
			r.one(t, "PodDisruptionBudget", &pdb)
			if pdb.Spec.MaxUnavailable != nil || pdb.Spec.MinAvailable == nil || *pdb.Spec.MinAvailable != intstr.FromString("50%") {
				t.Errorf("PDB minAvailable %v, maxUnavailable %v; want only minAvailable 50%%", pdb.Spec.MinAvailable, pdb.Spec.MaxUnavailable)
			}
		},
	}, {
		name:      "pool managed elsewhere: only its name is required",
		values:    []string{`inferencePool: {name: llama, create: false}`},
		wantKinds: []string{"ServiceAccount"},
		check: func(t *testing.T, r rendered) {
			_, c := pickerDeployment(t, r)
			if got := flagValue(t, c.Args, "--pool-name"); got != "llama" {
				t.Errorf("--pool-name = %q, want llama", got)
			}
			if !strings.Contains(r.notes, "did not create the pool") {
				t.Errorf("NOTES.txt does not say the pool is not created:\n%s", r.notes)
			}
		},
	}, {
		name: "pool with h2c and FailOpen",
		values: []string{requiredValues, `
inferencePool:
  appProtocol: kubernetes.io/h2c
  failureMode: FailOpen
  targetPorts: [{number: 8000}, {number: 8001}]
`},
		wantKinds: []string{"InferencePool", "ServiceAccount"},
		check: func(t *testing.T, r rendered) {
			var pool infv1.InferencePool
			r.one(t, "InferencePool", &pool)
			if pool.Spec.AppProtocol != "kubernetes.io/h2c" || pool.Spec.EndpointPickerRef.FailureMode != infv1.EndpointPickerFailOpen ||
				!slices.Equal(pool.Spec.TargetPorts, []infv1.Port{{Number: 8000}, {Number: 8001}}) {
				t.Errorf("pool spec = %+v", pool.Spec)
			}
		},
	}, {
		name: "picker configuration and flags",
		values: []string{requiredValues, `
picker:
  verbosity: 3
  secureServing: false
  extraArgs: [--max-request-lifetime=10m]
  image: {tag: v9.9.9}
  config:
    blockSizeChars: 128
    fallbackEndpoints: 2
    saturation: {maxInFlightRequests: 64}
`},
		wantKinds: []string{"InferencePool", "ServiceAccount"},
		check: func(t *testing.T, r rendered) {
			_, c := pickerDeployment(t, r)
			for flag, want := range map[string]string{"-v": "3", "--secure-serving": "false", "--max-request-lifetime": "10m"} {
				if got := flagValue(t, c.Args, flag); got != want {
					t.Errorf("%s = %q, want %q", flag, got, want)
				}
			}
			if !strings.HasSuffix(c.Image, ":v9.9.9") {
				t.Errorf("image = %q, want tag v9.9.9", c.Image)
			}
			want := v1alpha1.Default()
			want.BlockSizeChars = 128
			want.FallbackEndpoints = 2
			want.Saturation.MaxInFlightRequests = 64
			if diff := cmp.Diff(want, pickerConfig(t, r)); diff != "" {
				t.Errorf("picker configuration (-want +got):\n%s", diff)
			}
		},
	}, {
		name:      "existing ServiceAccount",
		values:    []string{requiredValues, `serviceAccount: {create: false, name: inference-sa}`},
		wantKinds: []string{"InferencePool"},
		check: func(t *testing.T, r rendered) {
			if len(r.all("ServiceAccount")) != 0 {
				t.Error("a ServiceAccount was rendered with serviceAccount.create=false")
			}
			d, _ := pickerDeployment(t, r)
			var rb rbacv1.RoleBinding
			r.one(t, "RoleBinding", &rb)
			if d.Spec.Template.Spec.ServiceAccountName != "inference-sa" || rb.Subjects[0].Name != "inference-sa" {
				t.Errorf("pod runs as %q, Role bound to %q; want inference-sa for both", d.Spec.Template.Spec.ServiceAccountName, rb.Subjects[0].Name)
			}
		},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := mustRender(t, testNamespace, tc.values...)
			// The defaults' PodDisruptionBudget and peer Secret are in
			// every case.
			want := append([]string{"ConfigMap", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding", "Secret", "Service"}, tc.wantKinds...)
			if !tc.noAuth {
				want = append(want, "ClusterRole", "ClusterRole", "ClusterRoleBinding")
			}
			slices.Sort(want)
			if diff := cmp.Diff(want, r.kinds()); diff != "" {
				t.Fatalf("rendered kinds (-want +got):\n%s", diff)
			}
			tc.check(t, r)
			if strings.Contains(r.notes, "<no value>") {
				t.Errorf("NOTES.txt renders a missing value:\n%s", r.notes)
			}
		})
	}
}

// TestChartRejectsBadValues checks that a mistake stops the install with a
// message naming the value at fault.
func TestChartRejectsBadValues(t *testing.T) {
	cases := []struct {
		name   string
		values []string
		want   []string
	}{
		{"negative replicas", []string{requiredValues, "picker: {replicas: -1}"}, []string{"/picker/replicas", "minimum", "-1"}},
		{"zero replicas", []string{requiredValues, "picker: {replicas: 0}"}, []string{"/picker/replicas", "minimum"}},
		{"unknown failure mode", []string{requiredValues, "inferencePool: {failureMode: Sometimes}"}, []string{"/inferencePool/failureMode", "FailOpen", "FailClose"}},
		{"misspelt key", []string{requiredValues, "picker: {replica: 2}"}, []string{"/picker", "'replica' not allowed"}},
		{"unknown top-level key", []string{requiredValues, "inferencepool: {name: x}"}, []string{"'inferencepool' not allowed"}},
		{"unknown picker config field", []string{requiredValues, "picker: {config: {blockSize: 16}}"}, []string{"/picker/config", "'blockSize' not allowed"}},
		{"picker config out of range", []string{requiredValues, "picker: {config: {blockSizeChars: 2}}"}, []string{"/picker/config/blockSizeChars", "minimum"}},
		{"pool name not a DNS label", []string{requiredValues, "inferencePool: {name: Llama_3}"}, []string{"/inferencePool/name"}},
		{"target port out of range", []string{requiredValues, "inferencePool: {targetPorts: [{number: 70000}]}"}, []string{"/inferencePool/targetPorts/0/number", "maximum"}},
		{"no values", nil, []string{"inferencePool.name is required"}},
		{"no pool name", []string{"inferencePool: {modelServers: {matchLabels: {app: x}}, targetPorts: [{number: 8000}]}"}, []string{"inferencePool.name is required"}},
		{"no model server labels", []string{"inferencePool: {name: llama, targetPorts: [{number: 8000}]}"}, []string{"inferencePool.modelServers.matchLabels is required"}},
		{"no target ports", []string{"inferencePool: {name: llama, modelServers: {matchLabels: {app: x}}}"}, []string{"inferencePool.targetPorts is required"}},
		{"route without a gateway", []string{requiredValues, "httpRoute: {create: true}"}, []string{"httpRoute.gateway.name is required"}},
		{"existing ServiceAccount without a name", []string{requiredValues, "serviceAccount: {create: false}"}, []string{"serviceAccount.name is required"}},
		{"termination grace below the drain", []string{requiredValues, "picker: {terminationGracePeriodSeconds: 30}"}, []string{"picker.terminationGracePeriodSeconds (30) must be above", "(605)"}},
		{"lease not above the renew deadline", []string{requiredValues, "picker: {leaderElection: {leaseDurationSeconds: 10}}"}, []string{"picker.leaderElection.leaseDurationSeconds (10) must be more than renewDeadlineSeconds (10)"}},
		{"budget allowing no eviction", []string{requiredValues, "podDisruptionBudget: {maxUnavailable: 0}"}, []string{"podDisruptionBudget.maxUnavailable (0) must be above 0"}},
		{"budget keeping every replica", []string{requiredValues, "podDisruptionBudget: {minAvailable: 2}"}, []string{"podDisruptionBudget.minAvailable (2) must be below picker.replicas (2)"}},
		{"budget keeping all in percent", []string{requiredValues, "picker: {replicas: 3}", `podDisruptionBudget: {minAvailable: "100%"}`}, []string{"podDisruptionBudget.minAvailable (100%) must be below picker.replicas (3)"}},
		{"renew deadline within a retry", []string{requiredValues, "picker: {leaderElection: {renewDeadlineSeconds: 2}}"}, []string{"renewDeadlineSeconds (2) must be more than 1.2 times retryPeriodSeconds (2)"}},
		{"unknown provider", []string{requiredValues, "provider: {name: nginx}"}, []string{"/provider/name", "none", "istio", "gke"}},
		{"GKE with an HTTPRoute timeout", []string{requiredValues, "{provider: {name: gke}, httpRoute: {create: true, gateway: {name: gw}, requestTimeout: 300s}}"}, []string{"httpRoute.requestTimeout (300s) must be empty with provider.name gke", "provider.gke.timeoutSeconds"}},
		{"GKE without target ports", []string{"inferencePool: {name: llama, create: false}", "provider: {name: gke}"}, []string{"inferencePool.targetPorts is required with provider.name gke"}},
		{"env the chart sets", []string{requiredValues, "picker: {env: [{name: GOMEMLIMIT, value: 1GiB}]}"}, []string{"picker.env sets GOMEMLIMIT, which the chart sets itself"}},
		{"env without a name", []string{requiredValues, "picker: {env: [{value: x}]}"}, []string{"/picker/env/0", "name"}},
		{"volume named as the chart's", []string{requiredValues, "picker: {extraVolumes: [{name: tmp, emptyDir: {}}]}"}, []string{`picker.extraVolumes names a volume "tmp"`}},
		{"mount without a path", []string{requiredValues, "picker: {extraVolumeMounts: [{name: x}]}"}, []string{"/picker/extraVolumeMounts/0", "mountPath"}},
		{"misspelt peer key", []string{requiredValues, "picker: {peer: {existingSecrets: x}}"}, []string{"/picker/peer", "'existingSecrets' not allowed"}},
		{"peer pick timeout not a duration", []string{requiredValues, "picker: {peer: {pickTimeout: 100}}"}, []string{"/picker/peer/pickTimeout"}},
		{"peer pick timeout without a unit", []string{requiredValues, `picker: {peer: {pickTimeout: "100"}}`}, []string{"/picker/peer/pickTimeout", "pattern"}},
		{"peer Secret not a name", []string{requiredValues, "picker: {peer: {existingSecret: Peer_TLS}}"}, []string{"/picker/peer/existingSecret", "pattern"}},
		{"env the chart sets for peers", []string{requiredValues, "picker: {env: [{name: POD_IP, value: 10.0.0.1}]}"}, []string{"picker.env sets POD_IP, which the chart sets itself"}},
		{"volume named as the peers'", []string{requiredValues, "picker: {extraVolumes: [{name: peer-tls, emptyDir: {}}]}"}, []string{`picker.extraVolumes names a volume "peer-tls"`}},
		{"budget without a bound", []string{requiredValues, `podDisruptionBudget: {create: true, maxUnavailable: ""}`}, []string{"set minAvailable or maxUnavailable"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := render(t, testNamespace, values(t, tc.values...))
			if err == nil {
				t.Fatalf("values %q were accepted", tc.values)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not contain %q:\n%v", w, err)
				}
			}
		})
	}
}

// TestChartLint runs Helm's linter (what `helm lint --strict` runs) with the
// required values and with every optional resource on.
func TestChartLint(t *testing.T) {
	allOn := `
picker: {replicas: 2}
httpRoute: {create: true, gateway: {name: inference-gateway}}
serviceMonitor: {create: true}
podDisruptionBudget: {create: true}
grafanaDashboard: {create: true}
prometheusRule: {create: true}
`
	for name, vals := range map[string]map[string]any{
		"required values": values(t, requiredValues),
		"all resources":   values(t, requiredValues, allOn),
		"istio":           values(t, requiredValues, allOn, `provider: {name: istio}`),
		"gke":             values(t, requiredValues, allOn, `{provider: {name: gke}, httpRoute: {requestTimeout: ""}}`),
		"pod options": values(t, requiredValues, `
picker:
  env: [{name: GODEBUG, value: tlsrsakex=0}]
  extraVolumes: [{name: epp-tls, secret: {secretName: llama-epp-tls}}]
  extraVolumeMounts: [{name: epp-tls, mountPath: /etc/epp-tls, readOnly: true}]
  podSecurityContext: {runAsUser: null, runAsGroup: null}
`),
	} {
		t.Run(name, func(t *testing.T) {
			linter := lint.All(chartDir(t), vals, testNamespace, true)
			for _, m := range linter.Messages {
				if m.Severity >= support.WarningSev {
					t.Errorf("lint: %v", m)
				} else {
					t.Logf("lint: %v", m)
				}
			}
		})
	}
	t.Run("the linter checks the rendered objects", func(t *testing.T) {
		// An invalid object name passes the schema and renders, and only the
		// linter's checks of the rendered objects catch it: if it reported
		// nothing here, the checks above would prove nothing.
		bad := values(t, requiredValues, `httpRoute: {create: true, name: Not_A_Name, gateway: {name: gw}}`)
		linter := lint.All(chartDir(t), bad, testNamespace, true)
		if linter.HighestSeverity < support.WarningSev {
			t.Fatalf("lint of an HTTPRoute named Not_A_Name found nothing: %v", linter.Messages)
		}
	})
}

// TestChartSchemaMatchesPickerConfig keeps values.schema.json's picker.config
// in step with api/v1alpha1: the same fields, and bounds that accept exactly
// what the picker accepts.
func TestChartSchemaMatchesPickerConfig(t *testing.T) {
	type property struct {
		Type       string              `json:"type"`
		Minimum    *int64              `json:"minimum"`
		Maximum    *int64              `json:"maximum"`
		Properties map[string]property `json:"properties"`
	}
	raw, err := os.ReadFile(filepath.Join(chartDir(t), "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	var schema struct {
		Properties map[string]struct {
			Properties map[string]property `json:"properties"`
		} `json:"properties"`
	}
	if err := json.Unmarshal(raw, &schema); err != nil {
		t.Fatalf("values.schema.json: %v", err)
	}
	config := schema.Properties["picker"].Properties["config"]

	wantTop := jsonFields(reflect.TypeFor[v1alpha1.PickerConfig](), "apiVersion", "kind")
	if diff := cmp.Diff(wantTop, sortedKeys(config.Properties)); diff != "" {
		t.Errorf("picker.config properties differ from PickerConfig's fields (-PickerConfig +schema):\n%s", diff)
	}
	wantSat := jsonFields(reflect.TypeFor[v1alpha1.Saturation]())
	if diff := cmp.Diff(wantSat, sortedKeys(config.Properties["saturation"].Properties)); diff != "" {
		t.Errorf("picker.config.saturation properties differ from Saturation's fields (-Saturation +schema):\n%s", diff)
	}

	// Each bound: the schema accepts it and so does the picker; one past it
	// the schema refuses and so would the picker.
	type bound struct {
		path  []string
		value int64
		ok    bool
	}
	var bounds []bound
	add := func(path []string, p property) {
		if p.Minimum != nil {
			bounds = append(bounds, bound{path, *p.Minimum, true}, bound{path, *p.Minimum - 1, false})
		}
		if p.Maximum != nil {
			bounds = append(bounds, bound{path, *p.Maximum, true}, bound{path, *p.Maximum + 1, false})
		}
	}
	for name, p := range config.Properties {
		if p.Type == "integer" {
			add([]string{name}, p)
		}
		for sub, sp := range p.Properties {
			add([]string{name, sub}, sp)
		}
	}
	if len(bounds) < 2*len(wantTop) {
		t.Fatalf("found only %d bounds in the schema: %+v", len(bounds), bounds)
	}
	for _, b := range bounds {
		field := strings.Join(b.path, ".")
		doc := fmt.Sprintf("%d", b.value)
		for i := len(b.path) - 1; i >= 0; i-- {
			doc = fmt.Sprintf("{%s: %s}", b.path[i], doc)
		}
		_, loadErr := v1alpha1.Load([]byte("apiVersion: " + v1alpha1.GroupVersion + "\nkind: PickerConfig\n" + strings.TrimSuffix(strings.TrimPrefix(doc, "{"), "}")))
		r, renderErr := render(t, testNamespace, values(t, requiredValues, "picker: {config: "+doc+"}"))
		switch {
		case b.ok && renderErr != nil:
			t.Errorf("%s = %d: the schema refuses a value at its own bound: %v", field, b.value, renderErr)
		case b.ok && loadErr != nil:
			t.Errorf("%s = %d: the schema accepts it but the picker refuses it: %v", field, b.value, loadErr)
		case b.ok:
			pickerConfig(t, r)
		case renderErr == nil:
			t.Errorf("%s = %d: the schema accepts a value past its bound", field, b.value)
		case loadErr == nil && b.value == 0:
			// The picker reads a zero as "not set" and applies its default;
			// the schema asks for the key to be left out instead.
		case loadErr == nil:
			t.Errorf("%s = %d: the schema refuses it but the picker accepts it: the schema is stricter than the picker", field, b.value)
		}
	}
}

// jsonFields returns the JSON names of typ's fields, sorted, without skip.
func jsonFields(typ reflect.Type, skip ...string) []string {
	var names []string
	for i := range typ.NumField() {
		name, _, _ := strings.Cut(typ.Field(i).Tag.Get("json"), ",")
		if name != "" && name != "-" && !slices.Contains(skip, name) {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	return names
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func ptr[T any](v T) *T { return &v }

// unstructuredSlice reads a list from a decoded object.
func unstructuredSlice(obj map[string]any, fields ...string) ([]any, bool, error) {
	return unstructured.NestedSlice(obj, fields...)
}
