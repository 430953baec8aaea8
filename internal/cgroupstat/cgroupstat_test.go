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
