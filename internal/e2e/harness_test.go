// Package e2e tests space end to end: the real space binary (all roles in one process)
// against a real PostgreSQL, a real btrfs store and real gVisor sandboxes, driven over
// HTTP by the Go client and the CLI.
package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/runtime/gvisor"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// options configure a test server.
type options struct {
	// embedded runs the server's own private PostgreSQL instead of a test database.
	embedded bool
	// noBase leaves the store without the base template (the server builds it).
	noBase bool
	// builtins are other builtin templates to put in the store (code-interpreter-v1).
	builtins []string
	args     []string
	// failpoints runs a -tags failpoints build (crash points act on env).
	failpoints bool
	// env is extra environment of the server process (kept across restarts unless
	// changed with setEnv).
	env []string
	// dbURL shares a database with another server (a fleet).
	dbURL string
}

// srv is a space serve process under test.
type srv struct {
	t       testing.TB
	bin     string
	dataDir string
	dbURL   string
	addr    string
	URL     string
	Key     string
	C       *client.Client
	opts    options

	mu   sync.Mutex
	cmd  *exec.Cmd
	log  *bytes.Buffer
	done chan struct{}
}

func requireHost(t testing.TB) {
	testenv.RequireRoot(t)
	testenv.RequireBinary(t, gvisor.DefaultRunscPath, "scripts/setup.sh builds it")
	templatetest.RequireStore(t)
}

func freeAddr(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// start starts space serve on a fresh data directory.
func start(t testing.TB, o options) *srv { return startWith(t, o, nil) }

// startWith is start with a hook that prepares the data directory first.
func startWith(t testing.TB, o options, prepare func(dataDir string)) *srv {
	requireHost(t)
	bin, _ := testenv.Binaries(t)
	if o.failpoints {
		bin, _ = testenv.FailpointBinaries(t)
	}
	dataDir := t.TempDir()
	s := &srv{t: t, bin: bin, dataDir: dataDir, addr: freeAddr(t), opts: o}
	if o.dbURL != "" {
		s.dbURL = o.dbURL
	} else if !o.embedded {
		s.dbURL = testenv.Postgres(t)
	}
	t.Cleanup(s.cleanup)
	if prepare != nil {
		prepare(dataDir)
	}
	if !o.noBase {
		st, err := storage.Open(context.Background(), storage.Config{DataDir: dataDir, ImageSizeBytes: 16 << 30})
		if err != nil {
			t.Fatal(err)
		}
		templatetest.Base(t, st)
		for _, name := range o.builtins {
			templatetest.Builtin(t, st, name)
		}
		st.Close()
	}
	s.URL = "http://" + s.addr
	s.launch()
	if b, err := os.ReadFile(filepath.Join(dataDir, "admin.key")); err == nil {
		s.Key = strings.TrimSpace(string(b))
	}
	s.C = client.New(s.URL, s.Key)
	return s
}

// launch starts the process and waits for /healthz.
func (s *srv) launch() {
	s.t.Helper()
	// Sandbox networking stays off unless a test turns it on (with a fake internet as
	// the host: network_test.go): the machine's own namespace is never touched.
	args := []string{"serve", "--data-dir", s.dataDir, "--listen", s.addr, "--store-size", "17179869184", "--network", "off"}
	if s.dbURL != "" {
		args = append(args, "--database-url", s.dbURL)
	}
	args = append(args, s.opts.args...)
	cmd := exec.Command(s.bin, args...)
	cmd.Env = append(os.Environ(), s.opts.env...)
	log := &bytes.Buffer{}
	w := &lockedWriter{b: log}
	cmd.Stdout, cmd.Stderr = w, w
	if os.Getenv("SPACE_TEST_VERBOSE") != "" {
		cmd.Stderr = os.Stderr
	}
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	s.mu.Lock()
	s.cmd, s.log, s.done = cmd, log, done
	s.mu.Unlock()
	deadline := time.Now().Add(90 * time.Second)
	for {
		resp, err := http.Get(s.URL + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		select {
		case <-done:
			s.t.Fatalf("space serve exited during start-up:\n%s", w.String())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("space serve did not become healthy:\n%s", w.String())
		}
	}
}

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

// Log returns the server's output so far.
func (s *srv) Log() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.log == nil {
		return ""
	}
	return s.log.String()
}

func (s *srv) signal(sig syscall.Signal) {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		s.t.Errorf("space serve did not stop after %v", sig)
	}
}

