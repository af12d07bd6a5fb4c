package install

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/tallyepp/tally/internal/syncbuf"
	"github.com/tallyepp/tally/internal/testenv"
	"github.com/tallyepp/tally/internal/testtier"
)

const (
	// fieldManager owns what the tests apply.
	fieldManager = "tally-install-test"
	// pickerReadyTimeout bounds the picker's start: connecting, syncing the
	// pool and, with leader election, taking the lease.
	pickerReadyTimeout = 60 * time.Second
	pollInterval       = 100 * time.Millisecond
	// pickerStopTimeout is how long a stopped picker may take to exit before
	// it is killed.
	pickerStopTimeout = 15 * time.Second
)

// cluster is the API server the tests install into, as its administrator.
type cluster struct {
	env    *envtest.Environment
	cfg    *rest.Config
	kube   kubernetes.Interface
	dyn    dynamic.Interface
	mapper meta.RESTMapper
}

// TestInstallOnAPIServer applies everything the chart and config/ produce to
// a real API server and runs the picker binary the way the rendered
// Deployment would, as the rendered ServiceAccount.
func TestInstallOnAPIServer(t *testing.T) {
	testtier.SkipIfShort(t, "a kube-apiserver and etcd (envtest), and the epp binary it builds")
	root := repoRoot(t)
	bin := buildPicker(t, root)
	c := startCluster(t, root)

	t.Run("chart with every optional resource", func(t *testing.T) {
		const ns = "tally-chart"
		r := mustRender(t, ns, requiredValues, `
httpRoute: {create: true, gateway: {name: inference-gateway}, requestTimeout: 300s}
serviceMonitor: {create: true, labels: {release: prometheus}}
podDisruptionBudget: {create: true}
networkPolicy: {create: true, extProcFrom: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: gateways}}}]}
grafanaDashboard: {create: true}
prometheusRule: {create: true, labels: {release: prometheus}}
picker:
  env: [{name: GODEBUG, value: tlsrsakex=0}]
  extraVolumes: [{name: epp-tls, secret: {secretName: llama-epp-tls}}]
  extraVolumeMounts: [{name: epp-tls, mountPath: /etc/epp-tls, readOnly: true}]
`)
		c.createNamespace(t, ns)
		c.applyAll(t, r.objects)
		c.createReadyPod(t, ns, "vllm-llama-0", map[string]string{"app": "vllm-llama"}, "127.0.0.2")

		d, _ := pickerDeployment(t, r)
		sa := d.Spec.Template.Spec.ServiceAccountName
		user := c.serviceAccountUser(t, ns, sa)
		p := startPicker(t, bin, r, user)
		p.waitReady(t)
		// GOMEMLIMIT is the default 2Gi limit, and the buffer budget half
		// of it.
		if out := p.output.String(); !regexp.MustCompile(`request buffering.*"maxBufferedRequestBytes"\W+1073741824.*half of GOMEMLIMIT`).MatchString(out) {
			t.Errorf("the picker did not log a 1 GiB buffer budget from half of GOMEMLIMIT:\n%s", out)
		}
		// Metrics are served over HTTPS to the ServiceMonitor's identity only.
		reader := metricsReader(t, r)
		p.waitForEndpoint(t, "https", c.token(t, ns, reader), "127.0.0.2:8000")
		c.checkMetricsAuth(t, p.metricsAddr, "https", ns, reader, true, true)

		// The Role grants the picker its namespace's pods, pools,
		// objectives and rewrites and nothing more.
		as := kubernetes.NewForConfigOrDie(user.Config())
		ctx := t.Context()
		if _, err := as.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); err != nil {
			t.Errorf("%s cannot list pods in %s: %v", sa, ns, err)
		}
		for _, resource := range []string{"inferenceobjectives", "inferencemodelrewrites"} {
			gvr := schema.GroupVersionResource{Group: "inference.networking.x-k8s.io", Version: "v1alpha2", Resource: resource}
			if _, err := dynamic.NewForConfigOrDie(user.Config()).Resource(gvr).Namespace(ns).List(ctx, metav1.ListOptions{}); err != nil {
				t.Errorf("%s cannot list %s in %s: %v", sa, resource, ns, err)
			}
		}
		refused := map[string]error{}
		_, refused["list secrets in "+ns] = as.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
		_, refused["list pods in all namespaces"] = as.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		_, refused["list pods in default"] = as.CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
		// With the default two replicas the picker elects a leader: it
		// may create its lease (the leader election subtest checks the
		// Role names it); a single replica's Role has no lease rule
		// (chart_test.go).
		if _, err := as.CoordinationV1().Leases(ns).Create(ctx, leaseNamed("probe"), metav1.CreateOptions{}); err != nil {
			t.Errorf("%s cannot create a lease in %s with two replicas: %v", sa, ns, err)
		}
		// The picker marks objectives and rewrites Accepted: it may patch
		// their status (none exists, so the patch finds nothing), and
		// nothing else of theirs.
		for _, resource := range []string{"inferenceobjectives", "inferencemodelrewrites"} {
			res := dynamic.NewForConfigOrDie(user.Config()).Resource(schema.GroupVersionResource{Group: "inference.networking.x-k8s.io", Version: "v1alpha2", Resource: resource}).Namespace(ns)
			if _, err := res.Patch(ctx, "probe", types.MergePatchType, []byte(`{}`), metav1.PatchOptions{}, "status"); !apierrors.IsNotFound(err) {
				t.Errorf("%s patching %s/status in %s: %v, want NotFound (allowed)", sa, resource, ns, err)
			}
			_, refused["patch "+resource+" in "+ns] = res.Patch(ctx, "probe", types.MergePatchType, []byte(`{}`), metav1.PatchOptions{})
		}
		for what, err := range refused {
			if !apierrors.IsForbidden(err) {
				t.Errorf("%s can %s (error: %v), want Forbidden", sa, what, err)
			}
		}
	})

	t.Run("chart with provider istio, as OpenShift assigns users", func(t *testing.T) {
		const ns = "tally-istio"
		r := mustRender(t, ns, requiredValues, `
provider: {name: istio, istio: {destinationRule: {trafficPolicy: {connectionPool: {http: {maxRequestsPerConnection: 256000}}}}}}
picker: {podSecurityContext: {runAsUser: null, runAsGroup: null}}
`)
		c.createNamespace(t, ns)
		c.applyAll(t, r.objects)
		dr := only(t, r, "DestinationRule")
		ri, err := c.resourceFor(dr)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ri.Get(t.Context(), dr.GetName(), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if mode, _, _ := unstructured.NestedString(got.Object, "spec", "trafficPolicy", "tls", "mode"); mode != "SIMPLE" {
			t.Errorf("the stored DestinationRule's tls mode = %q, want SIMPLE: %v", mode, got.Object["spec"])
		}
		d, err := c.kube.AppsV1().Deployments(ns).Get(t.Context(), "llama-epp", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if psc := d.Spec.Template.Spec.SecurityContext; psc == nil || psc.RunAsUser != nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
			t.Errorf("the stored pod securityContext %+v: want runAsNonRoot without runAsUser", psc)
		}
	})

	t.Run("chart with provider gke: what applies without GKE's CRDs", func(t *testing.T) {
		const ns = "tally-gke"
		r := mustRender(t, ns, requiredValues, `{provider: {name: gke}, serviceMonitor: {create: true}}`)
		c.createNamespace(t, ns)
		var kube []*unstructured.Unstructured
		for _, o := range r.objects {
			// GKE's own kinds are compared with the upstream chart's
			// render instead (TestChartProviderGKE).
			if !strings.HasSuffix(o.GroupVersionKind().Group, ".googleapis.com") && !strings.HasSuffix(o.GroupVersionKind().Group, ".gke.io") {
				kube = append(kube, o)
			}
		}
		if len(kube) == len(r.objects) {
			t.Fatalf("no GKE object among %v", r.kinds())
		}
		c.applyAll(t, kube)
	})

	t.Run("ext_proc certificate reloaded from --cert-path", func(t *testing.T) {
		const ns = "tally-certs"
		r := mustRender(t, ns, requiredValues)
		c.createNamespace(t, ns)
		c.applyAll(t, r.objects)
		c.createReadyPod(t, ns, "vllm-llama-0", map[string]string{"app": "vllm-llama"}, "127.0.0.7")
		d, _ := pickerDeployment(t, r)
		checkCertReload(t, c, bin, r, ns, d.Spec.Template.Spec.ServiceAccountName)
	})

	t.Run("chart with leader election", func(t *testing.T) {
		const ns = "tally-ha"
		r := mustRender(t, ns, requiredValues, "picker: {replicas: 2}")
		c.createNamespace(t, ns)
		c.applyAll(t, r.objects)
		c.createReadyPod(t, ns, "vllm-llama-0", map[string]string{"app": "vllm-llama"}, "127.0.0.3")

		d, _ := pickerDeployment(t, r)
		p := startPicker(t, bin, r, c.serviceAccountUser(t, ns, d.Spec.Template.Spec.ServiceAccountName))
		p.waitReady(t)

		leases, err := c.kube.CoordinationV1().Leases(ns).List(t.Context(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(leases.Items) != 1 || leases.Items[0].Spec.HolderIdentity == nil || *leases.Items[0].Spec.HolderIdentity == "" {
			t.Errorf("leases in %s = %+v, want one held by the ready picker", ns, leases.Items)
		}
	})

	t.Run("active-active replicas: both Ready, one lease", func(t *testing.T) {
		const ns = "tally-peers"
		r := mustRender(t, ns, requiredValues)
		c.createNamespace(t, ns)
		c.applyAll(t, r.objects)
		c.createReadyPod(t, ns, "vllm-llama-0", map[string]string{"app": "vllm-llama"}, "127.0.0.9")
		d, ctr := pickerDeployment(t, r)
		kubeconfig := c.tokenKubeconfig(t, ns, d.Spec.Template.Spec.ServiceAccountName)
		// Each with the rendered flags, the peer Secret's files and a peer
		// port of its own: the leader and a follower both serve.
		first := launch(t, bin, r, kubeconfig)
		first.waitReadyThroughProbes(t, ctr)
		second := launch(t, bin, r, kubeconfig)
		second.waitReadyThroughProbes(t, ctr)
		leases, err := c.kube.CoordinationV1().Leases(ns).List(t.Context(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(leases.Items) != 1 || leases.Items[0].Spec.HolderIdentity == nil || *leases.Items[0].Spec.HolderIdentity == "" {
			t.Errorf("leases in %s = %+v, want one, held", ns, leases.Items)
		}
	})

	t.Run("a rolling update of warm standbys: the new pod leads once the old one gets SIGTERM", func(t *testing.T) {
		const ns = "tally-roll"
		r := mustRender(t, ns, requiredValues, "picker: {replicas: 2, peer: {enabled: false}}")
		c.createNamespace(t, ns)
		c.applyAll(t, r.objects)
		c.createReadyPod(t, ns, "vllm-llama-0", map[string]string{"app": "vllm-llama"}, "127.0.0.8")
		d, ctr := pickerDeployment(t, r)
		kubeconfig := c.tokenKubeconfig(t, ns, d.Spec.Template.Spec.ServiceAccountName)
		old := launch(t, bin, r, kubeconfig)
		old.waitReadyThroughProbes(t, ctr)
		// The rolling update starts the new pod while the old one leads:
		// it stays a standby, not Ready.
		next := launch(t, bin, r, kubeconfig)
		nextHealth := next.healthClient(t)
		g := gomega.NewWithT(t)
		readiness := func(g gomega.Gomega) healthpb.HealthCheckResponse_ServingStatus {
			resp, err := nextHealth.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "readiness"})
			g.Expect(err).NotTo(gomega.HaveOccurred())
			return resp.GetStatus()
		}
		g.Eventually(func(g gomega.Gomega) healthpb.HealthCheckResponse_ServingStatus {
			resp, err := nextHealth.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "liveness"})
			g.Expect(err).NotTo(gomega.HaveOccurred())
			return resp.GetStatus()
		}).WithTimeout(pickerReadyTimeout).WithPolling(pollInterval).Should(gomega.Equal(healthpb.HealthCheckResponse_SERVING), "liveness of the new pod")
		g.Consistently(readiness).WithTimeout(3*time.Second).WithPolling(200*time.Millisecond).Should(gomega.Equal(healthpb.HealthCheckResponse_NOT_SERVING), "the standby while the old pod leads")
		// SIGTERM to the old pod: it releases the lease at once, while it
		// still drains (5 s of --shutdown-delay), and the new pod leads.
		if err := old.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		g.Eventually(readiness).WithTimeout(pickerReadyTimeout).WithPolling(pollInterval).Should(gomega.Equal(healthpb.HealthCheckResponse_SERVING), "the new pod after the old one's SIGTERM")
		select {
		case <-old.exited:
			t.Errorf("the old pod exited (%v) before the new one led: the lease waited for its drain", old.exitErr)
		default:
		}
	})

	t.Run("kustomize config/default and config/samples", func(t *testing.T) {
		k := kustomizeBuild(t, "config/default")
		samples := kustomizeBuild(t, "config/samples")
		c.applyAll(t, append(k.objects, samples.objects...))
		c.createReadyPod(t, kustomizeNamespace, "vllm-0", map[string]string{"app": kustomizePool}, "127.0.0.4")

		d, _ := pickerDeployment(t, k)
		p := startPicker(t, bin, k, c.serviceAccountUser(t, kustomizeNamespace, d.Spec.Template.Spec.ServiceAccountName))
		p.waitReady(t)
		// A scraper bound to config/rbac's metrics reader role.
		p.waitForEndpoint(t, "https", c.boundToken(t, kustomizeNamespace, "prometheus", "tally-metrics-reader"), "127.0.0.4:8000")
	})
}

