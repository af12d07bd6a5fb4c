#!/usr/bin/env bash
# Regenerates the manifests derived from code and modules (the Makefile's
# "manifests" target):
#   - config/rbac/role.yaml from the +kubebuilder:rbac markers in controllers/
#     (the namespaced Role) and cmd/epp (the ClusterRole for metrics auth),
#   - the InferencePool CRD in config/crd/bases and charts/tally/crds, copied
#     unchanged from the gateway-api-inference-extension module go.mod pins.
# Run from anywhere; it works from the repository root.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"

go run sigs.k8s.io/controller-tools/cmd/controller-gen@v0.23.0 \
  rbac:roleName=tally-picker paths="./controllers/...;./cmd/epp/..." \
  output:rbac:artifacts:config=config/rbac

crd="inference.networking.k8s.io_inferencepools.yaml"
src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/gateway-api-inference-extension)/config/crd/bases/${crd}"
for dir in config/crd/bases charts/tally/crds; do
  mkdir -p "${dir}"
  cp "${src}" "${dir}/${crd}"
  # The module cache is read-only; the copies are ordinary repository files.
  chmod 644 "${dir}/${crd}"
done
