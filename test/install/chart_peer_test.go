package install

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/tallyepp/tally/internal/testtier"
)

// peerServerName is the name every replica's certificate is issued for and
// checked against: replicas are reached at pod IPs, which no certificate
// can list ahead of time.
const peerServerName = "tally-peer"

// tokenSecret returns the one rendered Secret of a ServiceAccount token (the
// metrics reader's), beside which the peers' TLS Secret may be rendered.
func tokenSecret(t *testing.T, r rendered) corev1.Secret {
	t.Helper()
	var found []corev1.Secret
	for _, o := range r.all("Secret") {
		var s corev1.Secret
		decodeStrict(t, o, &s)
		if s.Type == corev1.SecretTypeServiceAccountToken {
			found = append(found, s)
		}
	}
	if len(found) != 1 {
		t.Fatalf("rendered %d ServiceAccount token Secrets, want 1 (kinds: %v)", len(found), r.kinds())
	}
	return found[0]
}

// peerMount returns the Secret volume mounted at the directory
// --peer-cert-path names, failing the test unless there is one, read-only.
func peerMount(t *testing.T, r rendered) *corev1.SecretVolumeSource {
	t.Helper()
	d, c := pickerDeployment(t, r)
	dir := flagValue(t, c.Args, "--peer-cert-path")
	i := slices.IndexFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == dir })
	if i < 0 || !c.VolumeMounts[i].ReadOnly || c.VolumeMounts[i].SubPath != "" {
		t.Fatalf("--peer-cert-path=%s is not a whole read-only volume mount (a subPath mount would never see a rotated Secret): %+v", dir, c.VolumeMounts)
	}
	j := slices.IndexFunc(d.Spec.Template.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == c.VolumeMounts[i].Name })
	if j < 0 || d.Spec.Template.Spec.Volumes[j].Secret == nil {
		t.Fatalf("the volume mounted at %s is not a Secret: %+v", dir, d.Spec.Template.Spec.Volumes)
	}
	return d.Spec.Template.Spec.Volumes[j].Secret
}

// peerSecret returns the rendered Secret the peer volume mounts, with its
// data decoded, and checks that the mount gives the files the picker reads.
func peerSecret(t *testing.T, r rendered) corev1.Secret {
	t.Helper()
	vol := peerMount(t, r)
	var paths []string
	for _, item := range vol.Items {
		if item.Key != item.Path {
			t.Errorf("peer Secret key %s mounted as %s, want its own name", item.Key, item.Path)
		}
		paths = append(paths, item.Path)
	}
	slices.Sort(paths)
	if want := []string{"ca.crt", "tls.crt", "tls.key"}; len(vol.Items) > 0 && !slices.Equal(paths, want) {
		t.Errorf("peer volume files = %v, want %v", paths, want)
	}
	for _, o := range r.all("Secret") {
		if o.GetName() == vol.SecretName {
			var s corev1.Secret
			decodeStrict(t, o, &s)
			return s
		}
	}
	t.Fatalf("the peer volume mounts Secret %q, which the chart does not render (kinds: %v)", vol.SecretName, r.kinds())
	return corev1.Secret{}
}

// verifyPeerCredentials parses the Secret's certificate and key and checks
// what a peer's TLS handshake checks, in both directions: the certificate
// chains to a CA of ca.crt for the name tally-peer, as a server and as a
// client, and the key is the certificate's.
func verifyPeerCredentials(t *testing.T, s corev1.Secret) *x509.Certificate {
	t.Helper()
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(s.Data["ca.crt"]) {
		t.Fatalf("Secret %s: ca.crt holds no PEM certificate:\n%s", s.Name, s.Data["ca.crt"])
	}
	block, _ := pem.Decode(s.Data["tls.crt"])
	if block == nil || block.Type != "CERTIFICATE" {
		t.Fatalf("Secret %s: tls.crt is not a PEM certificate:\n%s", s.Name, s.Data["tls.crt"])
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatalf("Secret %s: tls.crt: %v", s.Name, err)
	}
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := cert.Verify(x509.VerifyOptions{DNSName: peerServerName, Roots: roots, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			t.Errorf("Secret %s: the certificate does not verify against ca.crt for %s with usage %v: %v", s.Name, peerServerName, usage, err)
		}
	}
	if _, err := cert.Verify(x509.VerifyOptions{DNSName: "not-" + peerServerName, Roots: roots}); err == nil {
		t.Errorf("Secret %s: the certificate verifies for any name, want %s only", s.Name, peerServerName)
	}
	if cert.Subject.CommonName != peerServerName {
		t.Errorf("Secret %s: certificate CN = %q, want %s", s.Name, cert.Subject.CommonName, peerServerName)
	}
	if _, err := tls.X509KeyPair(s.Data["tls.crt"], s.Data["tls.key"]); err != nil {
		t.Errorf("Secret %s: tls.crt and tls.key are not a pair: %v", s.Name, err)
	}
	return cert
}