// buildPicker builds cmd/epp into a temporary directory.
func buildPicker(t *testing.T, root string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "epp")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/epp")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/epp: %v\n%s", err, out)
	}
	return bin
}

func startCluster(t *testing.T, root string) *cluster {
	t.Helper()
	// envtest logs through controller-runtime's logger, which warns (with a
	// stack trace) when it was never set. Its logs add nothing here.
	ctrllog.SetLogger(logr.Discard())
	gatewayAPI, err := moduleDir(root, "sigs.k8s.io/gateway-api")
	if err != nil {
		t.Fatal(err)
	}
	env, cfg, err := testenv.Start(
		filepath.Join(gatewayAPI, "config", "crd", "standard"),
		filepath.Join(root, "test", "install", "testdata", "monitoring.coreos.com_servicemonitors.yaml"),
		filepath.Join(root, "test", "install", "testdata", "monitoring.coreos.com_prometheusrules.yaml"),
		istioCRD(t, root, "destinationrules.networking.istio.io"),
	)
	if err != nil {
		t.Fatalf("starting the API server: %v", err)
	}
	t.Cleanup(func() {
		if err := env.Stop(); err != nil {
			t.Errorf("stopping the API server: %v", err)
		}
	})
	kube := kubernetes.NewForConfigOrDie(cfg)
	return &cluster{
		env:    env,
		cfg:    cfg,
		kube:   kube,
		dyn:    dynamic.NewForConfigOrDie(cfg),
		mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(kube.Discovery())),
	}
}

