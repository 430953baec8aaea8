package testenv

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) { Main(m) }

// helperEnv makes the test binary, re-executed by TestMainTearsDown, run
// TestHelperProcess in the given mode.
const helperEnv = "TESTENV_TEST_HELPER"

func connect(t *testing.T, u string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func TestPostgresDistinctDatabases(t *testing.T) {
	u1, u2 := Postgres(t), Postgres(t)
	if u1 == u2 {
		t.Fatalf("same URL twice: %s", u1)
	}
	c1, c2 := connect(t, u1), connect(t, u2)
	ctx := context.Background()
	var db1, db2 string
	if err := c1.QueryRow(ctx, "SELECT current_database()").Scan(&db1); err != nil {
		t.Fatal(err)
	}
	if err := c2.QueryRow(ctx, "SELECT current_database()").Scan(&db2); err != nil {
		t.Fatal(err)
	}
	if db1 == db2 || !strings.HasPrefix(db1, "t_") || !strings.HasPrefix(db2, "t_") {
		t.Errorf("databases %q and %q", db1, db2)
	}
	if _, err := c1.Exec(ctx, "CREATE TABLE only_in_one (v int)"); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := c2.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE tablename = 'only_in_one'").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Error("a table made in one database shows in the other: not empty / not distinct")
	}
}

func TestPostgresDropsDatabaseWithOpenConnections(t *testing.T) {
	var name string
	var left *pgx.Conn
	t.Run("user", func(t *testing.T) {
		u := Postgres(t)
		conn, err := pgx.Connect(context.Background(), u) // deliberately left open
		if err != nil {
			t.Fatal(err)
		}
		left = conn
		if err := conn.QueryRow(context.Background(), "SELECT current_database()").Scan(&name); err != nil {
			t.Fatal(err)
		}
	})
	if left != nil {
		defer left.Close(context.Background())
	}
	admin, err := env.admin()
	if err != nil {
		t.Fatal(err)
	}
	var exists bool
	if err := connect(t, admin).QueryRow(context.Background(),
		"SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if name == "" || exists {
		t.Errorf("database %q still exists after its test ended", name)
	}
}

func TestWithDatabase(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"postgres://u:p@db.example:5433/postgres?sslmode=require", "postgres://u:p@db.example:5433/t_x?sslmode=require"},
		{"postgresql://u@/space?host=%2Frun%2Fpg", "postgresql://u@/t_x?host=%2Frun%2Fpg"},
		{"host=/run/pg dbname=postgres user=u", "host=/run/pg dbname=postgres user=u dbname=t_x"},
	} {
		got, err := withDatabase(tc.in, "t_x")
		if err != nil || got != tc.want {
			t.Errorf("withDatabase(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
		cfg, err := pgx.ParseConfig(got)
		if err != nil || cfg.Database != "t_x" {
			t.Errorf("%q parses to database %q, %v", got, cfg.Database, err)
		}
	}
}

// TestHelperProcess is the child of TestMainTearsDown; it does nothing in a normal run.
func TestHelperProcess(t *testing.T) {
	mode := os.Getenv(helperEnv)
	if mode == "" {
		t.Skip("helper for TestMainTearsDown")
	}
	Postgres(t)
	env.mu.Lock()
	dir := env.pgDir
	env.mu.Unlock()
	fmt.Printf("\nCLUSTER %s\n", dir)
	if mode == "hang" {
		select {} // until the parent kills us
	}
}

// startHelper runs TestHelperProcess in a child test binary and returns it and the
// private cluster directory it reported.
func startHelper(t *testing.T, mode string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if dir, ok := strings.CutPrefix(sc.Text(), "CLUSTER "); ok {
			go func() { // drain the rest so the child never blocks on a full pipe
				for sc.Scan() {
				}
			}()
			return cmd, dir
		}
	}
	t.Fatalf("helper ended without reporting its cluster (%v)", sc.Err())
	return nil, ""
}

