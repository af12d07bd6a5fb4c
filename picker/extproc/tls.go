package extproc

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"path/filepath"
	"time"
)

// selfSignedValidity is how long a generated certificate is valid; the pod is
// expected to restart well within it.
const selfSignedValidity = 365 * 24 * time.Hour

// ServerTLS returns the TLS configuration of the ext_proc port. With certPath
// empty it generates a self-signed certificate (ECDSA P-256, valid one year):
// gateways connect to the picker without verifying it, as with the upstream
// picker. Otherwise it loads tls.crt and tls.key from the directory certPath
// (the upstream picker's convention, e.g. a mounted Secret), once, at start:
// a rotated certificate takes effect when the picker restarts.
func ServerTLS(certPath string) (*tls.Config, error) {
	var cert tls.Certificate
	var err error
	if certPath == "" {
		cert, err = selfSignedCertificate(time.Now())
	} else {
		cert, err = tls.LoadX509KeyPair(filepath.Join(certPath, "tls.crt"), filepath.Join(certPath, "tls.key"))
		if err != nil {
			err = fmt.Errorf("--cert-path %q: loading tls.crt and tls.key: %w", certPath, err)
		}
	}
	if err != nil {
		return nil, err
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
}

func selfSignedCertificate(now time.Time) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("generating a TLS key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("generating a certificate serial number: %w", err)
	}
	template := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{Organization: []string{"Tally"}, CommonName: "tally-picker"},
		NotBefore:    now.Add(-time.Minute), // tolerate small clock skew with the gateway
		NotAfter:     now.Add(selfSignedValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, template, template, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("creating a self-signed certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("parsing the self-signed certificate: %w", err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}
