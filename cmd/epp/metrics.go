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
	"github.com/tallyepp/tally/picker/debugledger"
	"github.com/tallyepp/tally/picker/replica"
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
func newMetricsServer(opts options, kube *rest.Config, reg *prometheus.Registry, pick *picker.Picker, peers *replica.Replica) (metricsserver.Server, func(), error) {
	if opts.metricsBindAddress == "0" {
		return nil, func() {}, nil
	}
	extra := map[string]http.Handler{debugledger.Path: ledgerHandler(pick, peers)}
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

// ledgerHandler serves the ledger, and with peers (non-nil) which replica
// leads and how current this one's copy is.
func ledgerHandler(pick *picker.Picker, peers *replica.Replica) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet {
			http.Error(w, "GET only", http.StatusMethodNotAllowed)
			return
		}
		doc := ledgerJSON(pick.SnapshotWithReservations())
		if peers != nil {
			s := peers.Status()
			doc.Replica = &debugledger.Replica{Self: s.Self, Leader: s.Leader, Leading: s.Leading, LagSeconds: s.LagSeconds, Peers: s.Peers}
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(doc)
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

// ledgerJSON is the ledger as /debug/ledger serves it.
func ledgerJSON(l picker.Ledger) debugledger.Ledger {
	rows := func(stats []picker.EndpointStats) []debugledger.Endpoint {
		out := make([]debugledger.Endpoint, 0, len(stats))
		for _, s := range stats {
			row := debugledger.Endpoint{
				Pod: s.Endpoint.Pod, UID: s.Endpoint.UID, Endpoint: s.Endpoint.Address.String(), Role: s.Endpoint.Role,
				InFlight: s.InFlight, PrefillTokens: s.PrefillTokens, Decoding: s.Decoding,
				PrefillLegs: s.PrefillLegs, Saturated: s.Saturated,
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
				row.Engine = &debugledger.Engine{Running: s.EngineRunning, Waiting: s.EngineWaiting,
					ForeignRequests: s.ForeignRequests, ForeignTokens: s.ForeignTokens,
					RunningAdapters: s.RunningAdapters, WaitingAdapters: s.WaitingAdapters, MaxLoRAs: s.MaxLoRAs}
			}
			out = append(out, row)
		}
		return out
	}
	doc := debugledger.Ledger{InFlight: l.InFlight, PrefillTokens: l.PrefillTokens, LoRALoadSeconds: l.LoRALoadSeconds, WorkWeight: l.WorkWeight,
		Endpoints: rows(l.Endpoints), Retained: rows(l.Retained),
		Roles:        make([]debugledger.Role, 0, len(l.Roles)),
		Reservations: make([]debugledger.Reservation, 0, len(l.Reservations)), ReservationsOmitted: l.ReservationsOmitted}
	for _, r := range l.Roles {
		doc.Roles = append(doc.Roles, debugledger.Role{Role: r.Role, Endpoints: r.Endpoints, Saturated: r.Saturated,
			InFlight: r.InFlight, Decoding: r.Decoding, PrefillTokens: r.PrefillTokens, PrefillLegs: r.PrefillLegs})
	}
	for _, r := range l.Reservations {
		row := debugledger.Reservation{Endpoint: r.Endpoint.String(), Pod: r.Pod, PrefillerPod: r.PrefillerPod, PrefillHeld: r.PrefillHeld,
			PrefillTokens: r.PrefillTokens, Decoding: r.Decoding, Detached: r.Detached,
			PromptTokens: r.PromptTokens, CachedTokens: r.CachedTokens, AgeSeconds: r.Age.Seconds()}
		if r.Prefiller.IsValid() {
			row.Prefiller = r.Prefiller.String()
		}
		doc.Reservations = append(doc.Reservations, row)
	}
	return doc
}
