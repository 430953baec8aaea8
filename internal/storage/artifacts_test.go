package storage_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
)

func TestSendReceiveArtifacts(t *testing.T) {
	a, b := templatetest.Store(t), templatetest.Store(t)
	ctx := context.Background()
	build, err := a.BeginRelease(ctx)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(build.Rootfs(), "file"), bytes.Repeat([]byte("data"), 1<<16), 0o644))
	rel, err := build.Commit(ctx, storage.Release{Name: "r"})
	must(t, err)
	rootA, _ := a.ReleaseRoot(rel.Digest)
	idA, err := a.SendIdentity(rootA)
	must(t, err)

	// A release sent whole and received keeps its identity: the sender's UUID.
	var full bytes.Buffer
	must(t, a.Send(ctx, rootA, "", &full))
	got, err := b.ReceiveRelease(ctx, rel, bytes.NewReader(full.Bytes()))
	must(t, err)
	if got.Digest != rel.Digest {
		t.Fatalf("received %s", got.Digest)
	}
	rootB, _ := b.ReleaseRoot(rel.Digest)
	if idB, err := b.SendIdentity(rootB); err != nil || idB != idA {
		t.Fatalf("identity %s after receive, sent %s (%v)", idB, idA, err)
	}

	// An increment of a sandbox on it applies to the received copy.
	sb, err := a.CreateSandboxRoot(ctx, "sb", rel.Digest)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(sb, "new"), []byte("new"), 0o644))
	tmp, err := a.TempDir("send")
	must(t, err)
	snap := filepath.Join(tmp, "rootfs")
	must(t, a.Snapshot(ctx, sb, snap, true))
	var inc bytes.Buffer
	must(t, a.Send(ctx, snap, rootA, &inc))
	must(t, a.RemoveAll(ctx, tmp))
	if inc.Len() > full.Len()/4 {
		t.Errorf("increment of %d bytes, full stream %d", inc.Len(), full.Len())
	}

	// Not on another subvolume: the stream names its parent, the filter refuses.
	other, err := b.CreateSandboxRoot(ctx, "other", rel.Digest)
	must(t, err)
	bad, err := b.BeginArtifact(ctx, storage.PulledSnapshots)
	must(t, err)
	if err := bad.Receive(ctx, bytes.NewReader(inc.Bytes()), other, "rootfs"); !errors.Is(err, storage.ErrBadStream) {
		t.Errorf("increment on the wrong parent: %v", err)
	}
	must(t, bad.Discard(ctx))

	ab, err := b.BeginArtifact(ctx, storage.PulledSnapshots)
	must(t, err)
	must(t, ab.Receive(ctx, bytes.NewReader(inc.Bytes()), rootB, "rootfs"))
	path, existed, err := ab.Publish(ctx, "abc123")
	must(t, err)
	if existed {
		t.Error("first publish found an entry")
	}
	data, err := os.ReadFile(filepath.Join(path, "rootfs", "new"))
	if err != nil || string(data) != "new" {
		t.Errorf("received increment: %q %v", data, err)
	}
	if !b.HasArtifact(storage.PulledSnapshots, "abc123") {
		t.Error("published entry missing")
	}
	// A second identical publish finds the first.
	ab2, err := b.BeginArtifact(ctx, storage.PulledSnapshots)
	must(t, err)
	must(t, ab2.Receive(ctx, bytes.NewReader(inc.Bytes()), rootB, "rootfs"))
	if _, existed, err := ab2.Publish(ctx, "abc123"); err != nil || !existed {
		t.Errorf("second publish: existed %v, %v", existed, err)
	}
	entries, err := b.ListArtifacts(storage.PulledSnapshots)
	must(t, err)
	if len(entries) != 1 || entries[0].Name != "abc123" {
		t.Errorf("entries %+v", entries)
	}
	must(t, b.DeleteArtifact(ctx, storage.PulledSnapshots, "abc123"))
	if b.HasArtifact(storage.PulledSnapshots, "abc123") {
		t.Error("deleted entry still there")
	}
	if left, _ := os.ReadDir(filepath.Join(b.Root(), "tmp")); len(left) != 0 {
		t.Errorf("tmp/ holds %d entries", len(left))
	}
}

func TestReflinkIntoKeepsInode(t *testing.T) {
	s := templatetest.Store(t)
	dir, err := s.TempDir("reflink")
	must(t, err)
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	must(t, os.WriteFile(src, []byte("new contents"), 0o600))
	must(t, os.WriteFile(dst, bytes.Repeat([]byte("old"), 10000), 0o600))
	before, _ := os.Stat(dst)
	must(t, s.ReflinkInto(src, dst))
	after, _ := os.Stat(dst)
	if before.Sys().(*syscall.Stat_t).Ino != after.Sys().(*syscall.Stat_t).Ino {
		t.Error("inode changed")
	}
	if data, _ := os.ReadFile(dst); string(data) != "new contents" {
		t.Errorf("contents %q", data)
	}
}