// istioModule holds Istio's CRDs (kubernetes/customresourcedefinitions.gen.yaml).
const istioModule = "istio.io/api@v1.32.0"

// istioCRD writes the CRD called name, taken from Istio's CRD file, to a
// file of its own, so that the API server serves that kind and no other of
// Istio's.
func istioCRD(t *testing.T, root, name string) string {
	t.Helper()
	cmd := exec.Command("go", "mod", "download", "-json", istioModule)
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go mod download %s: %v", istioModule, err)
	}
	var mod struct{ Dir string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("go mod download %s printed %s: %v", istioModule, out, err)
	}
	data, err := os.ReadFile(filepath.Join(mod.Dir, "kubernetes", "customresourcedefinitions.gen.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	crds, err := decodeManifests(string(data))
	if err != nil {
		t.Fatalf("Istio's CRDs: %v", err)
	}
	for _, crd := range crds {
		if crd.GetName() == name {
			b, err := json.Marshal(crd.Object)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), name+".json")
			if err := os.WriteFile(path, b, 0o600); err != nil {
				t.Fatal(err)
			}
			return path
		}
	}
	t.Fatalf("%s has no CRD %s", istioModule, name)
	return ""
}

// moduleDir returns the directory of a module go.mod requires.
func moduleDir(root, module string) (string, error) {
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", module)
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go list -m %s: %w", module, err)
	}
	return strings.TrimSpace(string(out)), nil
}

