package agent

import "testing"

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