// By default two replicas run active-active: every flag, variable, port,
// volume and Secret the peers need is rendered, and the credentials
// authenticate a peer both ways.
func TestChartPeering(t *testing.T) {
	r := mustRender(t, testNamespace, requiredValues)
	d, c := pickerDeployment(t, r)

	sel, err := labels.Parse(flagValue(t, c.Args, "--peer-selector"))
	if err != nil {
		t.Fatalf("--peer-selector: %v", err)
	}
	if !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("--peer-selector %s does not match the picker's pod labels %v", sel, d.Spec.Template.Labels)
	}
	// Another release's pickers in the namespace are not peers.
	otherRelease, err := renderRelease(t, "other", testNamespace, values(t, requiredValues))
	if err != nil {
		t.Fatal(err)
	}
	od, _ := pickerDeployment(t, otherRelease)
	if sel.Matches(labels.Set(od.Spec.Template.Labels)) {
		t.Errorf("--peer-selector %s matches the pods of release \"other\" %v", sel, od.Spec.Template.Labels)
	}

	if got := flagValue(t, c.Args, "--peer-port"); got != "9004" {
		t.Errorf("--peer-port = %q, want 9004", got)
	}
	if got := flagValue(t, c.Args, "--peer-pick-timeout"); got != "250ms" {
		t.Errorf("--peer-pick-timeout = %q, want the default 250ms", got)
	}
	if !slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool {
		return p.Name == "peer" && p.ContainerPort == 9004 && p.Protocol == corev1.ProtocolTCP
	}) {
		t.Errorf("container ports %+v lack peer 9004/TCP", c.Ports)
	}
	for _, want := range []struct{ name, field string }{{"POD_NAME", "metadata.name"}, {"POD_IP", "status.podIP"}} {
		if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool {
			return e.Name == want.name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == want.field
		}) {
			t.Errorf("env %+v lacks %s from %s", c.Env, want.name, want.field)
		}
	}
	// The Service does not carry the peer port: peers dial pod IPs.
	var svc corev1.Service
	r.one(t, "Service", &svc)
	if slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return p.Port == 9004 }) {
		t.Errorf("the Service exposes the peer port: %+v", svc.Spec.Ports)
	}

	s := peerSecret(t, r)
	if s.Name != "llama-epp-peer-tls" || s.Namespace != testNamespace {
		t.Errorf("peer Secret %s/%s, want %s/llama-epp-peer-tls", s.Namespace, s.Name, testNamespace)
	}
	verifyPeerCredentials(t, s)

	// A second render (an install elsewhere; `helm template`) generates a
	// new CA: a certificate of one does not verify against the other, which
	// is what a mismatched pair of replicas would meet.
	s2 := peerSecret(t, mustRender(t, testNamespace, requiredValues))
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(s2.Data["ca.crt"])
	if _, err := verifyPeerCredentials(t, s).Verify(x509.VerifyOptions{DNSName: peerServerName, Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err == nil {
		t.Error("two renders generated certificates that verify against each other's CA: the CA is not generated per install")
	}
}

// A Secret of the user's (e.g. cert-manager's) replaces the generated one.
func TestChartPeeringExistingSecret(t *testing.T) {
	r := mustRender(t, testNamespace, requiredValues, "picker: {peer: {existingSecret: llama-peer-cert, pickTimeout: 250ms}}")
	for _, o := range r.all("Secret") {
		t.Errorf("the chart renders Secret %s with picker.peer.existingSecret set", o.GetName())
	}
	vol := peerMount(t, r)
	if vol.SecretName != "llama-peer-cert" {
		t.Errorf("peer volume mounts Secret %q, want llama-peer-cert", vol.SecretName)
	}
	_, c := pickerDeployment(t, r)
	if got := flagValue(t, c.Args, "--peer-pick-timeout"); got != "250ms" {
		t.Errorf("--peer-pick-timeout = %q, want 250ms", got)
	}
}

// One replica has no lease and no peers; peer.enabled false keeps the
// warm standbys of before: neither renders anything of peering.
func TestChartWithoutPeering(t *testing.T) {
	for name, vals := range map[string]string{
		"one replica":                  "picker: {replicas: 1}",
		"warm standbys (peering off)":  "picker: {replicas: 2, peer: {enabled: false}}",
		"one replica, peering left on": "picker: {replicas: 1, peer: {enabled: true}}",
	} {
		t.Run(name, func(t *testing.T) {
			r := mustRender(t, testNamespace, requiredValues, vals)
			d, c := pickerDeployment(t, r)
			for _, a := range c.Args {
				if strings.HasPrefix(a, "--peer-") {
					t.Errorf("arg %s without peering", a)
				}
			}
			if slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "POD_IP" }) ||
				slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.Name == "peer" }) ||
				slices.ContainsFunc(d.Spec.Template.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == "peer-tls" }) {
				t.Errorf("POD_IP, the peer port or the peer volume without peering: env %+v, ports %+v, volumes %+v", c.Env, c.Ports, d.Spec.Template.Spec.Volumes)
			}
			if n := len(r.all("Secret")); n != 0 {
				t.Errorf("%d Secrets rendered without peering, want none", n)
			}
		})
	}
}

