package extproc

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc/internal/wire"
	"github.com/tallyepp/tally/picker/logging"
	"github.com/tallyepp/tally/picker/protocol"
	"github.com/tallyepp/tally/picker/request"
)

const (
	fullDuplex = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	buffered   = filterv3.ProcessingMode_BUFFERED
)

// stream is the state of one ext_proc stream, that is of one HTTP request.
// Only the goroutine serving the stream touches it.
type stream struct {
	s   *Server
	srv extprocv3.ExternalProcessor_ProcessServer
	// clientPrefiller: the request came with its own x-prefiller-host-port.
	clientPrefiller bool

	// Body modes the gateway announced in protocol_config; when it
	// announced none, FULL_DUPLEX_STREAMED both ways until the gateway's
	// silence says otherwise (see awaitBody).
	requestMode, responseMode filterv3.ProcessingMode_BodySendMode
	announced                 bool
	// wait is the pending inference of an unannounced body mode.
	wait *bodyWait
	// inferred: no mode was announced, and the gateway waited for the
	// headers answer: BUFFERED, as far as the picker can tell.
	inferred bool

	headersSeen  bool
	path, method string
	// apiPath is the path the API is told from: :path, or where a gateway
	// sends no pseudo-headers, x-original-path or x-forwarded-path (as the
	// upstream picker reads them); "" when none says.
	apiPath       string
	contentLength int64 // from the content-length header; 0 when absent
	subset        []netip.AddrPort
	hasSubset     bool
	// The request's InferenceObjective and flow (flow control's priority
	// band and fairness), from the gateway's headers.
	objective, fairnessID string
	// modelHeader is the gateway's x-gateway-model-name-rewrite: the
	// model to send on when no rewrite rule matches ("" for none).
	modelHeader string

	// body holds the request body while it arrives: nil before its first
	// chunk, and again once the body has been passed on.
	body *[]byte
	// charged is what body holds against the server's buffer budget.
	charged int64
	// prompt is the parsed prompt, until the request is routed (see Picker).
	prompt *[]byte
	// Where the parsed body's "model" value is (request.Parsed), and whether
	// a model rewrite replaced it in body.
	modelStart, modelEnd int
	rewritten            bool
	// restore, once the response headers came after a rewrite: each
	// "model" field naming the target, and the same naming the client's
	// model, with and without a space after the colon (modelRestorer).
	restore [][2][]byte
	// decided: the request phase is over (routed, or left to the gateway).
	decided bool
	// loadOnly: routed on its headers while its body passes by unread.
	loadOnly bool
	res      *picker.Reservation // nil until routed, and again once released or detached
	// resp follows the response, and owns what the stream reads of it.
	resp response
	// up follows the request for the upstream picker's metrics.
	up requestMetrics
}

func (s *Server) newStream(srv extprocv3.ExternalProcessor_ProcessServer) *stream {
	return &stream{s: s, srv: srv, requestMode: fullDuplex, responseMode: fullDuplex, up: requestMetrics{m: s.upstream}}
}

