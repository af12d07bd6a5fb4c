package routesim

import (
	"fmt"
	"io"
	"math"
	"strings"
	"time"

	"github.com/tallyepp/tally/internal/chart"
)

// The charts are drawn with package chart's helpers.

// maxCDFPoints bounds each CDF's polyline.
const maxCDFPoints = 600

// WriteTTFTCDF draws the TTFT CDF of each run and of the bound (dashed),
// on a logarithmic time axis.
func WriteTTFTCDF(w io.Writer, title string, bound Summary, runs []Summary) error {
	const (
		width, height          = 760, 440
		left, right, top, bott = 60, 170, 36, 50
	)
	pw, ph := float64(width-left-right), float64(height-top-bott)
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, s := range append([]Summary{bound}, runs...) {
		for _, d := range s.ttfts {
			if d > 0 {
				lo, hi = math.Min(lo, d.Seconds()), math.Max(hi, d.Seconds())
			}
		}
	}
	if math.IsInf(lo, 0) {
		lo, hi = 0.001, 1
	}
	decLo, decHi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if decHi <= decLo {
		decHi = decLo + 1
	}
	x := func(sec float64) float64 {
		sec = math.Max(sec, math.Pow(10, decLo))
		return float64(left) + (math.Log10(sec)-decLo)/(decHi-decLo)*pw
	}
	y := func(frac float64) float64 { return float64(top) + (1-frac)*ph }

	var b strings.Builder
	chart.Header(&b, width, height, title)
	// Grid and ticks: decades (and 2, 5 between them) on x, tenths on y.
	for d := decLo; d <= decHi; d++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, d)
			if math.Log10(v) > decHi+1e-9 {
				break
			}
			xx := x(v)
			stroke := "#eee"
			if m == 1 {
				stroke = "#ccc"
			}
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="%s"/>`+"\n", xx, top, xx, height-bott, stroke)
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", xx, height-bott+16, tickSeconds(v))
		}
	}
	for i := 0; i <= 10; i++ {
		f := float64(i) / 10
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#eee"/>`+"\n", left, y(f), width-right, y(f))
		if i%2 == 0 {
			fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%.1f</text>`+"\n", left-6, y(f)+4, f)
		}
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.0f" height="%.0f" fill="none" stroke="#333"/>`+"\n", left, top, pw, ph)
	fmt.Fprintf(&b, `<text x="%.0f" y="%d" text-anchor="middle">time to first token (s, log scale)</text>`+"\n", float64(left)+pw/2, height-12)
	fmt.Fprintf(&b, `<text transform="translate(16 %.0f) rotate(-90)" text-anchor="middle">fraction of requests</text>`+"\n", float64(top)+ph/2)

	line := func(ds []time.Duration, color, dash string) {
		n := len(ds)
		if n == 0 {
			return
		}
		b.WriteString(`<polyline fill="none" stroke-width="2" stroke="` + color + `"` + dash + ` points="`)
		step := max(n/maxCDFPoints, 1)
		prevY := y(0)
		for i := 0; i < n; i += step {
			xx := x(ds[i].Seconds())
			fmt.Fprintf(&b, "%.1f,%.1f %.1f,%.1f ", xx, prevY, xx, y(float64(i+1)/float64(n)))
			prevY = y(float64(i+1) / float64(n))
		}
		xx := x(ds[n-1].Seconds())
		fmt.Fprintf(&b, "%.1f,%.1f %.1f,%.1f", xx, prevY, xx, y(1))
		b.WriteString(`"/>` + "\n")
	}
	legend := func(k int, name, color, dash string) { chart.Legend(&b, width-right+14, top, k, name, color, dash) }
	for k, s := range runs {
		c := chart.Color(k)
		line(s.ttfts, c, "")
		legend(k, s.Policy, c, "")
	}
	line(bound.ttfts, "#000", chart.Dashed)
	legend(len(runs), "no-queueing bound", "#000", chart.Dashed)
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func tickSeconds(v float64) string {
	switch {
	case v >= 1:
		return fmt.Sprintf("%g", v)
	default:
		return strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.3f", v), "0"), ".")
	}
}

// WriteInFlight draws, for each burst run, every engine's requests
// (running and waiting) over time: one panel per policy, on shared axes.
func WriteInFlight(w io.Writer, title string, runs []BurstRun) error {
	const (
		width                 = 760
		panelH, gap           = 150, 34
		left, right, top, bot = 60, 130, 40, 44
	)
	height := top + len(runs)*(panelH+gap) - gap + bot
	pw := float64(width - left - right)
	var tEnd time.Duration
	most := 1
	for _, r := range runs {
		for _, s := range r.Samples {
			tEnd = max(tEnd, s.At)
			for _, n := range s.Requests {
				most = max(most, n)
			}
		}
	}
	tMax := chart.NiceCeil(math.Max(tEnd.Seconds(), 0.1))
	yMax := chart.NiceCeil(float64(most))
	x := func(sec float64) float64 { return float64(left) + sec/tMax*pw }

	var b strings.Builder
	chart.Header(&b, width, height, title)
	engines := 0
	for k, r := range runs {
		py := top + k*(panelH+gap)
		y := func(n float64) float64 { return float64(py) + (1-n/yMax)*panelH }
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-weight="bold">%s</text>`+"\n", left, py-6, chart.Escape(r.Policy))
		for i := 0; i <= 4; i++ {
			v := yMax * float64(i) / 4
			fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#eee"/>`+"\n", left, y(v), width-right, y(v))
			fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%g</text>`+"\n", left-6, y(v)+4, v)
		}
		for i := 0; i <= 5; i++ {
			v := tMax * float64(i) / 5
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#eee"/>`+"\n", x(v), py, x(v), py+panelH)
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%g</text>`+"\n", x(v), py+panelH+14, v)
		}
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.0f" height="%d" fill="none" stroke="#333"/>`+"\n", left, py, pw, panelH)
		if len(r.Samples) == 0 {
			continue
		}
		engines = max(engines, len(r.Samples[0].Requests))
		for e := range r.Samples[0].Requests {
			fmt.Fprintf(&b, `<polyline fill="none" stroke-width="1.5" stroke="%s" points="`, chart.Color(e))
			for _, s := range r.Samples {
				fmt.Fprintf(&b, "%.1f,%.1f ", x(s.At.Seconds()), y(float64(s.Requests[e])))
			}
			b.WriteString(`"/>` + "\n")
		}
	}
	for e := range engines {
		chart.Legend(&b, width-right+14, top, e, fmt.Sprintf("engine %d", e), chart.Color(e), "")
	}
	fmt.Fprintf(&b, `<text x="%.0f" y="%d" text-anchor="middle">time (s); requests running and waiting per engine</text>`+"\n", float64(left)+pw/2, height-12)
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}