// Kill kills the server with SIGKILL (its sandboxes and, when embedded, its
// PostgreSQL keep running).
func (s *srv) Kill() { s.signal(syscall.SIGKILL) }

// Stop stops the server with SIGTERM.
func (s *srv) Stop() { s.signal(syscall.SIGTERM) }

// Restart starts the server again on the same data directory.
func (s *srv) Restart() { s.launch() }

// RunscRoot is where the server's runsc keeps its state.
func (s *srv) RunscRoot() string {
	sum := sha256.Sum256([]byte(s.dataDir))
	return filepath.Join("/run/space", "runsc-"+hex.EncodeToString(sum[:6]))
}

// runscIDs lists the runsc containers of this server.
func (s *srv) runscIDs() []string {
	out, err := exec.Command(gvisor.DefaultRunscPath, "--root", s.RunscRoot(), "list", "-format=json").Output()
	if err != nil {
		return nil
	}
	var list []struct {
		ID string `json:"id"`
	}
	_ = json.Unmarshal(out, &list)
	var ids []string
	for _, c := range list {
		ids = append(ids, c.ID)
	}
	return ids
}

func (s *srv) cleanup() {
	s.Stop()
	// The gVisor runtime's Destroy also removes what it mounts for a sandbox (run dir,
	// log, id-mapped views), which killing the runsc container would leave behind.
	if len(s.runscIDs()) > 0 {
		if rt, err := gvisor.New(gvisor.Config{RootDir: s.RunscRoot()}); err == nil {
			dctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			if list, err := rt.List(dctx); err == nil {
				for _, in := range list {
					_ = rt.Destroy(dctx, in.ID)
				}
			}
			cancel()
			rt.Close()
		}
	}
	// runsc pins an empty network namespace for its gofers in its root dir (a mount).
	_ = syscall.Unmount(filepath.Join(s.RunscRoot(), "null-netns"), syscall.MNT_DETACH)
	if s.opts.embedded {
		// A killed server may leave its PostgreSQL running: stop it.
		if b, err := os.ReadFile(filepath.Join(s.dataDir, "postgres", "data", "postmaster.pid")); err == nil {
			var pid int
			fmt.Sscanf(string(b), "%d", &pid)
			if pid > 0 {
				_ = syscall.Kill(pid, syscall.SIGQUIT)
			}
		}
	}
	_ = os.RemoveAll(s.RunscRoot())
	_ = os.RemoveAll(strings.Replace(s.RunscRoot(), "/runsc-", "/qemu-", 1))
	store := filepath.Join(s.dataDir, "store")
	for i := 0; i < 50; i++ {
		if err := syscall.Unmount(store, 0); err == nil || err == syscall.EINVAL || err == syscall.ENOENT {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if s.t.Failed() {
		s.t.Logf("space serve log:\n%s", s.Log())
	}
}

// ctx returns a context bounded by a deadline for one test step.
func ctx(t testing.TB, d time.Duration) context.Context {
	c, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return c
}

// create makes a sandbox and waits until it runs.
func (s *srv) create(t testing.TB, req api.CreateSandboxRequest) *api.Sandbox {
	t.Helper()
	sb, err := s.C.CreateAndWait(ctx(t, 3*time.Minute), req)
	if err != nil {
		t.Fatalf("create sandbox: %v\n%s", err, s.Log())
	}
	return sb
}

// exec runs argv and returns stdout, stderr and the exit code.
func (s *srv) exec(t testing.TB, id string, argv ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code, err := s.C.Exec(ctx(t, 2*time.Minute), id, api.CreateSessionRequest{Argv: argv}, client.Output{Stdout: &out, Stderr: &errb})
	if err != nil {
		t.Fatalf("exec %v: %v", argv, err)
	}
	return out.String(), errb.String(), code
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// cli runs the space CLI against the server.
func (s *srv) cli(t testing.TB, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.CommandContext(ctx(t, 3*time.Minute), s.bin, args...)
	cmd.Env = append(os.Environ(), "SPACE_URL="+s.URL, "SPACE_DATA_DIR="+s.dataDir, "SPACE_API_KEY=")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run space %v: %v", args, err)
	}
	return out.String(), errb.String(), code
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }
