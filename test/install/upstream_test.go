package install

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	kptr "k8s.io/utils/ptr"

	modelsim "github.com/tallyepp/tally/internal/modelsim/server"
	"github.com/tallyepp/tally/internal/syncbuf"
	"github.com/tallyepp/tally/internal/testtier"
)

// upstreamModule is the last gateway-api-inference-extension release with the
// full picker and its inferencepool chart, which users migrate from.
const upstreamModule = "sigs.k8s.io/gateway-api-inference-extension@v1.5.0"

// upstreamChart loads the inferencepool chart from the module cache, with its
// file:// dependency (the epplib library chart, aliased inferenceExtension)
// attached, as `helm dependency build` would.
func upstreamChart(t *testing.T, root string) *chart.Chart {
	t.Helper()
	cmd := exec.Command("go", "mod", "download", "-json", upstreamModule)
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go mod download %s: %v", upstreamModule, err)
	}
	var mod struct{ Dir string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("go mod download %s printed %s: %v", upstreamModule, out, err)
	}
	charts := filepath.Join(mod.Dir, "config", "charts")
	c, err := loader.Load(filepath.Join(charts, "inferencepool"))
	if err != nil {
		t.Fatalf("loading the upstream chart: %v", err)
	}
	lib, err := loader.Load(filepath.Join(charts, "epplib"))
	if err != nil {
		t.Fatalf("loading the upstream chart's library: %v", err)
	}
	c.SetDependencies(lib)
	return c
}

// renderUpstream renders the upstream chart as `helm install <release> -n ns`
// would, namespaced objects without a namespace getting the release's.
func renderUpstream(t *testing.T, c *cluster, ch *chart.Chart, release, ns string, docs ...string) rendered {
	t.Helper()
	r := renderUpstreamObjects(t, ch, release, ns, docs...)
	for _, o := range r.objects {
		gvk := o.GroupVersionKind()
		m, err := c.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			t.Fatalf("the upstream chart renders %s, which this API server does not serve: %v", gvk, err)
		}
		if m.Scope.Name() == meta.RESTScopeNameNamespace && o.GetNamespace() == "" {
			o.SetNamespace(ns)
		}
	}
	return r
}

// renderUpstreamObjects renders the upstream chart as `helm template` would,
// leaving namespaces as the templates write them.
func renderUpstreamObjects(t *testing.T, ch *chart.Chart, release, ns string, docs ...string) rendered {
	t.Helper()
	vals := values(t, docs...)
	if err := chartutil.ProcessDependenciesWithMerge(ch, vals); err != nil {
		t.Fatalf("processing the upstream chart's dependencies: %v", err)
	}
	opts := chartutil.ReleaseOptions{Name: release, Namespace: ns, Revision: 1, IsInstall: true}
	top, err := chartutil.ToRenderValues(ch, vals, opts, chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatalf("upstream chart values: %v", err)
	}
	files, err := engine.Render(ch, top)
	if err != nil {
		t.Fatalf("rendering the upstream chart: %v", err)
	}
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	var r rendered
	for _, name := range names {
		if base := filepath.Base(name); base == "NOTES.txt" || strings.HasPrefix(base, "_") || !strings.HasSuffix(base, ".yaml") {
			continue
		}
		// Split as Helm does: its templates may leave a separator glued to
		// the next document ("---apiVersion: v1"), which Helm accepts.
		docs := releaseutil.SplitManifests(files[name])
		keys := make([]string, 0, len(docs))
		for k := range docs {
			keys = append(keys, k)
		}
		sort.Sort(releaseutil.BySplitManifestsOrder(keys))
		for _, k := range keys {
			objs, err := decodeManifests(docs[k])
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			r.objects = append(r.objects, objs...)
		}
	}
	return r
}

// The image swap of docs/install.md ("Coming from the upstream chart").
func tallyImageValues(t *testing.T) string {
	return fmt.Sprintf("inferenceExtension: {image: {registry: ghcr.io, repository: tallyepp/tally, tag: %q}}\n", loadChart(t).Metadata.AppVersion)
}

const upstreamRequiredValues = "inferencePool: {modelServers: {matchLabels: {app: vllm-llama}}}\n"

// TestUpstreamChartRunsTally renders the upstream inferencepool chart,
// unchanged but for the picker image, applies it to a real API server and
// runs the picker binary exactly as the rendered Deployment would (its
// arguments, environment and mounted configuration), as the chart's
// ServiceAccount with a token the API server issued: it must become Ready
// through the chart's own probes, pick, and, with the chart's monitoring on,
// serve metrics to the chart's identity only.
func TestUpstreamChartRunsTally(t *testing.T) {
	testtier.SkipIfShort(t, "a kube-apiserver and etcd (envtest), and the epp binary it builds")
	root := repoRoot(t)
	bin := buildPicker(t, root)
	c := startCluster(t, root)
	// Not tried: inferenceObjectives (v1.5.0's template reads .Values inside
	// its range and fails to render) and provider istio or gke (their CRDs
	// are not available here).
	ch := upstreamChart(t, root)

	for _, tc := range []struct {
		name, ns, values, podIP string
		// Probes of the chart: one replica asks for inference-extension
		// for both; more ask for liveness and readiness.
		wantProbes  [2]string
		authMetrics bool
		drain       bool
	}{
		{name: "default values", ns: "upstream-defaults", podIP: "127.0.10.5",
			wantProbes: [2]string{"inference-extension", "inference-extension"}, drain: true},
		{name: "documented options", ns: "upstream-options", podIP: "127.0.10.6", authMetrics: true,
			wantProbes: [2]string{"liveness", "readiness"},
			values: `
inferencePool:
  modelServerType: sglang
experimentalHttpRoute: {enabled: true}
inferenceExtension:
  replicas: 2
  flags:
    v: 3
    enable-pprof: false
    health-checking: true
  tracing: {enabled: true}
  monitoring:
    interval: 15s
    prometheus: {enabled: true}
  pluginsConfigFile: custom-plugins.yaml
  pluginsCustomConfig:
    custom-plugins.yaml: |
      apiVersion: inference.networking.x-k8s.io/v1alpha1
      kind: EndpointPickerConfig
      plugins:
      - type: queue-scorer
      - type: prefix-cache-scorer
        parameters:
          blockSizeTokens: 32
          lruCapacityPerServer: 20000
      - type: max-score-picker
        parameters:
          maxNumOfEndpoints: 2
      schedulingProfiles:
      - name: default
        plugins:
        - pluginRef: queue-scorer
        - pluginRef: prefix-cache-scorer
        - pluginRef: max-score-picker
`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const release = "vllm-llama"
			r := renderUpstream(t, c, ch, release, tc.ns, upstreamRequiredValues, tallyImageValues(t), tc.values)
			d, ctr := pickerDeployment(t, r)
			if !strings.HasPrefix(ctr.Image, "ghcr.io/tallyepp/tally:") {
				t.Fatalf("image = %q, want Tally's", ctr.Image)
			}
			probes := [2]string{kptr.Deref(ctr.LivenessProbe.GRPC.Service, ""), kptr.Deref(ctr.ReadinessProbe.GRPC.Service, "")}
			if probes != tc.wantProbes {
				t.Fatalf("the chart's probes ask for %q, want %q", probes, tc.wantProbes)
			}
			c.createNamespace(t, tc.ns)
			c.applyAll(t, r.objects)
			// A simulated vLLM at the pod's address, on the chart's
			// default target port: the picker scrapes its metrics.
			serveModelServer(t, tc.podIP+":8000")
			c.createReadyPod(t, tc.ns, "vllm-llama-0", map[string]string{"app": "vllm-llama"}, tc.podIP)

			sa := d.Spec.Template.Spec.ServiceAccountName
			p := launch(t, bin, r, c.tokenKubeconfig(t, tc.ns, sa))
			p.waitReadyThroughProbes(t, ctr)
			want := tc.podIP + ":8000"
			if got := p.pick(t); got != want {
				t.Fatalf("picked %q, want %q", got, want)
			}
			for _, f := range []string{"--tracing", "--zap-encoder"} {
				if n := strings.Count(p.output.String(), `"flag":"`+f+`"`); f == "--tracing" && n != 1 || f == "--zap-encoder" && n != 0 {
					t.Errorf("%s is logged as ignored %d times, want %d", f, n, map[bool]int{true: 1, false: 0}[f == "--tracing"])
				}
			}

			if tc.authMetrics {
				// The chart binds the picker's own ServiceAccount to get
				// /metrics, and the ServiceMonitor scrapes with its token.
				c.checkMetricsAuth(t, p.metricsAddr, "http", tc.ns, metricsReader(t, r), false, false)
				p.checkHealthOnExtProcPort(t)
				if !strings.Contains(p.output.String(), `"to":"lruCapacityBlocks"`) {
					t.Errorf("the custom EndpointPickerConfig's lruCapacityPerServer was not reported as mapped:\n%s", p.output.String())
				}
			}
			if tc.drain {
				p.checkDrain(t, want)
			}
		})
	}
}

