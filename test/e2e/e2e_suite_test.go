// Package e2e runs Tally end to end: a real kube-apiserver and etcd, the
// picker (cmd/epp) and the dev gateway (cmd/devgateway) as processes built
// from this tree, and simulated vLLM servers on loopback pod IPs; the NGINX
// specs put a real NGINX and NGINX Gateway Fabric's shim (cmd/ngf-shim) in
// front of a picker instead. It checks
// what a user of the pool sees: where requests go as pods come and go, how a
// burst is spread, that responses pass through whole, the failure modes,
// and that the picker's ledger drains.
//
// The routing specs share one stack and run in order; a spec that changes
// the pool (a pod's readiness, the failure mode, the picker's life) puts it
// back before it ends. Specs that need a pool of their own (three pods, a
// picker configuration of their own) start their own stack with startStack.
package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/tallyepp/tally/internal/stack"
	"github.com/tallyepp/tally/internal/testenv"
	"github.com/tallyepp/tally/internal/testtier"
)

func TestE2E(t *testing.T) {
	testtier.SkipIfShort(t, "a kube-apiserver and etcd (envtest), the epp, devgateway and ngf-shim binaries, and NGINX")
	// The suite's pods listen on fixed loopback addresses: a second suite
	// started on the same machine (another clone's `make test`) waits for
	// this one instead of failing on an address in use.
	if release, err := testenv.LockMachine("e2e", os.Stderr); err != nil {
		t.Logf("running without the machine lock: %v", err)
	} else {
		defer release()
	}
	RegisterFailHandler(Fail)
	RunSpecs(t, "End-to-end suite")
}

var st *stack.Stack

// binDir holds the epp and devgateway binaries every stack runs, and the
// ngf-shim that stacks with NGINX in front run.
var binDir string

// binDirEnv names a directory holding already built epp, devgateway and
// ngf-shim binaries; when it is unset the suite builds them from this tree.
const binDirEnv = "TALLY_E2E_BIN_DIR"

// pickerArgsEnv holds flags (space-separated) given to every picker after
// the spec's own, to check that a spec can fail: with
// TALLY_E2E_PICKER_ARGS=--refresh-metrics-interval=0 the specs of the
// picker's loop with the engines fail.
const pickerArgsEnv = "TALLY_E2E_PICKER_ARGS"

var _ = BeforeSuite(func(ctx SpecContext) {
	// envtest logs through controller-runtime's logger.
	logf.SetLogger(zap.New(zap.WriteTo(GinkgoWriter), zap.UseDevMode(true)))
	binDir = os.Getenv(binDirEnv)
	if binDir == "" {
		root, err := testenv.RepoRoot()
		Expect(err).NotTo(HaveOccurred())
		binDir = GinkgoT().TempDir()
		// The same build settings as `make build`, so the build cache
		// serves both.
		build := exec.CommandContext(ctx, "go", "build", "-o", binDir+string(filepath.Separator), "./cmd/epp", "./cmd/devgateway", "./cmd/ngf-shim")
		build.Dir = root
		build.Stdout, build.Stderr = GinkgoWriter, GinkgoWriter
		Expect(build.Run()).To(Succeed(), "building cmd/epp, cmd/devgateway and cmd/ngf-shim")
	}

	st = startStack(ctx, stack.Options{
		Namespace:  "e2e",
		PoolName:   "e2e-pool",
		Pods:       4,
		FirstPodIP: firstPodIP,
		TimeScale:  10,
	})
}, NodeTimeout(8*time.Minute)) // a cold build of cmd/epp takes minutes on two cores

// startStack starts a stack of the suite's binaries, its processes' output
// going to the spec's output, and stops it when the node that started it
// ends (the suite, or an Ordered container's BeforeAll).
func startStack(ctx context.Context, opts stack.Options) *stack.Stack {
	GinkgoHelper()
	opts.BinDir = binDir
	opts.Output = GinkgoWriter
	opts.PickerArgs = append(opts.PickerArgs, strings.Fields(os.Getenv(pickerArgsEnv))...)
	s, err := stack.Start(ctx, opts)
	Expect(err).NotTo(HaveOccurred())
	DeferCleanup(func() {
		Expect(s.Stop()).To(Succeed())
	})
	return s
}

// eventually polls with the suite's usual interval.
func eventually(ctx context.Context, f any) AsyncAssertion {
	return Eventually(ctx, f).WithPolling(50 * time.Millisecond)
}
