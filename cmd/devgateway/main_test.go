package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/internal/syncbuf"
	"github.com/tallyepp/tally/picker/extproc"
)

func noEnv(string) string { return "" }

func TestBadFlagsExitWithStatus2AndNameTheFlag(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		wantFlag string
	}{
		{[]string{"--bogus"}, "bogus"},
		{[]string{"--picker-tls=maybe"}, "picker-tls"},
		{[]string{"--picker-timeout=soon"}, "picker-timeout"},
		{[]string{"--picker-timeout=0s"}, "--picker-timeout"},
		{[]string{"--failure-mode=FailSometimes"}, "--failure-mode"},
		{[]string{"--endpoints=10.0.0.1"}, "--endpoints"},
		{[]string{"--endpoints=10.0.0.1:8000,pod-a:8000"}, "--endpoints"},
		{[]string{"--endpoints=10.0.0.1:0"}, "--endpoints"},
		{[]string{"--listen=8080"}, "--listen"},
		{[]string{"--listen=localhost:http"}, "--listen"},
		{[]string{"--picker-addr=localhost:0"}, "--picker-addr"},
		{[]string{"--picker-addr=127.0.0.1:9002,127.0.0.2"}, `"127.0.0.2" of`},
		{[]string{"--picker-addr=127.0.0.1:9002,"}, "--picker-addr"},
		{[]string{"--pool-name=pool"}, "--pool-namespace"},
		{[]string{"--pool-namespace=ns"}, "--pool-namespace"},
		{[]string{"--kubeconfig=/tmp/kc"}, "--kubeconfig"},
		{[]string{"-v=-1"}, "-v"},
		{[]string{"stray"}, "stray"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stderr bytes.Buffer
			code := run(context.Background(), tc.args, noEnv, &stderr)
			if code != exitBadUsage {
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

func TestParseFlags(t *testing.T) {
	env := func(k string) string {
		return map[string]string{"NAMESPACE": "inference", "KUBECONFIG": "/home/kc"}[k]
	}
	o, err := parseFlags([]string{
		"--listen=127.0.0.1:0", "--picker-addr=[::1]:9002", "--picker-tls=false", "--picker-timeout=3s",
		"--pool-name=llama", "--failure-mode=FailOpen", "--endpoints= 127.0.0.2:8000,[::1]:8001",
	}, env, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.listen != "127.0.0.1:0" || strings.Join(o.pickerAddrs, ",") != "[::1]:9002" || o.pickerTLS || o.pickerTimeout != 3*time.Second {
		t.Errorf("addresses and picker settings: %+v", o)
	}
	if o.poolName != "llama" || o.poolNamespace != "inference" || o.kubeconfig != "/home/kc" {
		t.Errorf("pool settings %q/%q kubeconfig %q, want llama in $NAMESPACE and $KUBECONFIG", o.poolNamespace, o.poolName, o.kubeconfig)
	}
	v := o.overrides.apply(PoolView{FailureMode: infv1.EndpointPickerFailClose, Endpoints: []string{"10.0.0.1:8000"}})
	if v.FailureMode != infv1.EndpointPickerFailOpen || strings.Join(v.Endpoints, ",") != "127.0.0.2:8000,[::1]:8001" {
		t.Errorf("overrides gave %+v", v)
	}

	several, err := parseFlags([]string{"--picker-addr=127.0.0.1:9002, 127.0.0.2:9002,[::1]:9003"}, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(several.pickerAddrs, " "); got != "127.0.0.1:9002 127.0.0.2:9002 [::1]:9003" {
		t.Errorf("--picker-addr list gave %q", got)
	}

	d, err := parseFlags(nil, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if d.listen != "localhost:8080" || strings.Join(d.pickerAddrs, ",") != "localhost:9002" || !d.pickerTLS {
		t.Errorf("defaults %+v", d)
	}
	if v := d.overrides.apply(PoolView{FailureMode: infv1.EndpointPickerFailClose, Endpoints: []string{"10.0.0.1:8000"}}); v.FailureMode != infv1.EndpointPickerFailClose || len(v.Endpoints) != 1 {
		t.Errorf("no overrides changed the view: %+v", v)
	}
}

// TestRunServesOverTLSAndStopsCleanly runs the command as the demo does:
// the default --picker-tls against a picker with a self-signed certificate,
// the listening line on stderr, and a clean stop when the context (the
// signal) ends.
func TestRunServesOverTLSAndStopsCleanly(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "from the model server")
	})
	picker := newTestPicker(pickerBehavior{destination: up.addr()})
	// The certificate the picker generates for itself when no --cert-path
	// is given: the one the gateway meets by default.
	tlsConfig, err := extproc.ServerTLS("")
	if err != nil {
		t.Fatal(err)
	}
	creds := credentials.NewTLS(tlsConfig)
	pickerAddr, _ := startPicker(t, picker, grpc.Creds(creds))

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	stderr := &syncbuf.Buffer{}
	exited := make(chan int, 1)
	go func() {
		exited <- run(ctx, []string{"--listen=127.0.0.1:0", "--picker-addr=" + pickerAddr}, noEnv, stderr)
	}()

	listening := regexp.MustCompile(`(?m)^devgateway listening on (127\.0\.0\.1:\d+)$`)
	var addr string
	for deadline := time.Now().Add(testDeadline); addr == ""; {
		if m := listening.FindStringSubmatch(stderr.String()); m != nil {
			addr = m[1]
			break
		}
		select {
		case code := <-exited:
			t.Fatalf("exited with %d before listening:\n%s", code, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no listening line on stderr:\n%s", stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}

	resp, err := newClient(t).Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(got) != "from the model server" {
		t.Errorf("got %d %q", resp.StatusCode, got)
	}
	if rec := picker.record(t); rec.servedBy != up.addr() {
		t.Errorf("served-by %q, want %q", rec.servedBy, up.addr())
	}

	stop()
	select {
	case code := <-exited:
		if code != exitOK {
			t.Errorf("exit %d after the stop signal, want 0:\n%s", code, stderr.String())
		}
	case <-time.After(testDeadline):
		t.Fatal("did not stop after the stop signal")
	}
}
