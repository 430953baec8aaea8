package bench

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// Report is what `space bench` saves after a run, at LastPath(data dir), for the API
// to serve (GET /v1/bench) and the web console to plot.
type Report struct {
	FinishedAt time.Time `json:"finished_at"`
	Template   string    `json:"template"`
	Runs       int       `json:"runs"`
	// Host is the machine the run measured (absent in reports saved before 2026-12-03).
	Host *Host `json:"host,omitempty"`
	// Only lists the scenarios asked for (empty: all of them).
	Only []string `json:"only,omitempty"`
	// Error is set when the run stopped early; Results then holds what finished.
	Error   string   `json:"error,omitempty"`
	Results []Result `json:"results"`
}

// LastPath is where the last report of a server's host is kept.
func LastPath(dataDir string) string { return filepath.Join(dataDir, "bench", "last.json") }

// SaveLast writes rep to LastPath(dataDir) atomically (a reader never sees half a
// file), readable by the server's user.
func SaveLast(dataDir string, rep Report) error {
	p := LastPath(dataDir)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return fmt.Errorf("save bench results: %w", err)
	}
	if rep.Results == nil {
		rep.Results = []Result{}
	}
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("save bench results: %w", err)
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("save bench results: %w", err)
	}
	return nil
}

// LoadReport reads a report saved by SaveLast (or written in the same form).
func LoadReport(path string) (Report, error) {
	var rep Report
	b, err := os.ReadFile(path)
	if err != nil {
		return rep, fmt.Errorf("read bench report: %w", err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		return rep, fmt.Errorf("bench report %s: %w", path, err)
	}
	return rep, nil
}
