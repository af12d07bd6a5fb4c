// Package nginx renders the NGINX side of NGINX Gateway Fabric's endpoint
// picking for one InferencePool route: the NGINX configuration (a location
// whose NJS handler asks the shim of package ngfshim for an endpoint, an
// internal location that proxies to it, and the pool's failure mode when
// there is none) and the NJS script. Both mirror what NGF generates, so a
// test through them sees what a cluster running NGF would.
//
// The invariant: the rendered NGINX needs no root and nothing outside Dir.
// Every path it writes (pid, logs, temporary files, sockets) is under Dir,
// so several can run at once and a test's cleanup removes all of it.
package nginx

import (
	"bytes"
	_ "embed"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"
	"text/template"

	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
)

// Script is the NJS script; the configuration imports it from
// Dir/ScriptName.
//
//go:embed epp.js
var Script []byte

// ScriptName is the file name the configuration expects the script under.
const ScriptName = "epp.js"

//go:embed nginx.conf.tmpl
var configText string

var configTemplate = template.Must(template.New("nginx.conf").Parse(configText))

// DefaultJSModule is where Debian's libnginx-mod-http-js installs the NJS module.
const DefaultJSModule = "/usr/lib/nginx/modules/ngx_http_js_module.so"

// defaultMaxBodyBytes bounds a request body NGINX accepts (413 above it).
const defaultMaxBodyBytes = 16 << 20

const (
	poolUpstream = "inference_pool"
	// internalPath is the location NJS redirects to, named as NGF names its own.
	internalPath = "/_ngf-internal-inference-pool"
)

// Config is what the rendered configuration needs to know.
type Config struct {
	// Dir is NGINX's prefix directory (absolute): its pid file, logs,
	// temporary files, sockets and the NJS script live there.
	Dir string
	// JSModule is the path of ngx_http_js_module.so (default DefaultJSModule).
	JSModule string
	// Listen is the client-facing address ("127.0.0.1:8080").
	Listen netip.AddrPort
	// Shim is the shim's address.
	Shim netip.AddrPort
	// Picker is the picker's ext_proc address, passed to the shim.
	Picker netip.AddrPort
	// PickerHost, when set, is the host name passed to the shim in place
	// of Picker's IP (with Picker's port), as NGF passes the name of the
	// picker's Service: the shim resolves it for each request and spreads
	// the requests over its addresses (see package ngfshim).
	PickerHost string
	// PoolEndpoints are the pool's endpoints, FailOpen's targets. NGINX
	// knows them as they were when the configuration was rendered.
	PoolEndpoints []netip.AddrPort
	// FailureMode applies when the picker names no endpoint: FailClose
	// answers 500 (NGF's invalid-backend-ref), FailOpen sends the request to
	// one of PoolEndpoints. Default FailClose.
	FailureMode infv1.EndpointPickerFailureMode
	// MaxBodyBytes bounds a request body (default 16 MiB); NJS holds each
	// body in memory.
	MaxBodyBytes int
}

// Render returns the nginx.conf for c.
func Render(c Config) ([]byte, error) {
	if c.JSModule == "" {
		c.JSModule = DefaultJSModule
	}
	if c.FailureMode == "" {
		c.FailureMode = infv1.EndpointPickerFailClose
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = defaultMaxBodyBytes
	}
	var errs []error
	if !filepath.IsAbs(c.Dir) || strings.ContainsAny(c.Dir, " \t\n;{}'\"$#") {
		errs = append(errs, fmt.Errorf("nginx config: Dir %q is invalid: must be an absolute path without spaces, quotes or any of ;{}$#", c.Dir))
	}
	if strings.ContainsAny(c.JSModule, " \t\n;{}'\"$#") {
		errs = append(errs, fmt.Errorf("nginx config: JSModule %q is invalid: must be a path without spaces, quotes or any of ;{}$#", c.JSModule))
	}
	for name, ap := range map[string]netip.AddrPort{"Listen": c.Listen, "Shim": c.Shim, "Picker": c.Picker} {
		if !ap.IsValid() || ap.Port() == 0 {
			errs = append(errs, fmt.Errorf("nginx config: %s %v is invalid: must be ip:port with a port from 1 to 65535", name, ap))
		}
	}
	pickerHost := c.Picker.Addr().String()
	if c.PickerHost != "" {
		if !isHostName(c.PickerHost) {
			errs = append(errs, fmt.Errorf("nginx config: PickerHost %q is invalid: must be a DNS name (letters, digits, '-' and '.')", c.PickerHost))
		}
		pickerHost = c.PickerHost
	}
	failureTarget := "invalid-backend-ref"
	switch c.FailureMode {
	case infv1.EndpointPickerFailClose:
	case infv1.EndpointPickerFailOpen:
		failureTarget = poolUpstream
	default:
		errs = append(errs, fmt.Errorf("nginx config: FailureMode %q is invalid: must be %s or %s", c.FailureMode, infv1.EndpointPickerFailOpen, infv1.EndpointPickerFailClose))
	}
	if c.MaxBodyBytes < 0 {
		errs = append(errs, fmt.Errorf("nginx config: MaxBodyBytes %d is invalid: must be 0 (the default) or more", c.MaxBodyBytes))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	endpoints := make([]string, len(c.PoolEndpoints))
	for i, ep := range c.PoolEndpoints {
		endpoints[i] = ep.String()
	}
	var b bytes.Buffer
	err := configTemplate.Execute(&b, map[string]any{
		"Dir":           c.Dir,
		"JSModule":      c.JSModule,
		"Listen":        c.Listen.String(),
		"ShimAddr":      c.Shim.String(),
		"PickerHost":    pickerHost,
		"PickerPort":    strconv.Itoa(int(c.Picker.Port())),
		"PoolUpstream":  poolUpstream,
		"PoolEndpoints": endpoints,
		"FailureTarget": failureTarget,
		"InternalPath":  internalPath,
		"MaxBodyBytes":  c.MaxBodyBytes,
	})
	if err != nil {
		return nil, fmt.Errorf("rendering nginx.conf: %w", err)
	}
	return b.Bytes(), nil
}

// isHostName reports whether s is a DNS name NGINX can take unquoted in a
// set directive: dot-separated labels of letters, digits and '-', none
// empty or starting or ending with '-'.
func isHostName(s string) bool {
	if len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, r := range label {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
				return false
			}
		}
	}
	return true
}