func (st *stream) handle(req *extprocv3.ProcessingRequest) error {
	if pc := req.GetProtocolConfig(); pc != nil {
		st.requestMode, st.responseMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
		st.announced = true
	}
	if st.wait != nil {
		if st.settleWait() {
			// The headers were answered for want of a body: the gateway
			// waits for each answer.
			st.requestMode, st.responseMode, st.inferred = buffered, buffered, true
		} else if req.GetRequestBody() != nil {
			st.s.unannouncedStreams.Store(true)
		}
	}
	if v := st.outOfOrder(req); v != "" {
		return st.violation(v)
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return st.requestHeaders(req.GetMetadataContext(), r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.requestBody(r.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return st.requestTrailers()
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return st.responseHeaders(req.GetMetadataContext(), r.ResponseHeaders)
	case *extprocv3.ProcessingRequest_ResponseBody:
		return st.responseBody(r.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return st.responseTrailers()
	}
	return nil // flow-control-only messages need no answer
}

// outOfOrder names the protocol violation req would be, or returns "".
// Envoy sends a stream's messages in the order of the HTTP exchange, so these
// come only from a broken ext_proc client, never from an HTTP client: there
// is no HTTP request to answer, and guessing one could book a reservation for
// a request that does not exist.
func (st *stream) outOfOrder(req *extprocv3.ProcessingRequest) string {
	switch req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		if st.headersSeen {
			return "a second request headers message on one stream"
		}
	case *extprocv3.ProcessingRequest_RequestBody, *extprocv3.ProcessingRequest_RequestTrailers:
		if !st.headersSeen {
			return "request body or trailers before the request headers"
		}
	case *extprocv3.ProcessingRequest_ResponseHeaders, *extprocv3.ProcessingRequest_ResponseBody,
		*extprocv3.ProcessingRequest_ResponseTrailers:
		if !st.decided {
			return "response headers, body or trailers before the request was routed"
		}
	}
	return ""
}

// viaShim reports whether the stream comes through a shim such as NGINX
// Gateway Fabric's rather than Envoy: it sent no :path (Envoy always sends
// its pseudo-headers). Such a gateway sends its body unasked and takes only
// the destination header from the answer, proxying to it as one host:port.
func (st *stream) viaShim() bool { return st.path == "" }

func (st *stream) requestHeaders(md *corev3.Metadata, h *extprocv3.HttpHeaders) error {
	st.headersSeen = true
	st.up.requestHeaders()
	headers := h.GetHeaders()
	st.path, st.method = headerValue(headers, ":path"), headerValue(headers, ":method")
	if st.apiPath = st.path; st.apiPath == "" {
		st.apiPath = cmp.Or(headerValue(headers, "x-original-path"), headerValue(headers, "x-forwarded-path"))
	}
	if cl := headerValue(headers, "content-length"); cl != "" {
		n, err := strconv.ParseInt(cl, 10, 64)
		switch {
		case err != nil || n < 0:
			// The upstream picker reads no content-length, so neither is a
			// bad one refused here: the body is counted as it comes.
			st.s.opts.Log.V(1).Info("ignoring a content-length header that is not a length", "contentLength", cl, "path", st.path)
		default:
			st.contentLength = n
		}
	}
	// Only the picker names a prefill pod: a client's own copy is removed
	// from an unsplit request's answer (a split one's is overwritten).
	st.clientPrefiller = headerValue(headers, protocol.PrefillerHeader) != ""
	st.objective, st.fairnessID = headerValue(headers, objectiveHeader), headerValue(headers, fairnessHeader)
	st.modelHeader = headerValue(headers, modelRewriteHeader)
	var bad []string
	st.subset, st.hasSubset, bad = subsetHint(md)
	if len(bad) > 0 {
		st.s.opts.Log.V(1).Info("ignoring subset hint entries that are not ip:port or ip", "entries", bad, "path", st.path)
	}
	if st.s.opts.ConformanceTestHooks {
		st.testSelection(headers)
	}
	// A gateway that asks through a shim of its own (NGINX Gateway Fabric)
	// sends the client's headers only: no :path or :method. The request is
	// then routed on its body's shape (parse), or, without a body, on load.
	if h.GetEndOfStream() {
		if kind := request.KindOf(st.apiPath); kind != request.KindOther && (st.method == "POST" || st.method == "") {
			// The model server would refuse it too, but only after it
			// had been booked against an endpoint.
			return st.reject(fmt.Errorf("%w: a %s request needs a JSON body", errEmptyBody, kind))
		}
		return st.route(picker.Request{}, false) // no body follows: routed on load alone
	}
	if limit := st.s.opts.MaxRequestBytes; limit > 0 && st.contentLength > limit {
		// Refused before a byte is buffered or reserved.
		return st.reject(tooLarge(limit))
	}
	switch st.requestMode {
	case fullDuplex:
		// Only Envoy has a BUFFERED mode: a shim's body comes unasked.
		if !st.announced && !st.s.unannouncedStreams.Load() && !st.viaShim() {
			st.awaitBody()
		}
		return nil // answered once the body is complete
	case buffered:
		// Envoy holds the body back until its headers are answered, and
		// applies the body answer's header mutation: the destination goes
		// there.
		return st.send(headersUnrouted)
	default:
		return st.routeOnLoad()
	}
}

var headersUnrouted = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
	RequestHeaders: &extprocv3.HeadersResponse{Response: unrouted()},
}}

