package install

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"testing"
)

// docBlock is one fenced code block of a Markdown file.
type docBlock struct {
	file string // relative to the repository root
	line int    // of the opening fence
	lang string
	text string
}

func (b docBlock) where() string { return fmt.Sprintf("%s:%d", b.file, b.line) }

// shellLangs and yamlLangs are the fence languages whose blocks are run;
// inertLangs hold no command (program output, code, JSON). A fence with any
// other language, or none, is an error: a command in it would never be run.
var (
	shellLangs = map[string]bool{"sh": true, "bash": true, "shell": true}
	yamlLangs  = map[string]bool{"yaml": true, "yml": true}
	inertLangs = map[string]string{
		"text": "program output",
		"go":   "Go code, compiled by its own package's tests",
		"json": "JSON data",
	}
)

// readBlocks returns the fenced code blocks of the Markdown file rel.
func readBlocks(root, rel string) ([]docBlock, error) {
	f, err := os.Open(root + "/" + rel)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var (
		blocks []docBlock
		cur    *docBlock
		fence  string
		body   strings.Builder
		n      int
	)
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	for s.Scan() {
		n++
		line := s.Text()
		trimmed := strings.TrimLeft(line, " ")
		if cur == nil {
			if strings.HasPrefix(trimmed, "```") {
				fence = trimmed[:len(trimmed)-len(strings.TrimLeft(trimmed, "`"))]
				cur = &docBlock{file: rel, line: n, lang: strings.TrimSpace(strings.TrimPrefix(trimmed, fence))}
				body.Reset()
			}
			continue
		}
		if strings.TrimSpace(line) == fence {
			cur.text = body.String()
			blocks = append(blocks, *cur)
			cur = nil
			continue
		}
		body.WriteString(line)
		body.WriteByte('\n')
	}
	if err := s.Err(); err != nil {
		return nil, err
	}
	if cur != nil {
		return nil, fmt.Errorf("%s: the fence opened here is never closed", cur.where())
	}
	return blocks, nil
}

// shellCommand is one simple command of a shell block: its words, after
// quotes and line continuations are resolved.
type shellCommand struct {
	where string
	args  []string
}

func (c shellCommand) String() string { return strings.Join(c.args, " ") }

// splitShell splits shell source into simple commands, as sh would read
// them: words separated by blanks, commands by newlines, ';', '&', '&&', '||'
// and '|'; single and double quotes, backslash escapes and line
// continuations resolved; '#' at the start of a word begins a comment; a
// $(...) substitution is kept inside its word, unexpanded. Heredocs and
// redirections are refused: the documentation puts YAML in yaml blocks and
// commands in sh blocks, so that each is checked on its own.
func splitShell(src string) ([][]string, error) {
	var (
		cmds [][]string
		args []string
		word strings.Builder
		in   bool // a word is open (even an empty quoted one)
	)
	endWord := func() {
		if in {
			args = append(args, word.String())
			word.Reset()
			in = false
		}
	}
	endCmd := func() {
		endWord()
		if len(args) > 0 {
			cmds = append(cmds, args)
			args = nil
		}
	}
	r := []rune(src)
	for i := 0; i < len(r); i++ {
		c := r[i]
		switch {
		case c == '\\' && i+1 < len(r) && r[i+1] == '\n':
			i++ // a line continuation joins the lines
		case c == '\\' && i+1 < len(r):
			word.WriteRune(r[i+1])
			in = true
			i++
		case c == '\'':
			j := i + 1
			for j < len(r) && r[j] != '\'' {
				j++
			}
			if j == len(r) {
				return nil, fmt.Errorf("unterminated single quote")
			}
			word.WriteString(string(r[i+1 : j]))
			in = true
			i = j
		case c == '"':
			j := i + 1
			for ; j < len(r) && r[j] != '"'; j++ {
				if r[j] == '\\' && j+1 < len(r) && strings.ContainsRune("\"\\$`\n", r[j+1]) {
					j++
				}
				word.WriteRune(r[j])
			}
			if j == len(r) {
				return nil, fmt.Errorf("unterminated double quote")
			}
			in = true
			i = j
		case c == '$' && i+1 < len(r) && r[i+1] == '(':
			depth, j := 0, i+1
			for ; j < len(r); j++ {
				if r[j] == '(' {
					depth++
				} else if r[j] == ')' {
					depth--
					if depth == 0 {
						break
					}
				}
			}
			if j == len(r) {
				return nil, fmt.Errorf("unterminated $(")
			}
			word.WriteString(string(r[i : j+1]))
			in = true
			i = j
		case c == '#' && !in:
			for i < len(r) && r[i] != '\n' {
				i++
			}
			endCmd()
		case c == '\n' || c == ';' || c == '|' || c == '&':
			endCmd()
			if (c == '&' || c == '|') && i+1 < len(r) && r[i+1] == c {
				i++
			}
		case c == '<' || c == '>':
			return nil, fmt.Errorf("redirection or heredoc (%q): put YAML in a yaml block and commands in an sh block", string(c))
		case c == ' ' || c == '\t':
			endWord()
		default:
			word.WriteRune(c)
			in = true
		}
	}
	endCmd()
	return cmds, nil
}

func TestSplitShell(t *testing.T) {
	got, err := splitShell(`helm install llama charts/tally --namespace llm \
  --set 'inferencePool.targetPorts[0].number=8000' # the port
kubectl -n llm port-forward deploy/llama-epp 9090 &
curl -H "Authorization: Bearer $(kubectl create token a)" https://x && make demo DEMO_ARGS=--keep; echo "a\"b" ''
`)
	if err != nil {
		t.Fatal(err)
	}
	want := [][]string{
		{"helm", "install", "llama", "charts/tally", "--namespace", "llm", "--set", "inferencePool.targetPorts[0].number=8000"},
		{"kubectl", "-n", "llm", "port-forward", "deploy/llama-epp", "9090"},
		{"curl", "-H", "Authorization: Bearer $(kubectl create token a)", "https://x"},
		{"make", "demo", "DEMO_ARGS=--keep"},
		{"echo", `a"b`, ""},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("splitShell:\n got %q\nwant %q", got, want)
	}
	for _, bad := range []string{"cat <<EOF", "echo 'open", `echo "open`, "echo $(open"} {
		if _, err := splitShell(bad); err == nil {
			t.Errorf("splitShell(%q) = nil error, want one", bad)
		}
	}
}