func postmasterPID(t *testing.T, dir string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "data", "postmaster.pid"))
	if err != nil {
		t.Fatal(err)
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(first)
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// running reports whether pid is a live process (zombies count as gone).
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(b), ')')
	return i > 0 && len(b) > i+2 && b[i+2] != 'Z'
}

func waitGone(pid int, within time.Duration) bool {
	deadline := time.After(within)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for running(pid) {
		select {
		case <-deadline:
			return false
		case <-tick.C:
		}
	}
	return true
}

func TestMainTearsDown(t *testing.T) {
	if os.Getenv(DatabaseURLEnv) != "" {
		t.Skipf("skipping: %s is set, so no private cluster is started", DatabaseURLEnv)
	}
	cmd, dir := startHelper(t, "exit")
	pid := postmasterPID(t, dir)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("helper: %v", err)
	}
	if !waitGone(pid, 5*time.Second) {
		t.Errorf("postmaster %d still running after the test binary exited", pid)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("cluster dir %s left behind (%v)", dir, err)
	}
}

func TestSweepStaleAfterKilledTestBinary(t *testing.T) {
	if os.Getenv(DatabaseURLEnv) != "" {
		t.Skipf("skipping: %s is set, so no private cluster is started", DatabaseURLEnv)
	}
	cmd, dir := startHelper(t, "hang")
	pid := postmasterPID(t, dir)
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if !running(pid) {
		t.Fatal("postmaster died with the killed test binary: the sweep has nothing to do")
	}
	// A binary dir of a dead owner, and one of a live owner (this process).
	deadPID := func() int {
		c := exec.Command("true")
		if err := c.Run(); err != nil {
			t.Fatal(err)
		}
		return c.Process.Pid
	}()
	stale, err := os.MkdirTemp("", binPrefix+strconv.Itoa(deadPID)+"-")
	if err != nil {
		t.Fatal(err)
	}
	mine, err := os.MkdirTemp("", binPrefix+strconv.Itoa(os.Getpid())+"-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(stale); _ = os.RemoveAll(mine) })

	sweepStale(slog.New(slog.NewTextHandler(os.Stderr, nil)))

	if !waitGone(pid, 5*time.Second) {
		t.Errorf("postmaster %d of the killed test binary still running", pid)
	}
	for _, d := range []string{dir, stale} {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("stale %s left behind (%v)", d, err)
		}
	}
	if _, err := os.Stat(mine); err != nil {
		t.Errorf("swept the directory of a live test binary: %v", err)
	}
}

func TestModuleRoot(t *testing.T) {
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root, err := moduleRoot(wd)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(root, "go.mod")); err != nil || !strings.Contains(string(b), "module github.com/spacedev/space\n") {
		t.Errorf("moduleRoot = %s (%v)", root, err)
	}
	if _, err := moduleRoot("/"); err == nil {
		t.Error("moduleRoot(/): no error")
	}
}

// TestBuild builds a throwaway module shaped like space (cmd/space, cmd/space-agent).
func TestBuild(t *testing.T) {
	root := t.TempDir()
	files := map[string]string{
		"go.mod":                    "module example.com/throwaway\n\ngo 1.26\n",
		"cmd/space/main.go":         "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"space\") }\n",
		"cmd/space-agent/main.go":   "package main\n\nimport (\n\t\"fmt\"\n\t\"net\"\n)\n\nfunc main() { fmt.Println(\"agent\", net.IPv4len) }\n",
		"cmd/space-agent/other.go":  "package main\n",
		"cmd/space/nested/README":   "not go\n",
		"internal/unused/unused.go": "package unused\n",
	}
	for name, body := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := build(ctx, root, out, "", ""); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"space": "space\n", "space-agent": "agent 4\n"} {
		got, err := exec.Command(filepath.Join(out, name)).Output()
		if err != nil || string(got) != want {
			t.Errorf("%s printed %q, %v; want %q", name, got, err, want)
		}
	}
	f, err := elf.Open(filepath.Join(out, "space-agent"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Error("space-agent is dynamically linked; want static (CGO_ENABLED=0)")
		}
	}

	// The agent of another build: it runs, and its code is not the first one's.
	other := t.TempDir()
	if err := build(ctx, root, other, otherAgentBuild.tags, otherAgentBuild.agentGC); err != nil {
		t.Fatal(err)
	}
	if got, err := exec.Command(filepath.Join(other, "space-agent")).Output(); err != nil || string(got) != "agent 4\n" {
		t.Errorf("the other agent printed %q, %v", got, err)
	}
	if bytes.Equal(textOf(t, filepath.Join(out, "space-agent")), textOf(t, filepath.Join(other, "space-agent"))) {
		t.Error("the other agent's code is the same as the first's")
	}

	broken := t.TempDir()
	if err := os.WriteFile(filepath.Join(broken, "go.mod"), []byte("module example.com/broken\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := build(ctx, broken, t.TempDir(), "", ""); err == nil || !strings.Contains(err.Error(), "cmd/space-agent") {
		t.Errorf("build of a module without the commands: %v", err)
	}
}

