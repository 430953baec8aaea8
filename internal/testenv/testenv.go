// Package testenv owns what tests across space share within one test binary: a private
// PostgreSQL cluster handing out throwaway databases, the space and space-agent binaries
// built once, and skip helpers. A package that uses Postgres or Binaries calls Main from
// its TestMain, which tears that shared state down when the tests end:
//
//	func TestMain(m *testing.M) { testenv.Main(m, agent.MaybeRunGate) }
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/internal/pgmanaged"
)

// DatabaseURLEnv names the variable that points Postgres at an existing server (any
// PostgreSQL 13+, superuser or a role with CREATEDB) instead of a private cluster.
const DatabaseURLEnv = "SPACE_TEST_DATABASE_URL"

const (
	clusterPrefix = "space-testpg-"  // + owner pid + "-" + random
	binPrefix     = "space-testbin-" // same
)

// env is what one test binary shares. It is the package's one mutable package-level
// variable: tests call Postgres and Binaries without a handle, and what they share is
// per test binary by definition.
var env state

type state struct {
	mu      sync.Mutex
	inMain  bool
	logger  *slog.Logger
	started bool // the cluster start was attempted (once: a failure is not retried)
	pgDir   string
	pg      *pgmanaged.Server
	adminDB string // URL of a database to issue CREATE/DROP DATABASE from
	pgErr   error

	// builds of the two commands, each made on first need (a failure is not retried).
	builds map[flavor]*built
}

// flavor is a build of the two commands: its build tags and the agent's -gcflags.
type flavor struct{ tags, agentGC string }

// The flavors the tests use.
var (
	plainBuild      = flavor{}
	failpointsBuild = flavor{tags: "failpoints"}
	// otherAgentBuild's agent is compiled without optimizations, so that its code
	// differs as another space release's does.
	otherAgentBuild = flavor{agentGC: "all=-N -l"}
)

// built is a flavor's directory of binaries, or why it could not be built.
type built struct {
	dir string
	err error
}

