package extproc_test

import (
	"encoding/json"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/types"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/controllers"
	"github.com/tallyepp/tally/picker"
)

// seenPool is the pool as the controllers would have seen it: its
// NoEndpointReason is the controllers' own wording of that state.
type seenPool controllers.PoolState

func (p seenPool) NoEndpointReason() string {
	_, msg := controllers.PoolState(p).Problem()
	return msg
}

// TestRefusalsSayWhy drives the real gRPC server: each refusal for want of
// an endpoint, or of room on one, names its cause in the body's message,
// in words that say what to fix.
func TestRefusalsSayWhy(t *testing.T) {
	pool := types.NamespacedName{Namespace: "serving", Name: "llm"}
	saturated := v1alpha1.Default()
	saturated.Saturation.MaxInFlightRequests = 1
	for _, tc := range []struct {
		name       string
		opts       fixtureOptions
		hint       []string
		saturate   bool
		wantStatus int32
		wantInMsg  []string
	}{
		{
			name:       "pool not found",
			opts:       fixtureOptions{endpoints: []picker.Endpoint{}, pool: seenPool{Pool: pool, Seen: true}},
			wantStatus: 503,
			wantInMsg:  []string{"InferencePool serving/llm does not exist", "--pool-name"},
		},
		{
			name:       "selector matches no pod",
			opts:       fixtureOptions{endpoints: []picker.Endpoint{}, pool: seenPool{Pool: pool, Seen: true, Found: true, Selector: "app=llm"}},
			wantStatus: 503,
			wantInMsg:  []string{"InferencePool serving/llm selects no pod", "app=llm"},
		},
		{
			name:       "no endpoint in the pool yet",
			opts:       fixtureOptions{endpoints: []picker.Endpoint{}, pool: seenPool{Pool: pool, Seen: true, Found: true, Selector: "app=llm", Pods: 2}},
			wantStatus: 503,
			wantInMsg:  []string{"selects 2 pod(s), none of them Ready", "no endpoint in the pool yet"},
		},
		{
			name:       "subset hint names no endpoint of the pool",
			opts:       fixtureOptions{pool: seenPool{Pool: pool, Seen: true, Found: true, Selector: "app=llm", Pods: 3, ReadyPods: 3, Endpoints: 3}},
			hint:       []string{"127.0.0.99:8000", "10.1.2.3"},
			wantStatus: 503,
			wantInMsg:  []string{"subset hint", "127.0.0.99:8000, 10.1.2.3", "none of which is an endpoint of the pool"},
		},
		{
			name:       "every endpoint saturated",
			opts:       fixtureOptions{cfg: &saturated, endpoints: endpoints(epA), pool: seenPool{Pool: pool, Seen: true, Found: true, Pods: 1, ReadyPods: 1, Endpoints: 1}},
			saturate:   true,
			wantStatus: 429,
			wantInMsg:  []string{"every endpoint of the pool is over its saturation limit", "retry later"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, tc.opts)
			if tc.saturate {
				x, err := f.gw.Open(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				defer x.Cancel()
				if r, err := x.SendRequest(post("/v1/completions", completionBody("m", "first"))); err != nil || r.Destination == "" {
					t.Fatalf("holding request: %+v, %v", r, err)
				}
			}
			req := completion("m", "hello")
			if tc.hint != nil {
				req.SubsetHint = hintList(tc.hint...)
			}
			r, err := f.gw.roundTrip(t.Context(), req)
			if err != nil {
				t.Fatal(err)
			}
			if got := int32(r.Immediate.GetStatus().GetCode()); got != tc.wantStatus {
				t.Fatalf("got %+v, want an immediate %d", r, tc.wantStatus)
			}
			var body struct {
				Error struct {
					Message string `json:"message"`
				} `json:"error"`
			}
			if err := json.Unmarshal(r.Immediate.GetBody(), &body); err != nil {
				t.Fatalf("body %q: %v", r.Immediate.GetBody(), err)
			}
			for _, want := range tc.wantInMsg {
				if !strings.Contains(body.Error.Message, want) {
					t.Errorf("message %q does not say %q", body.Error.Message, want)
				}
			}
		})
	}
}
