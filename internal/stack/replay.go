package stack

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tallyepp/tally/internal/modelsim/server"
)

// RequestIDHeader carries each replayed request's id. The simulators of a
// Stack record it, so a replay through the gateway can tell which pod served
// each request without trusting the gateway to say.
const RequestIDHeader = "X-Tally-Request-Id"

// DrawKeyHeader carries each replayed request's Request.DrawKey (its id when
// it has none): the simulators of a Stack draw from it which responses they
// hold back (Options.LateFirstByteFraction).
const DrawKeyHeader = "X-Tally-Draw-Key"

const defaultProgressInterval = 3 * time.Second

// Result is what one replayed request measured, client side.
type Result struct {
	// ID is the value sent in RequestIDHeader.
	ID string
	// Status is the HTTP status, 0 when no response arrived.
	Status int
	// TTFT is the time from sending the request to reading the first SSE
	// data line (the whole response for a non-streaming request).
	TTFT time.Duration
	// Latency is the time to the end of the response.
	Latency time.Duration
	// Token counts from the response's usage.
	PromptTokens     int
	CachedTokens     int
	CompletionTokens int
	// RetryAfter is the response's retry-after header ("" when none).
	RetryAfter string
	// HeldBack is how long after its first token a simulator held back a
	// streamed response (server.HeldBackHeader); 0 when it did not.
	HeldBack time.Duration
	// Err is set for a transport error, a status other than 200, or a
	// response that is cut short or malformed.
	Err error
}

// Replayer sends a workload's requests at their offsets and measures each.
type Replayer struct {
	// Client sends the requests; nil means NewHTTPClient().
	Client *http.Client
	// BaseURL returns where request i goes ("http://127.0.0.1:8080"): the
	// gateway for the picker, a pod in rotation for round robin.
	BaseURL func(i int) string
	// IDPrefix starts every request id ("tally-burst" gives "tally-burst-0", ...).
	IDPrefix string
	// Progress, when set, is called every ProgressInterval (default 3 s)
	// while the replay runs, and once at the end.
	Progress         func(done, total int)
	ProgressInterval time.Duration
}

// NewHTTPClient returns a client for loopback replays: no proxy (an
// environment proxy must not capture 127.0.0.x) and enough idle connections
// that a burst does not open and close sockets per request.
func NewHTTPClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:               nil,
		MaxIdleConns:        1024,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     30 * time.Second,
	}}
}

// Run sends every request at its offset from now and waits for all of them;
// results[i] belongs to reqs[i]. Cancelling ctx aborts the requests still
// running (they report ctx's error).
func (r *Replayer) Run(ctx context.Context, reqs []Request) []Result {
	client := r.Client
	if client == nil {
		client = NewHTTPClient()
	}
	results := make([]Result, len(reqs))
	var done atomic.Int64
	stopProgress := r.startProgress(&done, len(reqs))
	defer stopProgress()

	start := time.Now()
	var wg sync.WaitGroup
	timer := time.NewTimer(0)
	defer timer.Stop()
	for i, req := range reqs {
		if wait := time.Until(start.Add(req.At)); wait > 0 {
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-ctx.Done():
			}
		}
		id := r.IDPrefix + "-" + strconv.Itoa(i)
		wg.Go(func() {
			results[i] = send(ctx, client, r.BaseURL(i), id, req)
			done.Add(1)
		})
	}
	wg.Wait()
	return results
}

func (r *Replayer) startProgress(done *atomic.Int64, total int) (stop func()) {
	if r.Progress == nil {
		return func() {}
	}
	interval := r.ProgressInterval
	if interval <= 0 {
		interval = defaultProgressInterval
	}
	quit := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				r.Progress(int(done.Load()), total)
			case <-quit:
				return
			}
		}
	}()
	return func() {
		close(quit)
		<-finished
		r.Progress(int(done.Load()), total)
	}
}

// Send sends one request to baseURL and measures it.
func Send(ctx context.Context, client *http.Client, baseURL, id string, req Request) Result {
	return send(ctx, client, baseURL, id, req)
}