func (c *cluster) createNamespace(t *testing.T, name string) {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if _, err := c.kube.CoreV1().Namespaces().Create(t.Context(), ns, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating namespace %s: %v", name, err)
	}
}

// applyRank puts the kinds others depend on first.
func applyRank(kind string) int {
	switch kind {
	case "Namespace":
		return 0
	case "CustomResourceDefinition":
		return 1
	case "ServiceAccount", "Role", "RoleBinding", "ConfigMap":
		return 2
	}
	return 3
}

// applyAll server-side applies objs with strict field validation, so an
// unknown or misplaced field is an error rather than silently dropped, and
// checks that each can be read back.
func (c *cluster) applyAll(t *testing.T, objs []*unstructured.Unstructured) {
	t.Helper()
	sorted := slices.Clone(objs)
	slices.SortStableFunc(sorted, func(a, b *unstructured.Unstructured) int {
		return applyRank(a.GetKind()) - applyRank(b.GetKind())
	})
	for _, o := range sorted {
		ri, err := c.resourceFor(o)
		if err != nil {
			t.Fatalf("%s %s: %v", o.GetKind(), o.GetName(), err)
		}
		data, err := json.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		force := true
		if _, err := ri.Patch(t.Context(), o.GetName(), types.ApplyPatchType, data, metav1.PatchOptions{
			FieldManager: fieldManager, FieldValidation: metav1.FieldValidationStrict, Force: &force,
		}); err != nil {
			t.Errorf("the API server refused %s %s/%s: %v", o.GetKind(), o.GetNamespace(), o.GetName(), err)
			continue
		}
		if _, err := ri.Get(t.Context(), o.GetName(), metav1.GetOptions{}); err != nil {
			t.Errorf("reading back %s %s/%s: %v", o.GetKind(), o.GetNamespace(), o.GetName(), err)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
}

func (c *cluster) resourceFor(o *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := o.GroupVersionKind()
	m, err := c.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, fmt.Errorf("no resource for %s (is its CRD installed?): %w", gvk, err)
	}
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		return c.dyn.Resource(m.Resource).Namespace(o.GetNamespace()), nil
	}
	return c.dyn.Resource(m.Resource), nil
}