// serveModelServer serves a simulated vLLM (metrics, completions) on addr
// until the test ends.
func serveModelServer(t *testing.T, addr string) {
	t.Helper()
	sim, err := modelsim.New(modelsim.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		sim.Close()
		t.Fatalf("serving the model server at %s: %v", addr, err)
	}
	srv := &http.Server{Handler: sim, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(func() {
		_ = srv.Close()
		sim.Close()
	})
}

// metricsReader returns the ServiceAccount that the rendered
// ClusterRoleBindings allow to get /metrics.
func metricsReader(t *testing.T, r rendered) string {
	t.Helper()
	roles := map[string]bool{}
	for _, o := range r.all("ClusterRole") {
		var cr rbacv1.ClusterRole
		decodeStrict(t, o, &cr)
		for _, rule := range cr.Rules {
			for _, u := range rule.NonResourceURLs {
				if u == "/metrics" {
					roles[cr.Name] = true
				}
			}
		}
	}
	for _, o := range r.all("ClusterRoleBinding") {
		var b rbacv1.ClusterRoleBinding
		decodeStrict(t, o, &b)
		if roles[b.RoleRef.Name] && len(b.Subjects) > 0 && b.Subjects[0].Kind == "ServiceAccount" {
			return b.Subjects[0].Name
		}
	}
	t.Fatal("no rendered ClusterRoleBinding lets a ServiceAccount get /metrics")
	return ""
}

// token returns a token the API server issued for the ServiceAccount, as the
// kubelet mounts into a pod (TokenRequest).
func (c *cluster) token(t *testing.T, ns, sa string) string {
	t.Helper()
	tr, err := c.kube.CoreV1().ServiceAccounts(ns).CreateToken(t.Context(), sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: kptr.To[int64](3600)},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("requesting a token for ServiceAccount %s/%s: %v", ns, sa, err)
	}
	return tr.Status.Token
}

