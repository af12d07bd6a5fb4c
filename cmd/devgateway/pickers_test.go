package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/tallyepp/tally/internal/envoy"
)

// streamsSeen drains the records of the streams p has ended so far.
func streamsSeen(p *testPicker) []*streamRecord {
	var out []*streamRecord
	for {
		select {
		case r := <-p.records:
			out = append(out, r)
		default:
			return out
		}
	}
}

func TestSpreadsStreamsOverThePickersInTurn(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok")
	})
	var pickers []*testPicker
	var clients []*envoy.Client
	for range 3 {
		p := newTestPicker(pickerBehavior{destination: up.addr()})
		_, c := startPicker(t, p)
		pickers = append(pickers, p)
		clients = append(clients, c)
	}
	base := startGateway(t, &Gateway{Pickers: clients})

	const requests = 7
	for i := range requests {
		resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(got) != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, got)
		}
	}
	// In turn from the first: 3, 2 and 2 streams, each ended cleanly.
	for j, want := range []int{3, 2, 2} {
		for range want {
			if rec := pickers[j].record(t); rec.end != nil {
				t.Errorf("picker %d: a stream ended with %v", j, rec.end)
			}
		}
		if extra := streamsSeen(pickers[j]); len(extra) != 0 {
			t.Errorf("picker %d got %d streams, want %d", j, want+len(extra), want)
		}
	}
}

func TestAStreamThatFailsBeforeAnAnswerIsRetriedOnTheNextPicker(t *testing.T) {
	// 100 KiB: the retry sends a body read whole, not the client's stream.
	body := strings.Repeat("y", 100<<10)
	for _, tc := range []struct {
		name  string
		first func(t *testing.T) (*envoy.Client, *testPicker)
	}{
		{"connection refused", func(t *testing.T) (*envoy.Client, *testPicker) {
			return pickerClient(t, closedAddr(t)), nil
		}},
		{"the picker fails the stream", func(t *testing.T) (*envoy.Client, *testPicker) {
			p := newTestPicker(pickerBehavior{failBeforeDecision: true})
			_, c := startPicker(t, p)
			return c, p
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
				_, _ = io.WriteString(w, "served")
			})
			firstClient, firstPicker := tc.first(t)
			second := newTestPicker(pickerBehavior{destination: up.addr()})
			_, secondClient := startPicker(t, second)
			base := startGateway(t, &Gateway{Pickers: []*envoy.Client{firstClient, secondClient}})

			resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			got, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || string(got) != "served" {
				t.Fatalf("status %d %q, want 200 through the second picker", resp.StatusCode, got)
			}
			rec := second.record(t)
			if string(rec.requestBody) != body || rec.end != nil {
				t.Errorf("the retry's picker got %d body bytes (want %d), stream end %v", len(rec.requestBody), len(body), rec.end)
			}
			if upBody, _, _ := up.only(t); !bytes.Equal(upBody, []byte(body)) {
				t.Errorf("upstream got %d bytes, want %d", len(upBody), len(body))
			}
			if firstPicker != nil {
				if rec := firstPicker.record(t); rec.end == nil {
					t.Error("the first picker's stream ended cleanly, want its failure")
				}
			}
		})
	}
}

func TestOnlyOneRetryThenTheFailureMode(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {})
	var pickers []*testPicker
	var clients []*envoy.Client
	for range 3 {
		p := newTestPicker(pickerBehavior{failBeforeDecision: true})
		_, c := startPicker(t, p)
		pickers = append(pickers, p)
		clients = append(clients, c)
	}
	base := startGateway(t, &Gateway{
		Pickers: clients,
		Pool: func() PoolView {
			return PoolView{FailureMode: infv1.EndpointPickerFailClose, Endpoints: []string{up.addr()}}
		},
	})
	resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("status %d, want 503 (FailClose after the retry failed too)", resp.StatusCode)
	}
	pickers[0].record(t)
	pickers[1].record(t)
	if extra := streamsSeen(pickers[2]); len(extra) != 0 {
		t.Errorf("the third picker got %d streams: a request is retried once", len(extra))
	}
	if n := up.requests.Load(); n != 0 {
		t.Errorf("FailClose sent %d requests upstream", n)
	}
}

func TestAStreamThePickerAnsweredIsNotRetried(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "served")
	})
	// The first picker decides, then breaks: the response still completes
	// (best effort) and no second picker sees the request.
	first := newTestPicker(pickerBehavior{destination: up.addr(), breakOnResponse: "headers"})
	second := newTestPicker(pickerBehavior{destination: up.addr()})
	_, c1 := startPicker(t, first)
	_, c2 := startPicker(t, second)
	base := startGateway(t, &Gateway{Pickers: []*envoy.Client{c1, c2}})
	resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(got) != "served" {
		t.Errorf("status %d %q, want 200 served", resp.StatusCode, got)
	}
	first.record(t)
	if n := up.requests.Load(); n != 1 {
		t.Errorf("upstream got %d requests, want 1", n)
	}
	if extra := streamsSeen(second); len(extra) != 0 {
		t.Errorf("the second picker got %d streams for a request the first answered", len(extra))
	}
}

func TestStreamsGoOnlyToPickersWhoseHealthCheckPasses(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok")
	})
	// Picker 0 serves no health (counted healthy), picker 1 is not ready,
	// picker 2 is.
	var pickers []*testPicker
	var clients []*envoy.Client
	var conns []grpc.ClientConnInterface
	for i := range 3 {
		p := newTestPicker(pickerBehavior{destination: up.addr()})
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := grpc.NewServer()
		extprocv3.RegisterExternalProcessorServer(srv, p)
		if i > 0 {
			h := health.NewServer()
			st := healthpb.HealthCheckResponse_SERVING
			if i == 1 {
				st = healthpb.HealthCheckResponse_NOT_SERVING
			}
			h.SetServingStatus(extProcService, st)
			healthpb.RegisterHealthServer(srv, h)
		}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(srv.Stop)
		c := pickerClient(t, ln.Addr().String())
		conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		pickers, clients, conns = append(pickers, p), append(clients, c), append(conns, conn)
	}
	checks := newHealthChecks(len(conns))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go checks.run(ctx, conns)
	deadline := time.Now().Add(10 * time.Second)
	for checks.ok(1) {
		if time.Now().After(deadline) {
			t.Fatal("the not-ready picker still passes its health check after 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	base := startGateway(t, &Gateway{Pickers: clients, Healthy: checks.ok})
	const requests = 6
	for i := range requests {
		resp, err := newClient(t).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(got) != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, got)
		}
	}
	if n := len(streamsSeen(pickers[1])); n != 0 {
		t.Errorf("the picker that is not ready got %d streams", n)
	}
	for _, j := range []int{0, 2} {
		for range requests / 2 {
			pickers[j].record(t)
		}
	}
}
