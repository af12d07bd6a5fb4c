package chart

import (
	"math"
	"strings"
	"testing"
)

func TestLinesDrawsEverySeriesAndEscapesText(t *testing.T) {
	c := Lines{
		Title:  `CPU <per> request & "more"`,
		XLabel: "clients",
		YLabel: "ms of CPU per request",
		X:      []string{"1", "16", "64"},
		Series: []Series{
			{Name: "Tally, 8,000 tokens", Y: []float64{0.9, 0.4, 0.4}},
			{Name: "upstream <v1.5.0>", Y: []float64{2.6, 2.3, 2.2}, Color: "#d62728", Dashed: true},
			{Name: "one point", Y: []float64{math.NaN(), 1.3, math.NaN()}},
		},
	}
	var b strings.Builder
	if err := c.Write(&b); err != nil {
		t.Fatal(err)
	}
	svg := b.String()
	if !strings.HasPrefix(svg, "<svg ") || !strings.HasSuffix(svg, "</svg>\n") {
		t.Fatalf("not one SVG element:\n%s", svg)
	}
	if n := strings.Count(svg, "<polyline"); n != 3 {
		t.Errorf("%d polylines, want one per series (3)", n)
	}
	if n := strings.Count(svg, "<circle"); n != 7 {
		t.Errorf("%d dots, want one per value that is not NaN (7)", n)
	}
	for _, want := range []string{
		"CPU &lt;per&gt; request &amp; &quot;more&quot;", "upstream &lt;v1.5.0&gt;",
		">clients<", ">ms of CPU per request<", ">1<", ">16<", ">64<",
		"Tally, 8,000 tokens", Dashed, `stroke="#d62728"`,
	} {
		if !strings.Contains(svg, want) {
			t.Errorf("the SVG lacks %q", want)
		}
	}
	if strings.Contains(svg, "<per>") || strings.Contains(svg, "NaN") {
		t.Errorf("unescaped text or a NaN coordinate:\n%s", svg)
	}
	// The y axis reaches the largest value, rounded up: 5 ms for 2.6.
	if !strings.Contains(svg, ">5<") {
		t.Errorf("no 5 ms tick for a largest value of 2.6:\n%s", svg)
	}
}

func TestNiceCeil(t *testing.T) {
	for v, want := range map[float64]float64{0: 1, 0.3: 0.5, 1: 1, 1.2: 2, 2.6: 5, 7: 10, 120: 200} {
		if got := NiceCeil(v); math.Abs(got-want) > 1e-9 {
			t.Errorf("NiceCeil(%g) = %g, want %g", v, got, want)
		}
	}
}
