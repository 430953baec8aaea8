package instances

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

type rec struct {
	ID  string `json:"id"`
	PID int    `json:"pid"`
}

func TestRecords(t *testing.T) {
	s := Records[rec]{Dir: filepath.Join(t.TempDir(), "instances")}
	valid := func(id string) bool { return id != "" && id[0] != '.' }
	if ids, err := s.IDs(valid); err != nil || len(ids) != 0 {
		t.Fatalf("no records dir: %v %v", ids, err)
	}
	if _, err := s.Read("a"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("read a missing record: %v", err)
	}
	if err := s.Claim("a", rec{ID: "a", PID: 1}); err != nil {
		t.Fatal(err)
	}
	if err := s.Claim("a", rec{ID: "a", PID: 2}); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("second claim: %v, want fs.ErrExist", err)
	}
	if err := s.Update("a", rec{ID: "a", PID: 3}); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Read("a"); err != nil || got != (rec{ID: "a", PID: 3}) {
		t.Fatalf("read: %+v %v", got, err)
	}
	if err := s.Claim("b", rec{ID: "b"}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.Dir, "c.json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Read("c"); err == nil || errors.Is(err, fs.ErrNotExist) {
		t.Errorf("read a corrupt record: %v", err)
	}
	ids, err := s.IDs(valid)
	if slices.Sort(ids); err != nil || !slices.Equal(ids, []string{"a", "b", "c"}) {
		t.Errorf("ids %v %v (temporary files must not show)", ids, err)
	}
	for _, id := range []string{"a", "a", "zz"} {
		if err := s.Remove(id); err != nil {
			t.Errorf("remove %s: %v", id, err)
		}
	}
	if _, err := os.Stat(s.Path("a")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("removed record: %v", err)
	}
}

func TestProcs(t *testing.T) {
	sleep := exec.Command("sleep", "60")
	sleep.Args[0] = "instances-test"
	if err := sleep.Start(); err != nil {
		t.Skip(err)
	}
	defer sleep.Wait()
	defer sleep.Process.Kill()
	pid := sleep.Process.Pid
	// Start returns once the child's close-on-exec pipe closed, which the kernel does
	// before it lays out the new argv: wait for /proc to show it.
	var pi Proc
	var err error
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if pi, err = ReadProc(pid); err != nil || len(pi.Argv) > 1 {
			break
		}
	}
	if err != nil || !pi.Live() || pi.StartTime == 0 || !slices.Equal(pi.Argv, []string{"instances-test", "60"}) {
		t.Fatalf("ReadProc: %+v %v", pi, err)
	}
	match := func(argv []string) bool { return slices.Contains(argv, "instances-test") }
	if pids := Scan(match); !slices.Equal(pids, []int{pid}) {
		t.Errorf("Scan: %v, want [%d]", pids, pid)
	}
	if got := FindPID(pid, pi.StartTime, match); got != pid {
		t.Errorf("FindPID(recorded) = %d, want %d", got, pid)
	}
	if got := FindPID(pid, pi.StartTime+1, func([]string) bool { return false }); got != 0 {
		t.Errorf("FindPID of a reused pid = %d, want 0", got)
	}
	if got := FindPID(0, 0, match); got != pid {
		t.Errorf("FindPID(scan) = %d, want %d", got, pid)
	}
	sleep.Process.Kill()
	sleep.Wait()
	if got := FindPID(pid, pi.StartTime, match); got != 0 {
		t.Errorf("FindPID of an exited process = %d", got)
	}
}
