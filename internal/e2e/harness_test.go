// Package e2e tests space end to end: the real space binary (all roles in one process)
// against a real PostgreSQL, a real btrfs store and real gVisor sandboxes, driven over
// HTTP by the Go client and the CLI. The harness is package e2etest.
package e2e

import (
	"bytes"
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/e2e/e2etest"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// options configure a test server.
type options = e2etest.Options

// srv is a space serve process under test; the tests add their own helpers to it.
type srv struct{ *e2etest.Server }

func requireHost(t testing.TB) { e2etest.RequireHost(t) }

func freeAddr(t testing.TB) string { return e2etest.FreeAddr(t) }

// start starts space serve on a fresh data directory.
func start(t testing.TB, o options) *srv { return &srv{e2etest.Start(t, o)} }

// startWith is start with a hook that prepares the data directory first.
func startWith(t testing.TB, o options, prepare func(dataDir string)) *srv {
	return &srv{e2etest.StartWith(t, o, prepare)}
}

func (s *srv) runscIDs() []string { return s.RunscIDs() }

// create makes a sandbox and waits until it runs.
func (s *srv) create(t testing.TB, req api.CreateSandboxRequest) *api.Sandbox {
	t.Helper()
	return s.Create(t, req)
}

// exec runs argv and returns stdout, stderr and the exit code.
func (s *srv) exec(t testing.TB, id string, argv ...string) (string, string, int) {
	t.Helper()
	return s.Exec(t, id, argv...)
}

// cli runs the space CLI against the server.
func (s *srv) cli(t testing.TB, args ...string) (string, string, int) {
	t.Helper()
	return s.CLI(t, args...)
}

func ctx(t testing.TB, d time.Duration) context.Context { return e2etest.Ctx(t, d) }

func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	e2etest.WaitFor(t, d, what, cond)
}

func discard() *slog.Logger { return e2etest.Discard() }

// lockedWriter is a bytes.Buffer safe for concurrent writes.
type lockedWriter struct {
	mu sync.Mutex
	b  *bytes.Buffer
}

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *lockedWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}
