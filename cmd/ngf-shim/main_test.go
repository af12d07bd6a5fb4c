package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestBadFlagsExitWithStatus2AndNameTheFlag(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		wantFlag string
	}{
		{[]string{"--bogus"}, "bogus"},
		{[]string{"--picker-tls=maybe"}, "picker-tls"},
		{[]string{"--listen=54800"}, "--listen"},
		{[]string{"--listen=127.0.0.1:http"}, "--listen"},
		{[]string{"-v=-1"}, "-v"},
		{[]string{"--resolve=epp"}, "resolve"},
		{[]string{"--resolve=epp=127.0.0.1,epp-2"}, `"epp-2" is not an IP`},
		{[]string{"--resolve=epp=127.0.0.1:9002,epp-2:9002"}, `"epp-2:9002" is not an IP`},
		{[]string{"--resolve=epp=127.0.0.1:0"}, "port 0"},
		{[]string{"--resolve=epp=127.0.0.1:70000"}, `"127.0.0.1:70000" is not an IP`},
		{[]string{"--resolve=epp=127.0.0.1", "--resolve=epp=127.0.0.2"}, "given twice"},
		{[]string{"stray"}, "stray"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stderr strings.Builder
			if code := run(context.Background(), tc.args, &stderr); code != exitBadUsage {
				t.Errorf("exit %d, want %d", code, exitBadUsage)
			}
			if !strings.Contains(stderr.String(), tc.wantFlag) {
				t.Errorf("stderr does not name %q:\n%s", tc.wantFlag, stderr.String())
			}
			if strings.Contains(stderr.String(), listeningLinePrefix) {
				t.Error("started listening despite a bad flag")
			}
		})
	}
}

func TestListensPrintsItsAddressAndStopsCleanly(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"--listen=127.0.0.1:0", "--picker-tls=false"}, pw)
		pw.Close()
	}()
	sc := bufio.NewScanner(pr)
	var addr string
	for sc.Scan() {
		if a, ok := strings.CutPrefix(sc.Text(), listeningLinePrefix); ok {
			addr = a
			break
		}
	}
	go io.Copy(io.Discard, pr)
	if addr == "" {
		t.Fatal("no listening line")
	}
	// Without the picker headers the shim answers 400, as NGF's does.
	resp, err := http.Post("http://"+addr, "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("status %d, want 400", resp.StatusCode)
	}
	cancel()
	select {
	case code := <-done:
		if code != exitOK {
			t.Errorf("exit %d after cancel, want %d", code, exitOK)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("did not stop")
	}
}

func TestResolveFlagMapsAHostToItsReplicas(t *testing.T) {
	o, err := parseFlags([]string{"--resolve=epp.svc=127.0.0.3, 127.0.0.2", "--resolve=other=::1"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	r := resolver(o.resolve)
	got, err := r(context.Background(), "epp.svc")
	if err != nil || strings.Join(got, " ") != "127.0.0.3 127.0.0.2" {
		t.Errorf("epp.svc resolved to %v, %v", got, err)
	}
	if got, err := r(context.Background(), "other"); err != nil || strings.Join(got, " ") != "::1" {
		t.Errorf("other resolved to %v, %v", got, err)
	}
}

func TestResolveFlagTakesAPortPerAddress(t *testing.T) {
	// The local stack's replicas: one IP, a port each.
	o, err := parseFlags([]string{"--resolve=tally-epp.e2e.svc=127.0.0.1:9002, 127.0.0.1:9102,[::1]:9202,127.0.0.3"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	got, err := resolver(o.resolve)(context.Background(), "tally-epp.e2e.svc")
	if want := "127.0.0.1:9002 127.0.0.1:9102 [::1]:9202 127.0.0.3"; err != nil || strings.Join(got, " ") != want {
		t.Errorf("resolved to %v, %v; want %s", got, err, want)
	}
}
