// Package layout checks the README's layout table against the tree: every
// package under the roots below has a row, every row names a path that
// exists, and a package's row says "product" exactly when the picker binary
// (cmd/epp) is built from it.
package layout

import (
	"bufio"
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/tallyepp/tally/internal/testenv"
)

// roots are the directories whose every Go package the table must name.
var roots = []string{"cmd", "internal", "picker", "api", "controllers"}

// The values of the table's "ships" column.
const (
	shipsProduct = "product"
	shipsTool    = "tool"
)

// row is one path of the layout table and what it says ships.
type row struct {
	path, ships string
	line        int
}

// layoutRows reads the table under the README's "## Layout" heading.
func layoutRows(readme []byte) ([]row, error) {
	var rows []row
	in := false
	sc := bufio.NewScanner(bytes.NewReader(readme))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "## "):
			in = line == "## Layout"
			continue
		case !in || !strings.HasPrefix(line, "| `"):
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if len(cells) < 3 {
			return nil, fmt.Errorf("README.md:%d: a layout row has %d columns, want path | ships | what", n, len(cells))
		}
		ships := strings.TrimSpace(cells[1])
		for p := range strings.SplitSeq(cells[0], ",") {
			p = strings.Trim(strings.TrimSpace(p), "`")
			rows = append(rows, row{path: strings.TrimSuffix(p, "/"), ships: ships, line: n})
		}
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("README.md has no layout table: rows of \"| `path` | ships | what |\" under \"## Layout\"")
	}
	return rows, sc.Err()
}

// packages are the directories under roots that hold a Go package (a
// non-test .go file), as slash-separated paths from the repository root.
func packages(root string) ([]string, error) {
	var dirs []string
	for _, r := range roots {
		err := filepath.WalkDir(filepath.Join(root, r), func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && d.Name() == "testdata" {
				return filepath.SkipDir
			}
			if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return nil
			}
			rel, err := filepath.Rel(root, filepath.Dir(path))
			if err != nil {
				return err
			}
			if dir := filepath.ToSlash(rel); !slices.Contains(dirs, dir) {
				dirs = append(dirs, dir)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("listing the packages under %s: %w", r, err)
		}
	}
	return dirs, nil
}

// pickerDeps are the repository's packages the picker binary is built
// from, as paths from the repository root.
func pickerDeps(t *testing.T, root string) []string {
	t.Helper()
	cmd := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", "./cmd/epp")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/epp: %v", err)
	}
	var deps []string
	for p := range strings.FieldsSeq(string(out)) {
		if rel, ok := strings.CutPrefix(p, testenv.ModulePath+"/"); ok {
			deps = append(deps, rel)
		}
	}
	return deps
}

func TestTheLayoutTableNamesEveryPackageAndWhetherItShips(t *testing.T) {
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	rows, err := layoutRows(readme)
	if err != nil {
		t.Fatal(err)
	}
	pkgs, err := packages(root)
	if err != nil {
		t.Fatal(err)
	}
	deps := pickerDeps(t, root)

	named := map[string]row{}
	for _, r := range rows {
		if prev, ok := named[r.path]; ok {
			t.Errorf("README.md:%d: %s has a row already (line %d)", r.line, r.path, prev.line)
		}
		named[r.path] = r
		if _, err := os.Stat(filepath.Join(root, r.path)); err != nil {
			t.Errorf("README.md:%d: the layout names %s, which does not exist", r.line, r.path)
			continue
		}
		underRoot := slices.ContainsFunc(roots, func(root string) bool { return r.path == root || strings.HasPrefix(r.path, root+"/") })
		if underRoot && !slices.Contains(pkgs, r.path) {
			t.Errorf("README.md:%d: the layout names %s, which holds no Go package: name its packages one per row", r.line, r.path)
		}
	}
	for _, p := range pkgs {
		r, ok := named[p]
		if !ok {
			t.Errorf("package %s has no row in README.md's layout table", p)
			continue
		}
		want := shipsTool
		if slices.Contains(deps, p) {
			want = shipsProduct
		}
		if r.ships != want {
			t.Errorf("README.md:%d: %s ships %q, want %q (product: cmd/epp is built from it; tool: it is not)", r.line, p, r.ships, want)
		}
	}
}
