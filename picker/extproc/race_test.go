//go:build race

package extproc

const raceEnabled = true
