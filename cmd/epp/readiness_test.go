package main

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tallyepp/tally/controllers"
)

func TestReadinessWaitsForThePoolToExist(t *testing.T) {
	pool := types.NamespacedName{Namespace: "serving", Name: "llm"}
	missing := controllers.PoolState{Pool: pool, Seen: true}
	found := controllers.PoolState{Pool: pool, Seen: true, Found: true}
	for _, tc := range []struct {
		name           string
		synced         bool
		pool           controllers.PoolState
		leaderElection bool
		leads          bool
		want           bool
		wantWhy        string
	}{
		{"not read yet", false, controllers.PoolState{}, false, false, false, "not been read"},
		{"pool missing, though the empty set is synced", true, missing, false, false, false, "serving/llm does not exist"},
		{"pool found, no pods: ready, the answers say why", true, found, false, false, true, ""},
		{"pool found, another replica leads", true, found, true, false, false, "another replica leads"},
		{"pool found, this replica leads", true, found, true, true, true, ""},
	} {
		got, why := readiness(tc.synced, tc.pool, tc.leaderElection, tc.leads)
		if got != tc.want || !strings.Contains(why, tc.wantWhy) || (tc.want && why != "") {
			t.Errorf("%s: readiness = %v, %q; want %v, %q", tc.name, got, why, tc.want, tc.wantWhy)
		}
	}
}

// TestReadinessFollowsThePool: ready once the pool exists, not ready again
// (and said so) when it is deleted, ready when it comes back.
func TestReadinessFollowsThePool(t *testing.T) {
	var mu sync.Mutex
	exists := false
	var sets []bool
	var lines []string
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, args)
	}, funcr.Options{})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		followReadiness(ctx, time.Millisecond, func() (bool, string) {
			mu.Lock()
			defer mu.Unlock()
			return exists, "InferencePool serving/llm does not exist"
		}, func(ready bool) {
			mu.Lock()
			defer mu.Unlock()
			sets = append(sets, ready)
		}, log)
	}()
	waitFor := func(want []bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			mu.Lock()
			got := slices.Clone(sets)
			mu.Unlock()
			if slices.Equal(got, want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("readiness set %v, want %v", got, want)
			}
			time.Sleep(time.Millisecond)
		}
	}
	setExists := func(v bool) { mu.Lock(); exists = v; mu.Unlock() }
	waitFor([]bool{false})
	setExists(true)
	waitFor([]bool{false, true})
	setExists(false)
	waitFor([]bool{false, true, false})
	setExists(true)
	waitFor([]bool{false, true, false, true})
	cancel()
	<-done
	mu.Lock()
	defer mu.Unlock()
	var notReady int
	for _, l := range lines {
		if strings.Contains(l, "not ready: InferencePool serving/llm does not exist") && strings.Contains(l, `"warning"=true`) {
			notReady++
		}
	}
	if notReady != 1 {
		t.Errorf("logged %d not-ready warnings naming the pool, want 1: %q", notReady, lines)
	}
}
