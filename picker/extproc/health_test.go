package extproc_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/go-logr/logr"
	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
)

func TestHealth(t *testing.T) {
	h := extproc.NewHealth()
	g := grpc.NewServer()
	h.Register(g)
	gw := serve(t, g, grpc.WithTransportCredentials(insecure.NewCredentials()))
	client := healthpb.NewHealthClient(gw.conn)

	check := func(when string, want map[string]healthpb.HealthCheckResponse_ServingStatus) {
		t.Helper()
		for svc, st := range want {
			resp, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{Service: svc})
			if err != nil {
				t.Fatalf("%s: checking %q: %v", when, svc, err)
			}
			if resp.GetStatus() != st {
				t.Errorf("%s: %q is %v, want %v", when, svc, resp.GetStatus(), st)
			}
		}
	}
	const serving, notServing = healthpb.HealthCheckResponse_SERVING, healthpb.HealthCheckResponse_NOT_SERVING
	check("before ready", map[string]healthpb.HealthCheckResponse_ServingStatus{
		"liveness": serving, "readiness": notServing, "": notServing, "envoy.service.ext_proc.v3.ExternalProcessor": notServing,
		"inference-extension": notServing,
	})
	h.SetReady(true)
	check("ready", map[string]healthpb.HealthCheckResponse_ServingStatus{
		"liveness": serving, "readiness": serving, "": serving, "envoy.service.ext_proc.v3.ExternalProcessor": serving,
	})
	h.SetReady(false)
	check("no longer ready", map[string]healthpb.HealthCheckResponse_ServingStatus{
		"liveness": serving, "readiness": notServing, "": notServing, "envoy.service.ext_proc.v3.ExternalProcessor": notServing,
	})

	// What the upstream inferencepool chart's probes ask for is readiness.
	h.SetReady(true)
	check("ready again", map[string]healthpb.HealthCheckResponse_ServingStatus{"inference-extension": serving})
	h.Drain()
	h.SetReady(true) // e.g. a late sync: draining wins
	check("draining", map[string]healthpb.HealthCheckResponse_ServingStatus{
		"liveness": serving, "readiness": notServing, "": notServing, "inference-extension": notServing,
		"envoy.service.ext_proc.v3.ExternalProcessor": notServing,
	})
}

func TestSelfSignedTLS(t *testing.T) {
	cfg, err := extproc.ServerTLS("")
	if err != nil {
		t.Fatal(err)
	}
	leaf := cfg.Certificates[0].Leaf
	key, ok := leaf.PublicKey.(*ecdsa.PublicKey)
	if !ok || key.Curve != elliptic.P256() {
		t.Errorf("key %T, want ECDSA P-256", leaf.PublicKey)
	}
	if life := leaf.NotAfter.Sub(time.Now()); life < 364*24*time.Hour || life > 366*24*time.Hour {
		t.Errorf("certificate valid for %v more, want about a year", life)
	}

	// A gateway that does not verify the certificate (as gateways talk to
	// the picker) routes through the TLS port.
	p := picker.New(v1alpha1.Default(), picker.Options{Log: logr.Discard()})
	p.Replace(endpoints(epA))
	g := grpc.NewServer(grpc.Creds(credentials.NewTLS(cfg)))
	extproc.NewServer(p, extproc.Options{MaxRequestBytes: 1 << 20, Log: logr.Discard()}).Register(g)
	gw := serve(t, g, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})))
	r, err := gw.roundTrip(t.Context(), completion("m", "hello over TLS"))
	if err != nil || r.Destination != "127.0.0.11:8000" {
		t.Fatalf("got %+v, %v; want routed to A", r, err)
	}
}

func TestTLSFromCertPath(t *testing.T) {
	dir := t.TempDir()
	writeKeyPair(t, dir)
	cfg, err := extproc.ServerTLS(dir)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(cfg.Certificates[0].Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	if leaf.Subject.CommonName != "from-secret" {
		t.Errorf("loaded certificate for %q, want the one in %s", leaf.Subject.CommonName, dir)
	}

	missing := filepath.Join(dir, "nope")
	if _, err := extproc.ServerTLS(missing); err == nil || !strings.Contains(err.Error(), "--cert-path") || !strings.Contains(err.Error(), missing) {
		t.Errorf("missing directory: error %v, want one naming --cert-path and %s", err, missing)
	}
}

func writeKeyPair(t *testing.T, dir string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "from-secret"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	for name, block := range map[string]*pem.Block{
		"tls.crt": {Type: "CERTIFICATE", Bytes: der},
		"tls.key": {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}
