package server

import (
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/tallyepp/tally/internal/modelsim/engine"
)

// LoRAModule is one LoRA adapter served besides the base model, as vLLM's
// --lora-modules name=path names it.
type LoRAModule struct {
	// Name is the model name requests use to run with the adapter.
	Name string
	// Path is where the adapter's weights would be read from; /v1/models
	// reports it as the adapter's root. "" reports the name.
	Path string
}

// maxLoRAInfoSeries bounds the label sets of vllm:lora_requests_info kept.
// vLLM keeps every set it ever wrote; readers take the newest, so dropping
// the oldest past this many changes nothing but the size of a scrape.
const maxLoRAInfoSeries = 1000

// loraRequests writes vllm:lora_requests_info from the engine's requests
// by adapter (engine.AdapterRequests). Guarded by Server.mu.
type loraRequests struct {
	engine.AdapterRequests
	// series holds each label set written and the unix time, in seconds,
	// of its last write; vLLM's gauge keeps them all.
	series map[loraInfoLabels]float64
	last   float64
}

type loraInfoLabels struct{ running, waiting string }

func newLoRARequests() *loraRequests {
	return &loraRequests{series: map[loraInfoLabels]float64{}}
}

// record writes the current label set with the time now, as vLLM does each
// time it logs an iteration's stats. Times only increase, so the newest
// series is always the current one.
func (l *loraRequests) record(now time.Time) {
	running, waiting := l.Adapters()
	t := float64(now.UnixNano()) / 1e9
	if t <= l.last {
		t = math.Nextafter(l.last, math.Inf(1))
	}
	l.last = t
	l.series[loraInfoLabels{running: strings.Join(running, ","), waiting: strings.Join(waiting, ",")}] = t
	if len(l.series) > maxLoRAInfoSeries {
		oldest, at := loraInfoLabels{}, math.Inf(1)
		for k, v := range l.series {
			if v < at {
				oldest, at = k, v
			}
		}
		delete(l.series, oldest)
	}
}

// validateLoRA checks the adapters against the base model and the engine's
// slots, naming the field at fault.
func (c Config) validateLoRA(bad func(field string, got any, accepted string)) {
	seen := map[string]bool{}
	for i, m := range c.LoRAModules {
		field := fmt.Sprintf("LoRAModules[%d].Name", i)
		switch {
		case m.Name == "":
			bad(field, `""`, "must not be empty")
		case strings.ContainsAny(m.Name, ",="):
			// The metric joins names with commas; the flag splits name=path.
			bad(field, fmt.Sprintf("%q", m.Name), "must not contain ',' or '='")
		case m.Name == c.Model:
			bad(field, fmt.Sprintf("%q", m.Name), "must differ from Model, the base model's name")
		case seen[m.Name]:
			bad(field, fmt.Sprintf("%q", m.Name), "is given twice")
		}
		seen[m.Name] = true
	}
	switch {
	case len(c.LoRAModules) > 0 && c.Engine.MaxLoRAs < 1:
		bad("Engine.MaxLoRAs", c.Engine.MaxLoRAs, "must be 1 or more to serve LoRAModules")
	case len(c.LoRAModules) == 0 && c.Engine.MaxLoRAs != 0:
		bad("Engine.MaxLoRAs", c.Engine.MaxLoRAs, "must be 0 without LoRAModules")
	}
}
