package extproc

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"

	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc/internal/wire"
	"github.com/tallyepp/tally/picker/protocol"
	"github.com/tallyepp/tally/picker/request"
)

// ownedHeaders are the request headers only the picker may set. A copy sent
// by the client is removed, so that a client cannot choose its own endpoint
// on a path where the picker writes none.
var ownedHeaders = []string{protocol.DestinationHeader, protocol.PrefillerHeader}

// maxChunkBytes bounds each body chunk sent back in FULL_DUPLEX_STREAMED
// mode; Envoy's ext_proc filter expects chunks no larger than this.
const maxChunkBytes = 62_000

var (
	errBodyTooLarge = errors.New("request body too large")
	errEmptyBody    = errors.New("the request body is empty")
	errProtocol     = errors.New("ext_proc protocol violation")
	// errUnannouncedStreamed: see unannouncedBodyWait.
	errUnannouncedStreamed = errors.New("the gateway announced no body mode (protocol_config) and streams the request body after the headers were answered; " +
		"the destination can no longer be set: use the FULL_DUPLEX_STREAMED or BUFFERED request body mode, or an Envoy that announces its mode (1.35 or later)")
	errBufferBudget = errors.New("the picker is buffering too many request bytes")
	errPanic        = errors.New("internal error while routing the request")
	// errAnswered ends a stream cleanly once an ImmediateResponse is sent:
	// the gateway sends nothing more for that request.
	errAnswered = errors.New("answered with an immediate response")
)

// errorAnswers is the one place that decides how a failed request is
// answered: the first row whose message func accepts the error gives the
// HTTP status, the error type and the message shown to the client. An error
// no row accepts is answered 500 without details.
var errorAnswers = []struct {
	status  int
	kind    string
	message func(err error) (string, bool)
}{
	{400, "invalid_request_error", requestErrorMessage},
	{400, "invalid_request_error", is(errEmptyBody)},
	{400, "invalid_request_error", is(errProtocol)},
	{413, "invalid_request_error", is(errBodyTooLarge)},
	{503, "service_unavailable", is(errBufferBudget)},
	{503, "service_unavailable", is(picker.ErrNoEndpoint)},
	{429, "rate_limit_exceeded", is(picker.ErrSaturated)},
	{429, "rate_limit_exceeded", is(picker.ErrQueueFull)},
	{429, "rate_limit_exceeded", is(picker.ErrQueueTimeout)},
	{429, "rate_limit_exceeded", is(picker.ErrShed)},
	{503, "service_unavailable", is(picker.ErrShuttingDown)},
	{500, "internal_error", is(errUnannouncedStreamed)},
	{500, "internal_error", is(errPanic)},
}

func requestErrorMessage(err error) (string, bool) {
	var e *request.Error
	if errors.As(err, &e) {
		return e.Message, true
	}
	return "", false
}

func is(target error) func(error) (string, bool) {
	return func(err error) (string, bool) { return err.Error(), errors.Is(err, target) }
}

// answerFor returns the HTTP status and JSON body that answer err.
func answerFor(err error) (int, []byte) {
	httpStatus, kind, message := 500, "internal_error", errPanic.Error()
	for _, row := range errorAnswers {
		if m, ok := row.message(err); ok {
			httpStatus, kind, message = row.status, row.kind, m
			break
		}
	}
	type body struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	}
	b, _ := json.Marshal(struct { // cannot fail: strings and an int
		Error body `json:"error"`
	}{body{message, kind, httpStatus}})
	return httpStatus, b
}

func immediateResponse(httpStatus int, body []byte) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(httpStatus)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: answerHeaders(httpStatus)},
			Body:    body,
			Details: "tally_" + strconv.Itoa(httpStatus),
		},
	}}
}

// The constant answers, encoded once.
var (
	answerResponseHeaders = wire.NewPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}}}})
	answerRequestBody = wire.NewPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}})
	answerResponseBody = wire.NewPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}})
	answerRequestTrailers = wire.NewPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{}}})
	answerResponseTrailers = wire.NewPreEncoded(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
		ResponseTrailers: &extprocv3.TrailersResponse{}}})
)

// retryAfterSeconds is the retry-after of a 429 or 503: the picker's
// queues and endpoint set change within a second.
const retryAfterSeconds = "1"

