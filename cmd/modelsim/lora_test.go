package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/tallyepp/tally/internal/modelsim/engine"
	"github.com/tallyepp/tally/internal/modelsim/server"
	"github.com/tallyepp/tally/internal/syncbuf"
)

func TestLoRAFlags(t *testing.T) {
	o, err := parse([]string{"--lora-modules", "sql=/adapters/sql, chat", "--lora-modules=code", "--max-loras", "2", "--lora-load-time", "50ms"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := []server.LoRAModule{{Name: "sql", Path: "/adapters/sql"}, {Name: "chat"}, {Name: "code"}}
	if !reflect.DeepEqual(o.cfg.LoRAModules, want) || o.cfg.Engine.MaxLoRAs != 2 || o.cfg.Engine.LoRALoadTime != 50*time.Millisecond {
		t.Errorf("modules %+v, max loras %d, load time %v", o.cfg.LoRAModules, o.cfg.Engine.MaxLoRAs, o.cfg.Engine.LoRALoadTime)
	}
	o, err = parse([]string{"--lora-modules", "sql"}, io.Discard)
	if err != nil || o.cfg.Engine.MaxLoRAs != server.DefaultMaxLoRAs || o.cfg.Engine.LoRALoadTime != engine.DefaultLoRALoadTime {
		t.Errorf("adapters alone: max loras %d, load time %v, err %v; want the defaults %d and %v",
			o.cfg.Engine.MaxLoRAs, o.cfg.Engine.LoRALoadTime, err, server.DefaultMaxLoRAs, engine.DefaultLoRALoadTime)
	}
	if o, _ := parse(nil, io.Discard); len(o.cfg.LoRAModules) != 0 || o.cfg.Engine.MaxLoRAs != 0 {
		t.Errorf("by default: modules %v, max loras %d; want LoRA off", o.cfg.LoRAModules, o.cfg.Engine.MaxLoRAs)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--lora-modules", "sql", "--max-loras", "0"}, "--max-loras: 0 is invalid: must be 1 or more"},
		{[]string{"--lora-modules", "sql", "--lora-load-time", "-1s"}, "--lora-load-time: -1s is invalid: must be 0 or more"},
		{[]string{"--max-loras", "2"}, "--max-loras: 2 is invalid: needs --lora-modules"},
		{[]string{"--lora-load-time", "1s"}, "--lora-load-time: 1s is invalid: needs --lora-modules"},
		{[]string{"--lora-modules", "sql,sql"}, "--lora-modules: sql is invalid: is given twice"},
		{[]string{"--lora-modules", "sim-model"}, "--lora-modules: sim-model is invalid: names the base model"},
		{[]string{"--lora-modules", "=/adapters/x"}, "-lora-modules"},
	} {
		var stderr bytes.Buffer
		if code := run(t.Context(), tc.args, &stderr); code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("run(%q) = %d, stderr %q; want 2 and a message containing %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

func TestServesTheLoRAModules(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan int, 1)
	var stderr syncbuf.Buffer
	go func() {
		done <- run(ctx, []string{"--addr", "127.0.0.2:0", "--time-scale", "100", "--lora-modules", "sql=/adapters/sql"}, &stderr)
	}()
	serving := regexp.MustCompile(`msg=serving addr=(127\.0\.0\.2:\d+) .*lora_modules="sql=/adapters/sql" max_loras=1`)
	var url string
	for deadline := time.Now().Add(30 * time.Second); url == ""; time.Sleep(10 * time.Millisecond) {
		if m := serving.FindStringSubmatch(stderr.String()); m != nil {
			url = "http://" + m[1]
		} else if time.Now().After(deadline) {
			t.Fatalf("no serving line naming the adapter after 30s: %s", stderr.String())
		}
	}
	resp, err := http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var models struct {
		Data []struct{ ID, Root string } `json:"data"`
	}
	err = json.NewDecoder(resp.Body).Decode(&models)
	resp.Body.Close()
	if err != nil || len(models.Data) != 2 || models.Data[1].ID != "sql" || models.Data[1].Root != "/adapters/sql" {
		t.Fatalf("models %+v, err %v", models, err)
	}
	resp, err = http.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"sql","prompt":"select","max_tokens":1}`))
	if err != nil {
		t.Fatal(err)
	}
	var c struct{ Model string }
	err = json.NewDecoder(resp.Body).Decode(&c)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK || c.Model != "sql" {
		t.Fatalf("completion for the adapter: status %d, model %q, err %v", resp.StatusCode, c.Model, err)
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("run returned %d\n%s", code, stderr.String())
	}
}
