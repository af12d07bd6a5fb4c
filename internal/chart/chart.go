// Package chart draws the benchmarks' charts as plain SVG written by hand:
// a few polylines, axes and labels, no scripts and no external fonts, so
// they render the same in a browser and on GitHub.
//
// The invariant: every piece of caller text (titles, labels, series names)
// goes through Escape before it reaches the SVG.
package chart

import (
	"fmt"
	"io"
	"math"
	"strings"
	"unicode/utf8"
)

// paletteColors are ten colours of seven characters, a space apart.
const paletteColors = "#1f77b4 #d62728 #2ca02c #ff7f0e #9467bd #8c564b #e377c2 #7f7f7f #bcbd22 #17becf"

// Color is the i-th colour of the palette (it repeats after ten).
func Color(i int) string {
	k := i % 10 * 8
	return paletteColors[k : k+7]
}

// Dashed is the stroke attribute of a dashed line.
const Dashed = ` stroke-dasharray="6 4"`

const font = `font-family="sans-serif" font-size="12"`

// Header opens an SVG of w × h pixels on a white background, with title
// centred at the top. The caller closes it with "</svg>\n".
func Header(b *strings.Builder, w, h int, title string) {
	fmt.Fprintf(b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" %s>`+"\n", w, h, w, h, font)
	fmt.Fprintf(b, `<rect width="%d" height="%d" fill="white"/>`+"\n", w, h)
	fmt.Fprintf(b, `<text x="%d" y="20" text-anchor="middle" font-size="14" font-weight="bold">%s</text>`+"\n", w/2, Escape(title))
}

// Escape makes s safe as SVG text or attribute value.
func Escape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}

// NiceCeil rounds v up to 1, 2 or 5 times a power of ten (1 for v <= 0).
func NiceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v-1e-9 {
			return m * p
		}
	}
	return 10 * p
}

// Legend draws the k-th entry of a legend column at x: a short line in the
// series' style and its name.
func Legend(b *strings.Builder, x, top, k int, name, color, dash string) {
	y := top + 10 + 20*k
	fmt.Fprintf(b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>`+"\n", x, y, x+24, y, color, dash)
	fmt.Fprintf(b, `<text x="%d" y="%d">%s</text>`+"\n", x+30, y+4, Escape(name))
}

// Series is one line of a Lines chart.
type Series struct {
	Name string
	// Y has one value per category of the chart's X; NaN where there is
	// no measurement (the line skips it).
	Y []float64
	// Color is an SVG colour; empty takes the palette's, by position.
	Color string
	// Dashed draws the line dashed.
	Dashed bool
}

// Lines is a line chart over categories: X's labels evenly spaced, a
// linear Y axis from zero.
type Lines struct {
	Title, XLabel, YLabel string
	X                     []string
	Series                []Series
}

// Write draws the chart: one polyline per series, a dot at each value.
func (c Lines) Write(w io.Writer) error {
	const (
		plotWidth, height = 500, 400
		left, top, bott   = 60, 36, 50
		// A legend entry is a 24-pixel line, a gap, and its name at
		// about 7 pixels a character (12-pixel sans-serif).
		legendPerChar, legendFixed = 7, 60
	)
	longest := 0
	for _, s := range c.Series {
		longest = max(longest, utf8.RuneCountInString(s.Name))
	}
	right := legendFixed + legendPerChar*longest
	width := left + plotWidth + right
	pw, ph := float64(plotWidth), float64(height-top-bott)
	most := 0.0
	for _, s := range c.Series {
		for _, v := range s.Y {
			if !math.IsNaN(v) {
				most = math.Max(most, v)
			}
		}
	}
	yMax := NiceCeil(most)
	x := func(i int) float64 {
		if len(c.X) < 2 {
			return float64(left) + pw/2
		}
		// Half a step of margin on each side, so end points clear the frame.
		return float64(left) + (float64(i)+0.5)/float64(len(c.X))*pw
	}
	y := func(v float64) float64 { return float64(top) + (1-v/yMax)*ph }

	var b strings.Builder
	Header(&b, width, height, c.Title)
	for i := 0; i <= 5; i++ {
		v := yMax * float64(i) / 5
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#eee"/>`+"\n", left, y(v), width-right, y(v))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%g</text>`+"\n", left-6, y(v)+4, v)
	}
	for i, label := range c.X {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#eee"/>`+"\n", x(i), top, x(i), height-bott)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", x(i), height-bott+16, Escape(label))
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.0f" height="%.0f" fill="none" stroke="#333"/>`+"\n", left, top, pw, ph)
	fmt.Fprintf(&b, `<text x="%.0f" y="%d" text-anchor="middle">%s</text>`+"\n", float64(left)+pw/2, height-12, Escape(c.XLabel))
	fmt.Fprintf(&b, `<text transform="translate(16 %.0f) rotate(-90)" text-anchor="middle">%s</text>`+"\n", float64(top)+ph/2, Escape(c.YLabel))
	for k, s := range c.Series {
		color, dash := s.Color, ""
		if color == "" {
			color = Color(k)
		}
		if s.Dashed {
			dash = Dashed
		}
		var pts []string
		var dots strings.Builder
		for i, v := range s.Y {
			if i >= len(c.X) || math.IsNaN(v) {
				continue
			}
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(i), y(v)))
			fmt.Fprintf(&dots, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", x(i), y(v), color)
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke-width="2" stroke="%s"%s points="%s"/>`+"\n", color, dash, strings.Join(pts, " "))
		b.WriteString(dots.String())
		Legend(&b, width-right+14, top, k, s.Name, color, dash)
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}
