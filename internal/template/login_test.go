package template

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestQuickLogin edits Debian bookworm's /etc/profile and root's ~/.profile (testdata):
// bash's EUID answers where `id -u` ran, and gives the same PATH as the original to bash
// and to dash (which has no EUID and still runs `id -u`); mesg runs only on a terminal.
// Edited files are left as they are by a second pass, and a tree without them is fine.
func TestQuickLogin(t *testing.T) {
	root := t.TempDir()
	for _, f := range []struct{ from, to string }{
		{"bookworm-etc-profile", "etc/profile"},
		{"bookworm-root-profile", "root/.profile"},
	} {
		b, err := os.ReadFile(filepath.Join("testdata", f.from))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(root, filepath.Dir(f.to)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, f.to), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if err := quickLogin(root); err != nil {
			t.Fatal(err)
		}
	}
	profile, _ := os.ReadFile(filepath.Join(root, "etc/profile"))
	rootProfile, _ := os.ReadFile(filepath.Join(root, "root/.profile"))
	if strings.Count(string(profile), `"${EUID:-$(id -u)}"`) != 2 || strings.Contains(string(profile), `"$(id -u)"`) ||
		strings.Count(string(profile), "EUID") != 2 {
		t.Fatalf("etc/profile:\n%s", profile)
	}
	if !strings.Contains(string(rootProfile), "\nif [ -t 0 ]; then mesg n 2> /dev/null || true; fi\n") ||
		strings.Count(string(rootProfile), "mesg") != 1 {
		t.Fatalf("root/.profile:\n%s", rootProfile)
	}

	// The same PATH as Debian's own file, in bash and in dash, for this user and (as
	// root) for another.
	users := [][]string{nil}
	if os.Geteuid() == 0 {
		users = append(users, []string{"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"})
	}
	// Both files where another user can read them.
	dir, err := os.MkdirTemp("", "quicklogin")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	edited, orig := filepath.Join(dir, "edited"), filepath.Join(dir, "orig")
	b, err := os.ReadFile(filepath.Join("testdata", "bookworm-etc-profile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []struct {
		path string
		b    []byte
	}{{edited, profile}, {orig, b}} {
		if err := os.WriteFile(f.path, f.b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, sh := range []string{"bash", "dash"} {
		if _, err := exec.LookPath(sh); err != nil {
			t.Logf("no %s: %v", sh, err)
			continue
		}
		for _, as := range users {
			path := func(profile string) string {
				t.Helper()
				argv := append(append([]string{}, as...), "env", "-i", "PATH=/usr/bin:/bin", sh, "-c", `. "$1"; echo "$PATH"`, sh, profile)
				out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
				if err != nil {
					t.Fatalf("%s sourcing %s as %v: %v: %s", sh, profile, as, err, out)
				}
				return string(out)
			}
			if got, want := path(edited), path(orig); got != want {
				t.Errorf("%s as %v: PATH %q, Debian's profile gives %q", sh, as, got, want)
			}
		}
	}

	if err := quickLogin(t.TempDir()); err != nil {
		t.Fatalf("a tree without the files: %v", err)
	}
}
