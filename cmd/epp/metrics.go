package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/pprof"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"
	"k8s.io/client-go/rest"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/tallyepp/tally/picker"
)

// With --metrics-endpoint-auth the picker asks the API server who a scraper
// is and whether it may get the path:
// +kubebuilder:rbac:groups=authentication.k8s.io,resources=tokenreviews,verbs=create
// +kubebuilder:rbac:groups=authorization.k8s.io,resources=subjectaccessreviews,verbs=create

// newMetricsServer returns controller-runtime's metrics server for
// --metrics-bind-address: /metrics, /debug/ledger and, with --enable-pprof,
// /debug/pprof/. With --metrics-endpoint-auth every path needs a bearer
// token that the API server authenticates (TokenReview) and allows to get
// that path (SubjectAccessReview, nonResourceURLs), as the upstream picker
// does. The server is nil when the address is "0". detach takes the
// picker's registry back off /metrics.
func newMetricsServer(opts options, kube *rest.Config, reg *prometheus.Registry, pick *picker.Picker) (metricsserver.Server, func(), error) {
	if opts.metricsBindAddress == "0" {
		return nil, func() {}, nil
	}
	extra := map[string]http.Handler{"/debug/ledger": ledgerHandler(pick)}
	if opts.enablePprof {
		extra["/debug/pprof/"] = http.HandlerFunc(pprof.Index)
		extra["/debug/pprof/cmdline"] = http.HandlerFunc(pprof.Cmdline)
		extra["/debug/pprof/profile"] = http.HandlerFunc(pprof.Profile)
		extra["/debug/pprof/symbol"] = http.HandlerFunc(pprof.Symbol)
		extra["/debug/pprof/trace"] = http.HandlerFunc(pprof.Trace)
	}
	so := metricsserver.Options{
		BindAddress:   opts.metricsBindAddress,
		SecureServing: opts.metricsSecureServing,
		CertDir:       opts.metricsCertPath,
		ExtraHandlers: extra,
	}
	if opts.metricsEndpointAuth {
		so.FilterProvider = filters.WithAuthenticationAndAuthorization
	}
	httpClient, err := rest.HTTPClientFor(kube)
	if err != nil {
		return nil, nil, fmt.Errorf("creating the HTTP client for metrics authorization: %w", err)
	}
	srv, err := metricsserver.NewServer(so, kube, httpClient)
	if err != nil {
		return nil, nil, fmt.Errorf("flag --metrics-bind-address %s: %w", opts.metricsBindAddress, err)
	}
	bridge := &registryCollector{gatherer: reg}
	if err := ctrlmetrics.Registry.Register(bridge); err != nil {
		return nil, nil, fmt.Errorf("adding the picker's metrics to /metrics: %w", err)
	}
	return srv, bridge.detach, nil
}

func ledgerHandler(pick *picker.Picker) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet {
			http.Error(w, "GET only", http.StatusMethodNotAllowed)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(ledgerJSON(pick.Snapshot()))
	})
}

// registryCollector re-emits what a registry gathers as a collector of
// another: controller-runtime's metrics server serves only its global
// registry at /metrics, and the picker's metrics live on a registry of
// their own (so that tests and several pickers in one process never share
// them). It is unchecked (it describes nothing), so it cannot be
// unregistered; detach empties it instead.
type registryCollector struct {
	mu       sync.RWMutex
	gatherer prometheus.Gatherer
}

func (c *registryCollector) detach() {
	c.mu.Lock()
	c.gatherer = nil
	c.mu.Unlock()
}

func (*registryCollector) Describe(chan<- *prometheus.Desc) {}

func (c *registryCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.RLock()
	g := c.gatherer
	c.mu.RUnlock()
	if g == nil {
		return
	}
	families, err := g.Gather()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(prometheus.NewDesc("tally_metrics_gather_error", "gathering the picker's metrics failed", nil, nil), err)
		return
	}
	for _, f := range families {
		desc := prometheus.NewDesc(f.GetName(), f.GetHelp(), nil, nil)
		for _, m := range f.GetMetric() {
			ch <- gatheredMetric{desc: desc, metric: m}
		}
	}
}

// gatheredMetric is one gathered sample, written back as it was.
type gatheredMetric struct {
	desc   *prometheus.Desc
	metric *dto.Metric
}

func (m gatheredMetric) Desc() *prometheus.Desc { return m.desc }

func (m gatheredMetric) Write(out *dto.Metric) error {
	proto.Merge(out, m.metric)
	return nil
}