// Main runs the before hooks (e.g. a re-exec gate that turns the test binary into
// another program and never returns), sweeps what killed earlier test binaries left
// behind, runs the tests, stops what testenv started, and exits with the tests' code.
func Main(m *testing.M, before ...func()) {
	for _, f := range before {
		f()
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	env.mu.Lock()
	env.inMain = true
	env.logger = logger
	env.mu.Unlock()
	sweepStale(logger)

	code := m.Run()

	if err := env.teardown(); err != nil {
		fmt.Fprintf(os.Stderr, "testenv: teardown: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

func (s *state) teardown() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	if s.pg != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		errs = append(errs, s.pg.Stop(ctx))
		cancel()
		s.pg = nil
	}
	if s.pgDir != "" {
		errs = append(errs, os.RemoveAll(s.pgDir))
		s.pgDir = ""
	}
	for f, b := range s.builds {
		if b.dir != "" {
			errs = append(errs, os.RemoveAll(b.dir))
		}
		delete(s.builds, f)
	}
	return errors.Join(errs...)
}

func requireMain(t testing.TB, what string) {
	t.Helper()
	env.mu.Lock()
	ok := env.inMain
	env.mu.Unlock()
	if !ok {
		t.Fatalf("testenv.%s needs testenv.Main called from TestMain (it cleans up at exit)", what)
	}
}

// Postgres returns the URL of a new, empty database that is dropped when t ends. The
// database lives on a private cluster that testenv starts (once per test binary, in a
// temporary directory) or, when SPACE_TEST_DATABASE_URL is set, on that server.
func Postgres(t testing.TB) string {
	t.Helper()
	requireMain(t, "Postgres")
	admin, err := env.admin()
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := "t_" + randomHex(8)
	if err := adminExec(ctx, admin, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("testenv: create database: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// WITH (FORCE) terminates the connections a test left open before dropping.
		if err := adminExec(ctx, admin, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("testenv: drop database %s: %v", name, err)
		}
	})
	u, err := withDatabase(admin, name)
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	return u
}

// admin returns the administrative URL, starting the private cluster on first use.
func (s *state) admin() (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return s.adminDB, s.pgErr
	}
	s.started = true
	if u := os.Getenv(DatabaseURLEnv); u != "" {
		s.adminDB = u
		return u, nil
	}
	dir, err := os.MkdirTemp("", clusterPrefix+strconv.Itoa(os.Getpid())+"-")
	if err != nil {
		s.pgErr = fmt.Errorf("start postgres: %w", err)
		return "", s.pgErr
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := pgmanaged.Start(ctx, pgmanaged.Config{Dir: dir, Logger: s.logger})
	if err != nil {
		_ = os.RemoveAll(dir)
		s.pgErr = fmt.Errorf("start postgres (set %s to use an existing server): %w", DatabaseURLEnv, err)
		return "", s.pgErr
	}
	s.pgDir, s.pg, s.adminDB = dir, srv, srv.URL()
	return s.adminDB, nil
}

func adminExec(ctx context.Context, admin, sql string) error {
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, sql)
	return err
}

// withDatabase returns connURL, a URL or a keyword/value string, naming database db.
func withDatabase(connURL, db string) (string, error) {
	if strings.HasPrefix(connURL, "postgres://") || strings.HasPrefix(connURL, "postgresql://") {
		u, err := url.Parse(connURL)
		if err != nil {
			return "", fmt.Errorf("parse %s: %w", DatabaseURLEnv, err)
		}
		u.Path, u.RawPath = "/"+db, ""
		return u.String(), nil
	}
	// Keyword/value: a later keyword overrides an earlier one.
	return strings.TrimSpace(connURL) + " dbname=" + db, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails on Linux
	return hex.EncodeToString(b)
}

// Binaries builds ./cmd/space and ./cmd/space-agent (the agent static, CGO_ENABLED=0)
// once per test binary, side by side in a temporary directory that Main removes, and
// returns their paths.
func Binaries(t testing.TB) (spacePath, agentPath string) {
	t.Helper()
	return binariesOf(t, "Binaries", plainBuild)
}

// FailpointBinaries is Binaries built with -tags failpoints: crash points act on the
// SPACE_CRASH_* environment (internal/crash) and space serve offers --runtime fake.
func FailpointBinaries(t testing.TB) (spacePath, agentPath string) {
	t.Helper()
	return binariesOf(t, "FailpointBinaries", failpointsBuild)
}

// OtherAgentBinaries is Binaries with the agent of another build: the same source
// compiled without optimizations (-gcflags=all=-N -l), so that its code differs as
// another space release's does. A server run from them is a node of another space
// build, for tests of what crosses builds (a snapshot restored on a node whose own
// agent is another binary).
func OtherAgentBinaries(t testing.TB) (spacePath, agentPath string) {
	t.Helper()
	return binariesOf(t, "OtherAgentBinaries", otherAgentBuild)
}

// binariesOf returns the paths of flavor f's binaries, building them on first need.
func binariesOf(t testing.TB, what string, f flavor) (spacePath, agentPath string) {
	t.Helper()
	requireMain(t, what)
	dir, err := env.binaries(f)
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	return filepath.Join(dir, "space"), filepath.Join(dir, "space-agent")
}

func (s *state) binaries(f flavor) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if b, ok := s.builds[f]; ok {
		return b.dir, b.err
	}
	if s.builds == nil {
		s.builds = map[flavor]*built{}
	}
	dir, err := buildInto(f.tags, f.agentGC)
	s.builds[f] = &built{dir, err}
	return dir, err
}

