package qemu

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/template/templatetest"
)

var update = flag.Bool("update", false, "rewrite golden files")

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// TestArgsGolden pins QEMU's command line: every instance-specific path goes through an
// inherited descriptor, so two instances (or a checkpoint and its restore) differ only in
// their -name.
func TestArgsGolden(t *testing.T) {
	cmdline, err := kernelCmdline(map[string]string{"SPACE_AGENT_LOG_LEVEL": "debug"}, 2596150)
	if err != nil {
		t.Fatal(err)
	}
	m := machine{
		MemoryMB: 256, CPU: 1, Accel: AccelTCG, Kernel: "/boot/vmlinuz-6.1.0-test-cloud-amd64",
		Initrd: "/run/space/qemu/initramfs/0123.cpio", Append: cmdline, QEMU: "7.2.22",
	}
	var b strings.Builder
	for _, incoming := range []bool{false, true} {
		fmt.Fprintf(&b, "# incoming=%v\n", incoming)
		for _, a := range m.args("space-0000-id", incoming) {
			b.WriteString(a + "\n")
		}
	}
	m.Balloon, m.Host = true, hostOpts{TCGCacheMB: 16}
	b.WriteString("# balloon, tb-size=16\n")
	for _, a := range m.args("space-0000-id", false) {
		if strings.Contains(a, "balloon") || strings.Contains(a, "tb-size") {
			b.WriteString(a + "\n")
		}
	}
	m.Accel = AccelKVM
	b.WriteString("# kvm\n" + strings.Join(m.args("space-0000-id", false)[:8], "\n") + "\n")
	golden := filepath.Join("testdata", "args.golden")
	if *update {
		if err := os.WriteFile(golden, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if b.String() != string(want) {
		t.Errorf("command line changed (run with -update if intended):\n%s", b.String())
	}
	for _, a := range m.args("x", false) {
		if strings.Contains(a, "/tmp") || strings.Contains(a, "/var/lib") {
			t.Errorf("argument %q names an instance path", a)
		}
	}
}

func TestKernelCmdlineLimit(t *testing.T) {
	if _, err := kernelCmdline(map[string]string{"BIG": strings.Repeat("x", 3000)}, 0); err == nil {
		t.Error("a 3000-byte environment fits on the kernel command line")
	}
}

func writeFile(t *testing.T, p, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestDefaultKernelOrder(t *testing.T) {
	in := []string{"vmlinuz-6.1.0-9-cloud-amd64", "vmlinuz-6.1.0-10-cloud-amd64", "vmlinuz-5.10.0-28-cloud-amd64"}
	slices.SortFunc(in, func(a, b string) int { return compareVersions(b, a) })
	if in[0] != "vmlinuz-6.1.0-10-cloud-amd64" || in[2] != "vmlinuz-5.10.0-28-cloud-amd64" {
		t.Errorf("newest first: %v", in)
	}
}

func TestHostTSC(t *testing.T) {
	khz := hostTSCkHz()
	t.Logf("host TSC %d kHz", khz)
	if khz < 100_000 || khz > 10_000_000 {
		t.Errorf("host TSC frequency %d kHz is implausible", khz)
	}
	if again := hostTSCkHz(); again < khz*999/1000 || again > khz*1001/1000 {
		t.Errorf("measurements disagree by more than 0.1%%: %d and %d kHz", khz, again)
	}
}

func TestDetectAccel(t *testing.T) {
	if a, _, err := DetectAccel(AccelTCG); err != nil || a != AccelTCG {
		t.Errorf("tcg: %s %v", a, err)
	}
	if _, _, err := DetectAccel("hvf"); err == nil {
		t.Error("unknown accelerator accepted")
	}
	a, reason, err := DetectAccel(AccelAuto)
	if err != nil || reason == "" || (a != AccelKVM && a != AccelTCG) {
		t.Errorf("auto: %s %q %v", a, reason, err)
	}
	t.Logf("auto picks %s: %s", a, reason)
}

// needQEMU skips unless QEMU, a guest kernel and root are there; it returns a runtime
// over a fresh root dir and a spec whose disk is empty (the guest is never let boot).
func needQEMU(t *testing.T) (*Runtime, runtime.Spec) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (QEMU runs in its own mount and network namespace)")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 not found (apt-get install qemu-system-x86)")
	}
	if _, err := DefaultKernel(); err != nil {
		t.Skip(err)
	}
	rt, err := New(Config{RootDir: t.TempDir(), Accel: AccelTCG, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	disk := filepath.Join(dir, "disk.ext4")
	if err := os.WriteFile(disk, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(disk, 64<<20); err != nil {
		t.Fatal(err)
	}
	agent := filepath.Join(dir, "agent")
	writeFile(t, agent, "not booted")
	return rt, runtime.Spec{ID: "vm" + fmt.Sprint(time.Now().UnixNano()), RootFS: disk, StateDir: t.TempDir(), AgentPath: agent, CPU: 1, MemoryMB: 128}
}

// assertGone checks that nothing of the instance is left on the host.
func assertGone(t *testing.T, rt *Runtime, spec runtime.Spec) {
	t.Helper()
	if pid := rt.instancePID(spec.ID, nil); pid != 0 {
		t.Errorf("QEMU %d still runs", pid)
	}
	if _, err := os.Stat(rt.recordPath(spec.ID)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("record left: %v", err)
	}
	if entries, _ := os.ReadDir(spec.StateDir); len(entries) > 0 {
		t.Errorf("StateDir not empty: %v", entries)
	}
	if _, err := rt.Status(context.Background(), spec.ID); !errors.Is(err, runtime.ErrNotFound) {
		t.Errorf("Status: %v, want ErrNotFound", err)
	}
}

// TestLostRecord: an instance whose record is gone (a crash between starting QEMU and
// writing it) is still found from /proc by a new runtime, and destroyed completely.
func TestLostRecord(t *testing.T) {
	rt, spec := needQEMU(t)
	ctx := context.Background()
	if err := rt.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Destroy(context.Background(), spec.ID) })
	// Frozen before its kernel gets anywhere, so the empty disk does not matter.
	if err := rt.Pause(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if err := rt.Create(ctx, spec); err == nil {
		t.Error("second Create with the same id succeeded")
	}
	if st, err := rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusPaused {
		t.Fatalf("Status: %v %v", st, err)
	}
	rec, err := rt.readRecord(spec.ID)
	if err != nil || rec.UID == 0 || len(rec.Cgroups) == 0 {
		t.Fatalf("record without uid or cgroups: %+v %v", rec, err)
	}
	if err := os.Remove(rt.recordPath(spec.ID)); err != nil {
		t.Fatal(err)
	}
	rt2, err := New(rt.cfg)
	if err != nil {
		t.Fatal(err)
	}
	list, err := rt2.List(ctx)
	if err != nil || len(list) != 1 || list[0].ID != spec.ID || list[0].Status != runtime.StatusPaused {
		t.Fatalf("List without record: %v %v", list, err)
	}
	if err := rt2.Adopt(ctx, spec); err != nil {
		t.Fatalf("Adopt without record: %v", err)
	}
	if _, err := rt2.readRecord(spec.ID); err != nil {
		t.Errorf("Adopt did not rewrite the record: %v", err)
	}
	os.Remove(rt2.recordPath(spec.ID))
	if err := rt2.Destroy(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, rt2, spec)
	// The uid and the cgroups were found without the record, and given back.
	if _, err := os.Stat(rt2.uids.path(rec.UID)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("uid lease %d left: %v", rec.UID, err)
	}
	for _, dir := range rec.Cgroups {
		if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("cgroup %s left: %v", dir, err)
		}
	}
	if list, err := rt2.List(ctx); err != nil || len(list) != 0 {
		t.Errorf("List after Destroy: %v %v", list, err)
	}
}

// TestFailedStartUndone: a QEMU that exits during start (here: a kernel that is not
// one) makes Create fail with QEMU's message and leaves nothing behind.
func TestFailedStartUndone(t *testing.T) {
	rt, spec := needQEMU(t)
	bogus := filepath.Join(t.TempDir(), "vmlinuz-bogus")
	writeFile(t, bogus, "not a kernel")
	cfg := rt.cfg
	cfg.KernelPath = bogus
	bad, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = bad.Create(context.Background(), spec)
	if err == nil {
		bad.Destroy(context.Background(), spec.ID)
		t.Fatal("Create with a bogus kernel succeeded")
	}
	t.Logf("Create: %v", err)
	assertGone(t, bad, spec)
}

func TestNetworkUnsupported(t *testing.T) {
	rt, spec := needQEMU(t)
	spec.Network = true
	if err := rt.Create(context.Background(), spec); !errors.Is(err, runtime.ErrUnsupported) {
		t.Errorf("Create with network: %v", err)
	}
	assertGone(t, rt, spec)
}

// TestDestroyReleasesDisk: once Destroy returns, no thread of QEMU holds the disk: the
// file system it lives on unmounts at once (a thread group's leader is a zombie while
// its vCPU thread may still be exiting with the process's files).
func TestDestroyReleasesDisk(t *testing.T) {
	rt, spec := needQEMU(t)
	store := templatetest.Store(t)
	ctx := context.Background()
	for i := range 3 {
		spec.ID = fmt.Sprintf("rel%d%d", i, time.Now().UnixNano())
		spec.RootFS = filepath.Join(store.Root(), spec.ID+".ext4")
		if err := os.WriteFile(spec.RootFS, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(spec.RootFS, 64<<20); err != nil {
			t.Fatal(err)
		}
		if err := rt.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		// Let the guest kernel run (its vCPU thread busy) before pulling the plug.
		time.Sleep(300 * time.Millisecond)
		if err := rt.Destroy(ctx, spec.ID); err != nil {
			t.Fatal(err)
		}
		assertGone(t, rt, spec)
		if err := os.Remove(spec.RootFS); err != nil {
			t.Fatal(err)
		}
	}
	if err := store.Unmount(ctx); err != nil {
		t.Fatalf("store busy after Destroy: %v", err)
	}
}
