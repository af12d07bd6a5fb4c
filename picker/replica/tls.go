package replica

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
)

// ServerName is the name a replica's peer certificate is issued for, and
// the name its peers verify.
const ServerName = "tally-peer"

// Credentials are the peer credentials in a directory: ca.crt (one or more
// CAs: a peer's certificate must be signed by one of them), tls.crt and
// tls.key (this replica's certificate, for ServerName, used as server and
// as client). The files are read on each new connection, so a rotated
// Secret takes effect without a restart.
type Credentials struct{ Dir string }

// load reads the files: this replica's certificate and the CAs it trusts.
func (c Credentials) load() (tls.Certificate, *x509.CertPool, error) {
	cert, err := tls.LoadX509KeyPair(filepath.Join(c.Dir, "tls.crt"), filepath.Join(c.Dir, "tls.key"))
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("peer certificate in %s: %w", c.Dir, err)
	}
	pem, err := os.ReadFile(filepath.Join(c.Dir, "ca.crt"))
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("peer CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return tls.Certificate{}, nil, fmt.Errorf("peer CA %s holds no PEM certificate", filepath.Join(c.Dir, "ca.crt"))
	}
	return cert, pool, nil
}

// Check reads the files once, for a clear error at start.
func (c Credentials) Check() error {
	if c.Dir == "" {
		return errors.New("no directory given")
	}
	_, _, err := c.load()
	return err
}

// peerWindowBytes is the peer stream's flow control window, each way,
// fixed. gRPC's default window grows by estimating the bandwidth-delay
// product, with a PING and its ack for most messages when they come one at
// a time, as picks do: each a write on one side and a read and a write on
// the other: 5 writes and 10 reads for a forwarded pick at 400 a second,
// 3 and 6 without (BenchmarkPickPaced). A MiB lets some 2,000 picks of
// 8,000 tokens (about 530 bytes each) be sent unread; past it the sends
// wait in the outbox, whose bound cuts a stalled peer's stream
// (outboxSize).
const peerWindowBytes = 1 << 20

// maxPeerMessageBytes bounds one peer message each way. A Sync or a Claim
// lists every reservation in flight (about 600 bytes each): gRPC's default
// 4 MiB would cut the stream of a pool with some 7,000 in flight, and it
// would cut it again at each reconnection.
const maxPeerMessageBytes = 256 << 20

// peerPing is how long a peer stream may carry nothing before the
// follower pings its peer, and peerPingTimeout how long it waits for the
// ack before it takes the peer for gone.
const (
	peerPing        = 10 * time.Second
	peerPingTimeout = 5 * time.Second
)

// ServerOptions are the peer server's: creds (Server), the peer stream's
// flow control, and a keepalive policy that lets a follower ping every
// peerPing. gRPC's default policy takes a ping sooner than every 5 minutes
// for abuse: after three, on a stream with nothing to send (a quiet pool,
// or a peer that does not lead), it cut the connection with
// "too_many_pings", and a follower of a leader cut so placed picks alone
// until it reconnected.
func ServerOptions(creds credentials.TransportCredentials) []grpc.ServerOption {
	return []grpc.ServerOption{grpc.Creds(creds),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: peerPing / 2, PermitWithoutStream: true}),
		// A follower whose process or node stops answering is dropped
		// after about peerPing + peerPingTimeout, as the follower drops
		// a leader that does.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: peerPing, Timeout: peerPingTimeout}),
		grpc.StaticStreamWindowSize(peerWindowBytes), grpc.StaticConnWindowSize(peerWindowBytes),
		grpc.MaxRecvMsgSize(maxPeerMessageBytes), grpc.MaxSendMsgSize(maxPeerMessageBytes)}
}

// Server is the peer server's TLS: a client must present a certificate a
// trusted CA signed.
func (c Credentials) Server() credentials.TransportCredentials {
	return credentials.NewTLS(&tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			cert, pool, err := c.load()
			if err != nil {
				return nil, err
			}
			return &tls.Config{
				MinVersion:   tls.VersionTLS13,
				Certificates: []tls.Certificate{cert},
				ClientCAs:    pool,
				ClientAuth:   tls.RequireAndVerifyClientCert,
				NextProtos:   []string{"h2"},
			}, nil
		},
	})
}

// Dial is a follower's TLS toward its peers, read afresh.
func (c Credentials) Dial() (credentials.TransportCredentials, error) {
	cert, pool, err := c.load()
	if err != nil {
		return nil, err
	}
	return credentials.NewTLS(&tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		RootCAs:      pool,
		ServerName:   ServerName,
	}), nil
}