// unannouncedBodyWait is how long a stream whose gateway announced no body
// mode waits for the first body message before it takes the gateway for one
// that waits for the headers answer.
//
// Envoy announces its body modes in protocol_config from version 1.35 on;
// an older Envoy announces nothing, and the picker must tell from the
// messages. At the request headers, the modes cannot be told apart; what
// the gateway does next can. In FULL_DUPLEX_STREAMED the body follows the
// headers unasked, and the headers answer must wait for it (it carries the
// destination, chosen on the body). In BUFFERED (and STREAMED) the gateway
// sends nothing until the headers are answered. So the picker waits for
// the body as in FULL_DUPLEX_STREAMED, and if none has come after
// unannouncedBodyWait it answers the headers unrouted, as in BUFFERED, and
// reads the next message as BUFFERED's: the whole body with end_of_stream,
// answered with a body answer (a CommonResponse) that carries the
// destination, and the response answered in BUFFERED's shape too. A first
// body message without end_of_stream is STREAMED's, BUFFERED_PARTIAL's or
// BUFFERED's with trailers: the headers have gone on without a destination
// and a body answer's header mutation is applied in BUFFERED only, so the
// request is refused with a message that says to announce the mode.
//
// The wait is shorter than Envoy's default message_timeout (200 ms), past
// which a BUFFERED Envoy fails the request. Its cost: an unannounced
// BUFFERED gateway's request waits this long at its headers. Its risk: an
// unannounced FULL_DUPLEX_STREAMED gateway whose body comes later than this
// (a slow client, or a picker short of CPU) would be taken for a BUFFERED
// one. So the first body that comes unasked settles the question for the
// server: its gateway streams, and no later unannounced stream is timed
// (Server.unannouncedStreams), nor is one still waiting: its timer finds
// the question settled and answers nothing. (A test's cold burst of 128
// unannounced streams on a loaded machine had one request refused so.)
// A picker serving both an unannounced FULL_DUPLEX_STREAMED gateway and
// an unannounced BUFFERED one serves the BUFFERED one's requests only
// until the first has shown itself; Envoy 1.35 and later announce their
// modes, and none of this applies; nor does it to a stream without
// pseudo-headers, which no Envoy sends.
const unannouncedBodyWait = 100 * time.Millisecond

// bodyWait is the inference of an unannounced body mode: a timer that
// answers the headers unrouted unless a message comes first. The timer's
// goroutine sends at most once, while the stream's goroutine waits in
// Recv; settleWait makes every later send the stream's goroutine's.
type bodyWait struct {
	state    atomic.Int32 // waitPending, then waitSettled or waitAnswering
	timer    *time.Timer
	answered chan struct{} // closed once the timer's answer is sent
}

const (
	waitPending = iota
	waitSettled
	waitAnswering
)

func (st *stream) awaitBody() {
	w := &bodyWait{answered: make(chan struct{})}
	srv, settled := st.srv, &st.s.unannouncedStreams
	w.timer = time.AfterFunc(unannouncedBodyWait, func() {
		if settled.Load() {
			// Another stream's body has come unasked since this one began
			// waiting: the gateway streams, and this body comes too.
			return
		}
		if !w.state.CompareAndSwap(waitPending, waitAnswering) {
			return
		}
		_ = srv.SendMsg(headersUnrouted) // a failure ends the stream's Recv too
		close(w.answered)
	})
	st.wait = w
}

// settleWait ends the wait: it reports whether the timer answered the
// headers, and returns once that answer is sent.
func (st *stream) settleWait() bool {
	w := st.wait
	st.wait = nil
	if w.state.CompareAndSwap(waitPending, waitSettled) {
		w.timer.Stop()
		return false
	}
	<-w.answered
	return true
}

