package docsection

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSpliceReplacesOnlyBetweenTheMarkers(t *testing.T) {
	begin, end := Markers("sim")
	otherBegin, otherEnd := Markers("sim-mixed")
	doc := "# Title\n\nBefore.\n\n" + begin + "\n\nold table\n\n" + end + "\n\nBetween.\n\n" + otherBegin + "\nother table\n" + otherEnd + "\n\nAfter.\n"
	got, err := Splice(doc, "sim", "\nnew table\n")
	if err != nil {
		t.Fatal(err)
	}
	want := "# Title\n\nBefore.\n\n" + begin + "\n\nnew table\n\n" + end + "\n\nBetween.\n\n" + otherBegin + "\nother table\n" + otherEnd + "\n\nAfter.\n"
	if got != want {
		t.Fatalf("got:\n%s\nwant:\n%s", got, want)
	}
	again, err := Splice(got, "sim", "new table")
	if err != nil || again != got {
		t.Errorf("splicing the same text twice changed the file (%v):\n%s", err, again)
	}
	mixed, err := Splice(got, "sim-mixed", "mixed table")
	if err != nil || !strings.Contains(mixed, "new table") || strings.Contains(mixed, "other table") || !strings.Contains(mixed, "mixed table") {
		t.Errorf("a section whose name extends another's (%v):\n%s", err, mixed)
	}
}

func TestSpliceNamesTheMissingMarkers(t *testing.T) {
	begin, end := Markers("sim")
	for _, tc := range []struct{ doc, want string }{
		{"# Title\n\nno markers\n", "add the lines"},
		{begin + "\nunclosed\n", "not closed"},
		{end + "\n" + begin + "\n", "closes"},
		{begin + "\n" + end + "\n" + begin + "\n" + end + "\n", "opens twice"},
	} {
		_, err := Splice(tc.doc, "sim", "table")
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), `"sim"`) {
			t.Errorf("%q: error %v, want one naming the section and saying %q", tc.doc, err, tc.want)
		}
	}
}

func TestWriteFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bench.md")
	if err := WriteFile(path, "sim", "first"); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(path, "sim", "second"); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	begin, end := Markers("sim")
	if want := "# Benchmarks\n\n" + begin + "\n\nsecond\n\n" + end + "\n"; string(data) != want {
		t.Errorf("got:\n%s\nwant:\n%s", data, want)
	}
	if err := os.WriteFile(path, []byte("hand-written\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	err = WriteFile(path, "sim", "third")
	if err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("a file without markers: %v, want an error naming the file", err)
	}
	if data, _ := os.ReadFile(path); string(data) != "hand-written\n" {
		t.Errorf("a failed splice changed the file: %q", data)
	}
}
