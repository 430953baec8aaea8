package storage_test

import (
	"context"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
)

func TestParseDiskReserve(t *testing.T) {
	for in, want := range map[string]float64{"10%": 0.10, "0.1": 0.10, "0": 0, "0%": 0, " 25 % ": -1, "25 %": -1, "99.5%": 0.995} {
		got, err := storage.ParseDiskReserve(in)
		if want < 0 {
			if err == nil {
				t.Errorf("ParseDiskReserve(%q) = %v, want an error", in, got)
			}
			continue
		}
		if err != nil || got < want-1e-9 || got > want+1e-9 {
			t.Errorf("ParseDiskReserve(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"100%", "1", "-5%", "ten", "", "1.5"} {
		if _, err := storage.ParseDiskReserve(bad); err == nil {
			t.Errorf("ParseDiskReserve(%q) accepted", bad)
		}
	}
}

func TestOpenRejectsBadReserve(t *testing.T) {
	for _, r := range []float64{-0.1, 1, 2} {
		if _, err := storage.Open(context.Background(), storage.Config{DataDir: t.TempDir(), DiskReserve: r}); err == nil {
			t.Errorf("Open with reserve %v succeeded", r)
		}
	}
}

// TestCheckSpace checks the reserve against the store's btrfs volume: a request that
// would eat into the last 10 % fails with InsufficientStorage, one that leaves it passes.
func TestCheckSpace(t *testing.T) {
	templatetest.RequireStore(t)
	ctx := context.Background()
	s, err := storage.Open(ctx, storage.Config{DataDir: t.TempDir(), ImageSizeBytes: 2 << 30, DiskReserve: 0.10})
	must(t, err)
	defer s.Unmount(ctx)
	fss, err := s.Space()
	must(t, err)
	if len(fss) != 2 || fss[0].Name != "store" || fss[1].Name != "host" {
		t.Fatalf("Space() = %+v, want store and host", fss)
	}
	store := fss[0]
	if store.TotalBytes <= 0 || store.FreeBytes <= 0 || store.FreeBytes > store.TotalBytes {
		t.Fatalf("store space %+v", store)
	}
	keep := store.TotalBytes / 10
	fits := store.FreeBytes - keep - 64<<20 // leaves a margin for btrfs's estimate moving
	if err := s.CheckSpace(fits); err != nil {
		t.Errorf("CheckSpace(%d) with %d free and %d kept: %v", fits, store.FreeBytes, keep, err)
	}
	tooMuch := store.FreeBytes - keep + 64<<20
	err = s.CheckSpace(tooMuch)
	if fault.KindOf(err) != fault.InsufficientStorage {
		t.Fatalf("CheckSpace(%d): %v, want InsufficientStorage", tooMuch, err)
	}
	if msg := err.Error(); !strings.Contains(msg, "the store's file system") || !strings.Contains(msg, "kept free") || !strings.Contains(msg, "10 %") {
		t.Errorf("unclear message: %s", msg)
	}
	if err := s.CheckSpace(-1); fault.KindOf(err) != fault.Invalid {
		t.Errorf("negative request: %v", err)
	}

	// Without a reserve only the free space itself counts.
	s2, err := storage.Open(ctx, storage.Config{DataDir: t.TempDir(), ImageSizeBytes: 2 << 30})
	must(t, err)
	defer s2.Unmount(ctx)
	fss, err = s2.Space()
	must(t, err)
	if err := s2.CheckSpace(fss[0].FreeBytes - 64<<20); err != nil {
		t.Errorf("no reserve: %v", err)
	}
}

// TestCheckSpaceHostTighter puts a 2 GiB sparse store image on a 256 MiB file system:
// the host side runs out first, and CheckSpace says so though the btrfs volume has room.
func TestCheckSpaceHostTighter(t *testing.T) {
	templatetest.RequireStore(t)
	ctx := context.Background()
	dataDir := t.TempDir()
	must(t, unix.Mount("tmpfs", dataDir, "tmpfs", 0, "size=256m"))
	t.Cleanup(func() { unix.Unmount(dataDir, unix.MNT_DETACH) })
	s, err := storage.Open(ctx, storage.Config{DataDir: dataDir, ImageSizeBytes: 2 << 30, DiskReserve: 0.10})
	must(t, err)
	defer s.Unmount(ctx)
	fss, err := s.Space()
	must(t, err)
	store, host := fss[0], fss[1]
	if host.TotalBytes > 256<<20 || store.FreeBytes < 1<<30 {
		t.Fatalf("space: %+v", fss)
	}
	err = s.CheckSpace(300 << 20) // fits the btrfs volume, not the host
	if fault.KindOf(err) != fault.InsufficientStorage || !strings.Contains(err.Error(), "holding the store's image") {
		t.Fatalf("CheckSpace(300 MiB) with %d MiB free on the host: %v", host.FreeBytes>>20, err)
	}
	if err := s.CheckSpace(64 << 20); err != nil {
		t.Errorf("CheckSpace(64 MiB): %v", err)
	}
}
