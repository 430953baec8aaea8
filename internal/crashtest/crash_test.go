// Package crashtest walks every crash point of every lifecycle transition: it runs a
// real `space serve` (a failpoints build, with the fake runtime: no root needed), makes
// it die at each point in turn — kill -9 of space, or kill -9 of its PostgreSQL — lets
// it recover, and checks that nothing was lost or left pending: the sandbox ends in
// its old or its new state, its disk is intact, processes survive where the state says
// memory was kept, every operation ends and tells the truth, and nothing leaks. A
// randomized chaos test (seeded, bounded in time) mixes verbs with kills.
package crashtest_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/crash"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// converge bounds how long recovery may take after a crash.
const converge = 90 * time.Second

// server is a failpoints build of space serve on one data directory.
type server struct {
	t        testing.TB
	bin      string
	dataDir  string
	dbURL    string // "" runs the embedded PostgreSQL
	addr     string
	url      string
	C        *client.Client
	crashLog string
	armFile  string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	out  *bytes.Buffer
}

func newServer(t testing.TB, embedded bool) *server {
	t.Helper()
	bin, _ := testenv.FailpointBinaries(t)
	dir := t.TempDir()
	s := &server{t: t, bin: bin, dataDir: dir, addr: freeAddr(t), crashLog: filepath.Join(dir, "crash.log"),
		armFile: filepath.Join(dir, "crash.arm")}
	if !embedded {
		s.dbURL = testenv.Postgres(t)
	}
	s.url = "http://" + s.addr
	t.Cleanup(s.cleanup)
	return s
}

func freeAddr(t testing.TB) string { return testenv.FreeAddr(t) }

// start launches space serve and waits until it is healthy.
func (s *server) start() {
	s.t.Helper()
	args := []string{"serve", "--data-dir", s.dataDir, "--listen", s.addr, "--runtime", "fake", "--e2b-listen", "", "--log-level", "debug",
		// Base snapshots would change the create path after the first create: creates
		// always boot here (base snapshots are walked on gVisor).
		"--base-snapshots=false"}
	if s.dbURL != "" {
		args = append(args, "--database-url", s.dbURL)
	}
	cmd := exec.Command(s.bin, args...)
	cmd.Env = append(os.Environ(), "SPACE_CRASH_LOG="+s.crashLog, "SPACE_CRASH_ARM="+s.armFile,
		"SPACE_CRASH_PGPID="+filepath.Join(s.dataDir, "postgres", "data", "postmaster.pid"))
	out := &testenv.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if os.Getenv("SPACE_TEST_VERBOSE") != "" {
		cmd.Stderr = os.Stderr
	}
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if resp, err := http.Get(s.url + "/healthz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		select {
		case <-done:
			ss, _ := exec.Command("ss", "-ltnp").CombinedOutput()
			s.t.Fatalf("space serve exited during start-up:\n%s\n%s", out.String(), ss)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("space serve did not become healthy")
		}
	}
	if s.C == nil {
		key, err := os.ReadFile(filepath.Join(s.dataDir, "admin.key"))
		if err != nil {
			s.t.Fatal(err)
		}
		s.C = client.New(s.url, strings.TrimSpace(string(key)))
	}
}

// stop ends the server with SIGKILL (a crash) and waits for it.
func (s *server) kill() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

// died waits up to d for the server to exit by itself (killed at a crash point).
func (s *server) died(d time.Duration) bool {
	s.mu.Lock()
	done := s.done
	s.mu.Unlock()
	select {
	case <-done:
		s.mu.Lock()
		s.cmd = nil
		s.mu.Unlock()
		return true
	case <-time.After(d):
		return false
	}
}

// exited reports whether the server process has ended (without waiting).
func (s *server) exited() bool {
	s.mu.Lock()
	done := s.done
	s.mu.Unlock()
	if done == nil {
		return true
	}
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// isPID reports whether the server process the test runs now has pid.
func (s *server) isPID(pid int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cmd != nil && s.cmd.Process != nil && s.cmd.Process.Pid == pid
}

// running reports whether a server process runs.
func (s *server) running() bool { return !s.exited() }

func (s *server) cleanup() {
	s.kill()
	// The fake runtime's agents and their processes are host processes: end them all.
	for _, rec := range globRecords(s.dataDir) {
		var pid int
		if b, err := os.ReadFile(rec); err == nil {
			_, _ = scanPID(b, &pid)
		}
		if pid > 1 {
			killTree(pid)
		}
	}
	if s.dbURL == "" {
		if b, err := os.ReadFile(filepath.Join(s.dataDir, "postgres", "data", "postmaster.pid")); err == nil {
			var pid int
			fmt.Sscanf(string(b), "%d", &pid)
			if pid > 1 {
				_ = syscall.Kill(pid, syscall.SIGQUIT)
			}
		}
	}
}

// scanPID reads the "pid" of a fake runtime instance record.
func scanPID(rec []byte, pid *int) (int, error) {
	i := bytes.Index(rec, []byte(`"pid":`))
	if i < 0 {
		return 0, fmt.Errorf("no pid in %q", rec)
	}
	return fmt.Sscanf(string(rec[i+6:]), "%d", pid)
}

func globRecords(dataDir string) []string {
	recs, _ := filepath.Glob(filepath.Join(dataDir, "fake", "instances", "*.json"))
	return recs
}

// instances lists the ids the fake runtime holds an instance for.
func (s *server) instances() []string {
	var out []string
	for _, r := range globRecords(s.dataDir) {
		out = append(out, strings.TrimSuffix(filepath.Base(r), ".json"))
	}
	return out
}

// disks lists the ids that have a disk directory.
func (s *server) disks() []string {
	ents, _ := os.ReadDir(filepath.Join(s.dataDir, "fakestore", "sandboxes"))
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func killTree(pid int) {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var p int
		if _, err := fmt.Sscanf(e.Name(), "%d", &p); err != nil {
			continue
		}
		for q := p; q > 1; {
			if q == pid {
				_ = syscall.Kill(p, syscall.SIGKILL)
				break
			}
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", q))
			if err != nil {
				break
			}
			f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
			if len(f) < 2 {
				break
			}
			fmt.Sscanf(f[1], "%d", &q)
		}
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
}

func ctx(t testing.TB, d time.Duration) context.Context {
	c, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return c
}

// points reads the crash points passed since the log was last cleared, in order, once
// each.
func (s *server) points() []string {
	f, err := os.Open(s.crashLog)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if p := sc.Text(); p != "" && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}

func (s *server) clearPoints() { _ = os.Truncate(s.crashLog, 0) }

// arm arms a crash point of the running server (crash.Arm); disarm disarms.
func (s *server) arm(point, action, once string) {
	if err := crash.Arm(s.armFile, point, action, once); err != nil {
		s.t.Fatal(err)
	}
}

func (s *server) disarm() { s.arm("", "", "") }

// markerPath is a file on a sandbox's disk (the fake store's directory).
func (s *server) markerPath(id string) string {
	return filepath.Join(s.dataDir, "fakestore", "sandboxes", id, "rootfs", "marker")
}