// buildInto builds the two commands (with the build tags, if any; the agent with
// agentGC as its -gcflags, if set) into a new temporary directory and returns it.
func buildInto(tags, agentGC string) (string, error) {
	var out string
	err := func() error {
		wd, err := os.Getwd()
		if err != nil {
			return err
		}
		root, err := moduleRoot(wd)
		if err != nil {
			return err
		}
		dir, err := os.MkdirTemp("", binPrefix+strconv.Itoa(os.Getpid())+"-")
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		if err := build(ctx, root, dir, tags, agentGC); err != nil {
			_ = os.RemoveAll(dir)
			return err
		}
		out = dir
		return nil
	}()
	return out, err
}

// moduleRoot walks up from dir to the directory holding go.mod.
func moduleRoot(dir string) (string, error) {
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d, nil
		}
		if d == filepath.Dir(d) {
			return "", fmt.Errorf("no go.mod above %s", dir)
		}
	}
}

// build compiles the module's two commands into out (the agent with agentGC as its
// -gcflags, if set). space finds space-agent beside its own executable, hence one
// directory.
func build(ctx context.Context, root, out, tags, agentGC string) error {
	// go test puts its own toolchain first on PATH.
	goBin, err := exec.LookPath("go")
	if err != nil {
		return fmt.Errorf("build binaries: %w", err)
	}
	for _, b := range []struct{ pkg, name, cgo string }{
		{"./cmd/space-agent", "space-agent", "CGO_ENABLED=0"},
		{"./cmd/space", "space", ""},
	} {
		args := []string{"build", "-o", filepath.Join(out, b.name)}
		if tags != "" {
			args = append(args, "-tags", tags)
		}
		if agentGC != "" && b.name == "space-agent" {
			args = append(args, "-gcflags", agentGC)
		}
		cmd := exec.CommandContext(ctx, goBin, append(args, b.pkg)...)
		cmd.Dir = root
		cmd.Env = os.Environ()
		if b.cgo != "" {
			cmd.Env = append(cmd.Env, b.cgo)
		}
		if outb, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %w\n%s", b.pkg, err, outb)
		}
	}
	return nil
}

// sweepStale removes clusters and binary directories of test binaries that died
// without running their teardown (a -timeout panic, a kill), so they do not pile up.
// Directories carry their owner's pid; a live owner's are left alone.
func sweepStale(logger *slog.Logger) {
	for _, prefix := range []string{clusterPrefix, binPrefix} {
		dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), prefix+"*")) // errs only on a bad pattern
		for _, d := range dirs {
			pidStr, _, ok := strings.Cut(strings.TrimPrefix(filepath.Base(d), prefix), "-")
			pid, err := strconv.Atoi(pidStr)
			if !ok || err != nil || pid == os.Getpid() || ownerAlive(pid) {
				continue
			}
			if prefix == clusterPrefix {
				if err := stopCluster(d, logger); err != nil {
					logger.Warn("testenv: stale cluster", "dir", d, "err", err)
					continue
				}
			}
			if err := os.RemoveAll(d); err != nil {
				logger.Warn("testenv: remove stale dir", "dir", d, "err", err)
			}
		}
	}
}

func ownerAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// stopCluster stops a postmaster still running in a stale cluster directory by adopting
// it with pgmanaged (which knows how to tell it is really that cluster's) and stopping.
func stopCluster(dir string, logger *slog.Logger) error {
	if _, err := os.Stat(filepath.Join(dir, "data", "postmaster.pid")); errors.Is(err, os.ErrNotExist) {
		return nil // not running
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, err := pgmanaged.Start(ctx, pgmanaged.Config{Dir: dir, Logger: logger})
	if err != nil {
		return err
	}
	return srv.Stop(ctx)
}

// RequireRoot skips t unless the test runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root")
	}
}

// RequireBinary returns the path of the program name, looked up on PATH (or checked,
// when name is a path), and skips t with hint (e.g. which Debian package provides it)
// when it is missing.
func RequireBinary(t testing.TB, name, hint string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Skipf("skipping: %s not found (%s)", name, hint)
	}
	return p
}