// routeOnLoad routes, on its headers, a request whose body the picker will
// not see whole: in STREAMED, BUFFERED_PARTIAL and NONE request body modes.
// Envoy applies a body answer's header mutation only in BUFFERED mode, so
// the headers answer is the last one that can carry the destination. Routed
// on load alone, with its prompt size estimated from content-length, the
// traffic keeps flowing with exact load accounting instead of every request
// failing over a mode setting; the metric and the warning say what is lost.
func (st *stream) routeOnLoad() error {
	if st.s.loadOnlyWarned.CompareAndSwap(false, true) {
		logging.Warn(st.s.opts.Log, "the gateway sends request bodies in a mode the picker cannot read them in: "+
			"requests are routed on load alone, without prefix affinity, their prompt size estimated from content-length; "+
			"prefix-aware routing needs the FULL_DUPLEX_STREAMED (or BUFFERED) request body mode in the gateway's ext_proc processing mode",
			"requestBodyMode", st.requestMode.String(), "metric", "tally_load_only_routes_total")
	}
	st.loadOnly = true
	if err := st.route(picker.Request{PromptChars: int(st.contentLength)}, false); err != nil {
		return err
	}
	st.s.metrics.loadOnlyRoutes.WithLabelValues("request_body_mode").Inc()
	return nil
}

func (st *stream) requestBody(b *extprocv3.HttpBody) error {
	switch {
	case st.loadOnly:
		// Routed on its headers: each STREAMED chunk, or the one
		// BUFFERED_PARTIAL message, is answered and passes on unchanged.
		return st.send(answerRequestBody)
	case st.decided:
		return nil // nothing is expected after the body's end; ignore stragglers
	}
	if st.inferred && !b.GetEndOfStream() {
		// STREAMED or BUFFERED_PARTIAL (or BUFFERED with trailers): the
		// headers have gone on, so no answer left can carry the
		// destination. Refused, with what would serve it.
		return st.reject(errUnannouncedStreamed)
	}
	if err := st.buffer(b.GetBody()); err != nil {
		return st.reject(err)
	}
	if st.requestMode == fullDuplex && !b.GetEndOfStream() {
		return nil
	}
	// FULL_DUPLEX_STREAMED has reached its last chunk; BUFFERED sends one
	// body message, whether or not trailers follow.
	return st.routeBody(b.GetEndOfStream())
}

// buffer appends chunk to the body, charging it to the server's budget first.
func (st *stream) buffer(chunk []byte) error {
	if st.body == nil {
		st.body = st.s.getBuffer()
	}
	n := int64(len(chunk))
	if limit := st.s.opts.MaxRequestBytes; limit > 0 && int64(len(*st.body))+n > limit {
		return tooLarge(limit)
	}
	if !st.s.charge(n) {
		st.s.metrics.budgetRejections.Inc()
		return fmt.Errorf("%w (budget %d bytes); retry later", errBufferBudget, st.s.opts.MaxBufferedRequestBytes)
	}
	st.charged += n
	// The buffer grows with the bytes that arrive, never with what
	// content-length promises, so a stream that declares a large body and
	// sends little holds little. Past maxPooledBufferBytes it grows into
	// pooled buffers, doubling, rather than by append's fresh ones.
	if need := len(*st.body) + len(chunk); need > cap(*st.body) && need > maxPooledBufferBytes {
		grown := st.s.getLarge(max(need, 2*cap(*st.body)))
		*grown = append(*grown, *st.body...)
		st.s.putBuffer(st.body)
		st.body = grown
	}
	*st.body = append(*st.body, chunk...)
	return nil
}

func tooLarge(limit int64) error {
	return fmt.Errorf("%w: the body exceeds the picker's maxRequestBytes of %d bytes", errBodyTooLarge, limit)
}

func (st *stream) requestTrailers() error {
	if !st.decided {
		if st.requestMode == fullDuplex {
			// The body ended with trailers instead of end_of_stream.
			if err := st.routeBody(false); err != nil {
				return err
			}
		} else {
			// BUFFERED, and no body message came before the trailers: the
			// body is empty, and no answer left can carry a destination.
			if _, err := st.parse(); err != nil {
				return st.reject(err)
			}
			st.decided = true
			st.s.opts.Log.V(1).Info("request not routed: its BUFFERED body was empty and ended with trailers", "path", st.path)
		}
	}
	return st.send(answerRequestTrailers)
}