// tokenKubeconfig writes a kubeconfig that authenticates with a token for
// the ServiceAccount, and returns its path.
func (c *cluster) tokenKubeconfig(t *testing.T, ns, sa string) string {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["envtest"] = &clientcmdapi.Cluster{Server: c.cfg.Host, CertificateAuthorityData: c.cfg.CAData}
	cfg.AuthInfos[sa] = &clientcmdapi.AuthInfo{Token: c.token(t, ns, sa)}
	cfg.Contexts["picker"] = &clientcmdapi.Context{Cluster: "envtest", AuthInfo: sa, Namespace: ns}
	cfg.CurrentContext = "picker"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// checkMetricsAuth scrapes the picker's metrics endpoint: without a token it
// is refused, with the token of a ServiceAccount the chart lets get /metrics
// it is served.
//
// pprof says whether --enable-pprof is on: then /debug/pprof/ is behind the
// same check (and the reader may get it when its role lists it); else it is
// not served at all.
func (c *cluster) checkMetricsAuth(t *testing.T, metricsAddr, scheme, ns, reader string, pprof, readerGetsPprof bool) {
	t.Helper()
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	get := func(path, token string) (int, string) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, scheme+"://"+metricsAddr+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	for _, path := range []string{"/metrics", "/debug/ledger"} {
		if code, _ := get(path, ""); code != http.StatusUnauthorized {
			t.Errorf("GET %s without a token: %d, want 401", path, code)
		}
		// controller-runtime's filter answers 500 when the TokenReview
		// itself fails, as it does for a malformed token.
		if code, _ := get(path, "not-a-token"); code != http.StatusUnauthorized && code != http.StatusInternalServerError {
			t.Errorf("GET %s with a bad token: %d, want it refused (401, or 500 from the failed TokenReview)", path, code)
		}
	}
	// Another identity of the cluster, not granted /metrics.
	stranger := "stranger-" + strconv.Itoa(len(reader))
	if _, err := c.kube.CoreV1().ServiceAccounts(ns).Create(t.Context(), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: stranger}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if code, _ := get("/metrics", c.token(t, ns, stranger)); code != http.StatusForbidden {
		t.Errorf("GET /metrics as a ServiceAccount without the chart's role: %d, want 403", code)
	}
	readerToken := c.token(t, ns, reader)
	switch code, _ := get("/debug/pprof/", ""); {
	case pprof && code != http.StatusUnauthorized:
		t.Errorf("GET /debug/pprof/ without a token: %d, want 401", code)
	case !pprof && code != http.StatusNotFound:
		t.Errorf("GET /debug/pprof/ with --enable-pprof=false: %d, want 404", code)
	}
	if pprof {
		want := map[bool]int{true: http.StatusOK, false: http.StatusForbidden}[readerGetsPprof]
		if code, _ := get("/debug/pprof/", readerToken); code != want {
			t.Errorf("GET /debug/pprof/ as %s: %d, want %d", reader, code, want)
		}
	}
	code, body := get("/metrics", readerToken)
	if code != http.StatusOK || !strings.Contains(body, "tally_endpoints ") || !strings.Contains(body, "go_goroutines") {
		t.Errorf("GET /metrics as %s: %d, want 200 with the picker's and the runtime's metrics:\n%.400s", reader, code, body)
	}
}

// checkHealthOnExtProcPort checks --health-checking: the health service is
// served on the ext_proc port too.
func (p *launched) checkHealthOnExtProcPort(t *testing.T) {
	t.Helper()
	conn, err := grpc.NewClient(p.grpcAddr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	resp, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{Service: extprocv3.ExternalProcessor_ServiceDesc.ServiceName})
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("gRPC health on the ext_proc port with --health-checking: %v, %v; want SERVING", resp.GetStatus(), err)
	}
}

// launched is a picker binary run as a rendered Deployment would run it.
type launched struct {
	cmd                               *exec.Cmd
	grpcAddr, healthAddr, metricsAddr string
	output                            *syncbuf.Buffer
	exited                            chan struct{}
	exitErr                           error
}

