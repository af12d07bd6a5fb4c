#!/usr/bin/env bash
# Each picker replica's CPU time over 5 s inside extproc-load's open-loop
# load of 400 requests/s (docs/benchmarks.md, "Replicas"). Usage:
#   KUBEBUILDER_ASSETS=... hack/replica-cpu.sh [replicas]   (default 3)
# after `go build -o bin/ ./cmd/...`. Prints each replica's CPU ticks
# (1/100 s) over the 5 s, then the tool's summary.
set -euo pipefail
n=${1:-3}
out=$(mktemp)
bin/extproc-load load --rate 400 --replicas "$n" --tally-bin bin/epp >"$out" 2>&1 &
tool=$!
until [ "$(grep -c 'ready with' "$out")" -ge "$n" ]; do sleep 0.2; done
sleep 5 # into the measured window
declare -A before
pids=$(pgrep -f "bin/epp .*--pool-name")
for p in $pids; do before[$p]=$(awk '{print $14+$15}' "/proc/$p/stat"); done
sleep 5
for p in $pids; do
	after=$(awk '{print $14+$15}' "/proc/$p/stat")
	name=$(tr '\0' '\n' <"/proc/$p/environ" | grep '^POD_NAME=' || echo "POD_NAME=?")
	echo "$name: $((after - before[$p])) CPU ticks in 5 s"
done
wait "$tool"
tail -12 "$out"
rm -f "$out"