func (st *stream) responseHeaders(md *corev3.Metadata, h *extprocv3.HttpHeaders) error {
	st.resp.headers(h.GetHeaders())
	if addr, ok := servedBy(md); ok && st.res != nil {
		st.s.picker.ServedBy(st.res, addr)
	}
	if code, err := strconv.Atoi(headerValue(h.GetHeaders(), ":status")); err == nil && code >= 500 {
		st.s.metrics.serverErrors.Inc()
		st.resp.serverError = true
	}
	st.up.responseHeaders(h.GetHeaders())
	if h.GetEndOfStream() {
		st.responseEnd()
	}
	if st.rewritten && st.responseMode != filterv3.ProcessingMode_NONE && !h.GetEndOfStream() {
		st.restore = modelRestorer(st.up.target, st.up.model)
	}
	// The body's length changes when the client's model name is put back
	// in place of a target of another length.
	lengthChanges := len(st.restore) > 0 && len(st.up.target) != len(st.up.model)
	if !st.s.opts.ConformanceTestHooks && !lengthChanges {
		return st.send(answerResponseHeaders)
	}
	mutation := &extprocv3.HeaderMutation{}
	if st.s.opts.ConformanceTestHooks {
		mutation.SetHeaders = []*corev3.HeaderValueOption{wire.HeaderOption(testServedHeader, servedForTest(md))}
	}
	if lengthChanges {
		mutation.RemoveHeaders = []string{"content-length"}
	}
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{HeaderMutation: mutation}},
	}})
}

// modelRestorer pairs each "model" field naming target, as a JSON encoder
// writes it (compact, or with a space after the colon), with the same
// field naming model: the response says the model the client asked for,
// as with the upstream picker.
func modelRestorer(target, model string) [][2][]byte {
	t, m := jsonString(target), jsonString(model)
	return [][2][]byte{
		{[]byte(`"model":` + t), []byte(`"model":` + m)},
		{[]byte(`"model": ` + t), []byte(`"model": ` + m)},
	}
}

// jsonString quotes s as a JSON string, without escaping HTML characters.
func jsonString(s string) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s) // cannot fail: a string
	return strings.TrimSuffix(b.String(), "\n")
}

// restoreModel puts the client's model name back in a response chunk:
// each field the chunk holds whole (a field split across two chunks stays
// as the model server wrote it). changed says whether it did.
func (st *stream) restoreModel(chunk []byte) (_ []byte, changed bool) {
	for _, p := range st.restore {
		if bytes.Contains(chunk, p[0]) {
			chunk, changed = bytes.ReplaceAll(chunk, p[0], p[1]), true
		}
	}
	return chunk, changed
}

func (st *stream) responseBody(b *extprocv3.HttpBody) error {
	if !st.resp.firstByte && !st.resp.serverError && len(b.GetBody()) > 0 && st.res != nil {
		st.s.picker.FirstByte(st.res)
	}
	st.resp.body(b.GetBody(), st.res != nil, &st.s.tails)
	st.up.responseBody(len(b.GetBody()))
	if b.GetEndOfStream() {
		st.responseEnd()
	}
	chunk, changed := st.restoreModel(b.GetBody())
	if st.responseMode == fullDuplex {
		return st.send(&wire.BodyEcho{Response: true, Chunk: chunk, EndOfStream: b.GetEndOfStream()})
	}
	if changed {
		// BUFFERED, STREAMED: the answer replaces the chunk, or the whole
		// body; content-length went with the headers' answer.
		return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: chunk}},
			}},
		}})
	}
	return st.send(answerResponseBody)
}

func (st *stream) responseTrailers() error {
	st.resp.seen = true
	st.responseEnd()
	return st.send(answerResponseTrailers)
}

// responseEnd runs when the response has been seen to its end.
func (st *stream) responseEnd() {
	st.resp.ended = true
	st.up.responseEnd(&st.resp)
	st.release()
}

// routeBody routes the request on its buffered body, passes the body on in
// FULL_DUPLEX_STREAMED mode, then gives the body buffer and its budget back:
// nothing reads the body after that, and a long response must not keep its
// request's bytes charged.
func (st *stream) routeBody(bodyEnds bool) error {
	defer st.dropBody()
	req, err := st.parse()
	if err != nil {
		return st.reject(err)
	}
	st.rewriteModel(&req)
	if st.requestMode != fullDuplex {
		// BUFFERED: the headers were answered before the body came, and
		// Envoy passes on the body it holds.
		return st.route(req, true)
	}
	if err := st.route(req, false); err != nil {
		return err
	}
	if st.body == nil {
		return nil // trailers came with no body
	}
	return st.echoRequestBody(bodyEnds)
}

