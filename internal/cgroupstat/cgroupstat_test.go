package cgroupstat

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// The test's own process: its cgroup counts CPU it burns and charges it memory; a base
// that is not its cgroup's name finds nothing.
func TestOwnCgroup(t *testing.T) {
	pid := os.Getpid()
	f, err := CPUFile(pid, "")
	if err != nil {
		t.Skipf("no cgroup CPU counter on this host: %v", err)
	}
	before, err := ReadCPU(f)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for end := time.Now().Add(100 * time.Millisecond); time.Now().Before(end); {
		n++
	}
	after, err := CPU(pid)
	if err != nil || after-before < 20*time.Millisecond {
		t.Fatalf("100 ms of spinning (%d loops): %v → %v, %v", n, before, after, err)
	}
	if m, err := Memory(pid); err != nil || m <= 0 {
		t.Fatalf("memory: %d %v", m, err)
	}
	if _, err := CPUFile(pid, "no-such-cgroup-name"); !errors.Is(err, ErrNoCgroup) {
		t.Fatalf("another cgroup's name: %v", err)
	}
}

func TestReadCPU(t *testing.T) {
	dir := t.TempDir()
	v1 := filepath.Join(dir, "cpuacct.usage")
	v2 := filepath.Join(dir, "cpu.stat")
	os.WriteFile(v1, []byte("1500000\n"), 0o600)
	os.WriteFile(v2, []byte("usage_usec 2500\nuser_usec 2000\nsystem_usec 500\n"), 0o600)
	if d, err := ReadCPU(v1); err != nil || d != 1500*time.Microsecond {
		t.Fatalf("v1: %v %v", d, err)
	}
	if d, err := ReadCPU(v2); err != nil || d != 2500*time.Microsecond {
		t.Fatalf("v2: %v %v", d, err)
	}
	os.WriteFile(v2, []byte("user_usec 2000\n"), 0o600)
	if _, err := ReadCPU(v2); err == nil {
		t.Fatal("cpu.stat without usage_usec read")
	}
}

// TestReadFileMemory: the file cache of a memory cgroup less its shared memory, and
// the part of it not on disk, from a v1 and a v2 memory.stat.
func TestReadFileMemory(t *testing.T) {
	for _, tc := range []struct {
		name, stat string
		want       FileMemory
	}{
		{"v1", "cache 9000\nrss 100\nshmem 1000\ndirty 50\ntotal_cache 747634688\ntotal_rss 19357696\ntotal_shmem 5644288\ntotal_dirty 746586112\ntotal_writeback 4096\n",
			FileMemory{Cache: 747634688 - 5644288, Dirty: 746586112 + 4096}},
		{"v2", "anon 19357696\nfile 747634688\nshmem 5644288\nfile_dirty 700000000\nfile_writeback 8192\n",
			FileMemory{Cache: 747634688 - 5644288, Dirty: 700000000 + 8192}},
		{"shared memory only", "total_cache 5644288\ntotal_shmem 5644288\n", FileMemory{}},
	} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "memory.stat"), []byte(tc.stat), 0o644); err != nil {
			t.Fatal(err)
		}
		if got, err := ReadFileMemory(dir); err != nil || got != tc.want {
			t.Errorf("%s: %+v %v, want %+v", tc.name, got, err, tc.want)
		}
	}
	if _, err := ReadFileMemory(t.TempDir()); err == nil {
		t.Error("a directory without memory.stat read as a memory cgroup")
	}
}