// launch runs the picker with exactly the rendered container's arguments and
// environment, its ConfigMap volumes written out at their mount paths (under
// a temporary directory that stands for the container's root), as the
// identity in kubeconfig. Only what a pod gets differently is added at the
// end (later flags win): free loopback ports instead of the fixed ones, so
// tests can run side by side, and the kubeconfig instead of the mounted token.
//
// extra arguments, when given, come last: a test's own settings.
func launch(t *testing.T, bin string, r rendered, kubeconfig string, extra ...string) *launched {
	t.Helper()
	d, ctr := pickerDeployment(t, r)
	fsRoot := t.TempDir()
	configMaps := map[string]corev1.ConfigMap{}
	for _, o := range r.all("ConfigMap") {
		var cm corev1.ConfigMap
		decodeStrict(t, o, &cm)
		configMaps[cm.Name] = cm
	}
	secrets := map[string]corev1.Secret{}
	for _, o := range r.all("Secret") {
		var s corev1.Secret
		decodeStrict(t, o, &s)
		secrets[s.Name] = s
	}
	var mounts []string
	for _, m := range ctr.VolumeMounts {
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.Name != m.Name {
				continue
			}
			files := map[string][]byte{}
			switch {
			case v.ConfigMap != nil:
				cm, ok := configMaps[v.ConfigMap.Name]
				if !ok {
					t.Fatalf("volume %s mounts ConfigMap %s, which the chart does not render", v.Name, v.ConfigMap.Name)
				}
				for k, data := range cm.Data {
					files[k] = []byte(data)
				}
			case v.Secret != nil:
				// The chart's own Secrets (the peers'); one from elsewhere
				// (picker.extraVolumes) is the test's to provide.
				s, ok := secrets[v.Secret.SecretName]
				if !ok {
					continue
				}
				files = secretFiles(t, s, v.Secret.Items)
			default:
				continue
			}
			dir := filepath.Join(fsRoot, m.MountPath)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			for k, data := range files {
				if err := os.WriteFile(filepath.Join(dir, k), data, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			mounts = append(mounts, m.MountPath)
		}
	}
	remap := func(s string) string {
		for _, m := range mounts {
			if s == m || strings.HasPrefix(s, m+"/") {
				return filepath.Join(fsRoot, s)
			}
		}
		return s
	}
	var args []string
	for _, a := range ctr.Args {
		if name, v, ok := strings.Cut(a, "="); ok && strings.HasPrefix(name, "-") {
			args = append(args, name+"="+remap(v))
			continue
		}
		args = append(args, remap(a))
	}
	grpcPort, healthPort, metricsPort := freePort(t), freePort(t), freePort(t)
	args = append(args,
		"--grpc-port="+strconv.Itoa(grpcPort), "--grpc-health-port="+strconv.Itoa(healthPort),
		"--metrics-port="+strconv.Itoa(metricsPort), "--kubeconfig="+kubeconfig)
	if slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--peer-port=") }) {
		args = append(args, "--peer-port="+strconv.Itoa(freePort(t)))
	}
	args = append(args, extra...)

	p := &launched{
		grpcAddr:    net.JoinHostPort("127.0.0.1", strconv.Itoa(grpcPort)),
		healthAddr:  net.JoinHostPort("127.0.0.1", strconv.Itoa(healthPort)),
		metricsAddr: net.JoinHostPort("127.0.0.1", strconv.Itoa(metricsPort)),
		output:      &syncbuf.Buffer{},
		exited:      make(chan struct{}),
	}
	p.cmd = exec.Command(bin, args...)
	// Only the rendered environment (and PATH/HOME a process needs).
	p.cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, containerEnv(t, d, ctr)...)
	p.cmd.Stdout, p.cmd.Stderr = p.output, p.output
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", bin, err)
	}
	go func() {
		p.exitErr = p.cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(pickerStopTimeout):
			_ = p.cmd.Process.Kill()
			<-p.exited
			t.Errorf("the picker did not stop within %s of SIGTERM", pickerStopTimeout)
		}
		if t.Failed() {
			t.Logf("picker %q output:\n%s", args, p.output.String())
		}
	})
	return p
}

