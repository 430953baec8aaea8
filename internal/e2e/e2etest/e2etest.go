// Package e2etest is the harness of space's end-to-end tests: it starts the real space
// binary (`space serve`, all roles in one process unless told otherwise) on a fresh data
// directory against a real PostgreSQL and a real btrfs store with gVisor sandboxes,
// gives a Go client for it, kills and restarts it, and keeps its log. The end-to-end
// tests (internal/e2e) and the adversarial suite (internal/adversary) use it. A test
// binary that uses it calls testenv.Main from its TestMain.
package e2etest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/procfs"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/runtime/gvisor"
	"github.com/spacedev/space/internal/runtime/instances"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

// Options configure a test server.
type Options struct {
	// Embedded runs the server's own private PostgreSQL instead of a test database.
	Embedded bool
	// NoBase leaves the store without the base template (the server builds it).
	NoBase bool
	// Builtins are other builtin templates to put in the store (code-interpreter-v1).
	Builtins []string
	// Args are extra arguments of `space serve`.
	Args []string
	// Failpoints runs a -tags failpoints build (its crash points are configured by Env,
	// internal/crash).
	Failpoints bool
	// OtherAgent runs the server with the agent of another build
	// (testenv.OtherAgentBinaries): a node of another space release, to its sandboxes.
	OtherAgent bool
	// Env is extra environment of the server process (kept across restarts).
	Env []string
	// DBURL shares a database with another server (a fleet).
	DBURL string
	// Umask, when set (e.g. "077"), is the umask the server process inherits.
	Umask string
	// Addr is the --listen address of the first start ("": a free one). Should it be
	// taken, the server starts on another (the harness's own tests use that).
	Addr string
	// Socket: the test binds the --listen address and passes the socket to every start
	// of the server as systemd's socket activation does (LISTEN_FDS, named "listen"),
	// so that it outlives the server's restarts.
	Socket bool
}

// Server is a space serve process under test.
type Server struct {
	t       testing.TB
	Bin     string // the space binary
	DataDir string // --data-dir
	DBURL   string // its database ("" when embedded)
	Addr    string // host:port it listens on
	URL     string
	Key     string // the admin key
	C       *client.Client

	mu   sync.Mutex
	opts Options
	cmd  *exec.Cmd
	log  *lockedWriter
	done chan struct{}
	sock *os.File // the socket passed to the server (Options.Socket)
}

// RequireHost skips the test unless it runs as root with runsc and a store the base
// template can be put into.
func RequireHost(t testing.TB) {
	testenv.RequireRoot(t)
	testenv.RequireBinary(t, gvisor.DefaultRunscPath, "scripts/setup.sh builds it")
	templatetest.RequireStore(t)
}

// FreeAddr returns a loopback address with a port free at the time of the call, one
// that no outgoing connection takes meanwhile (testenv.FreeAddr).
func FreeAddr(t testing.TB) string { return testenv.FreeAddr(t) }

// storeSize is the size of the servers' store images.
const storeSize = 16 << 30

// Start starts space serve on a fresh data directory. Everything it made is undone
// when t ends (the server stopped, its sandboxes destroyed, its mounts removed).
func Start(t testing.TB, o Options) *Server { return StartWith(t, o, nil) }

// StartWith is Start with a hook that prepares the data directory first.
func StartWith(t testing.TB, o Options, prepare func(dataDir string)) *Server {
	RequireHost(t)
	bin, _ := testenv.Binaries(t)
	switch {
	case o.Failpoints && o.OtherAgent:
		t.Fatal("e2etest: Failpoints and OtherAgent are not built together")
	case o.Failpoints:
		bin, _ = testenv.FailpointBinaries(t)
	case o.OtherAgent:
		bin, _ = testenv.OtherAgentBinaries(t)
	}
	dataDir := t.TempDir()
	s := &Server{t: t, Bin: bin, DataDir: dataDir, Addr: o.Addr, opts: o}
	if s.Addr == "" {
		s.Addr = FreeAddr(t)
	}
	if o.DBURL != "" {
		s.DBURL = o.DBURL
	} else if !o.Embedded {
		s.DBURL = testenv.Postgres(t)
	}
	t.Cleanup(s.cleanup)
	if prepare != nil {
		prepare(dataDir)
	}
	if !o.NoBase {
		templatetest.SeedStore(t, dataDir, storeSize, o.Builtins...)
	}
	// FreeAddr's port was free when it was picked; a server of a test running beside
	// this one may take it before serve binds it (seen once in CI). The first start
	// then picks another; a restart keeps its address, which the clients know.
	for attempt := 1; ; attempt++ {
		s.URL = "http://" + s.Addr
		if s.launch(attempt < 3) {
			break
		}
		t.Logf("e2etest: %s was taken before space serve bound it; trying another address", s.Addr)
		s.Addr = FreeAddr(t)
	}
	if b, err := os.ReadFile(filepath.Join(dataDir, "admin.key")); err == nil {
		s.Key = strings.TrimSpace(string(b))
	}
	s.C = client.New(s.URL, s.Key)
	return s
}