func answerHeaders(httpStatus int) []*corev3.HeaderValueOption {
	h := []*corev3.HeaderValueOption{wire.HeaderOption("content-type", "application/json")}
	if httpStatus == 429 || httpStatus == 503 {
		h = append(h, wire.HeaderOption("retry-after", retryAfterSeconds))
	}
	return h
}

// destinationValue is the destination header's value: the endpoints,
// comma-separated, "[v6]:port" for IPv6.
func destinationValue(eps []netip.AddrPort) string {
	var b strings.Builder
	for i, ep := range eps {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(ep.String())
	}
	return b.String()
}

// unrouted answers request headers the picker writes no destination into.
func unrouted() *extprocv3.CommonResponse {
	return &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{RemoveHeaders: ownedHeaders}}
}

// headerValue is the value of the last header named key ("" when none
// is): Envoy passes a repeated header as separate entries, and the upstream
// picker reads them into a map, where the last wins. So a header a route
// appends (x-gateway-inference-objective, say) wins over the client's, as
// there.
func headerValue(h *corev3.HeaderMap, key string) string {
	headers := h.GetHeaders()
	for i := len(headers) - 1; i >= 0; i-- {
		if hv := headers[i]; hv.GetKey() == key {
			if raw := hv.GetRawValue(); len(raw) > 0 {
				return string(raw)
			}
			return hv.GetValue()
		}
	}
	return ""
}

// subsetHint reads the gateway's subset hint: a list of "ip:port" strings or
// one comma-separated string. ok reports whether a hint was sent at all (an
// empty hint allows no endpoint). An entry may be a bare IP, which names
// every endpoint at that IP (see picker.Request.Subset). Entries that are not
// addresses can match no endpoint and are returned in bad for logging.
func subsetHint(md *corev3.Metadata) (subset []netip.AddrPort, ok bool, bad []string) {
	v, ok := md.GetFilterMetadata()[protocol.SubsetNamespace].GetFields()[protocol.SubsetKey]
	if !ok {
		return nil, false, nil
	}
	if list := v.GetListValue(); list != nil {
		for _, item := range list.GetValues() {
			subset, bad = appendEndpoints(subset, bad, item.GetStringValue())
		}
	} else {
		subset, bad = appendEndpoints(subset, bad, v.GetStringValue())
	}
	return subset, true, bad
}

// appendEndpoints parses a comma-separated list of endpoints, each "ip:port",
// "[ipv6]:port" or a bare IP ("10.0.0.7", "fd00::1", "[fd00::1]"), which
// takes port 0: every endpoint at that IP. Entries that are neither are
// appended to bad.
func appendEndpoints(subset []netip.AddrPort, bad []string, list string) ([]netip.AddrPort, []string) {
	for part := range strings.SplitSeq(list, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		bare := part
		if len(bare) > 2 && bare[0] == '[' && bare[len(bare)-1] == ']' {
			bare = bare[1 : len(bare)-1]
		}
		if ap, err := netip.ParseAddrPort(part); err == nil {
			subset = append(subset, ap)
		} else if ip, err := netip.ParseAddr(bare); err == nil {
			subset = append(subset, netip.AddrPortFrom(ip, 0))
		} else {
			bad = append(bad, part)
		}
	}
	return subset, bad
}

// servedBy reads which endpoint the gateway actually sent the request to.
func servedBy(md *corev3.Metadata) (netip.AddrPort, bool) {
	v := md.GetFilterMetadata()[protocol.LBNamespace].GetFields()[protocol.ServedKey].GetStringValue()
	ap, err := netip.ParseAddrPort(strings.TrimSpace(v))
	return ap, err == nil
}

// Headers a gateway sends for flow control and model rewrites, as the
// upstream picker reads them (gateway-api-inference-extension v1.5.0,
// pkg/epp/metadata).
const (
	// objectiveHeader names the request's InferenceObjective: its
	// priority band.
	objectiveHeader = "x-gateway-inference-objective"
	// fairnessHeader names the request's flow inside its band.
	fairnessHeader = "x-gateway-inference-fairness-id"
	// modelRewriteHeader names the model the request is sent on as, when
	// no InferenceModelRewrite rule matches its model.
	modelRewriteHeader = "x-gateway-model-name-rewrite"
)

