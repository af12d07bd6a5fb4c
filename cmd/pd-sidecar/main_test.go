package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/tallyepp/tally/internal/syncbuf"
)

func TestInvalidFlagsExit2NamingTheFlag(t *testing.T) {
	for _, c := range []struct {
		args []string
		flag string
	}{
		{[]string{"--decoder", "127.0.0.1:8200"}, "--decoder"},
		{[]string{"--addr", "8000"}, "--addr"},
		{[]string{"--shutdown-grace", "-1s"}, "--shutdown-grace"},
	} {
		var stderr bytes.Buffer
		if code := run(context.Background(), c.args, &stderr); code != 2 || !strings.Contains(stderr.String(), c.flag) {
			t.Errorf("run %v: exit %d, %q; want 2 naming %s", c.args, code, stderr.String(), c.flag)
		}
	}
}

// The command serves the sidecar: a request without the prefiller header
// reaches the decoder, and it exits 0 when told to stop.
func TestServesAndStops(t *testing.T) {
	decoder := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "decoder saw %s", r.URL.Path)
	}))
	defer decoder.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var stderr syncbuf.Buffer
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"--addr", "127.0.0.1:0", "--decoder", decoder.URL}, &stderr) }()

	addrRE := regexp.MustCompile(`msg=serving addr=(\S+)`)
	var addr string
	for deadline := time.Now().Add(5 * time.Second); addr == "" && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if m := addrRE.FindStringSubmatch(stderr.String()); m != nil {
			addr = m[1]
		}
	}
	if addr == "" {
		cancel()
		t.Fatalf("no serving line in %q", stderr.String())
	}
	resp, err := http.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "decoder saw /v1/completions" {
		t.Fatalf("answer %q; want the decoder's", b)
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exit %d after shutdown, want 0; log %q", code, stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after shutdown")
	}
}
