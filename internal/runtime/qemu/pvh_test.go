package qemu

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

// TestPVHBoot checks that the runtime boots the host's distribution kernel through its
// PVH entry, with QEMU mapping the extracted vmlinux instead of holding a copy, and that
// checkpoints restore when the kernel file they were booted from is gone (a kernel
// upgrade): one booted through PVH, one booted through the firmware before PVH existed.
func TestPVHBoot(t *testing.T) {
	rt, _ := needQEMU(t)
	info, err := rt.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(info.Details["kernel_boot"], "pvh ") {
		t.Skipf("the host's kernel is not booted through PVH here: %s", info.Details["kernel_boot"])
	}
	if filepath.Dir(rt.boot) != rt.cfg.KernelCacheDir {
		t.Fatalf("boot kernel %s is not in the cache dir %s", rt.boot, rt.cfg.KernelCacheDir)
	}
	store := templatetest.Store(t)
	rel := templatetest.Base(t, store)
	_, agent := testenv.Binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	initrd, cmdline := bootFiles(t, ctx, rt, agent)
	// Copies of both kernels, removed before the restores.
	copyKernel := func(src string) string {
		dst := filepath.Join(t.TempDir(), filepath.Base(src))
		data, err := os.ReadFile(src)
		if err == nil {
			err = os.WriteFile(dst, data, 0o644)
		}
		if err == nil {
			err = os.Chmod(filepath.Dir(dst), 0o755)
		}
		if err != nil {
			t.Fatal(err)
		}
		return dst
	}
	for _, tc := range []struct {
		name, kernel string
		mapped       bool // QEMU maps the kernel file (PVH) rather than reading it
	}{
		{"pvh", copyKernel(rt.boot), true},
		{"firmware", copyKernel(rt.cfg.KernelPath), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := fmt.Sprintf("pvh%s%d", tc.name, time.Now().UnixNano()%1e9)
			disk, err := store.CreateSandboxDisk(ctx, id, rel.Digest, 0)
			if err != nil {
				t.Fatal(err)
			}
			spec, err := rt.checkSpec(runtime.Spec{ID: id, RootFS: disk, StateDir: t.TempDir(), AgentPath: agent, CPU: 1, MemoryMB: 256})
			if err != nil {
				t.Fatal(err)
			}
			defer rt.Destroy(context.Background(), id)
			m := machine{MemoryMB: 256, CPU: 1, Accel: rt.accel, Kernel: tc.kernel, Initrd: initrd, Append: cmdline,
				QEMU: rt.version, Balloon: true, Host: rt.host}
			if err := rt.launch(ctx, spec, m, ""); err != nil {
				t.Fatal(err)
			}
			c := agentclient.New(func(ctx context.Context) (net.Conn, error) { return rt.Dial(ctx, id) })
			if _, err := c.WaitReady(ctx); err != nil {
				t.Fatalf("agent not ready: %v", err)
			}
			maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", rt.instancePID(id, nil)))
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Contains(string(maps), " "+jailKernel+"\n"); got != tc.mapped {
				t.Fatalf("QEMU maps %s: %v, want %v", jailKernel, got, tc.mapped)
			}
			dir := t.TempDir()
			if err := rt.Checkpoint(ctx, id, dir); err != nil {
				t.Fatal(err)
			}
			if err := rt.Destroy(ctx, id); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(tc.kernel); err != nil {
				t.Fatal(err)
			}
			if err := rt.Restore(ctx, spec, dir); err != nil {
				t.Fatalf("restore with its kernel file gone: %v", err)
			}
			h, err := c.WaitReady(ctx)
			if err != nil {
				t.Fatalf("agent after the restore: %v", err)
			}
			t.Logf("%s: restored, agent generation %d", tc.name, h.Generation)
		})
	}
}
