package agent

import (
	"os"
	"path/filepath"
	"testing"
)

// TestFsTypeOf: a path's file system is its deepest mount's, escapes in mount points
// undone; the prefix of a name is not its directory.
func TestFsTypeOf(t *testing.T) {
	mounts := []mountEntry{{"/", "9p"}, {"/tmp", "tmpfs"}, {"/dev", "dev"}, {"/dev/shm", "tmpfs"},
		{unescapeMount(`/srv/my\040data`), "tmpfs"}, {"/run/space", "9p"}}
	for path, want := range map[string]string{
		"/root/app.sock":        "9p",
		"/tmp/app.sock":         "tmpfs",
		"/tmpfoo/app.sock":      "9p",
		"/dev/shm/x/app.sock":   "tmpfs",
		"/dev/log":              "dev",
		"/srv/my data/app.sock": "tmpfs",
		"/run/space/agent.sock": "9p",
	} {
		if got := fsTypeOf(mounts, path); got != want {
			t.Errorf("fsTypeOf(%q) = %q, want %q", path, got, want)
		}
	}
}

// TestResolveDir: a socket's directory is followed through links (Debian's /var/run is
// /run); the socket's own name is kept, and a path that does not resolve is kept.
func TestResolveDir(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "run"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("run", filepath.Join(dir, "varrun")); err != nil {
		t.Fatal(err)
	}
	real, _ := filepath.EvalSymlinks(dir) // t.TempDir may itself be under a link
	if got, want := resolveDir(filepath.Join(dir, "varrun", "app.sock")), filepath.Join(real, "run", "app.sock"); got != want {
		t.Errorf("through the link: %q, want %q", got, want)
	}
	if got, want := resolveDir(filepath.Join(dir, "gone", "app.sock")), filepath.Join(dir, "gone", "app.sock"); got != want {
		t.Errorf("missing directory: %q, want %q", got, want)
	}
}
