package storage_test

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
)

// TestRemoveInsideSandboxVolume removes a checkpoint and a clone batch, which live in a
// sandbox's own subvolume (so they cannot be renamed into tmp/), and checks that a
// removal a crash interrupted is finished by the next Open.
func TestRemoveInsideSandboxVolume(t *testing.T) {
	s := templatetest.Store(t)
	ctx := context.Background()
	rel := newRelease(t, s, "r", func(root string) { must(t, os.WriteFile(filepath.Join(root, "f"), []byte("x"), 0o644)) })
	root, err := s.CreateSandboxRoot(ctx, "vol", rel.Digest)
	must(t, err)
	if sub, err := s.IsSubvolume(filepath.Dir(root)); err != nil || !sub {
		t.Fatalf("sandbox directory is not a subvolume: %v %v", sub, err)
	}
	cp, err := s.CheckpointDir("vol")
	must(t, err)
	must(t, os.MkdirAll(cp, 0o700))
	must(t, os.WriteFile(filepath.Join(cp, "memory"), make([]byte, 1<<20), 0o600))
	must(t, s.MarkComplete(cp))
	batch, err := s.CloneBatchDir("vol", "b1")
	must(t, err)
	must(t, s.CopyDisk(ctx, root, filepath.Join(batch, "disk"), true))
	must(t, s.CopyTree(ctx, cp, filepath.Join(batch, "checkpoint")))

	must(t, s.RemoveAll(ctx, cp))
	must(t, s.RemoveAll(ctx, batch))
	for _, p := range []string{cp, batch} {
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s still there: %v", p, err)
		}
	}
	dir, _ := s.SandboxDir("vol")
	if entries, _ := os.ReadDir(filepath.Join(dir, ".trash")); len(entries) != 0 {
		t.Errorf("trash holds %v", entries)
	}

	// A removal interrupted after its rename: the next Open finishes it.
	left := filepath.Join(dir, ".trash", "remove-crashed")
	must(t, os.MkdirAll(left, 0o700))
	must(t, s.CopyDisk(ctx, root, filepath.Join(left, "disk"), true))
	must(t, s.Close())
	s2, err := storage.Open(ctx, storage.Config{DataDir: filepath.Dir(s.Root())})
	must(t, err)
	defer s2.Close()
	if _, err := os.Lstat(left); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("interrupted removal not finished at Open: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "f")); err != nil {
		t.Errorf("the sandbox's root filesystem suffered: %v", err)
	}
}

// TestMarkWritten: a checkpoint marked written counts as complete on this boot of the
// host, not on another (its data may not have reached the disk); MarkComplete makes it
// durable and Unmark retires both markers.
func TestMarkWritten(t *testing.T) {
	s := templatetest.Store(t)
	cp, err := s.CheckpointDir("w")
	must(t, err)
	must(t, os.MkdirAll(cp, 0o700))
	must(t, os.WriteFile(filepath.Join(cp, "memory"), make([]byte, 1<<20), 0o600))
	if s.IsComplete(cp) {
		t.Fatal("an unmarked checkpoint is complete")
	}
	must(t, s.MarkWritten(cp))
	if !s.IsComplete(cp) || s.IsDurable(cp) {
		t.Errorf("written: complete %v (want true), durable %v (want false)", s.IsComplete(cp), s.IsDurable(cp))
	}
	// Written during another boot of the host.
	must(t, os.WriteFile(filepath.Join(cp, "written"), []byte("00000000-0000-0000-0000-000000000000\n"), 0o600))
	if s.IsComplete(cp) {
		t.Error("a checkpoint written during another boot is complete")
	}
	must(t, s.MarkWritten(cp))
	must(t, s.MarkComplete(cp))
	if !s.IsComplete(cp) || !s.IsDurable(cp) {
		t.Errorf("after MarkComplete: complete %v, durable %v", s.IsComplete(cp), s.IsDurable(cp))
	}
	must(t, s.Unmark(cp))
	if s.IsComplete(cp) {
		t.Error("complete after Unmark")
	}
}

// TestRemoveLater moves a checkpoint out of its place at once (a new one can be written
// there right away) and frees it in the background; Close waits for the removal.
func TestRemoveLater(t *testing.T) {
	s := templatetest.Store(t)
	ctx := context.Background()
	rel := newRelease(t, s, "r", func(root string) { must(t, os.WriteFile(filepath.Join(root, "f"), []byte("x"), 0o644)) })
	if _, err := s.CreateSandboxRoot(ctx, "later", rel.Digest); err != nil {
		t.Fatal(err)
	}
	cp, err := s.CheckpointDir("later")
	must(t, err)
	must(t, os.MkdirAll(cp, 0o700))
	must(t, os.WriteFile(filepath.Join(cp, "memory"), make([]byte, 8<<20), 0o600))
	must(t, s.MarkComplete(cp))

	must(t, s.RemoveLater(ctx, cp))
	if _, err := os.Lstat(cp); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("%s still at its place after RemoveLater: %v", cp, err)
	}
	if s.IsComplete(cp) {
		t.Fatal("the removed checkpoint still counts as complete")
	}
	must(t, os.MkdirAll(cp, 0o700)) // the next checkpoint
	must(t, s.RemoveLater(ctx, filepath.Join(cp, "missing")))
	must(t, s.Close())
	dir, _ := s.SandboxDir("later")
	if entries, _ := os.ReadDir(filepath.Join(dir, ".trash")); len(entries) != 0 {
		t.Errorf("trash holds %v after Close", entries)
	}
	if _, err := os.Stat(cp); err != nil {
		t.Errorf("the new checkpoint directory went too: %v", err)
	}
}
