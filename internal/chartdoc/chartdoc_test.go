package chartdoc

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const values = `# A note for readers of values.yaml only.

## The pool.
pool:
  ## Its name, e.g.
  ##   llama
  ## Lower case; "<name>-epp" names the picker.
  name: ""
  # Not documented: no "##".
  ports: [8000]
## Shown whole: nothing below it is documented.
resources:
  limits: {memory: 2Gi}
plain: {a: 1}
`

func TestRowsDocumentEachValueWithItsDoubleHashComment(t *testing.T) {
	rows, err := Rows([]byte(values))
	if err != nil {
		t.Fatal(err)
	}
	want := []Row{
		{Key: "pool", Description: "The pool."},
		{Key: "pool.name", Type: "string", Default: `""`, Description: "Its name, e.g. `llama` Lower case; \"&lt;name&gt;-epp\" names the picker."},
		{Key: "pool.ports", Type: "list", Default: "[8000]"},
		{Key: "resources", Type: "object", Default: `{"limits":{"memory":"2Gi"}}`, Description: "Shown whole: nothing below it is documented."},
		{Key: "plain", Type: "object", Default: `{"a":1}`},
	}
	if diff := cmp.Diff(want, rows); diff != "" {
		t.Errorf("rows (-want +got):\n%s", diff)
	}
	if table := Table(rows); !strings.Contains(table, "| `pool.ports` | list | `[8000]` |  |\n") {
		t.Errorf("table:\n%s", table)
	}
}

func TestUpdateChangesOnlyBetweenTheMarkers(t *testing.T) {
	readme := "# Chart\n\nHand-written.\n\n" + Begin + "\nold table\n" + End + "\n\nAfter.\n"
	got, err := Update(readme, []byte(values))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(got, "# Chart\n\nHand-written.\n\n"+Begin+"\n") || !strings.HasSuffix(got, End+"\n\nAfter.\n") ||
		strings.Contains(got, "old table") || !strings.Contains(got, "| `pool.name` |") {
		t.Errorf("updated README:\n%s", got)
	}
	again, err := Update(got, []byte(values))
	if err != nil || again != got {
		t.Errorf("a second update changed the README (%v):\n%s", err, again)
	}
	for _, bad := range []string{"no markers", Begin + "\n" + Begin + "\n" + End, End + "\n" + Begin} {
		if _, err := Update(bad, []byte(values)); err == nil {
			t.Errorf("README %q was accepted", bad)
		}
	}
	if _, err := Update(readme, []byte("- a list\n")); err == nil {
		t.Error("values.yaml that is not a mapping was accepted")
	}
}
