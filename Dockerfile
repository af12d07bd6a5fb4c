# syntax=docker/dockerfile:1
# Tally's endpoint picker (cmd/epp): a static binary on distroless, run as
# the distroless "nonroot" user (65532), matching the chart's securityContext.

# The builder runs on the build machine's platform and cross-compiles, so
# multi-platform builds need no emulation.
FROM --platform=$BUILDPLATFORM golang:1.26 AS builder
ARG TARGETOS=linux
ARG TARGETARCH
WORKDIR /src

# Modules first: this layer is reused until go.mod or go.sum change.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download

COPY . .
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=${TARGETOS} GOARCH=${TARGETARCH} \
    go build -trimpath -ldflags "-s -w" -o /out/epp ./cmd/epp

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=builder /out/epp /epp
USER 65532:65532
# 9002 ext_proc (gRPC), 9003 gRPC health, 9090 metrics.
EXPOSE 9002 9003 9090
ENTRYPOINT ["/epp"]
