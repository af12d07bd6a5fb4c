package replica

import "github.com/prometheus/client_golang/prometheus"

// Why a pick was placed on this replica's own ledger.
const (
	reasonLeader   = "leader"    // this replica leads
	reasonNoLeader = "no_leader" // no replica leads, or the leader's stream broke
	reasonTimeout  = "timeout"   // the leader did not answer within PickTimeout
	reasonVersion  = "version"   // the leader speaks another protocol version
)

type metrics struct {
	forwarded      prometheus.Counter
	forwardSeconds prometheus.Histogram
	local          *prometheus.CounterVec
	lag            prometheus.Gauge
	leaderChanges  prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		forwarded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_peer_forwarded_picks_total",
			Help: "Picks this replica forwarded to the leader and got its answer to.",
		}),
		forwardSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tally_peer_forward_duration_seconds",
			Help:    "From a forwarded pick's sending to the leader's first answer: where the pick went, or that it waits in the leader's flow control queue (the wait is not counted).",
			Buckets: []float64{0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2, 10},
		}),
		local: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_peer_local_placements_total",
			Help: "Picks placed on this replica's own ledger, by reason: leader (this replica leads), no_leader, timeout (the leader did not answer in time), version (the leader speaks another peer protocol version).",
		}, []string{"reason"}),
		lag: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tally_peer_replication_lag_seconds",
			Help: "Age of the leader's last ledger change when this follower applied it.",
		}),
		leaderChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_peer_leader_changes_total",
			Help: "Times the leader changed as this replica saw it: it started following another leader than the last, or started leading after another led (a reconnection to the same leader is no change, nor the first leader seen).",
		}),
	}
	for _, r := range []string{reasonLeader, reasonNoLeader, reasonTimeout, reasonVersion} {
		m.local.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(m.forwarded, m.forwardSeconds, m.local, m.lag, m.leaderChanges)
	}
	return m
}

// registerState registers the gauges read from x's state.
func (x *Replica) registerState(reg prometheus.Registerer) {
	if reg == nil {
		return
	}
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tally_peer_connected_peers",
		Help: "Peers this replica has a working stream to (of the pods --peer-selector finds, itself excluded).",
	}, func() float64 {
		x.mu.Lock()
		defer x.mu.Unlock()
		n := 0
		for _, c := range x.peers {
			if c.up {
				n++
			}
		}
		return float64(n)
	}), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tally_peer_is_leader",
		Help: "1 while this replica leads (holds the Lease and places every pick), else 0.",
	}, func() float64 {
		if x.leading.Load() {
			return 1
		}
		return 0
	}))
}
