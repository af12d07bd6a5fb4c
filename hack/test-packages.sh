#!/usr/bin/env bash
# Prints the packages of one tier of `make test`, one a line:
#   unit         every package but the end-to-end suite; run with -short, so
#                each test that needs a process from outside its test binary
#                or tens of seconds of CPU (testtier.SkipIfShort) skips
#   integration  the packages whose tests call testtier.SkipIfShort (they
#                import internal/testtier), but the end-to-end suite; run in
#                full
#   e2e          the end-to-end suite, run alone
# Every test of the module is thereby in the unit tier, or in a package of
# the integration or end-to-end tier.
set -euo pipefail
cd "$(dirname "$0")/.."

go="${GO:-go}"
module="$("${go}" list -m)"
e2e="${module}/test/e2e"

case "${1:-}" in
unit)
  "${go}" list ./... | grep -vx "${e2e}"
  ;;
integration)
  "${go}" list -f '{{.ImportPath}}{{range .TestImports}} {{.}}{{end}}{{range .XTestImports}} {{.}}{{end}}' ./... |
    awk -v tier="${module}/internal/testtier" -v e2e="${e2e}" \
      '$1 != e2e { for (i = 2; i <= NF; i++) if ($i == tier) { print $1; break } }'
  ;;
e2e)
  echo "${e2e}"
  ;;
*)
  echo "usage: $0 unit|integration|e2e" >&2
  exit 2
  ;;
esac
