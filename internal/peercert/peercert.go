// Package peercert writes peer credentials for picker replicas
// (picker/replica.Credentials) as the chart provisions them: a CA, and one
// certificate it signed for the peers' server name (serverName),
// for server and client use.
// Tests and the local stack use it.
package peercert

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"time"
)

// Write writes ca.crt, tls.crt and tls.key into dir, the certificate for
// serverName, valid for validity from an hour ago.
func Write(dir, serverName string, validity time.Duration) error {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	notBefore := time.Now().Add(-time.Hour)
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "tally-peer-ca"},
		NotBefore: notBefore, NotAfter: notBefore.Add(validity), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("creating the peer CA: %w", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: serverName},
		DNSNames: []string{serverName}, NotBefore: notBefore, NotAfter: notBefore.Add(validity),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	leafDER, err := x509.CreateCertificate(rand.Reader, leaf, ca, &key.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("creating the peer certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	for _, f := range []struct {
		name, typ string
		der       []byte
	}{{"ca.crt", "CERTIFICATE", caDER}, {"tls.crt", "CERTIFICATE", leafDER}, {"tls.key", "PRIVATE KEY", keyDER}} {
		if err := os.WriteFile(filepath.Join(dir, f.name), pem.EncodeToMemory(&pem.Block{Type: f.typ, Bytes: f.der}), 0o600); err != nil {
			return err
		}
	}
	return nil
}
