package storage_test

import (
	"context"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
)

// TestQuotaCost measures what quotas add to making and deleting sandbox roots from the
// base template (a Debian tree of ~10,000 files), in three stores: quotas off, btrfs
// simple quotas (what space uses), and full qgroups (for comparison). Each sandbox
// changes 400 files spread over its tree and writes 16 MiB, so that deleting it has
// work to do. It logs the figures (docs/architecture.md quotes them) and checks that
// creation stays O(1): no slower than with a one-file template by more than a small
// constant. Creation is timed on a clean file system: a snapshot commits the running
// transaction, so in service it also pays for whatever other sandboxes have dirty.
func TestQuotaCost(t *testing.T) {
	if testing.Short() {
		t.Skip("measurement: skipped in -short")
	}
	requireBtrfsTool(t)
	const n = 8
	type result struct {
		create, createTiny, delete []time.Duration
		drop                       time.Duration
	}
	measure := func(t *testing.T, mode string) result {
		ctx := context.Background()
		s, err := storage.Open(ctx, storage.Config{DataDir: t.TempDir(), ImageSizeBytes: 16 << 30, DisableQuotas: mode != "simple"})
		must(t, err)
		t.Cleanup(func() { s.Unmount(ctx) })
		if on, why := s.QuotasEnabled(); mode == "simple" && !on {
			t.Skipf("no simple quotas: %s", why)
		}
		if mode == "full" {
			if out, err := exec.Command("btrfs", "quota", "enable", s.Root()).CombinedOutput(); err != nil {
				t.Fatalf("btrfs quota enable: %v\n%s", err, out)
			}
			if out, err := exec.Command("btrfs", "quota", "rescan", "-w", s.Root()).CombinedOutput(); err != nil {
				t.Fatalf("btrfs quota rescan: %v\n%s", err, out)
			}
		}
		base := templatetest.Base(t, s)
		tiny := newRelease(t, s, "tiny", func(root string) { randomFile(t, filepath.Join(root, "f"), 4096) })
		baseRoot, err := s.ReleaseRoot(base.Digest)
		must(t, err)
		files := spreadFiles(t, baseRoot, 400)
		var r result
		create := func(id, digest string) time.Duration {
			// A snapshot commits the transaction, writing out whatever other sandboxes
			// have dirty: commit first so that only the creation is measured.
			commit(t, s)
			start := time.Now()
			if _, err := s.CreateSandboxRoot(ctx, id, digest); err != nil {
				t.Fatal(err)
			}
			if mode == "simple" {
				must(t, s.SetSandboxLimit(ctx, id, 1<<30))
			}
			return time.Since(start)
		}
		for i := 0; i < n; i++ {
			id := "cost" + string(rune('a'+i))
			r.create = append(r.create, create(id, base.Digest))
			r.createTiny = append(r.createTiny, create("tiny"+string(rune('a'+i)), tiny.Digest))
			root, _ := s.SandboxRoot(id)
			for _, f := range files {
				p := filepath.Join(root, f)
				must(t, os.WriteFile(p, []byte("changed by the sandbox\n"), 0o644))
			}
			randomFile(t, filepath.Join(root, "data"), 16*mib)
		}
		commit(t, s)
		for i := 0; i < n; i++ {
			start := time.Now()
			must(t, s.DeleteSandbox(ctx, "cost"+string(rune('a'+i))))
			r.delete = append(r.delete, time.Since(start))
		}
		// The kernel drops deleted subvolumes in the background after a commit; with a
		// 1 s commit period, the time until all are gone is the background cost.
		must(t, unix.Mount("", s.Root(), "", unix.MS_REMOUNT|unix.MS_NOSUID|unix.MS_NODEV, "commit=1"))
		start := time.Now()
		if out, err := exec.Command("btrfs", "subvolume", "sync", s.Root()).CombinedOutput(); err != nil {
			t.Fatalf("btrfs subvolume sync: %v\n%s", err, out)
		}
		r.drop = time.Since(start)
		return r
	}
	results := map[string]result{}
	for _, mode := range []string{"off", "simple", "full"} {
		t.Run(mode, func(t *testing.T) { results[mode] = measure(t, mode) })
	}
	for _, mode := range []string{"off", "simple", "full"} {
		r, ok := results[mode]
		if !ok {
			continue
		}
		t.Logf("%-6s create from base: median %v max %v; from a one-file release: median %v; delete: median %v max %v; background drop of %d: %v",
			mode, median(r.create), slices.Max(r.create), median(r.createTiny), median(r.delete), slices.Max(r.delete), n, r.drop.Round(time.Millisecond))
	}
	if r, ok := results["simple"]; ok {
		if slices.Max(r.create) > 2*time.Second {
			t.Errorf("creating a sandbox root with quotas took up to %v", slices.Max(r.create))
		}
		// O(1): a 10,000-file template costs about what a one-file one does.
		if median(r.create) > 3*median(r.createTiny)+100*time.Millisecond {
			t.Errorf("creation grows with the template: %v from base, %v from one file", median(r.create), median(r.createTiny))
		}
	}
}

func requireBtrfsTool(t *testing.T) {
	t.Helper()
	templatetest.RequireStore(t)
	if _, err := exec.LookPath("btrfs"); err != nil {
		t.Skip("needs btrfs-progs (btrfs)")
	}
}

// spreadFiles picks n regular files spread evenly over the tree under root.
func spreadFiles(t *testing.T, root string, n int) []string {
	t.Helper()
	var all []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			rel, _ := filepath.Rel(root, p)
			all = append(all, rel)
		}
		return nil
	})
	must(t, err)
	if len(all) < n {
		return all
	}
	picked := make([]string, 0, n)
	for i := 0; i < n; i++ {
		picked = append(picked, all[i*len(all)/n])
	}
	return picked
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2].Round(100 * time.Microsecond)
}
