//go:build unix

package testenv

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// A second holder of a machine lock waits, saying so, until the first
// releases it.
func TestLockMachineMakesASecondHolderWait(t *testing.T) {
	name := fmt.Sprintf("locktest-%d", os.Getpid())
	release, err := LockMachine(name, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	said := ""
	got := make(chan func())
	go func() {
		var w bytes.Buffer
		second, err := LockMachine(name, &w)
		if err != nil {
			t.Error(err)
		}
		mu.Lock()
		said = w.String()
		mu.Unlock()
		got <- second
	}()
	select {
	case <-got:
		t.Fatal("a second holder took the lock while the first held it")
	case <-time.After(200 * time.Millisecond):
	}
	release()
	select {
	case second := <-got:
		if second != nil {
			second()
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the second holder did not get the lock once the first released it")
	}
	mu.Lock()
	defer mu.Unlock()
	if !strings.Contains(said, "waiting for it to finish") {
		t.Errorf("the second holder said %q, want that it waits", said)
	}
	_ = os.Remove(filepath.Join(os.TempDir(), "tally-"+name+".lock"))
}
