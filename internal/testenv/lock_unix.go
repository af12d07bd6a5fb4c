//go:build unix

package testenv

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
)

// LockMachine takes the machine-wide lock named name, waiting (and saying
// so on w) while another process holds it, and returns its release. Suites
// that listen on fixed loopback addresses take one, so that two of them
// started on one machine run one after the other instead of failing on an
// address in use.
func LockMachine(name string, w io.Writer) (release func(), err error) {
	path := filepath.Join(os.TempDir(), "tally-"+name+".lock")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDONLY, 0o666) // flock needs no write access
	if err != nil {
		return nil, fmt.Errorf("opening the lock %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		fmt.Fprintf(w, "another %s run holds %s on this machine: waiting for it to finish\n", name, path)
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
			f.Close()
			return nil, fmt.Errorf("taking the lock %s: %w", path, err)
		}
	}
	return func() { f.Close() }, nil // closing the file releases the lock
}
