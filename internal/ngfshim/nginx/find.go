package nginx

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// Where Find looks: the environment variables override the defaults
// (Debian's nginx and libnginx-mod-http-js, which hack/nginx.sh installs).
const (
	BinEnv      = "TALLY_NGINX"
	JSModuleEnv = "TALLY_NGINX_JS_MODULE"
	// OptionalEnv set to 1 lets a test that needs NGINX skip when Find
	// finds none. Otherwise a missing NGINX fails it: CI installs NGINX
	// (hack/nginx.sh, run by `make test`), and a silently skipped test
	// proves nothing.
	OptionalEnv = "TALLY_NGINX_OPTIONAL"
	// binFallback is where Debian installs nginx, off a user's PATH.
	binFallback = "/usr/sbin/nginx"
)

// Find returns the nginx binary and the NJS module to run, or an error
// saying what is missing and how to install it.
func Find() (bin, jsModule string, err error) {
	bin = os.Getenv(BinEnv)
	if bin == "" {
		if bin, err = exec.LookPath("nginx"); err != nil {
			bin = binFallback
		}
	}
	jsModule = os.Getenv(JSModuleEnv)
	if jsModule == "" {
		jsModule = DefaultJSModule
	}
	var errs []error
	if _, err := os.Stat(bin); err != nil {
		errs = append(errs, fmt.Errorf("the nginx binary: %w (install it with hack/nginx.sh, or name it in $%s)", err, BinEnv))
	}
	if _, err := os.Stat(jsModule); err != nil {
		errs = append(errs, fmt.Errorf("the NJS module: %w (install it with hack/nginx.sh, or name it in $%s)", err, JSModuleEnv))
	}
	return bin, jsModule, errors.Join(errs...)
}

// Optional reports whether OptionalEnv allows skipping without NGINX.
func Optional() bool { return os.Getenv(OptionalEnv) == "1" }

// Args are nginx's arguments to run the configuration rendered for dir in
// the foreground. -e sends the errors logged before the configuration is
// read to stderr, not to the compiled-in path under /var/log.
func Args(dir string) []string {
	return []string{"-p", dir + string(filepath.Separator), "-c", filepath.Join(dir, ConfigName), "-e", "stderr", "-g", "daemon off;"}
}

// ConfigName is the configuration's file name in Dir.
const ConfigName = "nginx.conf"
