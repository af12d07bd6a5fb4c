package main

import (
	"context"
	"fmt"
	"io"

	"github.com/tallyepp/tally/internal/stack"
)

// upstreamPolicy sends every workload through the upstream picker (bin)
// and a gateway of its own, started before its first workload and stopped
// after its last: its scrapes (every 50 ms) would share the cores with the
// other rows.
func upstreamPolicy(s *stack.Stack, bin string, lora bool, stdout io.Writer) policy {
	var r *stack.Replica
	args := upstreamPickerArgs(lora)
	return policy{
		name:    "upstream",
		baseURL: func(int) string { return r.GatewayURL() },
		start: func(ctx context.Context) (err error) {
			if r, err = s.StartUpstream(ctx, bin, args...); err != nil {
				return fmt.Errorf("starting the upstream picker (flag --upstream-bin): %w", err)
			}
			scorers := "its default scorers"
			if lora {
				scorers += " and lora-affinity-scorer"
			}
			fmt.Fprintf(stdout, "Upstream picker up (%s), gateway %s\n", scorers, r.GatewayURL())
			return nil
		},
		done: func() error { return r.Stop() },
	}
}

// upstreamLoRAConfig is the upstream picker's default scheduling profile
// (queue-scorer and kv-cache-utilization-scorer weighing 2,
// prefix-cache-scorer 3: v1.5.0's loadDefaultConfig) with its
// lora-affinity-scorer added at weight 1, what it gives a scorer its
// profile names without a weight. Its default profile has no LoRA scorer.
const upstreamLoRAConfig = `apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: lora-affinity-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: lora-affinity-scorer
    weight: 1
`

// upstreamPickerArgs are the upstream picker's flags beyond its chart's
// defaults: its LoRA scorer when the simulators serve adapters.
func upstreamPickerArgs(lora bool) []string {
	if !lora {
		return nil
	}
	return []string{"--config-text=" + upstreamLoRAConfig}
}