// createReadyPod creates a model server pod and marks it Ready at ip, as a
// kubelet would (no kubelet runs here).
func (c *cluster) createReadyPod(t *testing.T, ns, name string, labels map[string]string, ip string) {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm/vllm-openai"}}},
	}
	created, err := c.kube.CoreV1().Pods(ns).Create(t.Context(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating pod %s/%s: %v", ns, name, err)
	}
	created.Status = corev1.PodStatus{
		Phase:  corev1.PodRunning,
		PodIP:  ip,
		PodIPs: []corev1.PodIP{{IP: ip}},
		Conditions: []corev1.PodCondition{
			{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Now()},
		},
	}
	if _, err := c.kube.CoreV1().Pods(ns).UpdateStatus(t.Context(), created, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("marking pod %s/%s ready: %v", ns, name, err)
	}
}

// serviceAccountUser returns credentials that the API server authenticates
// as the ServiceAccount, as it would the token mounted in the picker's pod.
func (c *cluster) serviceAccountUser(t *testing.T, ns, sa string) *envtest.AuthenticatedUser {
	t.Helper()
	user, err := c.env.AddUser(envtest.User{
		Name:   "system:serviceaccount:" + ns + ":" + sa,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
	}, c.cfg)
	if err != nil {
		t.Fatalf("provisioning ServiceAccount %s/%s: %v", ns, sa, err)
	}
	return user
}

// picker is a running picker binary.
type picker struct {
	healthAddr  string
	metricsAddr string
	output      *syncbuf.Buffer
	exited      chan struct{}
	exitErr     error // set before exited is closed
}

