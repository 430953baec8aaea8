package template_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/template"
)

func TestSources(t *testing.T) {
	base := t.TempDir()
	allowed := filepath.Join(base, "allowed")
	outside := filepath.Join(base, "outside")
	for _, d := range []string{allowed, outside} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(allowed, "img.tar"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(outside, "secret"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// A link inside the allowed directory that leads out of it.
	if err := os.Symlink(outside, filepath.Join(allowed, "escape")); err != nil {
		t.Fatal(err)
	}

	var s template.Sources
	if err := s.Set("registry:registry.example.com/team, dir:" + allowed); err != nil {
		t.Fatal(err)
	}
	if err := s.Set("registry:127.0.0.1:5000"); err != nil {
		t.Fatal(err)
	}
	if got := s.String(); got != "registry:registry.example.com/team,registry:127.0.0.1:5000,dir:"+allowed {
		t.Errorf("String = %q", got)
	}
	for _, bad := range []string{"dir:relative", "registry:", "ftp:x", "/abs"} {
		if _, err := template.ParseSources(bad); err == nil {
			t.Errorf("ParseSources(%q) accepted", bad)
		}
	}

	for _, tc := range []struct {
		path      string
		mustExist bool
		ok        bool
	}{
		{filepath.Join(allowed, "img.tar"), true, true},
		{allowed, true, true},
		{filepath.Join(allowed, "sub", "..", "img.tar"), true, true},
		{filepath.Join(allowed, "..", "outside", "secret"), true, false},
		{filepath.Join(allowed, "escape", "secret"), true, false},
		{filepath.Join(allowed, "escape", "secret"), false, false},
		{filepath.Join(allowed, "later.tar"), false, true}, // not (yet) here: checked as written
		{filepath.Join(allowed+"x", "f"), false, false},
		{"/etc/passwd", true, false},
	} {
		_, err := s.CheckPath("from.archive", tc.path, tc.mustExist)
		if tc.ok && err != nil {
			t.Errorf("CheckPath(%s, %v) = %v, want allowed", tc.path, tc.mustExist, err)
		}
		if !tc.ok && (!fault.Is(err, fault.Forbidden) || !strings.Contains(err.Error(), template.SourcesSetting)) {
			t.Errorf("CheckPath(%s, %v) = %v, want forbidden naming the setting", tc.path, tc.mustExist, err)
		}
	}
	if _, err := s.CheckPath("from.archive", filepath.Join(allowed, "missing.tar"), true); !fault.Is(err, fault.Invalid) {
		t.Errorf("missing path on the node: %v, want invalid", err)
	}

	for _, tc := range []struct {
		ref string
		ok  bool
	}{
		{"registry.example.com/team/app:1", true},
		{"registry.example.com/team/sub/app@sha256:" + strings.Repeat("a", 64), true},
		{"REGISTRY.example.com/team/app:1", true},
		{"registry.example.com/teamx/app:1", false},
		{"registry.example.com/app:1", false},
		{"other.example.com/team/app:1", false},
		{"127.0.0.1:5000/anything/here:v2", true},
		{"127.0.0.1:5001/anything:v2", false},
	} {
		err := s.CheckImage(tc.ref)
		if tc.ok != (err == nil) || err != nil && !fault.Is(err, fault.Forbidden) {
			t.Errorf("CheckImage(%s) = %v, want ok=%v", tc.ref, err, tc.ok)
		}
	}

	var none template.Sources
	spec, err := template.ParseSpec([]byte("name: d\nfrom: {debian: {suite: bookworm}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if err := none.CheckSpec(spec, true); err != nil {
		t.Errorf("debian source needs no allowlist entry: %v", err)
	}
	spec, err = template.ParseSpec([]byte("name: d\nfrom: {template: base}\nsteps: [{copy: {src: " + filepath.Join(allowed, "img.tar") + ", dst: /x}}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if err := none.CheckSpec(spec, true); !fault.Is(err, fault.Forbidden) || !strings.Contains(err.Error(), "nothing is allowed") {
		t.Errorf("copy source with an empty allowlist: %v", err)
	}
	if err := s.CheckSpec(spec, true); err != nil {
		t.Errorf("allowed copy source: %v", err)
	}
}
