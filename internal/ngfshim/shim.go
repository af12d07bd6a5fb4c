// Package ngfshim plays the endpoint-picker shim that NGINX Gateway Fabric
// (NGF) runs beside NGINX (nginx/nginx-gateway-fabric,
// cmd/gateway/endpoint_picker.go), so Tally can be tested behind a real
// NGINX driven the way NGF drives it. NGINX cannot speak gRPC from NJS: for
// each client request its NJS handler (see package
// github.com/tallyepp/tally/internal/ngfshim/nginx) sends the client's
// method, headers and body to this shim over plain HTTP, with X-EPP-Host and
// X-EPP-Port naming the picker; the shim runs one ext_proc exchange with the
// picker and answers with the chosen endpoint in a response header, and
// NGINX proxies the request there itself.
//
// The exchange is NGF's, not Envoy's: a new gRPC connection per request; one
// RequestHeaders message built from the HTTP headers the shim received
// (lowercased keys, values in value, never raw_value, and no pseudo-headers:
// no :path, :method or :authority), end_of_stream set when there is no
// body; then the whole body in one RequestBody with end_of_stream; then a
// half-close. It reads answers until the picker ends the stream. It never
// sends protocol_config and never a response phase.
//
// X-EPP-Host is the name of the picker's Service, which stands for every
// ready replica of the picker. NGF dials that name anew for each request,
// so its requests spread over the replicas (kube-proxy spreads connections
// to a ClusterIP; a headless Service resolves to each pod's IP). The shim
// does the same explicitly: it resolves the host for each request and
// takes the resolved addresses in turn. Like NGF it does not retry a
// failed exchange on another replica. A resolved address may carry a port
// of its own, which then stands in for X-EPP-Port: replicas run on one
// machine listen on one IP at several ports, where a cluster's share the
// Service's port at several IPs.
//
// The invariant: the shim speaks to the picker only as NGF does. A shim
// that helped the picker (a :path, a protocol_config, a response phase)
// would hide exactly the incompatibilities it exists to find.
package ngfshim

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tallyepp/tally/picker/protocol"
)

// The headers of NGF's NJS-to-shim exchange.
const (
	// PickerHostHeader and PickerPortHeader name the picker to ask.
	PickerHostHeader = "X-EPP-Host"
	PickerPortHeader = "X-EPP-Port"
	// DestinationHeader carries the chosen endpoint: in the picker's header
	// mutation (lowercase, as the protocol spells it), and in the shim's
	// answer to NJS.
	DestinationHeader = protocol.DestinationHeader
)

// Shim is an http.Handler that turns each request into one ext_proc
// exchange with the picker its X-EPP-Host and X-EPP-Port headers name.
// Like httputil.ReverseProxy it is a plain struct: set Dial, and Resolve
// and Log if wanted. A Shim must not be copied after first use.
//
// Its answers to NJS are NGF's: 200 with the destination header when the
// picker named an endpoint (200 without it when the picker's answers held
// none); the ImmediateResponse's status and body when the picker sent one;
// 400 without the picker headers; 500 or 502 when the exchange failed.
type Shim struct {
	// Dial opens a connection to the picker at target ("host:port"). The
	// shim opens one per request and closes it when the request ends.
	Dial func(target string) (*grpc.ClientConn, error)
	// Resolve returns the addresses that X-EPP-Host stands for: the ready
	// replicas behind the picker's Service. Each is an IP, dialled at
	// X-EPP-Port, or an IP:PORT, dialled as it is. Nil looks the host up
	// in DNS (net.DefaultResolver); an IP host is used as it is either way.
	Resolve func(ctx context.Context, host string) ([]string, error)
	// Log receives one line per request at debug level and the failures at
	// warn; nil discards them.
	Log *slog.Logger

	mu    sync.Mutex
	turns map[string]uint64 // per host: the requests sent to it so far
}

