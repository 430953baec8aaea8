package agent_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"mime/multipart"
	"net/textproto"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/agent"
	filesystempb "github.com/spacedev/space/internal/guest/envdpb/filesystem"
)

// noXattrHome mounts a ramfs (a file system without user extended attributes, like
// gVisor's root file system) over the test user's home.
func noXattrHome(t *testing.T, e *envdEnv) {
	t.Helper()
	needRoot(t)
	if err := unix.Mount("none", e.home, "ramfs", 0, "mode=0755"); err != nil {
		t.Skipf("cannot mount a ramfs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(e.home, unix.MNT_DETACH) })
	if err := os.Chown(e.home, 4242, 4242); err != nil {
		t.Fatal(err)
	}
	probe := filepath.Join(e.home, ".probe")
	if err := os.WriteFile(probe, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(probe)
	if err := unix.Setxattr(probe, "user.x", []byte("1"), 0); !errors.Is(err, unix.ENOTSUP) {
		t.Skipf("ramfs here has user xattrs (%v): nothing to fall back from", err)
	}
}

// upload posts one raw file to envd's /files with optional metadata headers.
func (e *envdEnv) upload(t *testing.T, path, content string, md map[string]string) (int, string) {
	t.Helper()
	hdr := map[string]string{"Content-Type": "application/octet-stream"}
	for k, v := range md {
		hdr["X-Metadata-"+k] = v
	}
	resp, b := e.envdHTTP(t, "POST", "/files?path="+path, strings.NewReader(content), hdr)
	return resp.StatusCode, string(b)
}

func (e *envdEnv) metadataOf(t *testing.T, path string) map[string]string {
	t.Helper()
	st, err := e.fs.Stat(testCtx(t, time.Minute), connect.NewRequest(&filesystempb.StatRequest{Path: path}))
	if err != nil {
		t.Fatalf("stat %s: %v", path, err)
	}
	return st.Msg.GetEntry().GetMetadata()
}

// storeEntries reads the agent's sidecar metadata store.
func storeEntries(t *testing.T, stateDir string) map[string]json.RawMessage {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(stateDir, "file-metadata.json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Entries map[string]json.RawMessage `json:"entries"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatalf("store: %v: %s", err, b)
	}
	return doc.Entries
}

// TestEnvdMetadataWithoutXattrs: on a file system without extended attributes, file
// metadata lives in the agent's sidecar store, follows moves made through the API,
// goes with removes, and a failed write leaves nothing behind.
func TestEnvdMetadataWithoutXattrs(t *testing.T) {
	stateDir := ""
	e := startEnvdWith(t, func(c *agent.Config) { stateDir = c.StateDir })
	noXattrHome(t, e)
	ctx := testCtx(t, time.Minute)

	// Relative path (the home) and absolute path, metadata in the answer and in Stat.
	code, body := e.upload(t, "notes/meta.txt", "with metadata", map[string]string{"Owner": "suite", "kind": "a"})
	if code != 200 || !strings.Contains(body, `"metadata":{"kind":"a","owner":"suite"}`) {
		t.Fatalf("upload with metadata: %d %s", code, body)
	}
	want := map[string]string{"owner": "suite", "kind": "a"}
	if got := e.metadataOf(t, "notes/meta.txt"); !mapsEqual(got, want) {
		t.Errorf("stat metadata: %v, want %v", got, want)
	}
	abs := filepath.Join(e.home, "notes/abs.txt")
	if code, body := e.upload(t, abs, "x", map[string]string{"k": "v"}); code != 200 {
		t.Fatalf("upload abs: %d %s", code, body)
	}
	if _, err := unix.Getxattr(abs, "user.e2b.k", make([]byte, 16)); !errors.Is(err, unix.ENOTSUP) {
		t.Errorf("xattr on a ramfs: %v", err)
	}
	if entries := storeEntries(t, stateDir); entries[filepath.Join(e.home, "notes/meta.txt")] == nil || entries[abs] == nil {
		t.Errorf("sidecar store: %v", entries)
	}
	ls, err := e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "notes"}))
	if err != nil {
		t.Fatal(err)
	}
	for _, en := range ls.Msg.GetEntries() {
		if en.GetName() == "abs.txt" && en.GetMetadata()["k"] != "v" {
			t.Errorf("list metadata: %v", en)
		}
	}

	// Rewriting without metadata keeps it (same file); with metadata replaces it.
	if code, body := e.upload(t, "notes/meta.txt", "new content", nil); code != 200 {
		t.Fatalf("rewrite: %d %s", code, body)
	}
	if got := e.metadataOf(t, "notes/meta.txt"); !mapsEqual(got, want) {
		t.Errorf("metadata after a rewrite without metadata: %v", got)
	}
	if code, body := e.upload(t, "notes/meta.txt", "again", map[string]string{"only": "this"}); code != 200 {
		t.Fatalf("rewrite with metadata: %d %s", code, body)
	}
	if got := e.metadataOf(t, "notes/meta.txt"); !mapsEqual(got, map[string]string{"only": "this"}) {
		t.Errorf("replaced metadata: %v", got)
	}

	// A move of the directory carries the metadata of what is in it.
	if _, err := e.fs.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: "notes", Destination: "moved/notes"})); err != nil {
		t.Fatal(err)
	}
	if got := e.metadataOf(t, "moved/notes/abs.txt"); got["k"] != "v" {
		t.Errorf("metadata after a move: %v", got)
	}
	// A file moved over another takes its own metadata along.
	if code, _ := e.upload(t, "moved/notes/plain.txt", "plain", nil); code != 200 {
		t.Fatal("upload plain")
	}
	if _, err := e.fs.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: "moved/notes/plain.txt", Destination: "moved/notes/abs.txt"})); err != nil {
		t.Fatal(err)
	}
	if got := e.metadataOf(t, "moved/notes/abs.txt"); got != nil {
		t.Errorf("metadata of a file moved over a file with metadata: %v", got)
	}
	// A program's rename is not seen: the file loses its metadata.
	if err := os.Rename(filepath.Join(e.home, "moved/notes/meta.txt"), filepath.Join(e.home, "moved/notes/by-program.txt")); err != nil {
		t.Fatal(err)
	}
	if got := e.metadataOf(t, "moved/notes/by-program.txt"); got != nil {
		t.Errorf("metadata after a rename outside the API: %v", got)
	}

	// Remove drops it: a new file at the same path has none.
	if code, _ := e.upload(t, "moved/notes/r.txt", "r", map[string]string{"r": "1"}); code != 200 {
		t.Fatal("upload r")
	}
	if _, err := e.fs.Remove(ctx, connect.NewRequest(&filesystempb.RemoveRequest{Path: "moved"})); err != nil {
		t.Fatal(err)
	}
	for p := range storeEntries(t, stateDir) {
		if strings.HasPrefix(p, filepath.Join(e.home, "moved")+"/") {
			t.Errorf("store entry %s survived the remove", p)
		}
	}
	if code, _ := e.upload(t, "moved/notes/r.txt", "r", nil); code != 200 {
		t.Fatal("upload r again")
	}
	if got := e.metadataOf(t, "moved/notes/r.txt"); got != nil {
		t.Errorf("metadata of a new file at a removed path: %v", got)
	}

	// Failed writes leave nothing behind: bad metadata, and a multipart request whose
	// second part fails.
	code, body = e.upload(t, "fresh/dir/f.txt", "x", map[string]string{"big": strings.Repeat("v", 5000)})
	if code != 400 {
		t.Errorf("oversized metadata: %d %s", code, body)
	}
	var mp bytes.Buffer
	mw := multipart.NewWriter(&mp)
	for _, name := range []string{"fresh2/a/one.txt", "fresh2/a/one.txt"} {
		h := textproto.MIMEHeader{}
		h.Set("Content-Disposition", `form-data; name="file"; filename="`+name+`"`)
		pw, _ := mw.CreatePart(h)
		pw.Write([]byte("content"))
	}
	mw.Close()
	resp, b := e.envdHTTP(t, "POST", "/files", &mp, map[string]string{"Content-Type": mw.FormDataContentType(), "X-Metadata-A": "b"})
	if resp.StatusCode != 400 {
		t.Errorf("duplicate part: %d %s", resp.StatusCode, b)
	}
	for _, p := range []string{"fresh", "fresh2"} {
		if _, err := os.Lstat(filepath.Join(e.home, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind by a failed write: %v", p, err)
		}
	}
}