// ledgerRow is one endpoint in /debug/ledger.
type ledgerRow struct {
	Pod                    string  `json:"pod"`
	UID                    string  `json:"uid,omitempty"`
	Endpoint               string  `json:"endpoint"`
	InFlight               int     `json:"inFlight"`
	PrefillTokens          int     `json:"prefillTokens"`
	Decoding               int     `json:"decoding"`
	PrefillTokensPerSecond float64 `json:"prefillTokensPerSecond"`
	// Utilization is the share of recent time the model had prefill
	// queued here.
	Utilization float64 `json:"utilization"`
	// The engine's side (picker/engine.go): its last scrape (absent before
	// the first), the load beyond the ledger, the prefix index's size and
	// the cached tokens delivered against those predicted.
	Engine *ledgerEngine `json:"engine,omitempty"`
	// Unhealthy: enough scrapes in a row failed that it is not a candidate.
	Unhealthy             bool  `json:"unhealthy"`
	PrefixCapacityBlocks  int   `json:"prefixCapacityBlocks"`
	DeliveredCachedTokens int64 `json:"deliveredCachedTokens"`
	PredictedCachedTokens int64 `json:"predictedCachedTokens"`
	// CacheTrust is the share of predicted cached tokens the cost counts.
	CacheTrust float64 `json:"cacheTrust"`
	// Adapters counts the requests in flight by LoRA adapter.
	Adapters map[string]int `json:"adapters,omitempty"`
}

// ledgerEngine is what an endpoint's last successful scrape said.
type ledgerEngine struct {
	Running         int `json:"running"`
	Waiting         int `json:"waiting"`
	ForeignRequests int `json:"foreignRequests"`
	// ForeignTokens is what the foreign requests add to the cost now.
	ForeignTokens int `json:"foreignTokens"`
	// The LoRA adapters of its running and waiting requests, and the most
	// it runs at once, for an engine that publishes them.
	RunningAdapters []string `json:"runningAdapters,omitempty"`
	WaitingAdapters []string `json:"waitingAdapters,omitempty"`
	MaxLoRAs        int      `json:"maxLoras,omitempty"`
}

// ledger is /debug/ledger: one snapshot of the picker's ledger, its totals
// and rows read under one hold of its lock.
type ledger struct {
	InFlight      int `json:"inFlight"`
	PrefillTokens int `json:"prefillTokens"`
	// LoRALoadSeconds is what placement charges for loading an adapter.
	LoRALoadSeconds float64 `json:"loraLoadSeconds"`
	// WorkWeight is what an uncached prompt token costs a pick, relative
	// to a queued one.
	WorkWeight float64     `json:"workWeight"`
	Endpoints  []ledgerRow `json:"endpoints"`
	// Retained are endpoints that left the set and keep their row.
	Retained []ledgerRow `json:"retained"`
}

func ledgerJSON(l picker.Ledger) ledger {
	rows := func(stats []picker.EndpointStats) []ledgerRow {
		out := make([]ledgerRow, 0, len(stats))
		for _, s := range stats {
			row := ledgerRow{
				Pod: s.Endpoint.Pod, UID: s.Endpoint.UID, Endpoint: s.Endpoint.Address.String(),
				InFlight: s.InFlight, PrefillTokens: s.PrefillTokens, Decoding: s.Decoding,
				PrefillTokensPerSecond: s.PrefillTokensPerSecond,
				Utilization:            s.Utilization,
				Unhealthy:              s.Unhealthy,
				PrefixCapacityBlocks:   s.PrefixCapacityBlocks,
				DeliveredCachedTokens:  s.DeliveredCachedTokens,
				PredictedCachedTokens:  s.PredictedCachedTokens,
				CacheTrust:             s.CacheTrust,
				Adapters:               s.Adapters,
			}
			if s.Scraped {
				row.Engine = &ledgerEngine{Running: s.EngineRunning, Waiting: s.EngineWaiting,
					ForeignRequests: s.ForeignRequests, ForeignTokens: s.ForeignTokens,
					RunningAdapters: s.RunningAdapters, WaitingAdapters: s.WaitingAdapters, MaxLoRAs: s.MaxLoRAs}
			}
			out = append(out, row)
		}
		return out
	}
	return ledger{InFlight: l.InFlight, PrefillTokens: l.PrefillTokens, LoRALoadSeconds: l.LoRALoadSeconds, WorkWeight: l.WorkWeight, Endpoints: rows(l.Endpoints), Retained: rows(l.Retained)}
}
