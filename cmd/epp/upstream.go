package main

import (
	"flag"
	"strings"
)

// ignoredFlag is a flag of the upstream picker (gateway-api-inference-
// extension v1.5.0, cmd/epp and pkg/epp/server/options.go) that Tally accepts,
// so that a chart written for the upstream picker runs it unchanged, but does
// not apply. Each set one is logged once at start with its reason.
type ignoredFlag struct {
	name   string
	isBool bool
	reason string
}

const (
	reasonNoScraping = "Tally reads only the engine metrics it knows by engine type (the pod label inference.networking.k8s.io/engine-type)"
)

var ignoredUpstreamFlags = []ignoredFlag{
	{name: "refresh-prometheus-metrics-interval", reason: "Tally's gauges are computed when scraped"},
	{name: "metrics-staleness-threshold", reason: reasonNoScraping},
	{name: "tracing", isBool: true, reason: "Tally emits no traces"},
	{name: "disable-endpoint-subset-filter", isBool: true, reason: "Tally always keeps to the gateway's subset hint"},
}

// ignoredSetting is an ignored flag as given on the command line.
type ignoredSetting struct {
	flag, value, reason string
}

// addIgnoredUpstreamFlags defines the ignored flags on fs and returns a
// function that lists the ones set, after fs is parsed.
func addIgnoredUpstreamFlags(fs *flag.FlagSet) func() []ignoredSetting {
	for _, f := range ignoredUpstreamFlags {
		if f.isBool {
			fs.Bool(f.name, false, "accepted for compatibility with the upstream picker; ignored: "+f.reason)
		} else {
			fs.String(f.name, "", "accepted for compatibility with the upstream picker; ignored: "+f.reason)
		}
	}
	return func() []ignoredSetting {
		var out []ignoredSetting
		fs.Visit(func(fl *flag.Flag) {
			for _, f := range ignoredUpstreamFlags {
				if f.name == fl.Name {
					out = append(out, ignoredSetting{flag: "--" + f.name, value: fl.Value.String(), reason: f.reason})
				}
			}
		})
		return out
	}
}

// joinBoolValues rewrites "--flag true" and "--flag false" for boolean flags
// of fs into "--flag=true" and "--flag=false". The upstream chart passes its
// `flags` map as two arguments each ("--enable-pprof", "false"); Go's flag
// package would take the bare "--enable-pprof" as true and stop at "false".
func joinBoolValues(fs *flag.FlagSet, args []string) []string {
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return append(out, args[i:]...)
		}
		name := strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-")
		if name != a && !strings.Contains(name, "=") && i+1 < len(args) {
			if f := fs.Lookup(name); f != nil && isBoolFlag(f) {
				if v := strings.ToLower(args[i+1]); v == "true" || v == "false" {
					out = append(out, a+"="+v)
					i++
					continue
				}
			}
		}
		out = append(out, a)
	}
	return out
}

func isBoolFlag(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}
