package durable

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

func TestWriteFileAndSync(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := WriteFile(p, []byte("first, longer"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(p, []byte("second"), 0o640); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(p)
	if err != nil || string(got) != "second" {
		t.Fatalf("read back %q %v, want the second write alone", got, err)
	}
	if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o640 {
		t.Fatalf("mode %v %v, want 0640", fi.Mode(), err)
	}
	for _, q := range []string{p, dir} {
		if err := Sync(q); err != nil {
			t.Errorf("Sync(%s): %v", q, err)
		}
	}
	if err := Sync(filepath.Join(dir, "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Sync of a missing path: %v", err)
	}
	if err := WriteFile(filepath.Join(dir, "no", "such"), nil, 0o600); err == nil {
		t.Error("WriteFile into a missing directory succeeded")
	}
}
