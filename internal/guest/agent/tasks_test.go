package agent

import (
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// fakeCgroupfs makes a directory tree standing for a cgroup2 mount whose sandbox cgroup
// (at own) has the given pids.max ("" for none). Control files are plain files here:
// what the split writes is what it would write to cgroupfs.
func fakeCgroupfs(t *testing.T, own, pidsMax string) string {
	t.Helper()
	root := t.TempDir()
	dir := filepath.Join(root, own)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if pidsMax != "" {
		write(t, filepath.Join(dir, "pids.max"), pidsMax)
	}
	return root
}

func write(t *testing.T, file, data string) {
	t.Helper()
	if err := os.WriteFile(file, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func readFile(t *testing.T, file string) string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func newTestSplit(root, own string, memMiB int64) *taskSplit {
	return &taskSplit{root: root, log: slog.New(slog.DiscardHandler),
		self:     func() (string, error) { return own, nil },
		memTotal: func() (int64, error) { return memMiB, nil }}
}

// TestTaskSplit: under a sandbox cgroup with a pids limit (gVisor), the agent moves
// itself to <cgroup>/agent and user processes get <cgroup>/user with the limit minus
// the agent's share; a changed limit is followed at the next identity; a removed user
// cgroup is made again.
func TestTaskSplit(t *testing.T) {
	root := fakeCgroupfs(t, "/sb1", "256")
	s := newTestSplit(root, "/sb1", 256)
	s.refresh() // the first identity
	sb := filepath.Join(root, "sb1")
	if got := readFile(t, filepath.Join(sb, "agent", "cgroup.procs")); got != strconv.Itoa(os.Getpid()) {
		t.Errorf("agent cgroup.procs = %q", got)
	}
	if got := readFile(t, filepath.Join(sb, "cgroup.subtree_control")); got != "+pids" {
		t.Errorf("subtree_control = %q", got)
	}
	if got := readFile(t, filepath.Join(sb, "user", "pids.max")); got != "192" {
		t.Errorf("user pids.max = %q, want 192 (256 less the agent's 64)", got)
	}
	if s.userCgroupFD() < 0 {
		t.Fatal("no user cgroup to start processes in")
	}
	// A restore with another limit: the next identity follows it.
	write(t, filepath.Join(sb, "pids.max"), "2048")
	s.refresh()
	if got := readFile(t, filepath.Join(sb, "user", "pids.max")); got != "1984" {
		t.Errorf("user pids.max after the limit changed = %q, want 1984", got)
	}
	// Still there: a failed start is the program's own.
	if s.lost() {
		t.Error("lost() with the user cgroup in place")
	}
	if err := os.RemoveAll(filepath.Join(sb, "user")); err != nil {
		t.Fatal(err)
	}
	if !s.lost() {
		t.Fatal("lost() did not notice the removed user cgroup")
	}
	if s.userCgroupFD() < 0 {
		t.Fatal("the user cgroup was not made again")
	}
	if got := readFile(t, filepath.Join(sb, "user", "pids.max")); got != "1984" {
		t.Errorf("user pids.max made again = %q", got)
	}
	// A small limit keeps the agent a quarter of it.
	if got := agentTasks(16); got != 4 {
		t.Errorf("agentTasks(16) = %d", got)
	}
}

// TestTaskSplitVM: in a VM's guest the agent is in the root cgroup, which has no pids
// limit: user processes get one task per MiB of memory, at least 256, and the agent
// stays where it is.
func TestTaskSplitVM(t *testing.T) {
	for mib, want := range map[int64]string{512: "512", 100: "256"} {
		root := fakeCgroupfs(t, "/", "")
		s := newTestSplit(root, "/", mib)
		s.refresh()
		if got := readFile(t, filepath.Join(root, "user", "pids.max")); got != want {
			t.Errorf("%d MiB: user pids.max = %q, want %s", mib, got, want)
		}
		if _, err := os.Stat(filepath.Join(root, "agent")); err == nil {
			t.Errorf("%d MiB: the agent left the root cgroup", mib)
		}
		if s.userCgroupFD() < 0 {
			t.Errorf("%d MiB: no user cgroup", mib)
		}
	}
}

// TestTaskSplitNoLimit: a sandbox cgroup without a limit ("max", or no pids
// controller) is left alone, and processes start where the agent is.
func TestTaskSplitNoLimit(t *testing.T) {
	for _, pidsMax := range []string{"max", ""} {
		root := fakeCgroupfs(t, "/sb2", pidsMax)
		s := newTestSplit(root, "/sb2", 512)
		s.refresh()
		if fd := s.userCgroupFD(); fd >= 0 {
			t.Errorf("pids.max %q: a user cgroup (fd %d)", pidsMax, fd)
		}
		if _, err := os.Stat(filepath.Join(root, "sb2", "user")); err == nil {
			t.Errorf("pids.max %q: split anyway", pidsMax)
		}
	}
	// Off: no root configured (an agent that is not PID 1).
	if fd := (&taskSplit{}).userCgroupFD(); fd >= 0 {
		t.Errorf("disabled split gave fd %d", fd)
	}
}