// startPicker runs the picker binary with the arguments of the Deployment in
// r, as user. Only what a pod provides differs: the ports (free loopback
// ports instead of the fixed ones, so tests can run side by side), the
// configuration file (written from the rendered ConfigMap), the kubeconfig
// (instead of the mounted token) and the Downward API environment.
func startPicker(t *testing.T, bin string, r rendered, user *envtest.AuthenticatedUser) *picker {
	t.Helper()
	d, c := pickerDeployment(t, r)
	cm, _ := configFileMap(t, r)
	dir := t.TempDir()
	kubeconfig, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	kubeconfigPath := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfigPath, kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}
	configFile := flagValue(t, c.Args, "--config-file")
	configKey := filepath.Base(configFile)
	configPath := filepath.Join(dir, configKey)
	if err := os.WriteFile(configPath, []byte(cm.Data[configKey]), 0o600); err != nil {
		t.Fatal(err)
	}
	ports := map[string]int{"--grpc-port": freePort(t), "--grpc-health-port": freePort(t), "--metrics-port": freePort(t), "--peer-port": freePort(t)}
	args := []string{"--kubeconfig=" + kubeconfigPath}
	for _, a := range c.Args {
		name, _, _ := strings.Cut(a, "=")
		switch {
		case ports[name] != 0:
			a = name + "=" + strconv.Itoa(ports[name])
		case name == "--config-file":
			a = name + "=" + configPath
		case name == "--peer-cert-path":
			// The peer Secret's files, as its volume would hold them.
			peerDir := filepath.Join(dir, "peer-tls")
			if err := os.Mkdir(peerDir, 0o700); err != nil {
				t.Fatal(err)
			}
			for k, data := range secretFiles(t, peerSecret(t, r), peerMount(t, r).Items) {
				if err := os.WriteFile(filepath.Join(peerDir, k), data, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			a = name + "=" + peerDir
		}
		args = append(args, a)
	}

	p := &picker{
		healthAddr:  net.JoinHostPort("127.0.0.1", strconv.Itoa(ports["--grpc-health-port"])),
		metricsAddr: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports["--metrics-port"])),
		output:      &syncbuf.Buffer{},
		exited:      make(chan struct{}),
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), downwardEnv(t, d, c)...)
	cmd.Stdout, cmd.Stderr = p.output, p.output
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", bin, err)
	}
	go func() {
		p.exitErr = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(pickerStopTimeout):
			_ = cmd.Process.Kill()
			<-p.exited
			t.Errorf("the picker did not stop within %s of SIGTERM", pickerStopTimeout)
		}
		if t.Failed() {
			t.Logf("picker %q output:\n%s", args, p.output.String())
		}
	})
	return p
}

// downwardEnv resolves the container's environment as the kubelet would for
// a pod of Deployment d named after it.
func downwardEnv(t *testing.T, d appsv1.Deployment, c corev1.Container) []string {
	t.Helper()
	var env []string
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env = append(env, e.Name+"="+e.Value)
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.namespace":
			env = append(env, e.Name+"="+d.Namespace)
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name":
			env = append(env, e.Name+"="+d.Name+"-0")
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.podIP":
			env = append(env, e.Name+"=127.0.0.1")
		case e.ValueFrom.ResourceFieldRef != nil:
			env = append(env, e.Name+"="+resourceFieldValue(t, d, e.ValueFrom.ResourceFieldRef))
		default:
			t.Fatalf("env %s: the test cannot resolve %+v", e.Name, e.ValueFrom)
		}
	}
	return env
}

