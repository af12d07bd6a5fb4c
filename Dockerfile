# syntax=docker/dockerfile:1
# Tally's endpoint picker (cmd/epp): a static binary on distroless, run as
# the distroless "nonroot" user (65532), matching the chart's securityContext.
#
# The released image is built by `make image` (hack/image), which needs no
# container engine; this file builds the same binary, with the same flags,
# for those who build with Docker. .dockerignore drops .git, so the version
# and commit come in as build arguments:
#   docker build --build-arg VERSION="$(git describe --tags --always --dirty)" \
#     --build-arg COMMIT="$(git rev-parse HEAD)" -t tally-epp .
# Without them `epp --version` says "(devel)" and "unknown".

# The builder runs on the build machine's platform and cross-compiles, so
# multi-platform builds need no emulation.
FROM --platform=$BUILDPLATFORM golang:1.26 AS builder
ARG TARGETOS=linux
ARG TARGETARCH
ARG VERSION=""
ARG COMMIT=""
WORKDIR /src

# Modules first: this layer is reused until go.mod or go.sum change.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download

COPY . .
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=${TARGETOS} GOARCH=${TARGETARCH} \
    go build -trimpath -buildvcs=false -ldflags "-s -w -X main.version=${VERSION} -X main.commit=${COMMIT}" -o /out/epp ./cmd/epp

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=""
ARG COMMIT=""
LABEL org.opencontainers.image.source="https://github.com/tallyepp/tally" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.title="tally-epp"
COPY --from=builder /out/epp /epp
USER 65532:65532
# 9002 ext_proc (gRPC), 9003 gRPC health, 9090 metrics.
EXPOSE 9002 9003 9090
ENTRYPOINT ["/epp"]
