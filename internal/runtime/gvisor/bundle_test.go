package gvisor

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/spacedev/space/internal/runtime"
)

var update = flag.Bool("update", false, "rewrite golden files")

// TestBundleGolden pins the generated OCI config: any change to it shows in review.
func TestBundleGolden(t *testing.T) {
	spec := runtime.Spec{
		ID:        "abc123",
		RootFS:    "/var/lib/space/sandboxes/abc123/rootfs",
		StateDir:  "/var/lib/space/sandboxes/abc123/state",
		AgentPath: "/usr/lib/space/space-agent",
		CPU:       2,
		MemoryMB:  512,
		AgentEnv:  map[string]string{"SPACE_LOG": "debug", "PATH": "/opt/bin:/usr/bin:/bin"},
	}
	got, err := marshalSpec(bundleSpec(spec, bundleOptions{
		CgroupsPath: "/space/abc123",
		RootPath:    "/run/space/runsc/mnt/abc123/rootfs",
		RunSource:   "/run/space/runsc/mnt/abc123/run",
		UIDBase:     DefaultUIDBase,
		GuestPids:   true,
		layout:      layoutOf(spec),
	}))
	if err != nil {
		t.Fatal(err)
	}
	golden := filepath.Join("testdata", "config.golden.json")
	if *update {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("generated config differs from %s (run with -update to accept):\n%s", golden, got)
	}
}

func TestResources(t *testing.T) {
	for _, tc := range []struct {
		cpu, mem, pids       int
		quota, limitMB, want int64 // 0 = no limit
	}{
		{0, 0, 0, 0, 0, DefaultPidsLimit},
		{1, 0, 0, 100_000, 0, DefaultPidsLimit},
		{0, 256, 640, 0, 256, 640},
		{3, 1024, 4096, 300_000, 1024, 4096},
	} {
		res := resources(runtime.Spec{CPU: tc.cpu, MemoryMB: tc.mem, PidsLimit: tc.pids})
		if res.Pids == nil || res.Pids.Limit != tc.want {
			t.Errorf("pids %d: limit %v, want %d", tc.pids, res.Pids, tc.want)
		}
		var quota, limit int64
		if res != nil && res.CPU != nil {
			quota = *res.CPU.Quota
			if *res.CPU.Period != cpuPeriod {
				t.Errorf("cpu %d: period %d", tc.cpu, *res.CPU.Period)
			}
		}
		if res != nil && res.Memory != nil {
			limit = *res.Memory.Limit >> 20
		}
		if quota != tc.quota || limit != tc.limitMB {
			t.Errorf("cpu %d mem %d: quota %d limit %d MiB, want %d, %d", tc.cpu, tc.mem, quota, limit, tc.quota, tc.limitMB)
		}
	}
}

func TestPidsLimits(t *testing.T) {
	for host, guest := range map[int]int64{0: 2048, DefaultPidsLimit: 2048, MinPidsLimit: 16, 1792: 256, 1793: 256, 1791: 255} {
		if got := guestPidsLimit(runtime.Spec{PidsLimit: host}); got != guest {
			t.Errorf("PidsLimit %d: %d tasks inside, want %d", host, got, guest)
		}
	}
	if DefaultPidsLimit != 12544 {
		t.Errorf("DefaultPidsLimit = %d", DefaultPidsLimit)
	}
	if err := validateSpec(runtime.Spec{ID: "x", RootFS: "/", StateDir: t.TempDir(), AgentPath: "/bin/sh", PidsLimit: MinPidsLimit - 1}); err == nil {
		t.Error("a pids limit below the minimum was accepted")
	}
}

func TestMemoryLimits(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		mem, pids  int
		tasks      int64 // inside
		hostPids   int64
		hostMemMiB int64 // 0: none
	}{
		{0, 0, 2048, DefaultPidsLimit, 0},
		{128, 0, 256, 1792, 128 + 32 + 128},
		{256, 0, 256, 1792, 256 + 32 + 128},
		{1024, 0, 1024, 6400, 1024 + 32 + 512},
		{4096, 0, 2048, DefaultPidsLimit, 4096 + 32 + 1024},
		{4096, 1792, 256, 1792, 4096 + 32 + 128},
	} {
		spec := runtime.Spec{MemoryMB: tc.mem, PidsLimit: tc.pids}
		if got := guestPidsLimit(spec); got != tc.tasks {
			t.Errorf("%d MiB, pids %d: %d tasks inside, want %d", tc.mem, tc.pids, got, tc.tasks)
		}
		if got := hostPidsLimit(spec); got != tc.hostPids {
			t.Errorf("%d MiB, pids %d: host pids limit %d, want %d", tc.mem, tc.pids, got, tc.hostPids)
		}
		if got := hostMemoryLimit(spec); got != tc.hostMemMiB*mib {
			t.Errorf("%d MiB, pids %d: host memory limit %.1f MiB, want %d", tc.mem, tc.pids, float64(got)/mib, tc.hostMemMiB)
		}
		// The bundle (what runsc tells the guest) carries the guest's size.
		if res := resources(spec); tc.mem > 0 && (res.Memory == nil || *res.Memory.Limit != int64(tc.mem)*mib) {
			t.Errorf("%d MiB: bundle memory limit %v", tc.mem, res.Memory)
		}
	}
}

func TestFlagValue(t *testing.T) {
	argv := []string{"runsc-gofer", "--root=/r", "gofer", "--bundle", "/b", "-x=1"}
	for name, want := range map[string]string{"root": "/r", "bundle": "/b", "x": "1", "nope": ""} {
		if got := flagValue(argv, name); got != want {
			t.Errorf("flagValue(%s) = %q, want %q", name, got, want)
		}
	}
}
