package pgmanaged

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// requirePostgres skips when the machine has no PostgreSQL server binaries.
func requirePostgres(t *testing.T) {
	t.Helper()
	if _, err := findBinaries("", debianLibRoot, ""); err != nil {
		t.Skipf("skipping: %v", err)
	}
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// start starts a cluster in dir and stops it at test cleanup (a no-op when the test
// stopped it already).
func start(t *testing.T, dir string) *Server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := Start(ctx, Config{Dir: dir, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Stop(context.Background()); err != nil {
			t.Error(err)
		}
	})
	return s
}

func connect(t *testing.T, s *Server) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func exec1(t *testing.T, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	if _, err := conn.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func queryString(t *testing.T, conn *pgx.Conn, sql string) string {
	t.Helper()
	var v string
	if err := conn.QueryRow(context.Background(), sql).Scan(&v); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return v
}

// requireStopped checks that no process of the cluster in s is left.
func requireStopped(t *testing.T, s *Server) {
	t.Helper()
	if alive(s.pid) {
		t.Errorf("postmaster %d still running", s.pid)
	}
	if pids := leftovers(s.dataDir, 0); len(pids) > 0 {
		t.Errorf("postgres processes left: %v", pids)
	}
}

func TestStartQueryStopRestart(t *testing.T) {
	requirePostgres(t)
	dir := filepath.Join(t.TempDir(), "pg")
	s := start(t, dir)

	conn := connect(t, s)
	if db := queryString(t, conn, "SELECT current_database()"); db != "space" {
		t.Errorf("database = %q, want space", db)
	}
	if la := queryString(t, conn, "SHOW listen_addresses"); la != "" {
		t.Errorf("listen_addresses = %q, want none", la)
	}
	if pgid, err := syscall.Getpgid(s.pid); err != nil || pgid != s.pid {
		t.Errorf("postmaster process group = %d, %v; want its own (%d)", pgid, err, s.pid)
	}
	if enc := queryString(t, conn, "SHOW server_encoding"); enc != "UTF8" {
		t.Errorf("server_encoding = %q", enc)
	}
	exec1(t, conn, "CREATE TABLE kept (v text)")
	exec1(t, conn, "INSERT INTO kept VALUES ('survives')")
	_ = conn.Close(context.Background())

	if err := s.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	requireStopped(t, s)
	if err := s.Stop(context.Background()); err != nil {
		t.Errorf("second Stop: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "postgres.log")); err != nil || fi.Size() == 0 {
		t.Errorf("postgres.log missing or empty: %v", err)
	}

	s2 := start(t, dir)
	if s2.pid == s.pid {
		t.Errorf("restart reused pid %d", s.pid)
	}
	if v := queryString(t, connect(t, s2), "SELECT v FROM kept"); v != "survives" {
		t.Errorf("after restart: %q", v)
	}
	if err := s2.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	requireStopped(t, s2)
}

func TestSecondStartAdopts(t *testing.T) {
	requirePostgres(t)
	dir := filepath.Join(t.TempDir(), "pg")
	s1 := start(t, dir)
	s2 := start(t, dir)
	if s2.pid != s1.pid || s2.exited != nil {
		t.Fatalf("second Start did not adopt: pid %d (first %d)", s2.pid, s1.pid)
	}
	if v := queryString(t, connect(t, s2), "SELECT 'adopted'"); v != "adopted" {
		t.Errorf("query: %q", v)
	}
	if err := s2.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	requireStopped(t, s2)
	if err := s1.Stop(context.Background()); err != nil {
		t.Errorf("Stop of the original after the adopter stopped it: %v", err)
	}
}

func TestRecoversAfterKill9(t *testing.T) {
	requirePostgres(t)
	dir := filepath.Join(t.TempDir(), "pg")
	s1 := start(t, dir)
	conn := connect(t, s1)
	exec1(t, conn, "CREATE TABLE t (v int)")
	exec1(t, conn, "INSERT INTO t VALUES (42)")

	if err := syscall.Kill(s1.pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := waitFor(context.Background(), 10*time.Second, func() bool { return !s1.running() }); err != nil {
		t.Fatal("postmaster survived SIGKILL")
	}

	s2 := start(t, dir)
	if s2.pid == s1.pid {
		t.Fatalf("adopted the dead postmaster %d", s1.pid)
	}
	if v := queryString(t, connect(t, s2), "SELECT v::text FROM t"); v != "42" {
		t.Errorf("committed row after crash: %q", v)
	}
	// Stopping the dead server must not touch the new one.
	if err := s1.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !s2.running() || len(leftovers(s2.dataDir, s2.pid)) > 0 {
		t.Fatal("Stop of the dead server harmed the new one or left processes")
	}
	if err := s2.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	requireStopped(t, s2)
}

func TestStalePidFileOfUnrelatedProcess(t *testing.T) {
	requirePostgres(t)
	dir := filepath.Join(t.TempDir(), "pg")
	s1 := start(t, dir)
	if err := s1.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	// A live process that is not a postmaster, as after a reboot reused the pid.
	sleeper := exec.Command("sleep", "60")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sleeper.Process.Kill(); _ = sleeper.Wait() })
	pidFile := []byte(strings.Join([]string{strconv.Itoa(sleeper.Process.Pid), s1.dataDir, "0", "5432", "", "", "0 0", "ready", ""}, "\n"))
	if err := os.WriteFile(filepath.Join(s1.dataDir, "postmaster.pid"), pidFile, 0o600); err != nil {
		t.Fatal(err)
	}
	s2 := start(t, dir)
	if s2.pid == sleeper.Process.Pid {
		t.Fatal("adopted an unrelated process")
	}
	if v := queryString(t, connect(t, s2), "SELECT 'ok'"); v != "ok" {
		t.Errorf("query: %q", v)
	}
	// A done context skips the wait for the fast shutdown; Stop still finishes the job.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s2.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	requireStopped(t, s2)
}

func TestExplicitUser(t *testing.T) {
	requirePostgres(t)
	if os.Geteuid() != 0 {
		t.Skip("skipping: User applies only when running as root")
	}
	if _, err := Start(context.Background(), Config{Dir: t.TempDir(), User: "no-such-user-space"}); err == nil {
		t.Error("Start with a missing explicit user: no error")
	}
	u, err := user.Lookup("nobody")
	if err != nil {
		t.Skipf("skipping: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := Start(ctx, Config{Dir: filepath.Join(t.TempDir(), "pg"), User: "nobody", Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	status, err := os.ReadFile("/proc/" + strconv.Itoa(s.pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(status), "\nUid:\t"+u.Uid+"\t") {
		t.Errorf("postmaster does not run as nobody (uid %s):\n%s", u.Uid, status)
	}
}

func TestStartFailureLeavesNothing(t *testing.T) {
	requirePostgres(t)
	base := t.TempDir()
	dir := filepath.Join(base, "new", "pg")
	bin := t.TempDir()
	for _, name := range []string{"initdb", "postgres"} {
		if err := os.WriteFile(filepath.Join(bin, name), []byte("#!/bin/sh\necho broken >&2\nexit 1\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, err := Start(context.Background(), Config{Dir: dir, BinDir: bin, Logger: testLogger(t)})
	if err == nil || !strings.Contains(err.Error(), "initdb") {
		t.Fatalf("err = %v, want an initdb failure", err)
	}
	if _, err := os.Stat(filepath.Join(base, "new")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("failed Start left %s behind (%v)", filepath.Join(base, "new"), err)
	}
}

func TestSocketPathTooLong(t *testing.T) {
	dir := "/tmp/" + strings.Repeat("d", 120)
	_, err := Start(context.Background(), Config{Dir: dir})
	if err == nil || !strings.Contains(err.Error(), "socket path") {
		t.Fatalf("err = %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("created %s", dir)
	}
}

func TestURLParsesWithPgx(t *testing.T) {
	cfg, err := pgx.ParseConfig(connURL("/var/lib/space dir/run", "space"))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "/var/lib/space dir/run" || cfg.Port != 5432 || cfg.Database != "space" || cfg.User != "space" {
		t.Errorf("parsed %s:%d db=%s user=%s", cfg.Host, cfg.Port, cfg.Database, cfg.User)
	}
}

func TestFindBinaries(t *testing.T) {
	root := t.TempDir()
	mk := func(version string) string {
		d := filepath.Join(root, version, "bin")
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, n := range []string{"initdb", "postgres", "pg_ctl"} {
			if err := os.WriteFile(filepath.Join(d, n), nil, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	t.Setenv("PATH", t.TempDir()) // nothing on PATH
	if _, err := findBinaries("", root, ""); !errors.Is(err, errNoBinaries) || !strings.Contains(err.Error(), "postgresql-15") {
		t.Fatalf("empty: err = %v", err)
	}
	mk("9.6")
	v15 := mk("15")
	mk("10")
	if err := os.MkdirAll(filepath.Join(root, "99", "bin"), 0o755); err != nil { // no binaries in it
		t.Fatal(err)
	}
	v16 := mk("16")

	b, err := findBinaries("", root, "")
	if err != nil || b.dir != v16 {
		t.Errorf("highest: got %q, %v; want %s", b.dir, err, v16)
	}

	data := t.TempDir()
	if err := os.WriteFile(filepath.Join(data, "PG_VERSION"), []byte("15\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := findBinaries("", root, data); err != nil || b.dir != v15 {
		t.Errorf("existing cluster: got %q, %v; want %s", b.dir, err, v15)
	}
	if b, err := findBinaries(v15, root, ""); err != nil || b.dir != v15 {
		t.Errorf("BinDir: got %q, %v", b.dir, err)
	}
	if _, err := findBinaries(t.TempDir(), root, ""); err == nil {
		t.Error("BinDir without binaries: no error")
	}
	onPath := filepath.Join(root, "onpath", "bin")
	if err := os.MkdirAll(onPath, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"initdb", "postgres"} {
		if err := os.WriteFile(filepath.Join(onPath, n), nil, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", onPath)
	if b, err := findBinaries("", root, ""); err != nil || b.dir != onPath {
		t.Errorf("PATH: got %q, %v; want %s", b.dir, err, onPath)
	}
}

func TestMakeTraversable(t *testing.T) {
	base := t.TempDir()
	closed := filepath.Join(base, "closed")
	dir := filepath.Join(closed, "inner", "pg")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	undo, err := makeTraversable(dir, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{closed, filepath.Dir(dir)} {
		fi, _ := os.Stat(p)
		if fi.Mode().Perm() != 0o701 {
			t.Errorf("%s: mode %o, want 701 (search only)", p, fi.Mode().Perm())
		}
	}
	undo()
	for _, p := range []string{closed, filepath.Dir(dir)} {
		fi, _ := os.Stat(p)
		if fi.Mode().Perm() != 0o700 {
			t.Errorf("%s after undo: mode %o", p, fi.Mode().Perm())
		}
	}
}

// Supervise brings the cluster back after its postmaster is killed, with the data, and
// Stop ends the supervision.
func TestSuperviseRestartsAfterKill9(t *testing.T) {
	requirePostgres(t)
	dir := filepath.Join(t.TempDir(), "pg")
	s := start(t, dir)
	conn := connect(t, s)
	exec1(t, conn, "CREATE TABLE t (v int)")
	exec1(t, conn, "INSERT INTO t VALUES (7)")
	conn.Close(context.Background())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Supervise(ctx) }()
	for round := range 2 {
		old := s.PID()
		if err := syscall.Kill(old, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		if err := waitFor(context.Background(), 60*time.Second, func() bool { return s.PID() != old && alive(s.PID()) }); err != nil {
			t.Fatalf("round %d: not restarted after kill -9", round)
		}
		c := connect(t, s)
		if v := queryString(t, c, "SELECT v::text FROM t"); v != "7" {
			t.Errorf("round %d: committed row after restart: %q", round, v)
		}
		c.Close(context.Background())
	}
	if err := s.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Supervise did not end after Stop")
	}
	cancel()
	requireStopped(t, s)
}
