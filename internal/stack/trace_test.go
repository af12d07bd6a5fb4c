package stack

import (
	"bufio"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const samplePath = "../../test/data/mooncake_sample.jsonl"

func TestLoadTraceFileMatchesEveryRowOfTheSample(t *testing.T) {
	reqs, err := LoadTraceFile(samplePath)
	if err != nil {
		t.Fatal(err)
	}
	// Decode the file independently, as loose maps, and compare row by row.
	f, err := os.Open(samplePath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	i := 0
	for sc.Scan() {
		var row map[string]any
		if err := json.Unmarshal(sc.Bytes(), &row); err != nil {
			t.Fatalf("row %d: %v", i, err)
		}
		if i >= len(reqs) {
			t.Fatalf("loader returned %d rows, the file has more", len(reqs))
		}
		got := reqs[i]
		if want := time.Duration(row["timestamp"].(float64)) * time.Millisecond; got.Arrival != want {
			t.Errorf("row %d: Arrival %v, want %v", i, got.Arrival, want)
		}
		if want := int(row["input_length"].(float64)); got.InputTokens != want {
			t.Errorf("row %d: InputTokens %d, want %d", i, got.InputTokens, want)
		}
		if want := int(row["output_length"].(float64)); got.OutputTokens != want {
			t.Errorf("row %d: OutputTokens %d, want %d", i, got.OutputTokens, want)
		}
		ids := row["hash_ids"].([]any)
		if len(ids) != len(got.HashIDs) {
			t.Fatalf("row %d: %d hash ids, want %d", i, len(got.HashIDs), len(ids))
		}
		for k, id := range ids {
			if int(id.(float64)) != got.HashIDs[k] {
				t.Fatalf("row %d: hash_ids[%d] = %d, want %v", i, k, got.HashIDs[k], id)
			}
		}
		i++
	}
	if i != len(reqs) {
		t.Fatalf("loader returned %d rows, file has %d", len(reqs), i)
	}
}

func TestSampleStaysSmall(t *testing.T) {
	st, err := os.Stat(samplePath)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() > 200<<10 {
		t.Fatalf("%s is %d bytes; the sample must stay under 200 KiB", samplePath, st.Size())
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(samplePath), "LICENSE-Mooncake-Apache-2.0")); err != nil {
		t.Fatalf("the sample's licence must sit beside it: %v", err)
	}
}

func TestLoadTraceRejectsMalformedRows(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}`
	cases := []struct {
		name, input, wantInError string
	}{
		{"empty", "\n\n", "no requests"},
		{"not json", good + "\n{", "line 2"},
		{"unknown field", `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "extra": 1}`, "extra"},
		{"missing timestamp", `{"input_length": 1, "output_length": 1, "hash_ids": [1]}`, "timestamp is missing"},
		{"negative timestamp", `{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}`, "timestamp: -1"},
		{"missing input", `{"timestamp": 0, "output_length": 1, "hash_ids": [1]}`, "input_length is missing"},
		{"zero input", `{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}`, "input_length: 0"},
		{"zero output", `{"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [1]}`, "output_length: 0"},
		{"too few ids", `{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}`, "hash_ids: has 1 ids, want ceil(input_length/512) = 2"},
		{"too many ids", `{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}`, "want ceil(input_length/512) = 1"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := LoadTrace(strings.NewReader(c.input))
			if err == nil {
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), c.wantInError) {
				t.Fatalf("error %q does not mention %q", err, c.wantInError)
			}
		})
	}
	reqs, err := LoadTrace(strings.NewReader("\n" + good + "\n\n" + good))
	if err != nil || len(reqs) != 2 {
		t.Fatalf("blank lines: got %d rows, %v; want 2 rows", len(reqs), err)
	}
	if reqs[0].Line != 2 || reqs[1].Line != 4 {
		t.Fatalf("blank lines: rows on lines %d and %d, want 2 and 4", reqs[0].Line, reqs[1].Line)
	}
}

// sharedBlocks counts the leading 64-character blocks a and b have in common.
func sharedBlocks(a, b string) int {
	n := 0
	for (n+1)*chunkChars <= len(a) && (n+1)*chunkChars <= len(b) && a[n*chunkChars:(n+1)*chunkChars] == b[n*chunkChars:(n+1)*chunkChars] {
		n++
	}
	return n
}

func sharedIDs(a, b []int) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

func TestPromptTextSharesExactlyTheBlocksOfSharedHashIDs(t *testing.T) {
	reqs, err := LoadTraceFile(samplePath)
	if err != nil {
		t.Fatal(err)
	}
	reqs = reqs[:120]
	texts := make([]string, len(reqs))
	for i, r := range reqs {
		texts[i] = r.PromptText()
		if len(texts[i]) != r.InputTokens*charsPerToken {
			t.Fatalf("row %d: prompt is %d chars, want input_length*4 = %d", i, len(texts[i]), r.InputTokens*charsPerToken)
		}
		if strings.Trim(texts[i], chunkAlphabet) != "" {
			t.Fatalf("row %d: prompt has characters outside %q", i, chunkAlphabet)
		}
		if again := r.PromptText(); again != texts[i] {
			t.Fatalf("row %d: PromptText is not deterministic", i)
		}
	}
	pairsSharing := 0
	for i := range reqs {
		for j := i + 1; j < len(reqs); j++ {
			ids := sharedIDs(reqs[i].HashIDs, reqs[j].HashIDs)
			if ids > 0 {
				pairsSharing++
			}
			// Blocks past the end of the shorter prompt cannot be shared.
			want := min(ids*chunksPerHashID, len(texts[i])/chunkChars, len(texts[j])/chunkChars)
			if got := sharedBlocks(texts[i], texts[j]); got != want {
				t.Fatalf("rows %d and %d share %d leading hash ids but %d leading blocks, want %d", i, j, ids, got, want)
			}
		}
	}
	if pairsSharing == 0 {
		t.Fatal("no two sample rows share a prefix: the test would prove nothing")
	}
}

