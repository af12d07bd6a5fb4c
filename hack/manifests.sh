#!/usr/bin/env bash
# Regenerates the manifests derived from code and modules (the Makefile's
# "manifests" target):
#   - config/rbac/role.yaml from the +kubebuilder:rbac markers in controllers/
#     (the namespaced Role) and cmd/epp (the ClusterRole for metrics auth),
#   - the InferencePool CRD in config/crd/bases and charts/tally/crds, copied
#     unchanged from the gateway-api-inference-extension module go.mod pins,
#   - the InferenceObjective and InferenceModelRewrite CRDs beside it, from
#     that module's v1.5.0 (v1.6.0 no longer has them; api/v1alpha2 declares
#     their types), each under one comment line naming its source.
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

# Pinned apart from go.mod: v1.6.0, which go.mod pins, no longer has
# InferenceObjective or InferenceModelRewrite (test/manifests checks the
# copies against v1.5.0).
v1alpha2_version="v1.5.0"
v1alpha2_dir="$(go mod download -json "sigs.k8s.io/gateway-api-inference-extension@${v1alpha2_version}" |
  sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
for v1alpha2_crd in inference.networking.x-k8s.io_inferenceobjectives.yaml inference.networking.x-k8s.io_inferencemodelrewrites.yaml; do
  for dir in config/crd/bases charts/tally/crds; do
    {
      echo "# Source: gateway-api-inference-extension ${v1alpha2_version} config/crd/bases/${v1alpha2_crd} (Apache-2.0), unchanged below this line; copied by hack/manifests.sh."
      cat "${v1alpha2_dir}/config/crd/bases/${v1alpha2_crd}"
    } >"${dir}/${v1alpha2_crd}"
  done
done
