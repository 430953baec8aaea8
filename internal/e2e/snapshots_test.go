package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// TestNamedSnapshots drives named snapshots with the CLI on gVisor: a snapshot of a
// running sandbox with a process in memory, the source deleted, a sandbox created from
// the snapshot that has both the file and the process, metrics against its limits, and
// the snapshot removed with its files. It reports the times of a capture and of a
// create from a snapshot.
func TestNamedSnapshots(t *testing.T) {
	s := start(t, options{})
	c := ctx(t, 4*time.Minute)
	src := s.create(t, api.CreateSandboxRequest{CPU: 1, MemoryMB: 256})
	if _, err := s.C.WriteFile(c, src.ID, "/root/kept.txt", strings.NewReader("on the disk"), client.FileOptions{}); err != nil {
		t.Fatal(err)
	}
	sess, err := s.C.CreateSession(c, src.ID, api.CreateSessionRequest{Command: counter})
	if err != nil {
		t.Fatal(err)
	}
	st, err := s.C.Attach(c, sess, "")
	if err != nil {
		t.Fatal(err)
	}
	st.Next()
	st.Close()

	t0 := time.Now()
	out, errOut, code := s.cli(t, "snapshot", "create", src.ID, "--name", "e2e-warm", "-o", "json")
	took := time.Since(t0)
	if code != 0 {
		t.Fatalf("snapshot create: %s\n%s", errOut, s.Log())
	}
	var sn api.Snapshot
	if err := json.Unmarshal([]byte(out), &sn); err != nil || sn.State != api.SnapshotReady || sn.SizeBytes <= 0 {
		t.Fatalf("snapshot: %s %v", out, err)
	}
	t.Logf("snapshot create (CLI, waited until ready): %s; size %d bytes", took.Round(time.Millisecond), sn.SizeBytes)
	if p, err := s.C.GetProcess(c, src.ID, sess.PID); err != nil || p.State != api.ProcRunning {
		t.Fatalf("the source's process after the snapshot: %+v %v", p, err)
	}
	del, err := s.C.DeleteSandbox(c, src.ID)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.C.WaitOperation(c, del.ID); err != nil {
		t.Fatal(err)
	}

	t0 = time.Now()
	id, errOut, code := s.cli(t, "sandbox", "create", "--snapshot", "e2e-warm", "--wait")
	took = time.Since(t0)
	if code != 0 {
		t.Fatalf("sandbox create --snapshot: %s\n%s", errOut, s.Log())
	}
	id = strings.TrimSpace(id)
	t.Logf("sandbox create --snapshot (CLI, waited until running): %s", took.Round(time.Millisecond))
	got := s.state(t, id)
	if got.Snapshot != sn.ID || got.StartPath != "snapshot" || got.MemoryMB != 256 || got.State != api.StateRunning {
		t.Fatalf("sandbox from the snapshot: %+v", got)
	}
	if out, _, _ := s.exec(t, id, "cat", "/root/kept.txt"); out != "on the disk" {
		t.Fatalf("file: %q", out)
	}
	if p, err := s.C.GetProcess(c, id, sess.PID); err != nil || p.State != api.ProcRunning {
		t.Fatalf("the process in the sandbox from the snapshot: %+v %v", p, err)
	}
	if out, _, _ := s.exec(t, id, "hostname"); !strings.Contains(out, id[:8]) {
		t.Fatalf("identity: hostname %q", out)
	}

	// Metrics: the limits of the sandbox, not of the host.
	waitFor(t, 30*time.Second, "two metric samples", func() bool {
		m, err := s.C.SandboxMetrics(c, id, time.Time{}, time.Time{})
		return err == nil && len(m.Samples) >= 2
	})
	out, errOut, code = s.cli(t, "sandbox", "metrics", id, "-o", "json")
	var m api.MetricList
	if code != 0 || json.Unmarshal([]byte(out), &m) != nil || len(m.Samples) < 2 {
		t.Fatalf("sandbox metrics: %s %s", out, errOut)
	}
	for _, x := range m.Samples {
		if x.CPUCount != 1 || x.MemTotal != 256<<20 || x.MemUsed <= 0 || x.MemUsed > x.MemTotal || x.DiskTotal != int64(got.DiskMB)<<20 {
			t.Fatalf("sample: %+v", x)
		}
	}
	// CPU use comes from the sandbox's host cgroup: two seconds of spinning show.
	if _, _, code := s.exec(t, id, "timeout", "2", "sh", "-c", "while :; do :; done"); code != 124 {
		t.Fatalf("spin: exit %d", code)
	}
	waitFor(t, 30*time.Second, "a sample of the busy round", func() bool {
		m, err := s.C.SandboxMetrics(c, id, time.Time{}, time.Time{})
		return err == nil && slices.ContainsFunc(m.Samples, func(x api.MetricSample) bool { return x.CPUUsedPct >= 25 })
	})

	out, _, code = s.cli(t, "snapshot", "list")
	if code != 0 || !strings.Contains(out, "e2e-warm") || !strings.Contains(out, "ready") {
		t.Fatalf("snapshot list: %s", out)
	}
	if _, errOut, code := s.cli(t, "snapshot", "rm", "e2e-warm"); code != 0 {
		t.Fatalf("snapshot rm: %s", errOut)
	}
	waitFor(t, time.Minute, "the snapshot's files to go", func() bool {
		_, err := os.Stat(filepath.Join(s.DataDir, "store", "snapshots", sn.ID))
		_, gerr := s.C.GetSnapshot(c, sn.ID)
		return os.IsNotExist(err) && client.IsNotFound(gerr)
	})
	// The sandbox made from it lives on.
	if out, _, _ := s.exec(t, id, "cat", "/root/kept.txt"); out != "on the disk" {
		t.Fatalf("file after the snapshot was deleted: %q", out)
	}
}