// socket returns the socket passed to the server (Options.Socket), bound at s.Addr on
// first use: nil (orTaken) or a failure if that address is taken.
func (s *Server) socket(orTaken bool) *os.File {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sock != nil {
		return s.sock
	}
	ln, err := net.Listen("tcp", s.Addr)
	if err != nil {
		if orTaken {
			return nil
		}
		s.t.Fatal(err)
	}
	f, err := ln.(*net.TCPListener).File()
	ln.Close() // f is a socket of its own, still listening
	if err != nil {
		s.t.Fatal(err)
	}
	s.sock = f
	return f
}

// launch starts the process and waits for /healthz. With orTaken, a process that
// exits at start-up because its --listen address is taken is not a failure: launch
// reports false instead.
func (s *Server) launch(orTaken bool) bool {
	s.t.Helper()
	// Sandbox networking stays off unless a test turns it on (with a fake internet as
	// the host: internal/e2e/network_test.go): the machine's own namespace is never
	// touched.
	args := []string{"serve", "--data-dir", s.DataDir, "--listen", s.Addr, "--store-size", strconv.FormatInt(storeSize, 10), "--network", "off"}
	if s.DBURL != "" {
		args = append(args, "--database-url", s.DBURL)
	}
	s.mu.Lock()
	o := s.opts
	s.mu.Unlock()
	if !slices.Contains(o.Args, "--e2b-listen") {
		// Its default address is shared by every server on the host: a taken
		// listener stops serve.
		args = append(args, "--e2b-listen", "")
	}
	args = append(args, o.Args...)
	cmd := exec.Command(s.Bin, args...)
	if o.Umask != "" {
		// A shell sets it and becomes the server (same pid).
		cmd = exec.Command("/bin/sh", append([]string{"-c", `umask "$0" && exec "$@"`, o.Umask, s.Bin}, args...)...)
	}
	cmd.Env = append(os.Environ(), o.Env...)
	if o.Socket {
		// A shell says its pid, which the server keeps (socket activation passes the
		// sockets to that pid only).
		cmd = exec.Command("/bin/sh", append([]string{"-c", `export LISTEN_PID=$$ && exec "$@"`, "sh", s.Bin}, args...)...)
		cmd.Env = append(os.Environ(), append(o.Env, "LISTEN_FDS=1", "LISTEN_FDNAMES=listen")...)
		cmd.ExtraFiles = []*os.File{s.socket(orTaken)} // fd 3
		if cmd.ExtraFiles[0] == nil {
			return false
		}
	}
	w := &lockedWriter{b: &bytes.Buffer{}}
	cmd.Stdout, cmd.Stderr = w, w
	if os.Getenv("SPACE_TEST_VERBOSE") != "" {
		cmd.Stderr = io.MultiWriter(os.Stderr, w)
	}
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	s.mu.Lock()
	s.cmd, s.log, s.done = cmd, w, done
	s.mu.Unlock()
	deadline := time.Now().Add(90 * time.Second)
	// Healthy is this process's answer: one that has logged binding the address holds
	// it (another test's server that holds the port would answer too, while this one
	// fails to bind it and exits).
	serving := `msg="space is serving" listen=` + s.Addr
	for {
		resp, err := http.Get(s.URL + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 && strings.Contains(w.String(), serving) {
				return true
			}
		}
		select {
		case <-done:
			if orTaken && strings.Contains(w.String(), "--listen "+s.Addr+": the address is taken") {
				return false
			}
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

// Log returns the output of the server's current (or last) process so far.
func (s *Server) Log() string {
	s.mu.Lock()
	w := s.log
	s.mu.Unlock()
	if w == nil {
		return ""
	}
	return w.String()
}

// Pid returns the pid of the running server process (0 when none runs).
func (s *Server) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return 0
	}
	return s.cmd.Process.Pid
}

// WaitExit waits up to d for the server process to exit by itself (e.g. at a crash
// point) and forgets it, so that Restart can start another. It reports whether the
// process exited in time; when it did not, the process is left running.
func (s *Server) WaitExit(d time.Duration) bool {
	s.mu.Lock()
	done := s.done
	s.mu.Unlock()
	if done == nil {
		return true
	}
	select {
	case <-done:
	case <-time.After(d):
		return false
	}
	s.mu.Lock()
	s.cmd = nil
	s.mu.Unlock()
	return true
}

func (s *Server) signal(sig syscall.Signal) {
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
func (s *Server) Kill() { s.signal(syscall.SIGKILL) }

// Stop stops the server with SIGTERM.
func (s *Server) Stop() { s.signal(syscall.SIGTERM) }

// Restart starts the server again on the same data directory.
func (s *Server) Restart() { s.launch(false) }

// HostDown simulates the host going down under the server; Restart then starts the
// server on the host come back up. Everything that does not outlive a host goes as it
// would: the server, its
// PostgreSQL when embedded (the postmaster and every backend) and every runsc process
// of its sandboxes are killed; the host state they leave is removed (every mount under
// the data dir and the runsc root, the store's loop mount among them; the sandboxes'
// host cgroups; the runsc root, which is on tmpfs). The data dir's files stay, as on a
// disk. The kernel's boot id cannot change, so what a reboot does to a checkpoint that
// was written but not yet made durable is done to the checkpoints: their "written"
// mark names another boot. A test that wants a checkpoint caught before its sync
// passes its directory in notDurable: its "complete" mark is removed as well. Host
// state the server made outside its data dir and runsc root (sandbox network
// namespaces and rules) is the test's to remove.
func (s *Server) HostDown(notDurable ...string) {
	s.t.Helper()
	ids := s.RunscIDs()
	s.Kill()
	s.KillPostgres()
	root := s.RunscRoot()
	runsc := instances.Scan(func(argv []string) bool {
		for i, a := range argv {
			if a == "--root="+root || a == "--root" && i+1 < len(argv) && argv[i+1] == root {
				return true
			}
		}
		return false
	})
	for _, pid := range runsc {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	waitGone(s.t, runsc)
	s.killVMs()
	// What the host's page cache held but no sync wrote is gone with the boot.
	marks, _ := filepath.Glob(filepath.Join(s.DataDir, "store", "sandboxes", "*", "*", "written"))
	more, _ := filepath.Glob(filepath.Join(s.DataDir, "store", "sandboxes", "*", "*", "*", "written")) // clone batches
	for _, m := range append(marks, more...) {
		if err := os.WriteFile(m, []byte("00000000-0000-0000-0000-000000000000\n"), 0o600); err != nil {
			s.t.Fatalf("e2etest: reboot: %v", err)
		}
	}
	for _, dir := range notDurable {
		if err := os.Remove(filepath.Join(dir, "complete")); err != nil && !os.IsNotExist(err) {
			s.t.Fatalf("e2etest: reboot: %v", err)
		}
	}
	mounts, err := procfs.GetMounts()
	if err != nil {
		s.t.Fatalf("e2etest: reboot: %v", err)
	}
	var points []string
	for _, m := range mounts {
		if strings.HasPrefix(m.MountPoint, s.DataDir+"/") || strings.HasPrefix(m.MountPoint, root+"/") {
			points = append(points, m.MountPoint)
		}
	}
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) }) // deepest first
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && err != syscall.EINVAL && err != syscall.ENOENT {
			s.t.Fatalf("e2etest: reboot: unmount %s: %v", p, err)
		}
	}
	for _, m := range mounts { // the cgroup hierarchies, as listed before the unmounts
		if m.FSType != "cgroup" && m.FSType != "cgroup2" {
			continue
		}
		for _, id := range ids {
			if err := os.Remove(filepath.Join(m.MountPoint, gvisor.DefaultCgroupParent, id)); err != nil && !os.IsNotExist(err) {
				s.t.Fatalf("e2etest: reboot: %v", err)
			}
		}
	}
	if err := os.RemoveAll(root); err != nil {
		s.t.Fatalf("e2etest: reboot: %v", err)
	}
	_ = os.RemoveAll(strings.Replace(root, "/runsc-", "/qemu-", 1))
}