var envReference = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// containerEnv resolves the container's environment as the kubelet would for
// a pod of Deployment d: Downward API fields, and $(VAR) references to
// variables defined before.
func containerEnv(t *testing.T, d appsv1.Deployment, c corev1.Container) []string {
	t.Helper()
	defined := map[string]string{}
	var env []string
	for _, e := range c.Env {
		v := e.Value
		switch {
		case e.ValueFrom == nil:
			v = envReference.ReplaceAllStringFunc(v, func(ref string) string {
				if val, ok := defined[envReference.FindStringSubmatch(ref)[1]]; ok {
					return val
				}
				return ref
			})
		case e.ValueFrom.FieldRef != nil:
			switch e.ValueFrom.FieldRef.FieldPath {
			case "metadata.namespace":
				v = d.Namespace
			case "metadata.name":
				v = d.Name + "-0"
			case "spec.nodeName":
				v = "node-0"
			case "status.podIP":
				// Peers listen on the pod IP; here every picker is on
				// loopback, each on a port of its own.
				v = "127.0.0.1"
			default:
				t.Fatalf("env %s: the test cannot resolve field %s", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		case e.ValueFrom.ResourceFieldRef != nil:
			v = resourceFieldValue(t, d, e.ValueFrom.ResourceFieldRef)
		default:
			t.Fatalf("env %s: the test cannot resolve %+v", e.Name, e.ValueFrom)
		}
		defined[e.Name] = v
		env = append(env, e.Name+"="+v)
	}
	return env
}

// waitReadyThroughProbes probes the health port as the kubelet would with the
// container's own probes: readiness until SERVING, then liveness.
func (p *launched) waitReadyThroughProbes(t *testing.T, ctr corev1.Container) {
	t.Helper()
	health := p.healthClient(t)
	for _, probe := range []*corev1.Probe{ctr.ReadinessProbe, ctr.LivenessProbe} {
		if probe == nil || probe.GRPC == nil || probe.GRPC.Port != 9003 {
			t.Fatalf("probe %+v: want a gRPC probe of the health port, 9003", probe)
		}
		service := kptr.Deref(probe.GRPC.Service, "")
		gomega.NewWithT(t).Eventually(func(g gomega.Gomega) healthpb.HealthCheckResponse_ServingStatus {
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
		}).WithTimeout(pickerReadyTimeout).WithPolling(pollInterval).Should(gomega.Equal(healthpb.HealthCheckResponse_SERVING), "gRPC health %q", service)
	}
}

func (p *launched) healthClient(t *testing.T) healthpb.HealthClient {
	t.Helper()
	conn, err := grpc.NewClient(p.healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return healthpb.NewHealthClient(conn)
}

// extprocStream is one request through the picker, played as Envoy does in
// FULL_DUPLEX_STREAMED mode over TLS (the chart's --secure-serving default).
type extprocStream struct {
	t      *testing.T
	stream extprocv3.ExternalProcessor_ProcessClient
}

func (p *launched) open(t *testing.T) *extprocStream {
	t.Helper()
	conn, err := grpc.NewClient(p.grpcAddr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(t.Context())
	if err != nil {
		t.Fatalf("opening an ext_proc stream: %v", err)
	}
	return &extprocStream{t: t, stream: stream}
}

// route sends a completion request and returns the destination the picker
// set, once it has streamed the body back.
func (s *extprocStream) route() string {
	s.t.Helper()
	body := []byte(`{"model":"sim-model","prompt":"Hello from the upstream chart","max_tokens":8,"stream":true}`)
	s.send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":method", RawValue: []byte("POST")},
			{Key: ":path", RawValue: []byte("/v1/completions")},
			{Key: ":authority", RawValue: []byte("gateway.example")},
			{Key: "content-type", RawValue: []byte("application/json")},
			{Key: "content-length", RawValue: []byte(strconv.Itoa(len(body)))},
		}}}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		},
	})
	s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}})
	resp := s.recv()
	if imm := resp.GetImmediateResponse(); imm != nil {
		s.t.Fatalf("the picker answered %d %s", imm.GetStatus().GetCode(), imm.GetBody())
	}
	var dest string
	for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
			dest = string(h.GetHeader().GetRawValue())
		}
	}
	if dest == "" {
		s.t.Fatalf("the picker's answer to the headers sets no destination: %v", resp)
	}
	for {
		sb := s.recv().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sb == nil {
			s.t.Fatal("want the request body streamed back")
		}
		if sb.GetEndOfStream() {
			break
		}
	}
	first, _, _ := strings.Cut(dest, ",")
	return first
}

// respond plays the response headers of a streamed response.
func (s *extprocStream) respond() {
	s.t.Helper()
	s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":status", RawValue: []byte("200")},
		{Key: "content-type", RawValue: []byte("text/event-stream")},
	}}}}})
	if s.recv().GetResponseHeaders() == nil {
		s.t.Fatal("want an answer to the response headers")
	}
}

// chunk sends one response body chunk and checks it comes back.
func (s *extprocStream) chunk(data string, last bool) {
	s.t.Helper()
	s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte(data), EndOfStream: last}}})
	sb := s.recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if string(sb.GetBody()) != data || sb.GetEndOfStream() != last {
		s.t.Fatalf("response chunk %q came back as %q (end %v)", data, sb.GetBody(), sb.GetEndOfStream())
	}
}