// Names of the conformance test hooks (Options.ConformanceTestHooks), as the
// Gateway API Inference Extension conformance suite spells them
// (sigs.k8s.io/gateway-api-inference-extension/conformance/utils/headers).
const (
	// testSelectionHeader names the endpoints a request must go to: a
	// comma-separated list of "ip:port" or bare IPs (every endpoint at
	// that IP).
	testSelectionHeader = "test-epp-endpoint-selection"
	// testServedHeader, on the response, names the endpoint that served it.
	testServedHeader = "x-conformance-test-served-endpoint"
)

// testSelection applies the test-epp-endpoint-selection header, when the
// request has one: its endpoints replace the gateway's subset hint as the
// only candidates, as in the upstream lightweight picker the suite ships
// with (sigs.k8s.io/gateway-api-inference-extension v1.6.0, pkg/lwepp).
func (st *stream) testSelection(headers *corev3.HeaderMap) {
	value := headerValue(headers, testSelectionHeader)
	if strings.TrimSpace(value) == "" {
		return
	}
	var bad []string
	st.subset, bad = appendEndpoints(nil, nil, value)
	st.hasSubset = true
	if len(bad) > 0 {
		st.s.opts.Log.V(1).Info("ignoring "+testSelectionHeader+" entries that are not ip:port or ip", "entries", bad, "path", st.path)
	}
}

// servedForTest is the value of testServedHeader: the served-by endpoint as
// the gateway wrote it, or, as upstream answers, why there is none.
func servedForTest(md *corev3.Metadata) string {
	lb, ok := md.GetFilterMetadata()[protocol.LBNamespace]
	if !ok {
		return "fail: missing envoy lb metadata"
	}
	v, ok := lb.GetFields()[protocol.ServedKey]
	if !ok {
		return "fail: missing destination endpoint served metadata"
	}
	return v.GetStringValue()
}

// explain adds to a refusal for want of endpoints (or of room on them) its
// cause, as the client will read it in the answer's message: the pool does
// not exist, or has no Ready endpoint yet; the gateway's subset hint names
// no endpoint of the pool (with the addresses it names); every endpoint it
// may go to is saturated. Other errors are returned as they are.
func (st *stream) explain(err error) error {
	var why string
	if p := st.s.opts.Pool; p != nil {
		why = p.NoEndpointReason()
	}
	switch {
	case errors.Is(err, picker.ErrNoEndpoint) && why != "":
		return fmt.Errorf("%w: %s", err, why)
	case errors.Is(err, picker.ErrNoEndpoint) && st.hasSubset:
		return fmt.Errorf("%w: the gateway's subset hint (%s) names %s, none of which is an endpoint of the pool: "+
			"the gateway and the picker disagree on the pool's pods; check that the gateway routes to this pool's picker",
			err, protocol.SubsetKey, subsetList(st.subset))
	case errors.Is(err, picker.ErrNoEndpoint):
		return fmt.Errorf("%w: the pool has no endpoint that can take the request now", err)
	case errors.Is(err, picker.ErrSaturated) && st.hasSubset:
		return fmt.Errorf("%w: every endpoint the gateway's subset hint allows (%s) is over its saturation limit; retry later", err, subsetList(st.subset))
	case errors.Is(err, picker.ErrSaturated):
		return fmt.Errorf("%w: every endpoint of the pool is over its saturation limit; retry later, or add replicas to the pool", err)
	}
	return err
}

// subsetList writes a subset hint's addresses for a message: all of them,
// comma-separated, "(none)" for an empty hint, cut after maxShown.
func subsetList(addrs []netip.AddrPort) string {
	const maxShown = 8
	if len(addrs) == 0 {
		return "(none)"
	}
	var b strings.Builder
	for i, a := range addrs[:min(len(addrs), maxShown)] {
		if i > 0 {
			b.WriteString(", ")
		}
		if a.Port() == 0 {
			b.WriteString(a.Addr().String()) // an IP entry: any port
		} else {
			b.WriteString(a.String())
		}
	}
	if len(addrs) > maxShown {
		fmt.Fprintf(&b, " and %d more", len(addrs)-maxShown)
	}
	return b.String()
}
