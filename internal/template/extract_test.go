package template

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

type entry struct {
	name, link string
	typ        byte
	mode       int64
	uid, gid   int
	body       string
}

func tarOf(t *testing.T, entries ...entry) *bytes.Reader {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.gid,
			Size: int64(len(e.body)), ModTime: time.Unix(1700000000, 0), Format: tar.FormatPAX}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(e.body)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return bytes.NewReader(buf.Bytes())
}

func extractInto(t *testing.T, dir string, r *bytes.Reader) (extractStats, error) {
	t.Helper()
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	return extractTar(context.Background(), root, r, nil)
}

func TestExtractTar(t *testing.T) {
	dir := t.TempDir()
	// The order of mutate.Extract: upper layers first, so entries precede their
	// parents' entries and hard links their targets.
	st, err := extractInto(t, dir, tarOf(t,
		entry{name: "usr/bin/tool", typ: tar.TypeReg, mode: 0o4755, uid: 0, gid: 0, body: "#!tool"},
		entry{name: "usr/bin/alias", typ: tar.TypeLink, link: "usr/bin/tool"},
		entry{name: "/etc/localtime", typ: tar.TypeSymlink, link: "/usr/share/zoneinfo/UTC"},
		entry{name: "./home/app/", typ: tar.TypeDir, mode: 0o750, uid: 1000, gid: 1000},
		entry{name: "home/app/notes", typ: tar.TypeReg, mode: 0o600, uid: 1000, gid: 1000, body: "hi"},
		entry{name: "usr/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "usr/bin/", typ: tar.TypeDir, mode: 0o711},
		entry{name: "lib", typ: tar.TypeSymlink, link: "usr/lib"},
		entry{name: "dev/null", typ: tar.TypeChar},
		entry{name: "./", typ: tar.TypeDir, mode: 0o700},
	))
	if err != nil {
		t.Fatal(err)
	}
	if st.Files != 2 || st.Links != 3 || st.Skipped != 1 {
		t.Errorf("stats = %+v", st)
	}
	check := func(p string, mode fs.FileMode, uid int) {
		t.Helper()
		fi, err := os.Lstat(filepath.Join(dir, p))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode() != mode {
			t.Errorf("%s: mode %v, want %v", p, fi.Mode(), mode)
		}
		if os.Geteuid() == 0 && int(fi.Sys().(*syscall.Stat_t).Uid) != uid {
			t.Errorf("%s: uid %d, want %d", p, fi.Sys().(*syscall.Stat_t).Uid, uid)
		}
	}
	check("usr/bin/tool", 0o755|fs.ModeSetuid, 0)
	check("usr/bin", fs.ModeDir|0o711, 0)
	check("home/app", fs.ModeDir|0o750, 1000)
	check("home/app/notes", 0o600, 1000)
	if l, _ := os.Readlink(filepath.Join(dir, "etc/localtime")); l != "/usr/share/zoneinfo/UTC" {
		t.Errorf("absolute symlink target = %q", l)
	}
	a, _ := os.Stat(filepath.Join(dir, "usr/bin/tool"))
	b, _ := os.Stat(filepath.Join(dir, "usr/bin/alias"))
	if !os.SameFile(a, b) {
		t.Error("hard link is not the same file")
	}
	if fi, _ := os.Stat(dir); fi.Mode().Perm() == 0o700 {
		t.Error("the root directory's mode was changed by a ./ entry")
	}
	if !a.ModTime().Equal(time.Unix(1700000000, 0)) {
		t.Errorf("mtime = %v", a.ModTime())
	}
}

// TestExtractTarNoDevices checks that no device node or FIFO from an image reaches the
// host, not even through a hard link to one, while the rest of the image is extracted.
func TestExtractTarNoDevices(t *testing.T) {
	dir := t.TempDir()
	st, err := extractInto(t, dir, tarOf(t,
		entry{name: "dev/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "dev/mem", typ: tar.TypeChar, mode: 0o666},
		entry{name: "dev/sda", typ: tar.TypeBlock, mode: 0o666},
		entry{name: "run/fifo", typ: tar.TypeFifo, mode: 0o666},
		entry{name: "usr/mem-alias", typ: tar.TypeLink, link: "dev/mem"},
		entry{name: "usr/bin/sudo", typ: tar.TypeReg, mode: 0o4755, body: "#!sudo"},
	))
	if err != nil {
		t.Fatal(err)
	}
	if st.Skipped != 4 || st.Files != 1 {
		t.Errorf("stats = %+v, want 4 skipped and 1 file", st)
	}
	for _, p := range []string{"dev/mem", "dev/sda", "run/fifo", "usr/mem-alias"} {
		if _, err := os.Lstat(filepath.Join(dir, p)); !os.IsNotExist(err) {
			t.Errorf("%s exists on the host: %v", p, err)
		}
	}
	if fi, err := os.Stat(filepath.Join(dir, "usr/bin/sudo")); err != nil || fi.Mode()&fs.ModeSetuid == 0 {
		t.Errorf("setuid binary: %v %v (the setuid bit is kept for use inside sandboxes)", fi, err)
	}
}

// TestExtractTarEscapes feeds archives that try to write outside the root: each fails
// and nothing appears outside.
func TestExtractTarEscapes(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entries func(outside string) []entry
	}{
		{"dot-dot name", func(string) []entry {
			return []entry{{name: "../escaped", typ: tar.TypeReg, body: "x"}}
		}},
		{"dot-dot inside name", func(string) []entry {
			return []entry{{name: "a/../../escaped", typ: tar.TypeReg, body: "x"}}
		}},
		{"absolute symlink then write through it", func(outside string) []entry {
			return []entry{
				{name: "evil", typ: tar.TypeSymlink, link: outside},
				{name: "evil/escaped", typ: tar.TypeReg, body: "x"},
			}
		}},
		{"absolute symlink then mkdir through it", func(outside string) []entry {
			return []entry{
				{name: "evil", typ: tar.TypeSymlink, link: outside},
				{name: "evil/escaped/", typ: tar.TypeDir, mode: 0o755},
			}
		}},
		{"relative symlink climbing out then write", func(outside string) []entry {
			return []entry{
				{name: "a/b/evil", typ: tar.TypeSymlink, link: "../../../" + filepath.Base(outside)},
				{name: "a/b/evil/escaped", typ: tar.TypeReg, body: "x"},
			}
		}},
		{"hard link out", func(outside string) []entry {
			return []entry{{name: "stolen", typ: tar.TypeLink, link: "../" + filepath.Base(outside) + "/secret"}}
		}},
		{"hard link through an absolute symlink", func(outside string) []entry {
			return []entry{
				{name: "evil", typ: tar.TypeSymlink, link: outside},
				{name: "stolen", typ: tar.TypeLink, link: "evil/secret"},
			}
		}},
		{"symlink then symlink through it", func(outside string) []entry {
			return []entry{
				{name: "evil", typ: tar.TypeSymlink, link: outside},
				{name: "evil/planted", typ: tar.TypeSymlink, link: "/etc/passwd"},
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			root := filepath.Join(base, "root")
			outside := filepath.Join(base, "outside")
			for _, d := range []string{root, outside} {
				if err := os.Mkdir(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("secret"), 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := extractInto(t, root, tarOf(t, tc.entries(outside)...))
			if err == nil {
				t.Fatal("extraction succeeded")
			}
			t.Log(err)
			ents, _ := os.ReadDir(outside)
			if len(ents) != 1 {
				t.Errorf("something was written outside the root: %v", ents)
			}
			if b, _ := os.ReadFile(filepath.Join(outside, "secret")); string(b) != "secret" {
				t.Errorf("the file outside was changed: %q", b)
			}
			ents, _ = os.ReadDir(base)
			if len(ents) != 2 {
				t.Errorf("something was written beside the root: %v", ents)
			}
			if _, err := os.Stat(filepath.Join(root, "stolen")); err == nil {
				t.Error("a hard link to a file outside was made")
			}
		})
	}
}

// TestExtractReplacesLinks: an entry over an existing symbolic link to a file outside
// replaces the link; the file outside is untouched.
func TestExtractReplacesLinks(t *testing.T) {
	base := t.TempDir()
	root := filepath.Join(base, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(base, "secret")
	if err := os.WriteFile(secret, []byte("secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := extractInto(t, root, tarOf(t,
		entry{name: "evil", typ: tar.TypeSymlink, link: secret},
		entry{name: "evil", typ: tar.TypeReg, body: "mine"},
	))
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(secret); string(b) != "secret" {
		t.Fatalf("the file outside was changed: %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "evil")); string(b) != "mine" {
		t.Fatalf("evil = %q", b)
	}
}

// TestCopyTree copies a directory tree as is: a link out of the tree is copied as a
// link, not followed.
func TestCopyTree(t *testing.T) {
	base := t.TempDir()
	src, dst := filepath.Join(base, "src"), filepath.Join(base, "dst")
	for _, d := range []string{filepath.Join(src, "bin"), dst} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(src, "bin", "run"), []byte("run"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc/shadow", filepath.Join(src, "shadow")); err != nil {
		t.Fatal(err)
	}
	sr, err := os.OpenRoot(src)
	if err != nil {
		t.Fatal(err)
	}
	defer sr.Close()
	dr, err := os.OpenRoot(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer dr.Close()
	st, err := copyTree(context.Background(), sr, dr, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st.Files != 1 || st.Dirs != 1 || st.Links != 1 {
		t.Errorf("stats = %+v", st)
	}
	if b, err := os.ReadFile(filepath.Join(dst, "bin", "run")); err != nil || string(b) != "run" {
		t.Errorf("bin/run = %q, %v", b, err)
	}
	if fi, err := os.Lstat(filepath.Join(dst, "shadow")); err != nil || fi.Mode()&fs.ModeSymlink == 0 {
		t.Errorf("shadow is not a symlink: %v %v", fi, err)
	}
	if l, _ := os.Readlink(filepath.Join(dst, "shadow")); !strings.HasSuffix(l, "shadow") {
		t.Errorf("link target = %q", l)
	}
}

// TestExtractImageReportsLateErrors: mutate.Extract reports a failure after it ended
// its tar stream; extractImage must still fail (not commit a partial tree).
func TestExtractImageReportsLateErrors(t *testing.T) {
	data, err := io.ReadAll(tarOf(t,
		entry{name: "ok", typ: tar.TypeReg, body: "fine"},
		entry{name: "../escaped", typ: tar.TypeReg, body: "x"},
	))
	if err != nil {
		t.Fatal(err)
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	base := t.TempDir()
	dir := filepath.Join(base, "root")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	err = extractImage(context.Background(), img, root, func(string) {})
	if err == nil || !strings.Contains(err.Error(), "unsafe") {
		t.Fatalf("extractImage = %v, want the unsafe entry reported", err)
	}
	if _, err := os.Stat(filepath.Join(base, "escaped")); err == nil {
		t.Fatal("the entry was written outside")
	}
}
