package stack

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/api/v1alpha2"
	"github.com/tallyepp/tally/internal/testenv"
)

// apiServer is the real API server below a Stack or a Cluster, with an
// administrator's client and kubeconfig and a temporary directory for the
// files of what runs beside it. Its zero value is stopped.
type apiServer struct {
	env        *envtest.Environment
	restConfig *rest.Config
	kube       client.Client
	dir        string
	kubeconfig string
}

// start starts the API server; name names the temporary directory and the
// kubeconfig's user. clientConfig, if not nil, adjusts a copy of the
// connection for the client (restConfig stays the API server's). On error
// what it started is left for stop.
func (a *apiServer) start(name string, clientConfig func(*rest.Config)) error {
	var err error
	if a.dir, err = os.MkdirTemp("", name+"-"); err != nil {
		return fmt.Errorf("creating a temporary directory: %w", err)
	}
	if a.env, a.restConfig, err = testenv.Start(); err != nil {
		return fmt.Errorf("starting the API server: %w", err)
	}
	cfg := a.restConfig
	if clientConfig != nil {
		cfg = rest.CopyConfig(cfg)
		clientConfig(cfg)
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return err
	}
	if err := infv1.Install(scheme); err != nil {
		return err
	}
	if err := v1alpha2.Install(scheme); err != nil {
		return err
	}
	if a.kube, err = client.New(cfg, client.Options{Scheme: scheme}); err != nil {
		return fmt.Errorf("creating an API client: %w", err)
	}
	// The picker and the gateway run as an administrator too: RBAC is the
	// install tests' concern, not this one's.
	user, err := a.env.AddUser(envtest.User{Name: name, Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return fmt.Errorf("adding an API server user: %w", err)
	}
	data, err := user.KubeConfig()
	if err != nil {
		return fmt.Errorf("writing a kubeconfig: %w", err)
	}
	a.kubeconfig = filepath.Join(a.dir, "kubeconfig")
	if err := os.WriteFile(a.kubeconfig, data, 0o600); err != nil {
		return fmt.Errorf("writing a kubeconfig: %w", err)
	}
	return nil
}

// stop stops the API server and removes the temporary directory. It is safe
// to call more than once.
func (a *apiServer) stop() error {
	var errs []error
	if a.env != nil {
		if err := a.env.Stop(); err != nil {
			errs = append(errs, fmt.Errorf("stopping the API server: %w", err))
		}
		a.env = nil
	}
	if a.dir != "" {
		errs = append(errs, os.RemoveAll(a.dir))
		a.dir = ""
	}
	return errors.Join(errs...)
}