// route picks an endpoint for req and answers the message that carries the
// decision: the request headers (bodiless requests, the load-only modes, and
// FULL_DUPLEX_STREAMED mode where their answer was held back until the body
// was complete) or, in BUFFERED mode, the request body.
func (st *stream) route(req picker.Request, inBodyAnswer bool) error {
	req.Subset, req.HasSubset = st.subset, st.hasSubset
	req.DestinationOnly = st.viaShim()
	req.Objective, req.FairnessID, req.Bytes = st.objective, st.fairnessID, int64(max(st.bodyLen(), 0))
	if o := st.s.opts.Objectives; o != nil && st.objective != "" {
		req.Priority, _ = o.Priority(st.objective) // unknown: 0
	}
	if st.up.model == "" {
		st.up.model = req.Model // else the model before a rewrite
	}
	st.up.priority = req.Priority
	ctx := st.srv.Context()
	res, err := st.s.picker.Admit(ctx, req)
	if err != nil {
		if ctx.Err() != nil {
			// The gateway gave up on the request while it waited: there
			// is no one to answer, and nothing was left behind.
			return errAnswered
		}
		return st.reject(st.explain(err))
	}
	st.res, st.decided = res, true
	st.s.metrics.requests.WithLabelValues("200").Inc()
	st.up.routed(st.bodyLen())

	eps := res.Endpoints()
	if st.viaShim() {
		// A fallback list would fail every request there.
		eps = eps[:1]
	}
	answer := &wire.RouteAnswer{InBody: inBodyAnswer, Destination: destinationValue(eps)}
	if st.requestMode == fullDuplex && st.body != nil {
		// Envoy drops content-length from a request whose body it streams
		// in this mode, since a processor could change the body. This one
		// passes on unchanged, so its length is known: setting it again
		// spares the model server a chunked request.
		answer.ContentLength = strconv.Itoa(len(*st.body))
	}
	pre, split := res.Prefiller()
	rewrittenBody := inBodyAnswer && st.rewritten // only BUFFERED answers the body
	if !split && !st.clientPrefiller && !rewrittenBody {
		return st.send(answer)
	}
	resp := answer.Message()
	common := resp.GetRequestHeaders().GetResponse()
	if inBodyAnswer {
		common = resp.GetRequestBody().GetResponse()
	}
	mutation := common.HeaderMutation
	if rewrittenBody {
		// BUFFERED: Envoy passes on the body it holds unless the answer
		// replaces it, and its content-length with it.
		common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: *st.body}}
		mutation.SetHeaders = append(mutation.SetHeaders, wire.HeaderOption("content-length", strconv.Itoa(len(*st.body))))
	}
	switch {
	case split:
		// The destination's sidecar sends the prefill leg there.
		mutation.SetHeaders = append(mutation.SetHeaders, wire.HeaderOption(protocol.PrefillerHeader, pre.String()))
	case st.clientPrefiller:
		// Not split, and the client named a prefill pod: the decode pod's
		// sidecar must not send the prefill anywhere.
		mutation.RemoveHeaders = append(mutation.RemoveHeaders, protocol.PrefillerHeader)
	}
	return st.send(resp)
}

// parse reads the buffered body (nil when none came) into a picker request.
func (st *stream) parse() (picker.Request, error) {
	var body []byte
	if st.body != nil {
		body = *st.body
		st.s.metrics.requestBytes.Observe(float64(len(body)))
	}
	if st.prompt == nil {
		st.prompt = st.s.getBuffer()
		if n := len(body) + len(body)/8; n > maxPooledBufferBytes && cap(*st.prompt) < n {
			// A huge prompt: a pooled buffer of about its size (the prompt
			// is the body's text, plus a few bytes per message).
			st.s.putBuffer(st.prompt)
			st.prompt = st.s.getLarge(n)
		}
	}
	kind := request.KindOf(st.apiPath)
	if st.apiPath == "" {
		var err error
		if kind, err = request.KindOfBody(body); err != nil {
			return picker.Request{}, fmt.Errorf("parsing the request body: %w", err)
		}
	}
	parsed, err := request.ParseKind(kind, body, *st.prompt)
	if err != nil && st.apiPath == "" && kind == request.KindResponses {
		// An "input" with no path to tell: an embeddings request, whose
		// input (token ids, say) the Responses API does not take.
		parsed, err = request.ParseKind(request.KindEmbeddings, body, parsed.Prompt)
	}
	// Prompt is always appended to the buffer given (never a view of the
	// body): keeping it recycles the buffer at whatever size it grew to.
	*st.prompt = parsed.Prompt
	if err != nil {
		return picker.Request{}, fmt.Errorf("parsing the request body: %w", err)
	}
	st.modelStart, st.modelEnd = parsed.ModelStart, parsed.ModelEnd
	return picker.Request{Model: parsed.Model, CacheSalt: parsed.CacheSalt, Prompt: parsed.Prompt,
		Stream: parsed.Stream, MaxTokens: parsed.MaxTokens}, nil
}

