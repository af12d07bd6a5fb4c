package routesim

import (
	"cmp"
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"time"

	"github.com/tallyepp/tally/internal/stack"
)

// Trace geometry, the same as internal/stack's: each Mooncake hash_id
// stands for 512 tokens; the picker and the model-server simulator count 4
// characters per token, and the engine caches 16-token (64-character)
// blocks, so one hash_id becomes 32 chunks of 64 characters.
const (
	traceBlockTokens = 512
	charsPerToken    = 4
	chunkChars       = 64
	chunksPerHashID  = traceBlockTokens * charsPerToken / chunkChars
	// engineBlockTokens is the engine's KV block size; the simulation
	// always runs engines with it, so a chunk is one engine block.
	engineBlockTokens = chunkChars / charsPerToken
)

// Request is one row of a trace: Mooncake JSONL, or an Azure CSV row given
// a synthetic prefix structure.
type Request struct {
	// Arrival is the time from the first request of the trace.
	Arrival time.Duration
	// InputTokens and OutputTokens are the prompt and generated lengths.
	InputTokens  int
	OutputTokens int
	// HashIDs names each 512-token block of the prompt; equal leading ids
	// mean a shared prefix. len(HashIDs) == ceil(InputTokens/512).
	HashIDs []int
	// Adapter is the LoRA adapter the request is for; "" (every trace
	// row) is the base model, or one drawn when Config.Adapters is set.
	Adapter string
}

// LoadMooncakeFile reads a Mooncake-format trace (JSON lines) from path.
func LoadMooncakeFile(path string) ([]Request, error) {
	rows, err := stack.LoadTraceFile(path)
	if err != nil {
		return nil, err
	}
	reqs, err := fromMooncake(rows)
	if err != nil {
		return nil, fmt.Errorf("trace %s: %w", path, err)
	}
	return reqs, nil
}

// LoadMooncake reads a Mooncake-format trace as stack.LoadTrace does (the
// one parser of the format). Arrivals count from the first row; rows must
// not go back in time.
func LoadMooncake(r io.Reader) ([]Request, error) {
	rows, err := stack.LoadTrace(r)
	if err != nil {
		return nil, err
	}
	return fromMooncake(rows)
}

func fromMooncake(rows []stack.TraceRequest) ([]Request, error) {
	out := make([]Request, 0, len(rows))
	first := rows[0].Arrival
	for _, row := range rows {
		req := Request{Arrival: row.Arrival - first, InputTokens: row.InputTokens, OutputTokens: row.OutputTokens, HashIDs: row.HashIDs}
		if len(out) > 0 && req.Arrival < out[len(out)-1].Arrival {
			return nil, fmt.Errorf("line %d: field timestamp: %d is before the previous row's", row.Line, row.Arrival.Milliseconds())
		}
		out = append(out, req)
	}
	return out, nil
}

func blocksFor(tokens int) int { return (tokens + traceBlockTokens - 1) / traceBlockTokens }

// AzurePrefix gives an Azure trace, which has no prefix data, a synthetic
// prefix structure: each request belongs to one of Tenants tenants (drawn
// Zipf-like, so a few tenants are busy and most are not), and its prompt
// starts with its tenant's system prompt of SystemPromptTokens tokens (cut
// short for a shorter prompt); the rest of the prompt is its own.
type AzurePrefix struct {
	Tenants            int
	SystemPromptTokens int
	Seed               uint64
}

// LoadAzureFile reads an Azure LLM inference trace CSV from path.
func LoadAzureFile(path string, p AzurePrefix) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening trace: %w", err)
	}
	defer f.Close()
	reqs, err := LoadAzure(f, p)
	if err != nil {
		return nil, fmt.Errorf("trace %s: %w", path, err)
	}
	return reqs, nil
}

// azureTimeLayout is the TIMESTAMP column's format (fraction optional).
const azureTimeLayout = "2006-01-02 15:04:05.999999999"

