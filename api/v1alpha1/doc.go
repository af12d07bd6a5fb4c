// Package v1alpha1 holds Tally's own API: the picker configuration file
// (kind PickerConfig) read from --config-file or --config-text.
//
// Invariant: a PickerConfig returned by Load is defaulted and valid; code that
// consumes it never re-checks or re-defaults a field.
// +kubebuilder:object:generate=true
package v1alpha1
