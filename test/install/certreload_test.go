package install

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
	"testing"
	"time"

	"github.com/onsi/gomega"
)

// checkCertReload runs the chart's picker with its ext_proc certificate from
// a directory (--cert-path, --enable-cert-reload), replaces the certificate
// there, and expects new connections to get the new one without a restart.
func checkCertReload(t *testing.T, c *cluster, bin string, r rendered, ns, sa string) {
	t.Helper()
	dir := t.TempDir()
	writeCert(t, dir, "first")
	p := launch(t, bin, r, c.tokenKubeconfig(t, ns, sa), "--cert-path="+dir, "--enable-cert-reload")
	_, ctr := pickerDeployment(t, r)
	p.waitReadyThroughProbes(t, ctr)
	served := func(g gomega.Gomega) string {
		conn, err := tls.Dial("tcp", p.grpcAddr, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
		g.Expect(err).NotTo(gomega.HaveOccurred())
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0].Subject.CommonName
	}
	g := gomega.NewWithT(t)
	g.Expect(served(g)).To(gomega.Equal("first"))
	writeCert(t, dir, "second")
	g.Eventually(served).WithTimeout(30*time.Second).WithPolling(200*time.Millisecond).Should(gomega.Equal("second"),
		"the certificate served after tls.crt and tls.key were replaced")
}

// writeCert writes a self-signed tls.crt and tls.key for commonName into
// dir, each file replaced in one rename, as a Secret volume update does.
func writeCert(t *testing.T, dir, commonName string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: commonName},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
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
		"tls.key": {Type: "EC PRIVATE KEY", Bytes: keyDER},
		"tls.crt": {Type: "CERTIFICATE", Bytes: der},
	} {
		tmp := filepath.Join(dir, "."+name)
		if err := os.WriteFile(tmp, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
}