func (s *extprocStream) send(m *extprocv3.ProcessingRequest) {
	s.t.Helper()
	if err := s.stream.Send(m); err != nil {
		s.t.Fatalf("sending %T: %v", m.GetRequest(), err)
	}
}

func (s *extprocStream) recv() *extprocv3.ProcessingResponse {
	s.t.Helper()
	m, err := s.stream.Recv()
	if err != nil {
		s.t.Fatalf("receiving from the picker: %v", err)
	}
	return m
}

// pick routes one request and finishes its stream.
func (p *launched) pick(t *testing.T) string {
	t.Helper()
	s := p.open(t)
	dest := s.route()
	s.respond()
	s.chunk("data: [DONE]\n\n", true)
	if err := s.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	return dest
}

// checkDrain sends SIGTERM while a response streams: readiness turns
// NOT_SERVING at once, new streams are still routed during --shutdown-delay
// (5s by default, as the chart leaves it), the open stream runs past the
// delay to its end, and the picker then exits cleanly, long before
// --shutdown-grace.
func (p *launched) checkDrain(t *testing.T, want string) {
	t.Helper()
	health := p.healthClient(t)
	s := p.open(t)
	if got := s.route(); got != want {
		t.Fatalf("picked %q, want %q", got, want)
	}
	s.respond()
	s.chunk("data: {\"choices\":[{\"text\":\"a\"}]}\n\n", false)

	sent := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	gomega.NewWithT(t).Eventually(func(g gomega.Gomega) healthpb.HealthCheckResponse_ServingStatus {
		resp, err := health.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "inference-extension"})
		g.Expect(err).NotTo(gomega.HaveOccurred())
		return resp.GetStatus()
	}).WithTimeout(2*time.Second).WithPolling(20*time.Millisecond).Should(gomega.Equal(healthpb.HealthCheckResponse_NOT_SERVING), "readiness right after SIGTERM")
	if resp, err := health.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "liveness"}); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("liveness while draining: %v, %v; want SERVING", resp.GetStatus(), err)
	}
	// A gateway that has not noticed yet still gets its request routed.
	if got := p.pick(t); got != want {
		t.Errorf("a request during --shutdown-delay went to %q, want %q", got, want)
	}
	// The open stream outlives the delay, chunk by chunk.
	for time.Since(sent) < 6*time.Second {
		s.chunk("data: {\"choices\":[{\"text\":\"b\"}]}\n\n", false)
		time.Sleep(250 * time.Millisecond)
	}
	select {
	case <-p.exited:
		t.Fatalf("the picker exited (%v) with a stream still open", p.exitErr)
	default:
	}
	s.chunk("data: [DONE]\n\n", true)
	if err := s.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.stream.Recv(); err != io.EOF {
		t.Errorf("the finished stream ended with %v, want io.EOF (a clean end)", err)
	}
	select {
	case <-p.exited:
		if p.exitErr != nil {
			t.Errorf("the picker exited with %v after draining, want 0", p.exitErr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the picker did not exit once its last stream finished")
	}
	if !strings.Contains(p.output.String(), `"drained"`) {
		t.Errorf("no \"drained\" log line:\n%s", p.output.String())
	}
}

// secretFiles is what the kubelet writes for a Secret volume: each key of
// items under its path, or every key when items is empty. A key items
// names that the Secret lacks fails the test, as it fails the pod's start.
func secretFiles(t *testing.T, s corev1.Secret, items []corev1.KeyToPath) map[string][]byte {
	t.Helper()
	files := map[string][]byte{}
	if len(items) == 0 {
		maps.Copy(files, s.Data)
		return files
	}
	for _, item := range items {
		data, ok := s.Data[item.Key]
		if !ok {
			t.Fatalf("Secret %s has no key %s, which its volume mounts", s.Name, item.Key)
		}
		files[item.Path] = data
	}
	return files
}
