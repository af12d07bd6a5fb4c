package envoy

import (
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// The conversion between net/http's headers and ext_proc's, for a gateway
// written with net/http (cmd/devgateway): what Envoy sends the picker of a
// request or a response, and how it applies the picker's header mutations.

// RequestHeaders are r's headers as Envoy sends them, as key, value pairs
// for Request.Headers: the pseudo-headers first, then the others without
// the hop-by-hop ones, lower case, sorted, one pair per value, and a
// content-length when r's length is known.
func RequestHeaders(r *http.Request) []string {
	kv := []string{":method", r.Method, ":scheme", "http", ":path", r.URL.RequestURI(), ":authority", r.Host}
	h := r.Header.Clone()
	RemoveHopByHop(h)
	if r.ContentLength > 0 && h.Get("Content-Length") == "" {
		h.Set("Content-Length", strconv.FormatInt(r.ContentLength, 10))
	}
	return appendHeaders(kv, h)
}

// ResponseHeaders are resp's headers as Envoy sends them, as key, value
// pairs for Response.Headers (":status" is Response.Status's).
func ResponseHeaders(resp *http.Response) []string {
	h := resp.Header.Clone()
	RemoveHopByHop(h)
	return appendHeaders(nil, h)
}

// appendHeaders appends h to kv in a stable order, lower-cased as HTTP/2
// and Envoy spell them, one pair per value.
func appendHeaders(kv []string, h http.Header) []string {
	for _, k := range slices.Sorted(maps.Keys(h)) {
		lk := strings.ToLower(k)
		for _, v := range h[k] {
			kv = append(kv, lk, v)
		}
	}
	return kv
}

// ApplyHeaderMutation applies removals, then sets, with Envoy's semantics:
// an unset append_action falls back to the deprecated append flag, which
// defaults to overwrite.
func ApplyHeaderMutation(h http.Header, m *extprocv3.HeaderMutation) error {
	if m == nil {
		return nil
	}
	for _, name := range m.GetRemoveHeaders() {
		delete(h, headerKey(name))
	}
	for _, opt := range m.GetSetHeaders() {
		hv := opt.GetHeader()
		if hv == nil {
			continue
		}
		if hv.GetValue() != "" && len(hv.GetRawValue()) > 0 {
			return fmt.Errorf("header %q sets both value and raw_value", hv.GetKey())
		}
		value := hv.GetValue()
		if len(hv.GetRawValue()) > 0 {
			value = string(hv.GetRawValue())
		}
		key := headerKey(hv.GetKey())
		if key == "" {
			return errors.New("a header mutation has an empty key")
		}
		_, exists := h[key]
		switch opt.GetAppendAction() {
		case corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD:
			if opt.GetAppend().GetValue() {
				h[key] = append(h[key], value)
			} else {
				h[key] = []string{value}
			}
		case corev3.HeaderValueOption_ADD_IF_ABSENT:
			if !exists {
				h[key] = []string{value}
			}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD:
			h[key] = []string{value}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
			if exists {
				h[key] = []string{value}
			}
		default:
			return fmt.Errorf("header %q has an unknown append_action %d", hv.GetKey(), opt.GetAppendAction())
		}
	}
	return nil
}

// headerKey maps a wire header name to its http.Header key; pseudo-headers
// stay lower case.
func headerKey(name string) string {
	name = strings.ToLower(name)
	if strings.HasPrefix(name, ":") {
		return name
	}
	return http.CanonicalHeaderKey(name)
}

// RemoveHopByHop deletes the connection-level headers a proxy does not
// forward (RFC 9110 §7.6.1), nor Envoy pass to ext_proc.
func RemoveHopByHop(h http.Header) {
	for _, f := range h.Values("Connection") {
		for _, name := range strings.Split(f, ",") {
			if name = strings.TrimSpace(name); name != "" {
				h.Del(name)
			}
		}
	}
	for _, name := range [...]string{
		"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
		"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
	} {
		h.Del(name)
	}
}
