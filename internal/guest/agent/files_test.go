package agent_test

import (
	"bytes"
	"crypto/sha256"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
)

// randReader yields n deterministic pseudo-random bytes.
type randReader struct {
	rng *rand.ChaCha8
	n   int64
}

func (r *randReader) Read(p []byte) (int, error) {
	if r.n <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > r.n {
		p = p[:r.n]
	}
	_, _ = r.rng.Read(p)
	r.n -= int64(len(p))
	return len(p), nil
}

func TestLargeFileStreaming(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 60*time.Second)
	const size = 256 << 20
	path := filepath.Join(e.dir, "big.bin")
	runtime.GC()
	stop := heapSampler()

	up := sha256.New()
	src := io.TeeReader(&randReader{rng: rand.NewChaCha8([32]byte{1}), n: size}, up)
	info, err := e.c.WriteFile(ctx, path, src, agentclient.WriteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Size != size || info.Type != wire.FileTypeFile || info.Path != path {
		t.Fatalf("entry %+v", info)
	}
	rc, total, err := e.c.ReadFile(ctx, path, agentclient.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	down := sha256.New()
	n, err := io.Copy(down, rc)
	rc.Close()
	if err != nil || n != size || total != size {
		t.Fatalf("download: %d bytes (size %d), %v", n, total, err)
	}
	peak := stop()
	if !bytes.Equal(up.Sum(nil), down.Sum(nil)) {
		t.Fatal("checksum mismatch")
	}
	t.Logf("peak HeapInuse %d MiB for a 256 MiB upload and download", peak>>20)
	if peak > 64<<20 {
		t.Fatalf("heap grew to %d MiB", peak>>20)
	}
	// No temporary files are left next to the target.
	entries, err := os.ReadDir(e.dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range entries {
		if strings.Contains(de.Name(), ".space-") {
			t.Fatalf("temporary file left: %s", de.Name())
		}
	}
	// Ranges.
	rc, _, err = e.c.ReadFile(ctx, path, agentclient.ReadOptions{Offset: size - 10, Length: 4})
	if err != nil {
		t.Fatal(err)
	}
	part, _ := io.ReadAll(rc)
	rc.Close()
	full := &randReader{rng: rand.NewChaCha8([32]byte{1}), n: size}
	if _, err := io.CopyN(io.Discard, full, size-10); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 4)
	if _, err := io.ReadFull(full, want); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(part, want) {
		t.Fatalf("range read %x, want %x", part, want)
	}
}

func TestFileOperations(t *testing.T) {
	needRoot(t)
	e := startAgent(t, nil)
	ctx := testCtx(t, 30*time.Second)

	// Relative paths are relative to the user's home; parents are created and owned
	// by the user.
	info, err := e.c.WriteFile(ctx, "docs/a/hello.txt", strings.NewReader("hello"), agentclient.WriteOptions{User: "user"})
	if err != nil {
		t.Fatal(err)
	}
	abs := filepath.Join(e.home, "docs/a/hello.txt")
	if info.Path != abs || info.Name != "hello.txt" || info.Size != 5 || info.Owner != "user" || info.Group != "user" ||
		info.UID != 4242 || info.Mode != 0o644 || info.Permissions != "-rw-r--r--" || info.ModifiedTime.IsZero() {
		t.Fatalf("written entry %+v", info)
	}
	dirInfo, err := e.c.Stat(ctx, "~/docs/a", "user")
	if err != nil {
		t.Fatal(err)
	}
	if dirInfo.Type != wire.FileTypeDir || dirInfo.Owner != "user" || dirInfo.Permissions != "drwxr-xr-x" {
		t.Fatalf("created parent %+v", dirInfo)
	}
	// Replace keeps the mode unless given; mode is applied exactly.
	if err := os.Chmod(abs, 0o640); err != nil {
		t.Fatal(err)
	}
	info, err = e.c.WriteFile(ctx, abs, strings.NewReader("v2"), agentclient.WriteOptions{User: "user"})
	if err != nil || info.Mode != 0o640 || info.Size != 2 {
		t.Fatalf("replace: %+v %v", info, err)
	}
	info, err = e.c.WriteFile(ctx, abs, strings.NewReader("+more"), agentclient.WriteOptions{User: "user", Append: true})
	if err != nil || info.Size != 7 {
		t.Fatalf("append: %+v %v", info, err)
	}
	script := filepath.Join(e.dir, "run.sh")
	info, err = e.c.WriteFile(ctx, script, strings.NewReader("#!/bin/sh\necho ran\n"), agentclient.WriteOptions{Mode: 0o755})
	if err != nil || info.Permissions != "-rwxr-xr-x" || info.Owner != "root" {
		t.Fatalf("executable: %+v %v", info, err)
	}
	if _, r := e.run(t, wire.ProcessSpec{Argv: []string{script}}); string(r.all) != "ran\n" {
		t.Fatalf("written script ran: %q", r.all)
	}
	rc, size, err := e.c.ReadFile(ctx, abs, agentclient.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(rc)
	rc.Close()
	if string(got) != "v2+more" || size != 7 {
		t.Fatalf("read %q size %d", got, size)
	}
	rc, _, err = e.c.ReadFile(ctx, "docs/a/hello.txt", agentclient.ReadOptions{User: "user", Offset: 2, Length: 3})
	if err != nil {
		t.Fatal(err)
	}
	got, _ = io.ReadAll(rc)
	rc.Close()
	if string(got) != "+mo" {
		t.Fatalf("range %q", got)
	}
	_, _, err = e.c.ReadFile(ctx, e.home, agentclient.ReadOptions{})
	wantAgentError(t, err, 400, wire.ErrCodeIsDir)
	_, _, err = e.c.ReadFile(ctx, filepath.Join(e.dir, "missing"), agentclient.ReadOptions{})
	wantAgentError(t, err, 404, wire.ErrCodeNotFound)
	_, err = e.c.WriteFile(ctx, e.home, strings.NewReader("x"), agentclient.WriteOptions{})
	wantAgentError(t, err, 400, wire.ErrCodeIsDir)
	_, err = e.c.WriteFile(ctx, filepath.Join(abs, "under-a-file"), strings.NewReader("x"), agentclient.WriteOptions{})
	wantAgentError(t, err, 400, wire.ErrCodeNotDir)

	// Symlinks are reported, not followed.
	link := filepath.Join(e.home, "link")
	if err := os.Symlink("docs/a/hello.txt", link); err != nil {
		t.Fatal(err)
	}
	info, err = e.c.Stat(ctx, link, "")
	if err != nil || info.Type != wire.FileTypeSymlink || info.SymlinkTarget != "docs/a/hello.txt" || info.Permissions[0] != 'l' {
		t.Fatalf("symlink %+v %v", info, err)
	}

	// mkdir
	info, err = e.c.Mkdir(ctx, wire.MkdirRequest{Path: "x/y/z", User: "user", Parents: true, Mode: 0o700})
	if err != nil || info.Permissions != "drwx------" || info.Owner != "user" {
		t.Fatalf("mkdir %+v %v", info, err)
	}
	if st, err := e.c.Stat(ctx, "x/y", "user"); err != nil || st.Owner != "user" {
		t.Fatalf("mkdir parent %+v %v", st, err)
	}
	_, err = e.c.Mkdir(ctx, wire.MkdirRequest{Path: "x/y/z", User: "user"})
	wantAgentError(t, err, 409, wire.ErrCodeExists)
	_, err = e.c.Mkdir(ctx, wire.MkdirRequest{Path: abs})
	wantAgentError(t, err, 409, wire.ErrCodeNotDir)
	_, err = e.c.Mkdir(ctx, wire.MkdirRequest{Path: filepath.Join(e.dir, "no/parent")})
	wantAgentError(t, err, 404, wire.ErrCodeNotFound)

	// list
	entries, err := e.c.List(ctx, e.home, "", 1)
	if err != nil {
		t.Fatal(err)
	}
	if names := entryNames(entries); strings.Join(names, ",") != "docs,link,x" {
		t.Fatalf("list depth 1: %v", names)
	}
	entries, err = e.c.List(ctx, "~", "user", 3)
	if err != nil {
		t.Fatal(err)
	}
	if paths := entryPaths(e.home, entries); strings.Join(paths, ",") != "docs,docs/a,docs/a/hello.txt,link,x,x/y,x/y/z" {
		t.Fatalf("list depth 3: %v", paths)
	}
	_, err = e.c.List(ctx, abs, "", 1)
	wantAgentError(t, err, 400, wire.ErrCodeNotDir)
	_, err = e.c.List(ctx, filepath.Join(e.dir, "missing"), "", 1)
	wantAgentError(t, err, 404, wire.ErrCodeNotFound)

	// move
	info, err = e.c.Move(ctx, wire.MoveRequest{From: "docs/a/hello.txt", To: "moved/deep/hello2.txt", User: "user"})
	if err != nil || info.Path != filepath.Join(e.home, "moved/deep/hello2.txt") || info.Size != 7 {
		t.Fatalf("move %+v %v", info, err)
	}
	if st, err := e.c.Stat(ctx, "moved/deep", "user"); err != nil || st.Owner != "user" {
		t.Fatalf("move created parent %+v %v", st, err)
	}
	_, err = e.c.Move(ctx, wire.MoveRequest{From: "docs/a/hello.txt", To: "elsewhere", User: "user"})
	wantAgentError(t, err, 404, wire.ErrCodeNotFound)

	// remove
	err = e.c.Remove(ctx, "moved", "user", false)
	wantAgentError(t, err, 409, wire.ErrCodeNotEmpty)
	if err := e.c.Remove(ctx, "moved", "user", true); err != nil {
		t.Fatal(err)
	}
	if err := e.c.Remove(ctx, link, "", false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(link); !os.IsNotExist(err) {
		t.Fatalf("link still there: %v", err)
	}
	err = e.c.Remove(ctx, "moved", "user", true)
	wantAgentError(t, err, 404, wire.ErrCodeNotFound)
	err = e.c.Remove(ctx, "/", "", true)
	wantAgentError(t, err, 400, wire.ErrCodeBadRequest)
	_, err = e.c.Stat(ctx, "x", "nosuchuser")
	wantAgentError(t, err, 400, wire.ErrCodeUnknownUser)
}

func entryNames(es []wire.EntryInfo) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.Name)
	}
	sort.Strings(out)
	return out
}