// rewriteModel applies the pool's model rewrites to a parsed request: the
// model the picker scores and the body sent on name the target, and the
// body is otherwise passed on byte for byte. Where no rule matches, the
// gateway's x-gateway-model-name-rewrite header names the target, as with
// the upstream picker.
//
// A gateway that sends no pseudo-headers (NGINX Gateway Fabric's shim)
// takes only the destination header from the answer, and sends the body
// on as the client wrote it: its request is scored for the model the
// model server will receive, and the rewrite is counted as unapplied.
func (st *stream) rewriteModel(req *picker.Request) {
	if st.body == nil || st.modelEnd <= st.modelStart {
		return // no "model" in the body to rewrite (a path whose body is not JSON)
	}
	target, rule, ok := req.Model, "", false
	if rw := st.s.opts.Rewrites; rw != nil {
		target, rule, ok = rw.Rewrite(req.Model, rand.IntN)
	}
	switch {
	case ok:
	case st.modelHeader != "":
		target = st.modelHeader
	default:
		return
	}
	if st.viaShim() && target != req.Model {
		st.s.metrics.unappliedRewrites.Inc()
		if st.s.unappliedRewriteWarned.CompareAndSwap(false, true) {
			logging.Warn(st.s.opts.Log, "a model rewrite matched a request from a gateway that sends no pseudo-headers "+
				"(NGINX Gateway Fabric's shim), which takes only the destination from the picker: "+
				"the model server receives the model the client named, and the picker routes it as that model",
				"model", req.Model, "target", target, "metric", "tally_model_rewrites_unapplied_total")
		}
		return
	}
	if ok {
		st.s.upstream.rewrite(rule, req.Model, target)
	}
	st.up.model, st.up.target = req.Model, target
	if target == req.Model {
		return
	}
	quoted, _ := json.Marshal(target) // cannot fail: a string
	body := *st.body
	nb := st.s.getBuffer()
	if n := len(body) - (st.modelEnd - st.modelStart) + len(quoted); n > maxPooledBufferBytes && cap(*nb) < n {
		st.s.putBuffer(nb)
		nb = st.s.getLarge(n)
	}
	*nb = append(append(append((*nb)[:0], body[:st.modelStart]...), quoted...), body[st.modelEnd:]...)
	st.s.putBuffer(st.body)
	st.body = nb
	st.rewritten = true
	req.Model = target
}

// echoRequestBody sends the buffered body back unchanged, in chunks the
// gateway accepts; a zero-length body is one empty chunk. The chunks alias
// the pooled buffer: gRPC has encoded each message when Send returns (the
// server installs no stats handler that could read it later), and the
// buffer goes back to the pool only after the last Send.
func (st *stream) echoRequestBody(endOfStream bool) error {
	body := *st.body
	for {
		n := min(len(body), maxChunkBytes)
		last := n == len(body)
		err := st.send(&wire.BodyEcho{Chunk: body[:n], EndOfStream: last && endOfStream})
		if err != nil || last {
			return err
		}
		body = body[n:]
	}
}

// reject answers the request with the HTTP error errorAnswers gives for err
// and ends the stream.
func (st *stream) reject(err error) error {
	// Nothing reads the body after a refusal: its bytes go back to the
	// budget now, not once the answer is sent and the stream unwinds. Held
	// until then, a flood of equal slow streams, which fills the budget
	// with all of them part-sent, was refused whole (0 held of 200 on a
	// loaded machine): each stream's next chunk found the budget full of
	// the others', refused ones included.
	st.dropBody()
	httpStatus, body := answerFor(err)
	st.decided = true
	st.s.metrics.requests.WithLabelValues(strconv.Itoa(httpStatus)).Inc()
	st.up.rejected(httpStatus)
	if httpStatus >= 500 && httpStatus != 503 {
		st.s.opts.Log.Error(err, "request failed", "path", st.path, "status", httpStatus)
	} else {
		st.s.opts.Log.V(1).Info("request refused", "path", st.path, "status", httpStatus, "reason", err.Error())
	}
	if err := st.send(immediateResponse(httpStatus, body)); err != nil {
		return err
	}
	return errAnswered
}

