package runtime

import (
	"os"
	"path/filepath"
	"testing"
)

func TestLogTail(t *testing.T) {
	p := filepath.Join(t.TempDir(), "log")
	if err := os.WriteFile(p, []byte("early line\nthe error\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := LogTail(p, 10); got != "the error" {
		t.Errorf("LogTail(10) = %q, want %q", got, "the error")
	}
	if got := LogTail(p, 1<<10); got != "early line\nthe error" {
		t.Errorf("LogTail(1024) = %q, want the whole file", got)
	}
	if got := LogTail(filepath.Join(t.TempDir(), "missing"), 10); got != "" {
		t.Errorf("LogTail of a missing file = %q", got)
	}
}
