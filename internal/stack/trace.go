package stack

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// Mooncake trace geometry: each hash_id stands for 512 tokens; the picker and
// the simulator count 4 characters per token and cut prompts into 64-character
// (16-token) blocks, so one hash_id becomes 32 chunks of 64 characters.
const (
	traceBlockTokens = 512
	charsPerToken    = 4
	chunkChars       = 64
	chunksPerHashID  = traceBlockTokens * charsPerToken / chunkChars
)

// TraceRequest is one row of a Mooncake-format trace.
type TraceRequest struct {
	// Arrival is the time from the start of the trace.
	Arrival time.Duration
	// InputTokens and OutputTokens are the prompt and generated lengths.
	InputTokens  int
	OutputTokens int
	// HashIDs names each 512-token block of the prompt; equal leading ids
	// mean a shared prefix.
	HashIDs []int
	// Line is the row's line in the trace, so that a caller checking rows
	// against each other can name the one at fault.
	Line int
}

// traceRow is the file format: one JSON object a line.
type traceRow struct {
	Timestamp    *int64 `json:"timestamp"`
	InputLength  *int   `json:"input_length"`
	OutputLength *int   `json:"output_length"`
	HashIDs      []int  `json:"hash_ids"`
}

// LoadTraceFile reads a Mooncake-format trace (JSON lines) from path.
func LoadTraceFile(path string) ([]TraceRequest, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening trace: %w", err)
	}
	defer f.Close()
	reqs, err := LoadTrace(f)
	if err != nil {
		return nil, fmt.Errorf("trace %s: %w", path, err)
	}
	return reqs, nil
}

// LoadTrace reads a Mooncake-format trace: one JSON object a line with
// timestamp (ms), input_length, output_length (tokens) and hash_ids (one per
// 512 prompt tokens). Blank lines are skipped; any other malformed row is an
// error naming its line and field. It is the one parser of the format: the
// routing simulator reads its traces through it too.
func LoadTrace(r io.Reader) ([]TraceRequest, error) {
	var out []TraceRequest
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	line := 0
	for sc.Scan() {
		line++
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 {
			continue
		}
		req, err := parseTraceRow(text)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		req.Line = line
		out = append(out, req)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading line %d: %w", line+1, err)
	}
	if len(out) == 0 {
		return nil, errors.New("no requests in trace")
	}
	return out, nil
}

func parseTraceRow(text []byte) (TraceRequest, error) {
	var row traceRow
	dec := json.NewDecoder(bytes.NewReader(text))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&row); err != nil {
		return TraceRequest{}, fmt.Errorf("not a trace row: %w", err)
	}
	switch {
	case row.Timestamp == nil:
		return TraceRequest{}, errors.New("field timestamp is missing")
	case *row.Timestamp < 0:
		return TraceRequest{}, fmt.Errorf("field timestamp: %d is invalid: must be 0 or more milliseconds", *row.Timestamp)
	case row.InputLength == nil:
		return TraceRequest{}, errors.New("field input_length is missing")
	case *row.InputLength < 1:
		return TraceRequest{}, fmt.Errorf("field input_length: %d is invalid: must be 1 or more tokens", *row.InputLength)
	case row.OutputLength == nil:
		return TraceRequest{}, errors.New("field output_length is missing")
	case *row.OutputLength < 1:
		return TraceRequest{}, fmt.Errorf("field output_length: %d is invalid: must be 1 or more tokens", *row.OutputLength)
	}
	want := (*row.InputLength + traceBlockTokens - 1) / traceBlockTokens
	if len(row.HashIDs) != want {
		return TraceRequest{}, fmt.Errorf("field hash_ids: has %d ids, want ceil(input_length/%d) = %d", len(row.HashIDs), traceBlockTokens, want)
	}
	return TraceRequest{
		Arrival:      time.Duration(*row.Timestamp) * time.Millisecond,
		InputTokens:  *row.InputLength,
		OutputTokens: *row.OutputLength,
		HashIDs:      row.HashIDs,
	}, nil
}

// PromptText is the prompt a trace request stands for: each hash_id expands
// into 32 chunks of 64 characters that depend on the id and the chunk's
// position within it only, and the text is cut to InputTokens*4 characters.
// Two prompts therefore share exactly the 64-character blocks that their
// leading hash_ids share, which is the prefix structure both the picker and
// the simulator see.
func (t TraceRequest) PromptText() string {
	n := t.InputTokens * charsPerToken
	var b strings.Builder
	b.Grow(len(t.HashIDs) * chunksPerHashID * chunkChars)
	var chunk [chunkChars]byte
	for _, id := range t.HashIDs {
		for i := range chunksPerHashID {
			fillChunk(&chunk, uint64(id), uint64(i))
			b.Write(chunk[:])
		}
	}
	return b.String()[:n]
}

// HashIDChunk writes the text of chunk i (of 32) of hash_id id: the
// characters PromptText expands each 512-token block into, so that other
// replayers (the routing simulator) share prefixes exactly as the demo does.
func HashIDChunk(dst *[64]byte, id, i uint64) { fillChunk(dst, id, i) }

// chunkAlphabet has 32 symbols so each takes 5 bits of a random word; the
// spaces make the text split into word-like runs.
const chunkAlphabet = "abcdefghijklmnopqrstuvwxyz      "

// fillChunk writes the deterministic text of chunk i of hash_id id.
func fillChunk(dst *[chunkChars]byte, id, i uint64) {
	state := id*chunksPerHashID + i + 1
	var word uint64
	for k := range dst {
		if k%12 == 0 {
			word = splitmix64(&state)
		}
		dst[k] = chunkAlphabet[word&31]
		word >>= 5
	}
}

// splitmix64 is a small, well-mixed generator: adjacent seeds give unrelated
// chunks, so distinct ids never share a 64-character block in practice.
func splitmix64(state *uint64) uint64 {
	*state += 0x9e3779b97f4a7c15
	z := *state
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}