func TestPromptTextDiffersInEveryBlockOfDifferentIDs(t *testing.T) {
	a := TraceRequest{InputTokens: 3 * 512, HashIDs: []int{7, 8, 9}}.PromptText()
	b := TraceRequest{InputTokens: 3 * 512, HashIDs: []int{7, 10, 9}}.PromptText()
	for k := range 3 * chunksPerHashID {
		same := a[k*chunkChars:(k+1)*chunkChars] == b[k*chunkChars:(k+1)*chunkChars]
		if wantSame := k < chunksPerHashID || k >= 2*chunksPerHashID; same != wantSame {
			t.Fatalf("block %d: same=%v, want %v", k, same, wantSame)
		}
	}
	// No chunk repeats, within an id or across ids (including the
	// negative ids of synthetic prompts), so no text is shared by accident.
	ids := make([]int, 0, 200)
	for id := -100; id < 100; id++ {
		ids = append(ids, id)
	}
	text := TraceRequest{InputTokens: len(ids) * 512, HashIDs: ids}.PromptText()
	seen := map[string]int{}
	for k := range len(text) / chunkChars {
		c := text[k*chunkChars : (k+1)*chunkChars]
		if prev, ok := seen[c]; ok {
			t.Fatalf("chunk %d (id %d) equals chunk %d (id %d)", k, ids[k/chunksPerHashID], prev, ids[prev/chunksPerHashID])
		}
		seen[c] = k
	}
}

func TestTraceWorkloadCompressesArrivalsAndCarriesThePrompt(t *testing.T) {
	reqs, err := LoadTraceFile(samplePath)
	if err != nil {
		t.Fatal(err)
	}
	reqs = reqs[5:40] // start mid-trace: offsets count from the first row given
	const timeScale = 10
	w := TraceWorkload(reqs, "m", timeScale)
	if len(w) != len(reqs) {
		t.Fatalf("%d requests, want %d", len(w), len(reqs))
	}
	for i, r := range w {
		want := time.Duration(float64(reqs[i].Arrival-reqs[0].Arrival) / timeScale)
		if math.Abs(float64(r.At-want)) > 1 {
			t.Fatalf("request %d at %v, want %v", i, r.At, want)
		}
		var body struct {
			Model         string `json:"model"`
			Prompt        string `json:"prompt"`
			MaxTokens     int    `json:"max_tokens"`
			Stream        bool   `json:"stream"`
			StreamOptions struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		if err := json.Unmarshal(r.Body, &body); err != nil {
			t.Fatal(err)
		}
		if body.Model != "m" || body.Prompt != reqs[i].PromptText() || body.MaxTokens != reqs[i].OutputTokens ||
			!body.Stream || !body.StreamOptions.IncludeUsage || !r.Stream || r.Path != CompletionsPath {
			t.Fatalf("request %d: body %s... does not match its trace row", i, r.Body[:80])
		}
		if r.PromptTokens != reqs[i].InputTokens {
			t.Fatalf("request %d: PromptTokens %d, want %d", i, r.PromptTokens, reqs[i].InputTokens)
		}
	}
	if w[len(w)-1].At == 0 {
		t.Fatal("all arrivals at zero: the test would prove nothing")
	}
}

func TestBurstSharesOnlyTheSystemPrompt(t *testing.T) {
	b := Burst{Requests: 16, SystemTokens: 2048, UserTokens: 100, MaxTokens: 8, Model: "m"}
	w := b.Workload()
	if len(w) != b.Requests {
		t.Fatalf("%d requests, want %d", len(w), b.Requests)
	}
	prompts := make([]string, len(w))
	for i, r := range w {
		var body struct {
			Prompt string `json:"prompt"`
		}
		if err := json.Unmarshal(r.Body, &body); err != nil {
			t.Fatal(err)
		}
		prompts[i] = body.Prompt
		if r.At != 0 {
			t.Fatalf("request %d at %v: a burst is sent at once", i, r.At)
		}
	}
	systemBlocks := b.SystemTokens * charsPerToken / chunkChars
	for i := range prompts {
		for j := i + 1; j < len(prompts); j++ {
			if got := sharedBlocks(prompts[i], prompts[j]); got != systemBlocks {
				t.Fatalf("prompts %d and %d share %d blocks, want the %d of the system prompt", i, j, got, systemBlocks)
			}
		}
	}
	other := Burst{Requests: 1, SystemTokens: 2048, UserTokens: 100, MaxTokens: 8, Model: "m", Seed: 1}.Workload()
	var body struct {
		Prompt string `json:"prompt"`
	}
	if err := json.Unmarshal(other[0].Body, &body); err != nil {
		t.Fatal(err)
	}
	if sharedBlocks(body.Prompt, prompts[0]) != 0 {
		t.Fatal("bursts with different seeds share a prefix")
	}
}
