package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSelected(t *testing.T) {
	dir := t.TempDir()
	for in, want := range map[string]string{
		"always within_size advise [never] deny force\n": "never",
		"always defer defer+madvise [madvise] never\n":   "madvise",
		"no choice\n": "",
	} {
		p := filepath.Join(dir, "f")
		if err := os.WriteFile(p, []byte(in), 0o600); err != nil {
			t.Fatal(err)
		}
		if got := selected(p); got != want {
			t.Errorf("selected(%q) = %q, want %q", in, got, want)
		}
	}
	if got := selected(filepath.Join(dir, "missing")); got != "" {
		t.Errorf("missing file: %q", got)
	}
	h := Host{CPUs: 2, Kernel: "6.1.0", ShmemTHP: "advise", THPDefrag: "defer", Load: "0.50"}
	if s := h.String(); !strings.Contains(s, "2 CPUs") || !strings.Contains(s, "advise (defrag defer)") || !strings.Contains(s, "load 0.50") {
		t.Errorf("Host.String() = %q", s)
	}
	if ReadHost().CPUs < 1 {
		t.Error("ReadHost found no CPU")
	}
}
