package storage_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/storage"
)

// makeTree writes a small tree with every kind of entry the digest distinguishes.
func makeTree(t *testing.T, dir string) {
	t.Helper()
	must(t, os.MkdirAll(filepath.Join(dir, "etc/sub"), 0o755))
	must(t, os.WriteFile(filepath.Join(dir, "etc/a.conf"), []byte("alpha\n"), 0o644))
	must(t, os.WriteFile(filepath.Join(dir, "etc/sub/b"), []byte("beta"), 0o600))
	must(t, os.WriteFile(filepath.Join(dir, "empty"), nil, 0o644))
	must(t, os.Symlink("etc/a.conf", filepath.Join(dir, "link")))
	must(t, unix.Mkfifo(filepath.Join(dir, "fifo"), 0o644))
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func digest(t *testing.T, dir string) (string, int64) {
	t.Helper()
	d, size, err := storage.TreeDigest(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := storage.ValidateDigest(d); err != nil {
		t.Fatal(err)
	}
	return d, size
}

func TestTreeDigestDeterministic(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	makeTree(t, a)
	makeTree(t, b) // same content, different inodes and timestamps
	da, sizeA := digest(t, a)
	if da2, _ := digest(t, a); da2 != da {
		t.Fatalf("same tree twice: %s != %s", da, da2)
	}
	db, _ := digest(t, b)
	if da != db {
		t.Fatalf("identical trees: %s != %s", da, db)
	}
	if want := int64(len("alpha\n") + len("beta")); sizeA != want {
		t.Fatalf("size = %d, want %d", sizeA, want)
	}

	changes := map[string]func(dir string) error{
		"mode":    func(dir string) error { return os.Chmod(filepath.Join(dir, "etc/a.conf"), 0o755) },
		"dirmode": func(dir string) error { return os.Chmod(filepath.Join(dir, "etc"), 0o700) },
		"content": func(dir string) error { return os.WriteFile(filepath.Join(dir, "etc/sub/b"), []byte("betA"), 0o600) },
		"owner":   func(dir string) error { return os.Lchown(filepath.Join(dir, "empty"), 1000, 1000) },
		"target": func(dir string) error {
			os.Remove(filepath.Join(dir, "link"))
			return os.Symlink("etc/sub/b", filepath.Join(dir, "link"))
		},
		"rename": func(dir string) error { return os.Rename(filepath.Join(dir, "empty"), filepath.Join(dir, "empty2")) },
		"add":    func(dir string) error { return os.Mkdir(filepath.Join(dir, "new"), 0o755) },
	}
	for name, change := range changes {
		t.Run(name, func(t *testing.T) {
			if name == "owner" && os.Geteuid() != 0 {
				t.Skip("chown needs root")
			}
			c := t.TempDir()
			makeTree(t, c)
			must(t, change(c))
			if dc, _ := digest(t, c); dc == da {
				t.Fatalf("digest unchanged after %s change", name)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		id string
		ok bool
	}{
		{"abc123", true}, {"a", true}, {"", false}, {"ABC", false}, {"a-b", false},
		{"a.b", false}, {"../x", false}, {"a/b", false},
		{"x123456789012345678901234567890123456789012345678901234567890123", false},
	} {
		if err := storage.ValidateID(tc.id); (err == nil) != tc.ok {
			t.Errorf("ValidateID(%q) = %v, want ok=%v", tc.id, err, tc.ok)
		}
	}
	hex := "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	for _, tc := range []struct {
		d  string
		ok bool
	}{
		{"sha256:" + hex, true}, {hex, false}, {"sha256:" + hex[1:], false},
		{"sha256:" + hex[1:] + "G", false}, {"sha256:" + hex[1:] + "A", false},
		{"sha512:" + hex, false}, {"sha256:../../../../etc" + hex[22:], false},
	} {
		if err := storage.ValidateDigest(tc.d); (err == nil) != tc.ok {
			t.Errorf("ValidateDigest(%q) = %v, want ok=%v", tc.d, err, tc.ok)
		}
	}
}