// pickTarget resolves host and returns the address ("host:port") whose
// turn it is: port applies to the resolved addresses that carry none.
func (s *Shim) pickTarget(ctx context.Context, host, port string) (string, error) {
	addr, err := s.pickAddr(ctx, host)
	if err != nil {
		return "", err
	}
	if ap, err := netip.ParseAddrPort(addr); err == nil {
		return ap.String(), nil
	}
	if _, err := netip.ParseAddr(addr); err != nil {
		return "", fmt.Errorf("resolving %s %q: %q is neither IP nor IP:PORT", PickerHostHeader, host, addr)
	}
	return net.JoinHostPort(addr, port), nil
}

// pickAddr resolves host and returns the address (IP or IP:PORT) whose
// turn it is.
func (s *Shim) pickAddr(ctx context.Context, host string) (string, error) {
	if ip, err := netip.ParseAddr(host); err == nil {
		return ip.String(), nil
	}
	resolve := s.Resolve
	if resolve == nil {
		resolve = net.DefaultResolver.LookupHost
	}
	addrs, err := resolve(ctx, host)
	if err != nil {
		return "", fmt.Errorf("resolving %s %q: %w", PickerHostHeader, host, err)
	}
	if len(addrs) == 0 {
		return "", fmt.Errorf("resolving %s %q: no address", PickerHostHeader, host)
	}
	// A resolver may rotate its answers; in order, the turns stay even.
	addrs = slices.Sorted(slices.Values(addrs))
	s.mu.Lock()
	if s.turns == nil {
		s.turns = map[string]uint64{}
	}
	n := s.turns[host]
	s.turns[host] = n + 1
	s.mu.Unlock()
	return addrs[n%uint64(len(addrs))], nil
}

// Dialer returns a Shim.Dial that connects with TLS (certificate not
// verified: the picker serves a self-signed one by default, and NGF skips
// verification unless it is given a CA) or in plaintext.
func Dialer(useTLS bool) func(target string) (*grpc.ClientConn, error) {
	creds := insecure.NewCredentials()
	if useTLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}) //nolint:gosec // see above
	}
	return func(target string) (*grpc.ClientConn, error) {
		return grpc.NewClient(target, grpc.WithTransportCredentials(creds))
	}
}

func (s *Shim) log() *slog.Logger {
	if s.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return s.Log
}

// ServeHTTP runs one exchange with the picker for r.
func (s *Shim) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	log := s.log()
	host, port := r.Header.Get(PickerHostHeader), r.Header.Get(PickerPortHeader)
	if host == "" || port == "" {
		msg := fmt.Sprintf("missing header %s or %s: the NJS handler names the picker in both", PickerHostHeader, PickerPortHeader)
		log.Warn(msg)
		http.Error(w, msg, http.StatusBadRequest)
		return
	}
	target, err := s.pickTarget(r.Context(), host, port)
	if err != nil {
		log.Warn("finding the picker", "err", err)
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	conn, err := s.Dial(target)
	if err != nil {
		log.Warn("connecting to the picker", "picker", target, "err", err)
		http.Error(w, fmt.Sprintf("connecting to the picker %s: %v", target, err), http.StatusInternalServerError)
		return
	}
	defer conn.Close()
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(r.Context())
	if err != nil {
		log.Warn("opening an ext_proc stream", "picker", target, "err", err)
		http.Error(w, fmt.Sprintf("opening an ext_proc stream to %s: %v", target, err), http.StatusBadGateway)
		return
	}
	// As NGF's does, a failed send ends the exchange: when the picker
	// answered at the headers and ended the stream, the body's send fails
	// with EOF and its ImmediateResponse is never read. NGINX gets no
	// endpoint either way.
	if status, err := send(stream, r); err != nil {
		log.Warn("sending the request to the picker", "picker", target, "err", err)
		http.Error(w, err.Error(), status)
		return
	}
	a, err := ReadAnswer(stream)
	if a.Named {
		w.Header().Set(DestinationHeader, a.Endpoint)
	}
	if a.InValue != "" {
		log.Warn("the picker set the destination in value, not raw_value: NGF reads raw_value", "value", a.InValue)
	}
	if err != nil {
		log.Warn("reading the picker's answer", "picker", target, "err", err)
		http.Error(w, fmt.Sprintf("reading the picker's answer: %v", err), http.StatusBadGateway)
		return
	}
	if ir := a.Immediate; ir != nil {
		status := int(ir.GetStatus().GetCode())
		if status < 100 || status > 999 {
			// NGF's shim would panic writing it, and NGINX would see the
			// connection drop; either way NGINX gets no endpoint.
			status = http.StatusBadGateway
		}
		log.Debug("immediate response", "path", r.URL.Path, "status", status, "body_bytes", len(ir.GetBody()))
		http.Error(w, string(ir.GetBody()), status)
		return
	}
	log.Debug("picked", "path", r.URL.Path, "endpoint", a.Endpoint)
	w.WriteHeader(http.StatusOK)
}

