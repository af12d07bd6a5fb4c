package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"

	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/internal/envoy"
	"github.com/tallyepp/tally/picker/protocol"
)

// Forwarding to the model servers: the request as the picker returned it,
// sent to its destinations in turn, or, when the picker did not decide, to
// the pool's endpoints per its failure mode.

// upstreamRequest is the request as the picker returned it.
type upstreamRequest struct {
	method, path, host string
	header             http.Header
	body               []byte
	destinations       []string
}

func newUpstreamRequest(r *http.Request, d *envoy.Routed) (*upstreamRequest, error) {
	h := r.Header.Clone()
	// Pseudo-headers ride along in the header map so that the mutation can
	// rewrite them as it can in Envoy.
	h[":path"] = []string{r.URL.RequestURI()}
	h[":authority"] = []string{r.Host}
	if err := envoy.ApplyHeaderMutation(h, d.HeadersAnswer.GetHeaderMutation()); err != nil {
		return nil, err
	}
	out := &upstreamRequest{
		method: r.Method,
		path:   h.Get(":path"),
		host:   h.Get(":authority"),
		header: h,
		body:   d.Body,
	}
	for _, k := range []string{":path", ":authority", ":method", ":scheme"} {
		delete(h, k)
	}
	out.destinations = parseDestinations(h.Values(protocol.DestinationHeader))
	if len(out.destinations) == 0 {
		// The header is what Envoy's original-destination cluster reads; the
		// metadata carries the same value.
		if d.Metadata != "" {
			out.destinations = parseDestinations([]string{d.Metadata})
		}
	}
	return out, nil
}

// parseDestinations splits "ip:port,ip:port" values into an ordered list.
func parseDestinations(values []string) []string {
	var out []string
	for _, v := range values {
		for _, ep := range strings.Split(v, ",") {
			if ep = strings.TrimSpace(ep); ep != "" {
				out = append(out, ep)
			}
		}
	}
	return out
}

// forward sends the request to the destinations in order, moving on only
// when a connection cannot be opened (nothing was sent, so a retry is safe).
// It returns the response and the endpoint that served it.
func (g *Gateway) forward(ctx context.Context, u *upstreamRequest, log *slog.Logger) (*http.Response, string, error) {
	var errs []error
	for _, ep := range u.destinations {
		req, err := u.build(ctx, ep)
		if err != nil {
			errs = append(errs, fmt.Errorf("endpoint %q: %w", ep, err))
			continue
		}
		resp, err := g.transport().RoundTrip(req)
		if err == nil {
			return resp, ep, nil
		}
		if ctx.Err() != nil {
			return nil, "", ctx.Err()
		}
		errs = append(errs, fmt.Errorf("endpoint %s: %w", ep, err))
		if !isDialError(err) {
			// The request may have reached the server: do not send it twice.
			break
		}
		log.Debug("endpoint refused the connection; trying the next", "endpoint", ep, "err", err)
	}
	return nil, "", errors.Join(errs...)
}

func (u *upstreamRequest) build(ctx context.Context, endpoint string) (*http.Request, error) {
	target, err := url.Parse("http://" + endpoint + u.path)
	if err != nil {
		return nil, fmt.Errorf("building the upstream URL: %w", err)
	}
	if target.Host != endpoint {
		return nil, fmt.Errorf("%q is not host:port", endpoint)
	}
	req, err := http.NewRequestWithContext(ctx, u.method, target.String(), bytes.NewReader(u.body))
	if err != nil {
		return nil, fmt.Errorf("building the upstream request: %w", err)
	}
	req.Host = u.host
	req.Header = u.header.Clone()
	envoy.RemoveHopByHop(req.Header)
	// The body may have been rewritten: its length is what the picker returned.
	req.Header.Del("Content-Length")
	if _, ok := req.Header["User-Agent"]; !ok {
		req.Header.Set("User-Agent", "") // keep Go's default out
	}
	return req, nil
}

func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// failOver answers a request the picker could not decide, per the pool's
// failure mode: FailOpen sends the original request to a pool endpoint
// chosen at random (the others in turn if it refuses the connection),
// FailClose answers 503.
func (ex *exchange) failOver(cause error, original []byte) {
	view := ex.g.pool()
	if view.FailureMode != infv1.EndpointPickerFailOpen || len(view.Endpoints) == 0 {
		ex.log.Warn("the endpoint picker did not decide; failing closed", "err", cause, "failure_mode", view.FailureMode, "endpoints", len(view.Endpoints))
		http.Error(ex.w, "endpoint picker unavailable", http.StatusServiceUnavailable)
		return
	}
	choose := ex.g.Choose
	if choose == nil {
		choose = rand.IntN
	}
	start := choose(len(view.Endpoints))
	order := append(slices.Clone(view.Endpoints[start:]), view.Endpoints[:start]...)
	u := &upstreamRequest{
		method:       ex.r.Method,
		path:         ex.r.URL.RequestURI(),
		host:         ex.r.Host,
		header:       ex.r.Header,
		body:         original,
		destinations: order,
	}
	resp, served, err := ex.g.forward(ex.r.Context(), u, ex.log)
	if err != nil {
		if ex.r.Context().Err() == nil {
			ex.log.Warn("failing open found no endpoint", "err", err)
			http.Error(ex.w, "upstream connect error", http.StatusServiceUnavailable)
		}
		return
	}
	defer resp.Body.Close()
	ex.log.Warn("the endpoint picker did not decide; failed open", "err", cause, "served", served)
	h := resp.Header.Clone()
	envoy.RemoveHopByHop(h)
	for k, v := range h {
		ex.w.Header()[k] = v
	}
	ex.w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(ex.w)
	_ = rc.Flush()
	buf := make([]byte, ex.g.chunkBytes())
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := ex.w.Write(buf[:n]); werr != nil {
				return
			}
			_ = rc.Flush()
		}
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			panic(http.ErrAbortHandler)
		}
	}
}

// localReply is the response the gateway itself gives, as Envoy's local
// replies do; it still goes through the picker's response path.
func localReply(status int, body string) *http.Response {
	return &http.Response{
		StatusCode:    status,
		Header:        http.Header{"Content-Type": {"text/plain; charset=utf-8"}},
		Body:          io.NopCloser(strings.NewReader(body)),
		ContentLength: int64(len(body)),
	}
}