func send(ctx context.Context, client *http.Client, baseURL, id string, req Request) Result {
	return sendBody(ctx, client, baseURL, id, req, bytes.NewReader(req.Body), int64(len(req.Body)))
}

// sendBody is send with the request's body read from body, of size bytes.
func sendBody(ctx context.Context, client *http.Client, baseURL, id string, req Request, body io.Reader, size int64) Result {
	res := Result{ID: id}
	httpReq, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+req.Path, body)
	if err != nil {
		res.Err = fmt.Errorf("building request %s: %w", id, err)
		return res
	}
	httpReq.ContentLength = size
	httpReq.Header.Set("Content-Type", "application/json")
	httpReq.Header.Set(RequestIDHeader, id)
	httpReq.Header.Set(DrawKeyHeader, req.DrawKeyOf(id))
	for k, v := range req.Headers {
		httpReq.Header.Set(k, v)
	}
	start := time.Now()
	resp, err := client.Do(httpReq)
	if err != nil {
		res.Err = fmt.Errorf("request %s: %w", id, err)
		return res
	}
	defer resp.Body.Close()
	res.Status = resp.StatusCode
	res.RetryAfter = resp.Header.Get("Retry-After")
	if ms, err := strconv.ParseFloat(resp.Header.Get(server.HeldBackHeader), 64); err == nil && ms > 0 {
		res.HeldBack = time.Duration(ms * float64(time.Millisecond))
	}
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		res.Err = fmt.Errorf("request %s: HTTP %d: %s", id, resp.StatusCode, bytes.TrimSpace(msg))
		res.Latency = time.Since(start)
		return res
	}
	if req.Stream {
		err = readStream(resp.Body, start, &res)
	} else {
		err = readJSON(resp.Body, &res)
		res.TTFT = time.Since(start)
	}
	if err == nil {
		// Read to the end, as a careful client does: the connection is
		// reused, and the gateway finishes the exchange (the picker sees
		// the response's end and reads its usage) before the client
		// leaves. A client that closes at "data: [DONE]" may cut the
		// picker's stream first.
		_, err = io.Copy(io.Discard, resp.Body)
	}
	res.Latency = time.Since(start)
	if err != nil {
		res.Err = fmt.Errorf("request %s: %w", id, err)
	}
	return res
}

// usage is the OpenAI usage object.
type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

type responseEnvelope struct {
	Usage *usage `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

func (res *Result) takeUsage(u *usage) {
	if u == nil {
		return
	}
	res.PromptTokens = u.PromptTokens
	res.CompletionTokens = u.CompletionTokens
	if u.PromptTokensDetails != nil {
		res.CachedTokens = u.PromptTokensDetails.CachedTokens
	}
}

// readStream reads SSE events until "data: [DONE]", recording the time of
// the first data line and the usage of whichever event carries it.
func readStream(body io.Reader, start time.Time, res *Result) error {
	br := bufio.NewReaderSize(body, 64<<10)
	for {
		line, err := br.ReadBytes('\n')
		if payload, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data:")); ok {
			if res.TTFT == 0 {
				res.TTFT = time.Since(start)
			}
			payload = bytes.TrimSpace(payload)
			if bytes.Equal(payload, []byte("[DONE]")) {
				return nil
			}
			var env responseEnvelope
			if jerr := json.Unmarshal(payload, &env); jerr != nil {
				return fmt.Errorf("SSE event is not JSON: %w", jerr)
			}
			if env.Error != nil {
				return fmt.Errorf("error event in stream: %s", env.Error.Message)
			}
			res.takeUsage(env.Usage)
		}
		if errors.Is(err, io.EOF) {
			return errors.New("stream ended before data: [DONE]")
		}
		if err != nil {
			return fmt.Errorf("reading stream: %w", err)
		}
	}
}

func readJSON(body io.Reader, res *Result) error {
	var env responseEnvelope
	if err := json.NewDecoder(body).Decode(&env); err != nil {
		return fmt.Errorf("decoding response: %w", err)
	}
	res.takeUsage(env.Usage)
	return nil
}