// TestEnvdMetadataStoreFailure: when the metadata cannot be stored the write fails
// and the file it created is removed.
func TestEnvdMetadataStoreFailure(t *testing.T) {
	e := startEnvdWith(t, func(c *agent.Config) { c.StateDir = "/dev/null/state" })
	noXattrHome(t, e)
	code, body := e.upload(t, "new/f.txt", "x", map[string]string{"k": "v"})
	if code != 500 || !strings.Contains(body, "metadata") {
		t.Errorf("write with an unusable store: %d %s", code, body)
	}
	if _, err := os.Lstat(filepath.Join(e.home, "new")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("failed write left %v", err)
	}
	// Without metadata the store is not needed.
	if code, body := e.upload(t, "new/f.txt", "x", nil); code != 200 {
		t.Errorf("write without metadata: %d %s", code, body)
	}
}

// TestEnvdSymlinkEntries: Stat and ListDir report a link as envd does: its resolved
// absolute target, the target's type and permission bits; a link that does not
// resolve reports its own path and no type.
func TestEnvdSymlinkEntries(t *testing.T) {
	e := startEnvd(t)
	ctx := testCtx(t, time.Minute)
	file := filepath.Join(e.home, "test_file.txt")
	if err := os.WriteFile(file, []byte("test"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(file, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(e.home, "dir"), 0o750); err != nil {
		t.Fatal(err)
	}
	for link, target := range map[string]string{"file_link": "test_file.txt", "dir_link": filepath.Join(e.home, "dir"),
		"chain": "file_link", "broken": "/does/not/exist"} {
		if err := os.Symlink(target, filepath.Join(e.home, link)); err != nil {
			t.Fatal(err)
		}
	}
	cases := []struct {
		link, target string
		typ          filesystempb.FileType
		mode         uint32
	}{
		{"file_link", file, filesystempb.FileType_FILE_TYPE_FILE, 0o640},
		{"chain", file, filesystempb.FileType_FILE_TYPE_FILE, 0o640},
		{"dir_link", filepath.Join(e.home, "dir"), filesystempb.FileType_FILE_TYPE_DIRECTORY, 0o750},
		{"broken", filepath.Join(e.home, "broken"), filesystempb.FileType_FILE_TYPE_UNSPECIFIED, 0},
	}
	ls, err := e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: e.home}))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]*filesystempb.EntryInfo{}
	for _, en := range ls.Msg.GetEntries() {
		listed[en.GetName()] = en
	}
	for _, c := range cases {
		st, err := e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: c.link}))
		if err != nil {
			t.Fatalf("stat %s: %v", c.link, err)
		}
		for how, en := range map[string]*filesystempb.EntryInfo{"stat": st.Msg.GetEntry(), "list": listed[c.link]} {
			if en == nil {
				t.Errorf("%s %s: missing", how, c.link)
				continue
			}
			if en.GetPath() != filepath.Join(e.home, c.link) || en.GetSymlinkTarget() != c.target || en.GetType() != c.typ ||
				en.GetMode() != c.mode || !strings.HasPrefix(en.GetPermissions(), "L") {
				t.Errorf("%s %s: path %s target %q type %v mode %o perms %s; want target %q type %v mode %o",
					how, c.link, en.GetPath(), en.GetSymlinkTarget(), en.GetType(), en.GetMode(), en.GetPermissions(), c.target, c.typ, c.mode)
			}
		}
	}
	// An upload to a link that leads nowhere yet creates its target, as a plain write
	// would.
	if err := os.Symlink("later.txt", filepath.Join(e.home, "pending")); err != nil {
		t.Fatal(err)
	}
	if code, body := e.upload(t, "pending", "through the link", nil); code != 200 {
		t.Fatalf("upload through a dangling link: %d %s", code, body)
	}
	if b, err := os.ReadFile(filepath.Join(e.home, "later.txt")); err != nil || string(b) != "through the link" {
		t.Errorf("link target: %q %v", b, err)
	}
	// A plain file has no target.
	st, err := e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "test_file.txt"}))
	if err != nil || st.Msg.GetEntry().SymlinkTarget != nil || st.Msg.GetEntry().GetPermissions() != "-rw-r-----" {
		t.Errorf("stat of a file: %v %v", st, err)
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if bv, ok := b[k]; !ok || bv != v {
			return false
		}
	}
	return true
}