// recovered answers a panic in this stream: a 500 if the gateway still takes
// one, and an error for this stream only.
func (st *stream) recovered(r any) error {
	st.s.metrics.streamPanics.Inc()
	st.s.opts.Log.Error(fmt.Errorf("panic: %v", r), "ext_proc stream failed", "path", st.path, "stack", string(debug.Stack()))
	if !st.decided {
		st.s.metrics.requests.WithLabelValues("500").Inc()
		st.up.rejected(500)
	}
	httpStatus, body := answerFor(errPanic)
	_ = st.srv.Send(immediateResponse(httpStatus, body)) // best effort: the stream may be gone
	return status.Error(codes.Internal, errPanic.Error())
}

// violation ends the stream with InvalidArgument, for a message the gateway
// should never have sent (see outOfOrder). The stream's deferred close
// releases whatever it had reserved.
//
// Before it ends the stream, it answers 400 with the reason, unless the
// request was already decided (answered or routed): a gateway that would
// pass an answer on gets one that says what went wrong.
func (st *stream) violation(what string) error {
	st.s.metrics.protocolErrors.Inc()
	err := status.Error(codes.InvalidArgument, "ext_proc protocol violation: "+what)
	st.s.opts.Log.Error(err, "ending an ext_proc stream", "path", st.path)
	if !st.decided {
		st.decided = true
		st.s.metrics.requests.WithLabelValues("400").Inc()
		st.up.rejected(400)
		httpStatus, body := answerFor(fmt.Errorf("%w: %s", errProtocol, what))
		_ = st.send(immediateResponse(httpStatus, body)) // best effort: the stream ends either way
	}
	return err
}

// halfClosed runs when the gateway closes its side of the stream. Before
// any response phase, that is a gateway that asked only where the request
// goes (NGINX Gateway Fabric's shim; an Envoy that skips the response
// phases): the request runs on the model server after the stream ends, so
// its reservation is detached, not released (picker/detach.go).
func (st *stream) halfClosed() {
	if st.res != nil && !st.resp.seen {
		st.s.picker.End(st.res, picker.Outcome{Detached: true})
		st.res = nil
	}
}

func (st *stream) release() {
	if st.res == nil {
		return
	}
	res := st.res
	st.res = nil // ended once: close runs release again
	var o picker.Outcome
	if u, ok := st.resp.usage(); ok && u.hasCached {
		// What the engine really had cached corrects the prefix index.
		o.PromptTokens, o.CachedTokens = u.promptTokens, u.cachedTokens
	}
	if st.resp.seen {
		o.CompletionTokens = st.resp.outputTokens()
	}
	o.ServerError = st.resp.serverError
	st.s.picker.End(res, o)
}

// dropBody gives the body buffer back to the pool and its bytes back to the
// budget; it is harmless when there is no body.
func (st *stream) dropBody() {
	st.s.uncharge(st.charged)
	st.charged = 0
	st.s.putBuffer(st.body)
	st.body = nil
	st.s.putBuffer(st.prompt)
	st.prompt = nil
}

// close runs when the stream ends, however it ends.
func (st *stream) close() {
	if st.wait != nil {
		st.settleWait() // no answer is sent once the stream is done
	}
	st.release()
	st.dropBody()
	st.up.closed()
	st.resp.close(&st.s.tails)
}

// send sends one answer: a *extprocv3.ProcessingResponse, or one the codec
// writes itself (wire.RouteAnswer, wire.BodyEcho, wire.PreEncoded), proto
// messages too.
func (st *stream) send(resp protoreflect.ProtoMessage) error {
	if err := st.srv.SendMsg(resp); err != nil {
		return fmt.Errorf("sending to the gateway: %w", err)
	}
	return nil
}