func entryPaths(root string, es []wire.EntryInfo) []string {
	var out []string
	for _, e := range es {
		rel, _ := filepath.Rel(root, e.Path)
		out = append(out, rel)
	}
	sort.Strings(out)
	return out
}

func TestWatch(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 20*time.Second)
	root := filepath.Join(e.dir, "watched")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	w, err := e.c.Watch(ctx, root, "", true)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	events := make(chan wire.WatchEvent, 100)
	go func() {
		defer close(events)
		for {
			ev, err := w.Next()
			if err != nil {
				return
			}
			events <- ev
		}
	}()
	// expect waits for an event, ignoring others in between.
	expect := func(typ, name string, isDir bool) {
		t.Helper()
		for {
			select {
			case ev, ok := <-events:
				if !ok {
					t.Fatalf("watch ended waiting for %s %s", typ, name)
				}
				if ev.Type == typ && ev.Name == name && ev.IsDir == isDir && ev.Path == filepath.Join(root, name) {
					return
				}
			case <-ctx.Done():
				t.Fatalf("no %s event for %s", typ, name)
			}
		}
	}
	a := filepath.Join(root, "a.txt")
	if err := os.WriteFile(a, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	expect(wire.WatchCreate, "a.txt", false)
	expect(wire.WatchWrite, "a.txt", false)
	// A new directory is watched too, including what appears in it right away.
	if err := os.MkdirAll(filepath.Join(root, "sub", "deeper"), 0o755); err != nil {
		t.Fatal(err)
	}
	expect(wire.WatchCreate, "sub", true)
	expect(wire.WatchCreate, "sub/deeper", true)
	if err := os.WriteFile(filepath.Join(root, "sub", "deeper", "b.txt"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	expect(wire.WatchCreate, "sub/deeper/b.txt", false)
	if err := os.Rename(a, filepath.Join(root, "c.txt")); err != nil {
		t.Fatal(err)
	}
	expect(wire.WatchRename, "a.txt", false)
	expect(wire.WatchCreate, "c.txt", false)
	if err := os.Chmod(filepath.Join(root, "c.txt"), 0o600); err != nil {
		t.Fatal(err)
	}
	expect(wire.WatchChmod, "c.txt", false)
	if err := os.Remove(filepath.Join(root, "c.txt")); err != nil {
		t.Fatal(err)
	}
	expect(wire.WatchRemove, "c.txt", false)
	// Removing the watched directory ends the stream.
	if err := os.RemoveAll(root); err != nil {
		t.Fatal(err)
	}
	expect(wire.WatchRemove, "sub", true)
	for range events {
	}

	_, err = e.c.Watch(ctx, filepath.Join(e.dir, "missing"), "", false)
	wantAgentError(t, err, 404, wire.ErrCodeNotFound)
	f := filepath.Join(e.dir, "file")
	if err := os.WriteFile(f, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = e.c.Watch(ctx, f, "", false)
	wantAgentError(t, err, 400, wire.ErrCodeNotDir)
}
