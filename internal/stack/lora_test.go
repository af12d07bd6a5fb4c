package stack

import (
	"context"
	"strings"
	"testing"
	"time"
)

func TestLoRAAdaptersReachTheSimulators(t *testing.T) {
	s, p := newTestPod(t)
	s.opts.LoRAAdapters = []string{"a1", "a2"}
	s.opts.LoRALoadTime = 50 * time.Millisecond
	if err := s.ResetSimulators(0); err != nil {
		t.Fatal(err)
	}
	if cfg := s.simulatorConfig(); len(cfg.LoRAModules) != 2 || cfg.Engine.MaxLoRAs != 1 || cfg.Engine.LoRALoadTime != 50*time.Millisecond {
		t.Fatalf("simulator config: modules %v, max loras %d, load time %v; want a1 and a2, 1 (the default), 50ms",
			cfg.LoRAModules, cfg.Engine.MaxLoRAs, cfg.Engine.LoRALoadTime)
	}
	for i, model := range []string{"a1", "a1", "a2", DefaultModel} {
		if r := Send(context.Background(), s.HTTPClient(), p.URL(), "lora-"+model, Completion(model, "hello there", 2, true)); r.Err != nil {
			t.Fatalf("request %d for %s: %v", i, model, r.Err)
		}
	}
	if st, ok := p.Stats(); !ok || st.AdapterLoads != 2 || st.FinishedRequests != 4 {
		t.Fatalf("pod stats %+v: want 2 adapter loads (a1, a2) and 4 finished", st)
	}

	s.opts.LoRAAdapters = nil
	s.opts.MaxLoRAs = 2
	if err := s.ResetSimulators(0); err == nil || !strings.Contains(err.Error(), "MaxLoRAs: 2 is invalid") {
		t.Fatalf("MaxLoRAs without adapters: err = %v", err)
	}
}
