# Tally's build. `make help` lists the targets.
SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec

GO ?= go
CONTROLLER_GEN ?= $(GO) run sigs.k8s.io/controller-tools/cmd/controller-gen@v0.23.0
FUZZTIME ?= 2m
# `make run` settings.
POOL_NAME ?= tally-pool
POOL_NAMESPACE ?= default

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"} /^[a-zA-Z0-9_-]+:.*##/ { printf "  %-16s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

.PHONY: build
build: ## Build every binary into bin/.
	$(GO) build -o bin/ ./cmd/...

.PHONY: chart-readme
chart-readme: ## Regenerate the values table of charts/tally/README.md from values.yaml.
	$(GO) run ./hack/chartdoc

# `make image` settings. Unset, hack/image reads the version (git describe
# --tags --always --dirty), the commit (git rev-parse HEAD) and the creation
# time (SOURCE_DATE_EPOCH, else the commit's time) from the checkout.
VERSION ?=
COMMIT ?=
PLATFORMS ?= linux/amd64,linux/arm64
IMAGE_REPOSITORY ?= ghcr.io/tallyepp/tally
IMAGE_ARGS = --platforms=$(PLATFORMS) --repository=$(IMAGE_REPOSITORY) \
	$(if $(VERSION),--version=$(VERSION)) $(if $(COMMIT),--commit=$(COMMIT))

.PHONY: image
image: ## Build the picker's OCI image without a container engine: the layout bin/image/ (PLATFORMS) and bin/image.tar (this machine's platform) for docker load; reproducible.
	$(GO) run ./hack/image --out=bin/image --tarball=bin/image.tar $(IMAGE_ARGS)

.PHONY: envtest-assets
envtest-assets: ## Build (once) the kube-apiserver and etcd the tests run against.
	@hack/envtest-assets.sh >/dev/null

.PHONY: nginx
nginx: ## Install (once, with apt-get) NGINX and its NJS module, which the NGINX Gateway Fabric tests run.
	@hack/nginx.sh

# The tiers of `make test` (hack/test-packages.sh lists their packages).
# Unit: every package but the end-to-end suite, with -short, which skips
# each test that needs a process from outside its test binary (a
# kube-apiserver and etcd, NGINX, a binary of bin/) or tens of seconds of
# CPU under -race (testtier.SkipIfShort). Integration: the packages holding
# such tests, in full (their unit tests run again, about half a minute).
# End to end: test/e2e, alone.
TEST_UNIT = $(GO) test -race -short -count=1 $$(GO=$(GO) hack/test-packages.sh unit)
# test/install builds the image (cmd/epp, static and trimmed: a build cache
# of its own) on top of its API server tests: past go test's default 10
# minutes on a busy machine.
TEST_INTEGRATION = KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" TALLY_E2E_BIN_DIR="$(CURDIR)/bin" $(GO) test -race -count=1 -timeout=30m $$(GO=$(GO) hack/test-packages.sh integration)

.PHONY: test
test: ## Run the test tiers with -race, each only once the one before passed: unit, integration, end to end.
	$(TEST_UNIT)
	@$(MAKE) --no-print-directory envtest-assets nginx build
	$(TEST_INTEGRATION)
	@# The end-to-end suite runs on its own: its specs time real streams
	@# against simulators, and other packages' tests on the same cores would
	@# skew what they measure.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" TALLY_E2E_BIN_DIR="$(CURDIR)/bin" $(GO) test -race -count=1 ./test/e2e/...

.PHONY: test-unit
test-unit: ## Run the unit tier with -race: no API server, NGINX or bin/ (3.6 CPU-minutes with the build cache warm: about 2 minutes on 2 idle cores).
	$(TEST_UNIT)

.PHONY: test-integration
test-integration: envtest-assets nginx build ## Run the integration tier with -race: the packages whose tests start a kube-apiserver and etcd, NGINX or bin/ binaries, or simulate at full scale.
	$(TEST_INTEGRATION)

.PHONY: test-e2e
test-e2e: envtest-assets nginx build ## Run only the end-to-end suite (real API server, epp, simulators, dev gateway, NGINX).
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" TALLY_E2E_BIN_DIR="$(CURDIR)/bin" $(GO) test -count=1 ./test/e2e/...

.PHONY: demo
demo: envtest-assets build upstream-epp ## Start a local stack (API server, simulators, epp, dev gateway on localhost:8080), replay a burst and a trace, compare policies (Tally, the upstream picker, round-robin; Tally over a prefill/decode pool). DEMO_ARGS=--keep leaves it running.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" bin/demo --upstream-bin=bin/upstream-epp $(DEMO_ARGS)

.PHONY: fuzz
fuzz: ## Fuzz the request parser (the APIs it reads, then the model of other paths), then ext_proc streams of any message order (flow control off, then holding them), for FUZZTIME each (default 2m).
	$(GO) test -run '^$$' -fuzz='^FuzzParse$$' -fuzztime=$(FUZZTIME) ./picker/request
	$(GO) test -run '^$$' -fuzz='^FuzzParseOther$$' -fuzztime=$(FUZZTIME) ./picker/request
	$(GO) test -run '^$$' -fuzz=FuzzStreamsLeaveNothingBehind -fuzztime=$(FUZZTIME) ./picker/extproc
	$(GO) test -run '^$$' -fuzz=FuzzHeldStreamsLeaveNothingBehind -fuzztime=$(FUZZTIME) ./picker/extproc

.PHONY: bench-micro
bench-micro: ## Run the picker's Go benchmarks (one pick, parsing, hashing, request cycles in-process).
	$(GO) test -run '^$$' -bench . -benchmem ./picker/...

# The upstream picker (gateway-api-inference-extension v1.5.0 cmd/epp) that
# `make bench` runs beside Tally, built from its own module in
# test/bench/upstream. Built once (about 4 minutes on 2 cores), then reused
# while bin/upstream-epp exists; delete it to rebuild.
.PHONY: upstream-epp
upstream-epp: ## Build (once) bin/upstream-epp, the upstream picker the benchmarks compare with.
	@if [ ! -x bin/upstream-epp ]; then \
		echo "building bin/upstream-epp from test/bench/upstream (about 4 minutes the first time)" >&2; \
		cd test/bench/upstream && GOWORK=off $(GO) build -trimpath -o $(CURDIR)/bin/upstream-epp .; \
	fi

# The routing simulator's sections of docs/benchmarks.md, on the demo's
# trace, and their charts in docs/bench/: virtual time, so the numbers are
# the same on any machine (a few seconds). The tables it also prints are
# in the document, so stdout is dropped; progress stays on stderr.
ROUTESIM_BENCH = bin/routesim --trace test/data/mooncake_sample.jsonl --engines 4 --out docs/bench --doc docs/benchmarks.md
.PHONY: bench-routesim
bench-routesim: build ## Rerun only the routing simulator's sections of docs/benchmarks.md and their charts (seconds).
	$(ROUTESIM_BENCH) --name routesim >/dev/null
	@# The burst ignores --bypass and --non-streaming: the first run has it.
	$(ROUTESIM_BENCH) --name routesim-mixed --bypass 0.3 --non-streaming 0.5 --burst 0 >/dev/null
	@# Two prefill and two decode engines, Tally against llm-d-like, beside
	@# the same four engines serving both roles.
	$(ROUTESIM_BENCH) --name routesim-pd --pd >/dev/null

# BENCH_ARGS passes flags to bin/extproc-load, e.g. BENCH_ARGS=--runs=3 for
# medians of three runs of the 3-endpoint loads, alternating the pickers.
BENCH_ARGS ?=
.PHONY: bench
bench: envtest-assets build upstream-epp bench-routesim ## Run the routing simulator, then Tally and the upstream picker side by side (bursts, load, churn, 3 to 1,000 endpoints); write the tables into docs/benchmarks.md, the charts into docs/bench/ (about 10 minutes once built).
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" bin/extproc-load --tally-bin bin/epp --upstream-bin bin/upstream-epp $(BENCH_ARGS) bench --out docs/benchmarks.md

.PHONY: bench-quick
bench-quick: envtest-assets build upstream-epp bench-routesim ## The short version of `make bench` (about 2 minutes once built).
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" bin/extproc-load --tally-bin bin/epp --upstream-bin bin/upstream-epp --quick $(BENCH_ARGS) bench --out docs/benchmarks.md

.PHONY: manifests
manifests: ## Regenerate RBAC from the markers and copy the pinned InferencePool CRD into config/ and charts/.
	hack/manifests.sh

.PHONY: generate
generate: manifests ## Regenerate everything generated (deep copies of api/ types, then manifests).
	$(CONTROLLER_GEN) object paths=./api/...

.PHONY: lint
lint: ## Fail on unformatted files or go vet findings.
	@out="$$(gofmt -l $$(git ls-files '*.go'))"; if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

.PHONY: proto
proto: ## Regenerate the peer protocol's Go code (picker/replica/replicapb) from peer.proto: needs protoc (Debian: protobuf-compiler); the plugins come from the module proxy.
	GOBIN=$(CURDIR)/bin $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
	GOBIN=$(CURDIR)/bin $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
	cd picker/replica/replicapb && PATH=$(CURDIR)/bin:$$PATH protoc --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative peer.proto

.PHONY: run
run: ## Run the picker against the cluster in KUBECONFIG (POOL_NAME, POOL_NAMESPACE).
	$(GO) run ./cmd/epp --pool-name=$(POOL_NAME) --pool-namespace=$(POOL_NAMESPACE)
