package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/tallyepp/tally/internal/syncbuf"
)

// runMainEnv makes the test binary run main instead of the tests, so a test
// can start the command as a process and signal it.
const runMainEnv = "MODELSIM_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) == "1" {
		main()
		return
	}
	os.Exit(m.Run())
}

func TestInvalidFlagsExitTwoNamingTheFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--nope"}, "-nope"},
		{[]string{"--time-scale", "fast"}, "time-scale"},
		{[]string{"--time-scale", "0"}, "--time-scale: 0 is invalid"},
		{[]string{"--error-rate", "1.5"}, "--error-rate: 1.5 is invalid: must be from 0 to 1"},
		{[]string{"--hang-rate", "-0.1"}, "--hang-rate: -0.1 is invalid"},
		{[]string{"--kv-blocks", "0"}, "--kv-blocks: 0 is invalid"},
		{[]string{"--chars-per-token", "0"}, "--chars-per-token: 0 is invalid"},
		{[]string{"--added-latency", "-1s"}, "--added-latency: -1s is invalid"},
		{[]string{"--addr", "127.0.0.2"}, "-addr"},
		{[]string{"--addr", "127.0.0.2:0,127.0.0.2:0"}, "given twice"},
		{[]string{"--model", ""}, "--model"},
		{[]string{"extra"}, `unexpected argument "extra"`},
	} {
		var stderr bytes.Buffer
		code := run(t.Context(), tc.args, &stderr)
		if code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("run(%q) = %d, stderr %q; want 2 and a message containing %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

func TestParseAcceptsRepeatedAndCommaSeparatedAddrs(t *testing.T) {
	o, err := parse([]string{"--addr", "127.0.0.2:8000,127.0.0.3:8000", "--addr=127.0.0.4:8000", "--time-scale", "10", "--kv-blocks", "1000"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := o.addrs.String(); got != "127.0.0.2:8000,127.0.0.3:8000,127.0.0.4:8000" {
		t.Errorf("addrs = %s", got)
	}
	if o.cfg.TimeScale != 10 || o.cfg.Engine.KVBlocks != 1000 || o.cfg.Model != "sim-model" || o.cfg.CharsPerToken != 4 {
		t.Errorf("config %+v", o.cfg)
	}
	o, err = parse(nil, io.Discard)
	if err != nil || o.addrs.String() != defaultAddr {
		t.Errorf("no --addr: addrs %s, err %v; want %s", o.addrs.String(), err, defaultAddr)
	}
}

func TestServesOneEnginePerAddressAndStopsOnSIGTERM(t *testing.T) {
	cmd := exec.Command(os.Args[0], "--addr", "127.0.0.2:0,127.0.0.3:0", "--time-scale", "10", "--shutdown-grace", "300ms")
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-exited
		}
	})

	// The "serving" log lines give the ports actually bound.
	serving := regexp.MustCompile(`msg=serving addr=(127\.0\.0\.[23]:\d+)`)
	addrs := make(chan string, 2)
	var logs bytes.Buffer
	logDone := make(chan struct{})
	go func() {
		defer close(logDone)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			logs.WriteString(sc.Text() + "\n")
			if m := serving.FindStringSubmatch(sc.Text()); m != nil {
				addrs <- m[1]
			}
		}
	}()
	go func() {
		<-logDone // read all of stderr before Wait closes it
		exited <- cmd.Wait()
	}()
	var urls []string
	for range 2 {
		select {
		case a := <-addrs:
			urls = append(urls, "http://"+a)
		case err := <-exited:
			t.Fatalf("modelsim exited early: %v\n%s", err, logs.String())
		case <-time.After(30 * time.Second):
			t.Fatal("no serving lines within 30s")
		}
	}

	// A request to the first engine shows in its metrics only.
	resp, err := http.Post(urls[0]+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"`+strings.Repeat("p", 400)+`","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("completion status %d", resp.StatusCode)
	}
	for i, want := range []float64{100, 0} {
		if got := prefixQueries(t, urls[i]); got != want {
			t.Errorf("engine %d (%s) prefix_cache_queries_total = %v, want %v", i, urls[i], got, want)
		}
	}

	// A stream in flight is cut after the grace period and the process
	// exits 0.
	stream, err := http.Post(urls[1]+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hello","max_tokens":100000,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Body.Close()
	body := bufio.NewReader(stream.Body)
	if line, err := body.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first stream line %q: %v", line, err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("modelsim exited with %v after SIGTERM\n%s", err, logs.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("modelsim still running 30s after SIGTERM")
	}
	if _, err := io.Copy(io.Discard, body); err == nil {
		// A clean end is fine too, as long as the stream ended.
		t.Log("stream ended cleanly at shutdown")
	}
	if !strings.Contains(logs.String(), "shutting down") {
		t.Errorf("no shutdown log line:\n%s", logs.String())
	}
}

func TestRunStopsWhenItsContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan int, 1)
	var stderr syncbuf.Buffer
	go func() { done <- run(ctx, []string{"--addr", "127.0.0.2:0"}, &stderr) }()
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(stderr.String(), "msg=serving") {
		if time.Now().After(deadline) {
			t.Fatalf("not serving after 30s: %s", stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("run returned %d, want 0\n%s", code, stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("run did not return after its context ended")
	}
}

func TestListenFailureExitsOne(t *testing.T) {
	var stderr bytes.Buffer
	// 192.0.2.1 (TEST-NET-1) is not an address of this machine: bind fails
	// without any traffic leaving it.
	if code := run(t.Context(), []string{"--addr", "127.0.0.2:0,192.0.2.1:8000"}, &stderr); code != 1 || !strings.Contains(stderr.String(), "--addr 192.0.2.1:8000") {
		t.Fatalf("run = %d, stderr %q; want 1 naming the address", code, stderr.String())
	}
}

func prefixQueries(t *testing.T, url string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	fam := fams["vllm:prefix_cache_queries_total"]
	if fam == nil || len(fam.Metric) != 1 {
		t.Fatalf("prefix_cache_queries_total: %v", fam)
	}
	return fam.Metric[0].Counter.GetValue()
}