// TestBinaries builds the real commands once they exist.
func TestBinaries(t *testing.T) {
	wd, _ := os.Getwd()
	root, err := moduleRoot(wd)
	if err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"cmd/space", "cmd/space-agent"} {
		if m, _ := filepath.Glob(filepath.Join(root, cmd, "*.go")); len(m) == 0 {
			t.Skipf("skipping: %s has no Go files yet (TestBuild covers the build helper)", cmd)
		}
	}
	space, agent := Binaries(t)
	if filepath.Dir(space) != filepath.Dir(agent) {
		t.Errorf("space %s and space-agent %s not side by side", space, agent)
	}
	for _, p := range []string{space, agent} {
		if fi, err := os.Stat(p); err != nil || fi.Mode()&0o111 == 0 {
			t.Errorf("%s: not an executable (%v)", p, err)
		}
	}
	if s2, _ := Binaries(t); s2 != space {
		t.Errorf("second call built again: %s vs %s", s2, space)
	}
}

func TestRequireBinary(t *testing.T) {
	if p := RequireBinary(t, "sh", "base system"); !filepath.IsAbs(p) {
		t.Errorf("RequireBinary(sh) = %q", p)
	}
	ran := false
	t.Run("missing", func(t *testing.T) {
		RequireBinary(t, "no-such-program-space-test", "nothing provides it")
		ran = true
	})
	if ran {
		t.Error("RequireBinary did not skip for a missing program")
	}
}

func TestRequireRoot(t *testing.T) {
	ran := false
	t.Run("root", func(t *testing.T) {
		RequireRoot(t)
		ran = true
	})
	if ran != (syscall.Geteuid() == 0) {
		t.Errorf("RequireRoot ran=%v as uid %d", ran, syscall.Geteuid())
	}
}

// FreeAddr's ports are free and outside the kernel's ephemeral range.
func TestFreeAddr(t *testing.T) {
	lo, hi := freePortRange()
	for range 20 {
		_, p, err := net.SplitHostPort(FreeAddr(t))
		if err != nil {
			t.Fatal(err)
		}
		port, _ := strconv.Atoi(p)
		if port < lo || port > hi {
			t.Fatalf("port %d outside %d-%d", port, lo, hi)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:"+p)
		if err != nil {
			t.Fatalf("port %d not free: %v", port, err)
		}
		ln.Close()
	}
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		t.Skip(err)
	}
	f := strings.Fields(string(b))
	eLo, _ := strconv.Atoi(f[0])
	eHi, _ := strconv.Atoi(f[1])
	if lo <= eHi && hi >= eLo {
		t.Fatalf("range %d-%d overlaps the ephemeral %d-%d", lo, hi, eLo, eHi)
	}
}

// textOf returns the code (.text) of an ELF executable.
func textOf(t *testing.T, path string) []byte {
	t.Helper()
	f, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sec := f.Section(".text")
	if sec == nil {
		t.Fatalf("%s has no .text", path)
	}
	data, err := sec.Data()
	if err != nil {
		t.Fatal(err)
	}
	return data
}
