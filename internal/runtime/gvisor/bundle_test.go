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
	got, err := marshalSpec(bundleSpec(spec, bundleOptions{CgroupsPath: "/space/abc123"}))
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
		cpu, mem       int
		quota, limitMB int64 // 0 = no limit
	}{
		{0, 0, 0, 0},
		{1, 0, 100_000, 0},
		{0, 256, 0, 256},
		{3, 1024, 300_000, 1024},
	} {
		res := resources(runtime.Spec{CPU: tc.cpu, MemoryMB: tc.mem})
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
		if (tc.cpu == 0 && tc.mem == 0) != (res == nil) {
			t.Errorf("cpu %d mem %d: resources %v", tc.cpu, tc.mem, res)
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