// Answer is what the picker answered one exchange, read as NGF reads it.
type Answer struct {
	// Immediate is the picker's ImmediateResponse; nil when it sent none.
	Immediate *extprocv3.ImmediateResponse
	// Endpoint is the destination header's raw_value in the last header
	// mutation that set it, and Named says one did (NGF passes even an
	// empty one on). NGF reads raw_value only: InValue is a destination
	// the picker put in value instead, which leaves NGINX without one.
	Endpoint string
	Named    bool
	InValue  string
}

// ReadAnswer reads the picker's answers as NGF's shim does: until the
// picker ends the stream, or sends an ImmediateResponse. On an error, the
// answer holds what was read before it.
func ReadAnswer(stream interface {
	Recv() (*extprocv3.ProcessingResponse, error)
}) (Answer, error) {
	var a Answer
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return a, nil
		}
		if err != nil {
			return a, err
		}
		if ir := resp.GetImmediateResponse(); ir != nil {
			a.Immediate = ir
			return a, nil
		}
		for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() != DestinationHeader {
				continue
			}
			a.Endpoint, a.Named = string(h.GetHeader().GetRawValue()), true
			if a.Endpoint == "" && h.GetHeader().GetValue() != "" {
				a.InValue = h.GetHeader().GetValue()
			}
		}
	}
}

// send sends r's headers and body, then half-closes the stream. On failure
// it returns the status to answer NJS with.
func send(stream extprocv3.ExternalProcessor_ProcessClient, r *http.Request) (int, error) {
	withBody := hasBody(r)
	if err := stream.Send(RequestHeaders(r.Header, !withBody)); err != nil {
		return http.StatusBadGateway, fmt.Errorf("sending the request headers: %w", err)
	}
	if withBody {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return http.StatusInternalServerError, fmt.Errorf("reading the request body: %w", err)
		}
		if err := stream.Send(RequestBody(body)); err != nil {
			return http.StatusBadGateway, fmt.Errorf("sending the request body: %w", err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		return http.StatusInternalServerError, fmt.Errorf("half-closing the stream: %w", err)
	}
	return 0, nil
}

// hasBody is NGF's test: a known length of zero is no body, an unknown
// length (chunked) is one.
func hasBody(r *http.Request) bool {
	return r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0
}

// RequestHeaders builds the RequestHeaders message from the HTTP headers as
// Go's server holds them: without Host (Go moves it to r.Host, so NGF never
// sends it) and with the X-EPP-* headers NJS added. Keys are lowercased,
// values go in value. They are sorted only so that logs and tests read the
// same each time; NGF sends them in map order. It is exported for the load
// tool (cmd/extproc-load), which plays NGF's exchange without HTTP.
func RequestHeaders(h http.Header, endOfStream bool) *extprocv3.ProcessingRequest {
	list := make([]*corev3.HeaderValue, 0, len(h))
	for _, key := range slices.Sorted(maps.Keys(h)) {
		for _, v := range h[key] {
			list = append(list, &corev3.HeaderValue{Key: strings.ToLower(key), Value: v})
		}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{
			Headers:     &corev3.HeaderMap{Headers: list},
			EndOfStream: endOfStream,
		},
	}}
}

// RequestBody is NGF's one body message: the whole body, with end_of_stream.
func RequestBody(body []byte) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true},
	}}
}
