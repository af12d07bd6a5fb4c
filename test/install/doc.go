// Package install tests the ways Tally is installed: the Helm chart in
// charts/tally, the kustomize bases in config/ and the picker they deploy.
// The chart is rendered with the Helm SDK for its defaults and for each
// optional resource, linted, and fed bad values; every object it and
// `kubectl kustomize config/default` produce is then applied to a real API
// server, and the picker binary is run with the rendered Deployment's
// arguments as the rendered ServiceAccount, which must be enough for it to
// become ready and no more. TestDocCommands runs the commands and YAML
// blocks of README.md, docs/install.md and the chart's README the same way.
// The container image is built as `make image` builds it
// (internal/ociimage), read back from its OCI layout and its binary run;
// the release workflow, which needs a registry, is read.
//
// The invariant not to break: every kind of object the chart or the kustomize
// bases can produce is applied to the real API server with strict field
// validation; a render-only check never stands in for that, because a
// misplaced field renders fine and is dropped or refused only by the server.
package install