// With the NetworkPolicy on, the peer port admits this release's pickers
// and nothing else.
func TestChartNetworkPolicyAdmitsPeers(t *testing.T) {
	r := mustRender(t, testNamespace, requiredValues, `networkPolicy: {create: true}`)
	var np networkingv1.NetworkPolicy
	r.one(t, "NetworkPolicy", &np)
	d, _ := pickerDeployment(t, r)
	i := slices.IndexFunc(np.Spec.Ingress, func(rule networkingv1.NetworkPolicyIngressRule) bool {
		return slices.ContainsFunc(rule.Ports, func(p networkingv1.NetworkPolicyPort) bool { return p.Port.IntValue() == 9004 })
	})
	if i < 0 {
		t.Fatalf("ingress %+v: no rule for the peer port 9004", np.Spec.Ingress)
	}
	rule := np.Spec.Ingress[i]
	if len(rule.Ports) != 1 || len(rule.From) != 1 || rule.From[0].PodSelector == nil || rule.From[0].NamespaceSelector != nil {
		t.Fatalf("peer rule %+v: want port 9004 alone, from one pod selector of the release namespace", rule)
	}
	if !labels.SelectorFromSet(rule.From[0].PodSelector.MatchLabels).Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("the peer rule admits %v, not the picker pods %v", rule.From[0].PodSelector.MatchLabels, d.Spec.Template.Labels)
	}
	other, err := renderRelease(t, "other", testNamespace, values(t, requiredValues))
	if err != nil {
		t.Fatal(err)
	}
	od, _ := pickerDeployment(t, other)
	if labels.SelectorFromSet(rule.From[0].PodSelector.MatchLabels).Matches(labels.Set(od.Spec.Template.Labels)) {
		t.Errorf("the peer rule admits another release's pickers %v", od.Spec.Template.Labels)
	}
	off := mustRender(t, testNamespace, requiredValues, `{networkPolicy: {create: true}, picker: {replicas: 1}}`)
	var npOff networkingv1.NetworkPolicy
	off.one(t, "NetworkPolicy", &npOff)
	if len(npOff.Spec.Ingress) != 2 {
		t.Errorf("ingress with one replica %+v: want only ext_proc/health and metrics", npOff.Spec.Ingress)
	}
}

// The generated peer Secret survives `helm upgrade`: the chart finds the
// stored one (lookup) and renders it unchanged, so replicas keep trusting
// each other; deleted, it is generated anew (the documented rotation).
func TestChartPeerSecretKeptOnUpgrade(t *testing.T) {
	testtier.SkipIfShort(t, "a kube-apiserver and etcd (envtest) for the chart's lookup")
	c := startCluster(t, repoRoot(t))
	const ns = "tally-peer-secret"
	c.createNamespace(t, ns)
	renderHere := func() corev1.Secret {
		t.Helper()
		r, err := renderOn(t, c.cfg, releaseName, ns, values(t, requiredValues))
		if err != nil {
			t.Fatalf("rendering against the API server: %v", err)
		}
		return peerSecret(t, r)
	}
	installed := renderHere()
	verifyPeerCredentials(t, installed)
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&installed)
	if err != nil {
		t.Fatal(err)
	}
	u := &unstructured.Unstructured{Object: obj}
	u.SetAPIVersion("v1")
	u.SetKind("Secret")
	c.applyAll(t, []*unstructured.Unstructured{u})

	upgraded := renderHere()
	for _, key := range []string{"ca.crt", "tls.crt", "tls.key"} {
		if !bytes.Equal(upgraded.Data[key], installed.Data[key]) {
			t.Errorf("an upgrade renders a new %s: replicas would stop trusting the ones not yet restarted", key)
		}
	}

	if err := c.kube.CoreV1().Secrets(ns).Delete(t.Context(), installed.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	rotated := renderHere()
	verifyPeerCredentials(t, rotated)
	if bytes.Equal(rotated.Data["ca.crt"], installed.Data["ca.crt"]) {
		t.Error("after the Secret is deleted an upgrade renders the same CA: rotation would not rotate")
	}
}
