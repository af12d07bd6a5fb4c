// Command chartdoc regenerates the values table of charts/tally/README.md
// from charts/tally/values.yaml (`make chart-readme`). A test in
// test/install fails while the README is stale.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/tallyepp/tally/internal/chartdoc"
)

func main() {
	dir := flag.String("chart", "charts/tally", "the chart directory: its values.yaml is read and its README.md rewritten")
	flag.Parse()
	if err := run(*dir); err != nil {
		fmt.Fprintln(os.Stderr, "chartdoc:", err)
		os.Exit(1)
	}
}

func run(dir string) error {
	values, err := os.ReadFile(filepath.Join(dir, "values.yaml"))
	if err != nil {
		return err
	}
	path := filepath.Join(dir, "README.md")
	readme, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	updated, err := chartdoc.Update(string(readme), values)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return os.WriteFile(path, []byte(updated), 0o644)
}