// LoadAzure reads TIMESTAMP,ContextTokens,GeneratedTokens rows (a header
// line first) and gives them the prefix structure p describes. Arrivals
// count from the first row; rows are sorted by arrival, stably.
func LoadAzure(r io.Reader, p AzurePrefix) ([]Request, error) {
	if p.Tenants < 1 {
		return nil, fmt.Errorf("tenants: %d is invalid: must be 1 or more", p.Tenants)
	}
	if p.SystemPromptTokens < 0 {
		return nil, fmt.Errorf("system prompt tokens: %d is invalid: must be 0 or more", p.SystemPromptTokens)
	}
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = 3
	cr.ReuseRecord = true
	header, err := cr.Read()
	if err != nil {
		return nil, fmt.Errorf("reading the header: %w", err)
	}
	if header[0] != "TIMESTAMP" || header[1] != "ContextTokens" || header[2] != "GeneratedTokens" {
		return nil, fmt.Errorf("header %q: want TIMESTAMP,ContextTokens,GeneratedTokens", header)
	}
	rng := rand.New(rand.NewPCG(p.Seed, 0x617a757265)) // "azure"
	var zipf *rand.Zipf
	if p.Tenants > 1 {
		zipf = rand.NewZipf(rng, 1.2, 1, uint64(p.Tenants-1))
	}
	sysBlocks := blocksFor(p.SystemPromptTokens)
	if p.SystemPromptTokens == 0 {
		sysBlocks = 0
	}
	// Tenant t's system prompt is ids t*sysBlocks ...; unique ids follow
	// every tenant's.
	nextID := p.Tenants * sysBlocks
	var out []Request
	var first time.Time
	for line := 2; ; line++ {
		rec, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		ts, err := time.Parse(azureTimeLayout, rec[0])
		if err != nil {
			return nil, fmt.Errorf("line %d: field TIMESTAMP: %w", line, err)
		}
		ctx, err := strconv.Atoi(rec[1])
		if err != nil || ctx < 1 {
			return nil, fmt.Errorf("line %d: field ContextTokens: %q is invalid: must be 1 or more tokens", line, rec[1])
		}
		gen, err := strconv.Atoi(rec[2])
		if err != nil || gen < 0 {
			return nil, fmt.Errorf("line %d: field GeneratedTokens: %q is invalid: must be 0 or more tokens", line, rec[2])
		}
		if len(out) == 0 {
			first = ts
		}
		tenant := 0
		if zipf != nil {
			tenant = int(zipf.Uint64())
		}
		n := blocksFor(ctx)
		ids := make([]int, n)
		for i := range ids {
			if i < sysBlocks {
				ids[i] = tenant*sysBlocks + i
				continue
			}
			ids[i] = nextID
			nextID++
		}
		out = append(out, Request{
			Arrival:      ts.Sub(first),
			InputTokens:  ctx,
			OutputTokens: max(gen, 1), // a request generates at least one token
			HashIDs:      ids,
		})
	}
	if len(out) == 0 {
		return nil, errors.New("no requests in trace")
	}
	// The column is sorted in the published files; a few equal or
	// out-of-order stamps must not make arrivals go back.
	sortByArrival(out)
	if out[0].Arrival != 0 {
		base := out[0].Arrival
		for i := range out {
			out[i].Arrival -= base
		}
	}
	return out, nil
}

func sortByArrival(reqs []Request) {
	byArrival := func(a, b Request) int { return cmp.Compare(a.Arrival, b.Arrival) }
	if !slices.IsSortedFunc(reqs, byArrival) {
		slices.SortStableFunc(reqs, byArrival)
	}
}

// AppendPromptText appends the prompt r stands for to dst: each hash_id
// expands into 32 chunks of 64 characters that depend on the id and the
// chunk's position within it only, cut to InputTokens*4 characters, as
// internal/stack's PromptText does. Two prompts therefore share exactly the
// 64-character blocks their leading hash_ids share.
func (r Request) AppendPromptText(dst []byte) []byte {
	var t idText
	return t.appendPrompt(dst, r)
}

// idTextBytes is the text one hash_id expands into.
const idTextBytes = chunksPerHashID * chunkChars

// idText expands hash_ids into text, remembering the texts of up to maxIDs
// ids; the zero value remembers none. Once frozen it remembers no more and
// is safe for concurrent use: a miss is expanded into the caller's buffer.
type idText struct {
	maxIDs int
	frozen bool
	at     map[int]*[idTextBytes]byte
}

func newIDText(maxIDs int) *idText {
	return &idText{maxIDs: maxIDs, at: make(map[int]*[idTextBytes]byte)}
}

func (t *idText) appendPrompt(dst []byte, r Request) []byte {
	n := r.InputTokens * charsPerToken
	for _, id := range r.HashIDs {
		if n <= 0 {
			break
		}
		k := min(n, idTextBytes)
		if txt := t.lookup(id); txt != nil {
			dst = append(dst, txt[:k]...)
		} else {
			dst = appendIDText(dst, id, k)
		}
		n -= k
	}
	return dst
}

// lookup returns id's text if it is remembered or can be; nil if not.
func (t *idText) lookup(id int) *[idTextBytes]byte {
	if txt, ok := t.at[id]; ok {
		return txt
	}
	if t.frozen || t.maxIDs == 0 {
		return nil
	}
	if len(t.at) >= t.maxIDs {
		// Forget everything: cheaper than an LRU, and the ids in use
		// come back at once.
		clear(t.at)
	}
	txt := new([idTextBytes]byte)
	for i := range chunksPerHashID {
		stack.HashIDChunk((*[chunkChars]byte)(txt[i*chunkChars:]), uint64(id), uint64(i))
	}
	t.at[id] = txt
	return txt
}

// appendIDText appends the first k bytes of id's text.
func appendIDText(dst []byte, id, k int) []byte {
	var chunk [chunkChars]byte
	for i := 0; k > 0; i++ {
		stack.HashIDChunk(&chunk, uint64(id), uint64(i))
		m := min(k, chunkChars)
		dst = append(dst, chunk[:m]...)
		k -= m
	}
	return dst
}
