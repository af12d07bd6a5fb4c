#!/usr/bin/env bash
# Builds the kube-apiserver and etcd that the envtest suites run against, from
# the Go module proxy (no binary bucket is reachable from CI), and caches them
# under bin/ keyed by version. Prints the asset directory on stdout; progress
# goes to stderr. Rebuilds only when a pinned version changes.
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
# The staging modules (k8s.io/api, k8s.io/apiserver, ...) of a kubernetes
# release v1.X.Y are published as v0.X.Y.
STAGING_VERSION="v0.${KUBE_VERSION#v1.}"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${root}/bin/k8s/kube-${KUBE_VERSION}-etcd-${ETCD_VERSION}"

if [[ -x "${dir}/kube-apiserver" && -x "${dir}/etcd" && -x "${dir}/kubectl" ]]; then
  echo "${dir}"
  exit 0
fi

log() { echo "envtest-assets: $*" >&2; }
mkdir -p "${dir}"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
export GOFLAGS=-mod=mod GOWORK=off

build_etcd() {
  [[ -x "${dir}/etcd" ]] && return
  log "building etcd ${ETCD_VERSION} (about 1 minute)"
  mkdir -p "${work}/etcd" && cd "${work}/etcd"
  cat > main.go <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  go mod init tally.local/etcd >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" >&2
  go mod tidy >&2
  go build -o "${dir}/etcd.tmp" . >&2
  mv "${dir}/etcd.tmp" "${dir}/etcd"
}

build_kube() {
  [[ -x "${dir}/kube-apiserver" && -x "${dir}/kubectl" ]] && return
  log "building kube-apiserver and kubectl ${KUBE_VERSION} (about 8 minutes the first time)"
  mkdir -p "${work}/kube/kube-apiserver" "${work}/kube/kubectl" && cd "${work}/kube"
  cat > kube-apiserver/main.go <<'GO'
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() { os.Exit(cli.Run(app.NewAPIServerCommand())) }
GO
  cat > kubectl/main.go <<'GO'
package main

import (
	"k8s.io/component-base/cli"
	"k8s.io/kubectl/pkg/cmd"
)

func main() { cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()) }
GO
  go mod init tally.local/kube >/dev/null 2>&1
  go mod download "k8s.io/kubernetes@${KUBE_VERSION}" >&2
  local modfile
  modfile="$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/${KUBE_VERSION}.mod"
  go mod edit -require="k8s.io/kubernetes@${KUBE_VERSION}"
  local m
  for m in $(grep '=> ./staging' "${modfile}" | awk '{print $1}'); do
    go mod edit -replace="${m}=${m}@${STAGING_VERSION}"
  done
  go mod tidy >&2
  go build -o "${dir}/kube-apiserver.tmp" ./kube-apiserver >&2
  mv "${dir}/kube-apiserver.tmp" "${dir}/kube-apiserver"
  go build -o "${dir}/kubectl.tmp" ./kubectl >&2
  mv "${dir}/kubectl.tmp" "${dir}/kubectl"
}

build_etcd
build_kube
log "assets ready in ${dir}"
echo "${dir}"