// waitReady waits for the gRPC health service to report readiness SERVING,
// as the kubelet's readiness probe would, and checks liveness too.
func (p *picker) waitReady(t *testing.T) {
	t.Helper()
	conn, err := grpc.NewClient(p.healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	status := func(service string) func(gomega.Gomega) healthpb.HealthCheckResponse_ServingStatus {
		return func(g gomega.Gomega) healthpb.HealthCheckResponse_ServingStatus {
			select {
			case <-p.exited:
				gomega.StopTrying(fmt.Sprintf("the picker exited (%v)", p.exitErr)).Now()
			default:
			}
			ctx, cancel := context.WithTimeout(t.Context(), time.Second)
			defer cancel()
			resp, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
			g.Expect(err).NotTo(gomega.HaveOccurred())
			return resp.GetStatus()
		}
	}
	g := gomega.NewWithT(t)
	g.Eventually(status("readiness")).WithTimeout(pickerReadyTimeout).WithPolling(pollInterval).
		Should(gomega.Equal(healthpb.HealthCheckResponse_SERVING), "readiness of the picker")
	g.Expect(status("liveness")(g)).To(gomega.Equal(healthpb.HealthCheckResponse_SERVING), "liveness of the picker")
}

// waitForEndpoint waits until the picker's ledger lists endpoint: proof that
// it read the pool and its pods with the credentials it was given.
func (p *picker) waitForEndpoint(t *testing.T, scheme, token, endpoint string) {
	t.Helper()
	url := scheme + "://" + p.metricsAddr + "/debug/ledger"
	// The picker's metrics certificate is self-signed.
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	gomega.NewWithT(t).Eventually(func(g gomega.Gomega) []string {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
		g.Expect(err).NotTo(gomega.HaveOccurred())
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := client.Do(req)
		g.Expect(err).NotTo(gomega.HaveOccurred())
		defer resp.Body.Close()
		g.Expect(resp.StatusCode).To(gomega.Equal(http.StatusOK))
		var ledger struct {
			Endpoints []struct {
				Endpoint string `json:"endpoint"`
			} `json:"endpoints"`
		}
		g.Expect(json.NewDecoder(resp.Body).Decode(&ledger)).To(gomega.Succeed())
		var got []string
		for _, e := range ledger.Endpoints {
			got = append(got, e.Endpoint)
		}
		return got
	}).WithTimeout(pickerReadyTimeout).WithPolling(pollInterval).Should(gomega.ConsistOf(endpoint), "endpoints in %s", url)
}

// boundToken creates a ServiceAccount bound to clusterRole and returns a
// token for it.
func (c *cluster) boundToken(t *testing.T, ns, sa, clusterRole string) string {
	t.Helper()
	if _, err := c.kube.CoreV1().ServiceAccounts(ns).Create(t.Context(), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: ns + "-" + sa},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: clusterRole},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: ns}},
	}
	if _, err := c.kube.RbacV1().ClusterRoleBindings().Create(t.Context(), binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return c.token(t, ns, sa)
}

// freePort returns a loopback port that was free a moment ago. The picker
// binds the port itself, so it cannot be handed a listener.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func leaseNamed(name string) *coordinationv1.Lease {
	return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name}}
}

// resourceFieldValue resolves a Downward API resourceFieldRef as the kubelet
// does: the named container's request or limit, divided by the divisor
// (default 1) and rounded up.
func resourceFieldValue(t *testing.T, d appsv1.Deployment, ref *corev1.ResourceFieldSelector) string {
	t.Helper()
	var ctr *corev1.Container
	for i := range d.Spec.Template.Spec.Containers {
		if d.Spec.Template.Spec.Containers[i].Name == ref.ContainerName {
			ctr = &d.Spec.Template.Spec.Containers[i]
		}
	}
	if ctr == nil {
		t.Fatalf("resourceFieldRef %+v names no container of the pod", ref)
	}
	kind, name, _ := strings.Cut(ref.Resource, ".")
	var q resource.Quantity
	var ok bool
	switch kind {
	case "limits":
		q, ok = ctr.Resources.Limits[corev1.ResourceName(name)]
	case "requests":
		q, ok = ctr.Resources.Requests[corev1.ResourceName(name)]
	}
	if !ok {
		// Unset limits give the node's allocatable: not what a chart means.
		t.Fatalf("resourceFieldRef %s: container %s sets no %s", ref.Resource, ctr.Name, ref.Resource)
	}
	divisor := int64(1)
	if !ref.Divisor.IsZero() {
		divisor = ref.Divisor.Value()
	}
	return strconv.FormatInt((q.Value()+divisor-1)/divisor, 10)
}
