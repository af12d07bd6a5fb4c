// Command upstream-epp is the upstream endpoint picker
// (sigs.k8s.io/gateway-api-inference-extension v1.5.0, cmd/epp) built as it
// ships, with no plugin of our own, so that `make bench` can run it side by
// side with Tally through the same scenarios. It lives in a module of its
// own so that Tally's go.mod never depends on the upstream picker.
package main

import (
	"os"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/gateway-api-inference-extension/cmd/epp/runner"
)

func main() {
	if err := runner.NewRunner().Run(ctrl.SetupSignalHandler()); err != nil {
		os.Exit(1)
	}
}