// KillPostgres kills the server's embedded PostgreSQL (the postmaster and every
// backend) with SIGKILL and returns once they are gone, as a crash of it would; the
// server, when it runs, starts it again (after about half a second). It does nothing
// for a server on a test database.
func (s *Server) KillPostgres() {
	if !s.opts.Embedded {
		return
	}
	if pid, err := s.postmaster(); err == nil && pid > 1 {
		killTree(pid)
	}
}

// postmaster returns the pid the embedded PostgreSQL's postmaster.pid names.
func (s *Server) postmaster() (int, error) {
	b, err := os.ReadFile(filepath.Join(s.DataDir, "postgres", "data", "postmaster.pid"))
	if err != nil {
		return 0, err
	}
	first, _, _ := strings.Cut(string(b), "\n")
	return strconv.Atoi(strings.TrimSpace(first))
}

// PostgresAway takes the embedded PostgreSQL away until back is called, for longer
// than its supervisor would let a kill last: its socket is moved aside (new
// connections find nothing there) and one of its processes is killed, so that
// PostgreSQL ends every session (a crash restart; the postmaster stays). back puts
// the socket back; calling it again does nothing.
func (s *Server) PostgresAway(t testing.TB) (back func()) {
	t.Helper()
	if !s.opts.Embedded {
		t.Fatal("PostgresAway needs the embedded PostgreSQL")
	}
	socks, err := filepath.Glob(filepath.Join(s.DataDir, "postgres", "run", ".s.PGSQL.*[0-9]"))
	if err != nil || len(socks) != 1 {
		t.Fatalf("embedded PostgreSQL's socket: %v %v", socks, err)
	}
	sock := socks[0]
	if err := os.Rename(sock, sock+".away"); err != nil {
		t.Fatal(err)
	}
	postmaster, err := s.postmaster()
	if err != nil {
		t.Fatal(err)
	}
	procs, err := procfs.AllProcs()
	if err != nil {
		t.Fatal(err)
	}
	var children []int
	for _, p := range procs {
		if st, err := p.Stat(); err == nil && st.PPID == postmaster {
			children = append(children, p.PID)
		}
	}
	if len(children) == 0 || syscall.Kill(children[0], syscall.SIGKILL) != nil {
		t.Fatalf("no process of PostgreSQL (postmaster %d) to kill: %v", postmaster, children)
	}
	waitGone(t, children) // the postmaster ends the others, the sessions among them
	return sync.OnceFunc(func() {
		if err := os.Rename(sock+".away", sock); err != nil {
			t.Error(err)
		}
	})
}

