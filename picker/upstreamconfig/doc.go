// Package upstreamconfig reads the upstream endpoint picker's configuration
// file, an EndpointPickerConfig (gateway-api-inference-extension v1.5.0, as
// its Helm chart mounts it), and maps it onto Tally's PickerConfig
// (api/v1alpha1), noting what each setting became or why it was ignored.
// LoadAny reads a file of either kind.
package upstreamconfig
