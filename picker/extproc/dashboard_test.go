package extproc_test

import (
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
	"github.com/tallyepp/tally/picker/extproc"
	"github.com/tallyepp/tally/picker/replica"
	"github.com/tallyepp/tally/picker/scrape"
)

// recordingRegisterer passes collectors on and remembers the names of the
// metrics they describe: every family the picker and the ext_proc server
// can export, whether or not it has a series yet.
type recordingRegisterer struct {
	prometheus.Registerer
	names map[string]bool
}

var descName = regexp.MustCompile(`fqName: "([^"]+)"`)

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		if m := descName.FindStringSubmatch(d.String()); m != nil {
			r.names[m[1]] = true
		}
	}
	return r.Registerer.Register(c)
}

func (r *recordingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// exportedMetrics names every metric family the picker, its ext_proc server
// and its scraper register.
func exportedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	reg := &recordingRegisterer{Registerer: prometheus.NewRegistry(), names: map[string]bool{}}
	newServerOn(reg)
	if len(reg.names) < 20 {
		t.Fatalf("only %d metric names described: %v", len(reg.names), reg.names)
	}
	return reg.names
}

// metricRef finds metric names in PromQL: all of Tally's start with one of
// these prefixes.
var metricRef = regexp.MustCompile(`\b(?:tally|inference_objective|inference_pool|inference_extension)_[a-z0-9_]+`)

func TestDashboardQueriesOnlyExportedMetrics(t *testing.T) {
	exported := exportedMetrics(t)
	data, err := os.ReadFile("../../config/grafana/tally-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		UID        string `json:"uid"`
		Title      string `json:"title"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
		Panels []struct {
			ID      int    `json:"id"`
			Type    string `json:"type"`
			Title   string `json:"title"`
			Targets []struct {
				Expr  string `json:"expr"`
				RefID string `json:"refId"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("the dashboard is not valid JSON: %v", err)
	}
	if dash.UID == "" || dash.Title == "" {
		t.Errorf("the dashboard needs a uid and a title")
	}
	var exprs []string
	for _, v := range dash.Templating.List {
		exprs = append(exprs, v.Definition)
	}
	ids := map[int]bool{}
	queried := map[string]bool{}
	for _, p := range dash.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d is used twice", p.ID)
		}
		ids[p.ID] = true
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, target := range p.Targets {
			if strings.TrimSpace(target.Expr) == "" || target.RefID == "" {
				t.Errorf("panel %q has a target without expr or refId", p.Title)
			}
			if strings.Count(target.Expr, "(") != strings.Count(target.Expr, ")") ||
				strings.Count(target.Expr, "{") != strings.Count(target.Expr, "}") {
				t.Errorf("panel %q: unbalanced query %q", p.Title, target.Expr)
			}
			exprs = append(exprs, target.Expr)
		}
	}
	for _, e := range exprs {
		for _, name := range metricRef.FindAllString(e, -1) {
			base := name
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if trimmed, ok := strings.CutSuffix(name, suffix); ok && exported[trimmed] {
					base = trimmed
				}
			}
			if !exported[base] {
				t.Errorf("the dashboard queries %s, which the picker does not export (in %q)", name, e)
			}
			queried[base] = true
		}
	}
	// The upstream names a migrating user's dashboards rely on are shown.
	for _, name := range []string{
		"inference_objective_request_total", "inference_objective_request_error_total",
		"inference_objective_request_duration_seconds", "inference_objective_request_ttft_seconds",
		"inference_objective_input_tokens", "inference_objective_output_tokens",
		"inference_objective_prompt_cached_tokens", "inference_objective_running_requests",
		"inference_pool_ready_pods", "inference_pool_average_queue_size", "inference_pool_per_pod_queue_size",
		"inference_extension_info", "inference_extension_scheduler_e2e_duration_seconds",
		"inference_extension_prefix_indexer_hit_ratio",
	} {
		if !exported[name] {
			t.Errorf("%s is not exported", name)
		}
		if !queried[name] {
			t.Errorf("the dashboard shows no panel over %s", name)
		}
	}
	// So are model rewrites (those a gateway cannot apply among them), what
	// the learned rate made of first bytes (adapter loads and slot waits
	// among them), flow control, and prefill/decode disaggregation.
	for _, name := range []string{
		"inference_extension_model_rewrite_decisions_total", "tally_model_rewrites_unapplied_total",
		"tally_prefill_rate_samples_total",
		"inference_extension_flow_control_queue_size", "inference_extension_flow_control_pool_saturation",
		"inference_extension_flow_control_request_queue_duration_seconds", "tally_flow_control_requests_total",
		"tally_split_decisions_total", "tally_role_endpoints", "tally_role_saturated_endpoints",
		"tally_role_queued_prefill_tokens", "tally_prefill_legs_total", "tally_endpoint_prefill_legs",
	} {
		if !queried[name] {
			t.Errorf("the dashboard shows no panel over %s", name)
		}
	}
}

func TestMetricsDocDocumentsEveryMetric(t *testing.T) {
	data, err := os.ReadFile("../../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	var missing []string
	for name := range exportedMetrics(t) {
		if !strings.Contains(string(data), "`"+name+"`") {
			missing = append(missing, name)
		}
	}
	slices.Sort(missing)
	if len(missing) > 0 {
		t.Errorf("docs/metrics.md does not document %v", missing)
	}
}

// newServerOn builds a picker and an ext_proc server registered on r, as
// cmd/epp does, with flow control on and peers, so that their metrics are
// described too.
func newServerOn(r prometheus.Registerer) {
	cfg := v1alpha1.Default()
	cfg.FlowControl.Enabled = true
	p := picker.New(cfg, picker.Options{Registerer: r, PoolName: "pool"})
	extproc.NewServer(replica.New(p, replica.Options{Registerer: r}), extproc.Options{Registerer: r})
	scrape.New(p, scrape.Options{Registerer: r})
}

// Under OpenMetrics a counter X_total is the family X: no other metric may
// be named X.
func TestNoMetricNameCollidesUnderOpenMetrics(t *testing.T) {
	names := exportedMetrics(t)
	for name := range names {
		if base, ok := strings.CutSuffix(name, "_total"); ok && names[base] {
			t.Errorf("%s and %s are one family under OpenMetrics", base, name)
		}
	}
}