// killTree kills pid and its children with SIGKILL, as a host going down would.
func killTree(pid int) {
	pids := []int{pid}
	if procs, err := procfs.AllProcs(); err == nil {
		for _, p := range procs {
			if st, err := p.Stat(); err == nil && st.PPID == pid {
				pids = append(pids, p.PID)
			}
		}
	}
	for _, p := range pids {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
	waitGone(nil, pids)
}

// waitGone waits up to 10 s until the processes pids have exited; t (when not nil)
// fails if one has not.
func waitGone(t testing.TB, pids []int) {
	for end := time.Now().Add(10 * time.Second); len(pids) > 0; {
		pids = slices.DeleteFunc(pids, func(pid int) bool {
			p, err := instances.ReadProc(pid)
			return err != nil || !p.Live()
		})
		if len(pids) > 0 && time.Now().After(end) {
			if t != nil {
				t.Fatalf("e2etest: processes %v outlived SIGKILL", pids)
			}
			return
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
}

// RunscRoot is where the server's runsc keeps its state.
func (s *Server) RunscRoot() string {
	sum := sha256.Sum256([]byte(s.DataDir))
	return filepath.Join("/run/space", "runsc-"+hex.EncodeToString(sum[:6]))
}

// RunscIDs lists the runsc containers of this server.
func (s *Server) RunscIDs() []string {
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

// killVMs kills the QEMU processes that hold files under the server's data dir and
// waits (up to 10 s) until they are gone.
func (s *Server) killVMs() {
	vms := instances.Scan(func(argv []string) bool {
		return len(argv) > 0 && strings.HasPrefix(filepath.Base(argv[0]), "qemu-system-")
	})
	var killed []int
	for _, pid := range vms {
		fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		for _, fd := range fds {
			if target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil && strings.HasPrefix(target, s.DataDir+"/") {
				if syscall.Kill(pid, syscall.SIGKILL) == nil {
					killed = append(killed, pid)
				}
				break
			}
		}
	}
	for end := time.Now().Add(10 * time.Second); len(killed) > 0 && time.Now().Before(end); {
		killed = slices.DeleteFunc(killed, func(pid int) bool {
			p, err := instances.ReadProc(pid)
			return err != nil || !p.Live()
		})
		time.Sleep(50 * time.Millisecond) // poll interval
	}
}

func (s *Server) cleanup() {
	s.Stop()
	if s.sock != nil {
		s.sock.Close()
	}
	// The gVisor runtime's Destroy also removes what it mounts for a sandbox (run dir,
	// log, id-mapped views), which killing the runsc container would leave behind.
	if len(s.RunscIDs()) > 0 {
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
	_ = gvisor.UnpinNullNetNS(s.RunscRoot())
	// A stopped server leaves its sandboxes running (a restart adopts them); a test
	// that failed before deleting its QEMU sandboxes leaves their VMs, which hold the
	// store busy. Kill those holding files of this server's data dir.
	s.killVMs()
	if s.opts.Embedded {
		// A killed server may leave its PostgreSQL running: stop it.
		if pid, err := s.postmaster(); err == nil && pid > 0 {
			_ = syscall.Kill(pid, syscall.SIGQUIT)
		}
	}
	_ = os.RemoveAll(s.RunscRoot())
	_ = os.RemoveAll(strings.Replace(s.RunscRoot(), "/runsc-", "/qemu-", 1))
	store := filepath.Join(s.DataDir, "store")
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

// Ctx returns a context bounded by a deadline for one test step, cancelled when t ends.
func Ctx(t testing.TB, d time.Duration) context.Context {
	c, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return c
}

// Create makes a sandbox and waits until it runs.
func (s *Server) Create(t testing.TB, req api.CreateSandboxRequest) *api.Sandbox {
	t.Helper()
	sb, err := s.C.CreateAndWait(Ctx(t, 3*time.Minute), req)
	if err != nil {
		t.Fatalf("create sandbox: %v\n%s", err, s.Log())
	}
	return sb
}

// Exec runs argv in sandbox id (as root) and returns stdout, stderr and the exit code.
func (s *Server) Exec(t testing.TB, id string, argv ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code, err := s.C.Exec(Ctx(t, 2*time.Minute), id, api.CreateSessionRequest{Argv: argv}, client.Output{Stdout: &out, Stderr: &errb})
	if err != nil {
		t.Fatalf("exec %v: %v", argv, err)
	}
	return out.String(), errb.String(), code
}

// WaitFor polls cond until it holds or the deadline passes (then the test fails).
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	start := time.Now()
	deadline := start.Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if took := time.Since(start); took > time.Second {
		t.Logf("waited %.1fs for %s", took.Seconds(), what) // where a slow test's time goes (-v)
	}
}

// CLI runs the space CLI against the server.
func (s *Server) CLI(t testing.TB, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.CommandContext(Ctx(t, 3*time.Minute), s.Bin, args...)
	cmd.Env = append(os.Environ(), "SPACE_URL="+s.URL, "SPACE_DATA_DIR="+s.DataDir, "SPACE_API_KEY=")
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

// Discard is a logger that drops everything.
func Discard() *slog.Logger { return slog.New(slog.DiscardHandler) }
