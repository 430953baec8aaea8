// Package pgmanaged owns the private PostgreSQL cluster that `space serve` runs when no
// database URL is given: finding the machine's server binaries, initializing the cluster
// on first run, running postgres (as an unprivileged account when space is root, never
// listening on TCP), adopting a postmaster left running by a space that was killed, and
// shutting it down.
//
// Layout under Config.Dir: data/ (the cluster), run/ (the unix socket; private, so local
// connections are trusted without a password), postgres.log (initdb and server output,
// appended), pgmanaged.lock (serializes concurrent Starts on one Dir).
//
// The server binaries are run directly rather than through pg_ctl: space needs the
// postmaster's pid, its process group and its output file, which pg_ctl would hide.
package pgmanaged

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

const (
	// dbName is the database Start creates and URL names.
	dbName = "space"
	// superuser is the cluster's bootstrap role, the role URL connects as. A fixed name
	// keeps URL the same whichever OS account runs postgres.
	superuser = "space"
	// port only names the socket file (.s.PGSQL.5432): nothing listens on TCP.
	port = 5432
	// maxSocketPath is sizeof(sockaddr_un.sun_path)-1 on Linux.
	maxSocketPath = 107

	readyTimeout    = 2 * time.Minute // crash recovery of a large cluster can take a while
	fastStopTimeout = 30 * time.Second
	hardStopTimeout = 10 * time.Second
)

// Config configures Start.
type Config struct {
	// Dir holds the cluster, its socket directory and its log. Created if missing.
	Dir string
	// User is the OS account that runs initdb and postgres when space runs as root
	// (PostgreSQL refuses to run as root). Empty means "postgres" (created by Debian's
	// postgresql packages) or, when that account does not exist, a system account
	// "space-postgres" without a login shell, created with useradd. Ignored when not
	// root: postgres then runs as the current user.
	User string
	// BinDir is the directory holding initdb and postgres. Empty means: the installed
	// version matching an existing cluster, else initdb on PATH, else the highest version
	// under /usr/lib/postgresql/*/bin.
	BinDir string
	// Logger receives lifecycle events. Nil discards them.
	Logger *slog.Logger
}

// Server is a running private cluster.
type Server struct {
	cfg     Config
	log     *slog.Logger
	dataDir string // real path: compared with /proc/<pid>/cwd
	runDir  string
	pid     int
	// exited is closed once our own child postmaster has been reaped; nil for an adopted
	// postmaster, which is watched through /proc instead.
	exited chan struct{}

	mu      sync.Mutex
	stopped bool
}

// Start brings up the cluster in cfg.Dir and returns once it accepts connections and
// the database "space" exists. If a postmaster left by an earlier space is still running
// on the cluster, Start adopts it (Stop will stop it). On failure nothing Start made is
// left behind: a postgres it started is stopped, a Dir it created is removed, parent
// modes it changed are restored.
func Start(ctx context.Context, cfg Config) (_ *Server, err error) {
	if cfg.Dir == "" {
		return nil, errors.New("pgmanaged: Dir is empty")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	runDir := filepath.Join(dir, "run")
	if sock := filepath.Join(runDir, ".s.PGSQL."+strconv.Itoa(port)); len(sock) > maxSocketPath {
		return nil, fmt.Errorf("pgmanaged: socket path %s is longer than %d bytes; use a shorter Dir", sock, maxSocketPath)
	}

	var undo []func()
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()

	acct, err := resolveAccount(ctx, cfg.User, log)
	if err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	created, err := mkdirAll(dir)
	if err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	if created != "" {
		undo = append(undo, func() { _ = os.RemoveAll(created) })
	}
	unlock, err := lockDir(ctx, dir)
	if err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	defer unlock()

	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	logPath := filepath.Join(dir, "postgres.log")
	logFile, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	defer logFile.Close() // children hold their own copy of the descriptor
	if acct.drop {
		restore, err := makeTraversable(dir, log)
		if err != nil {
			return nil, fmt.Errorf("pgmanaged: make %s reachable for %s: %w", dir, acct.name, err)
		}
		undo = append(undo, restore)
		for _, p := range []string{dir, runDir, logPath} {
			if err := os.Chown(p, acct.uid, acct.gid); err != nil {
				return nil, fmt.Errorf("pgmanaged: %w", err)
			}
		}
	}

	dataDir := filepath.Join(dir, "data")
	bins, err := findBinaries(cfg.BinDir, debianLibRoot, dataDir)
	if err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	if err := initCluster(ctx, bins, acct, dir, dataDir, logFile, log); err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	realData, err := filepath.EvalSymlinks(dataDir)
	if err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}

	s := &Server{cfg: cfg, log: log, dataDir: realData, runDir: runDir}
	for attempt := 0; ; attempt++ {
		pid, err := readPostmasterPID(realData)
		if err != nil {
			return nil, fmt.Errorf("pgmanaged: %w", err)
		}
		if pid != 0 && alive(pid) {
			// ok is false when /proc cannot tell (not root, another user's process):
			// then try to adopt it, connecting decides.
			if yes, ok := servesDataDir(pid, realData); yes || !ok {
				log.Info("adopting running postgres", "pid", pid, "dir", realData)
				s.pid, s.exited = pid, nil
				err := s.waitReady(ctx, logPath)
				if err == nil {
					break
				}
				if s.running() || attempt > 0 {
					return nil, fmt.Errorf("pgmanaged: adopt postgres pid %d: %w", pid, err)
				}
				continue // it was shutting down: start our own
			}
			// A reused pid (e.g. after a reboot): postgres would refuse to start while the
			// lock file names a live process, so remove it.
			log.Warn("removing postmaster.pid naming an unrelated process", "pid", pid)
			if err := os.Remove(filepath.Join(realData, "postmaster.pid")); err != nil {
				return nil, fmt.Errorf("pgmanaged: %w", err)
			}
		} else if pid != 0 {
			// A dead postmaster (killed): its lock file may still name a pid that the
			// kernel keeps as a zombie until someone reaps it, and postgres refuses to
			// start while that pid exists. The postmaster is gone: remove the file.
			log.Warn("removing the lock files of a dead postmaster", "pid", pid)
			sock := filepath.Join(runDir, ".s.PGSQL."+strconv.Itoa(port))
			for _, f := range []string{filepath.Join(realData, "postmaster.pid"), sock + ".lock", sock} {
				if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
					return nil, fmt.Errorf("pgmanaged: %w", err)
				}
			}
		}
		if err := killLeftovers(ctx, realData, 0); err != nil {
			return nil, fmt.Errorf("pgmanaged: %w", err)
		}
		if err := s.startPostmaster(bins, acct, logFile); err != nil {
			return nil, fmt.Errorf("pgmanaged: %w", err)
		}
		undo = append(undo, func() { _ = s.Stop(context.Background()) })
		log.Info("started postgres", "pid", s.pid, "dir", realData, "user", acct.name)
		if err := s.waitReady(ctx, logPath); err != nil {
			return nil, fmt.Errorf("pgmanaged: %w", err)
		}
		break
	}
	if err := s.ensureDatabase(ctx); err != nil {
		return nil, fmt.Errorf("pgmanaged: %w", err)
	}
	return s, nil
}

// Restart backoff of Supervise.
const (
	restartFirstDelay = 500 * time.Millisecond
	restartMaxDelay   = 30 * time.Second
	watchPoll         = time.Second
)

// Supervise keeps the cluster up until ctx ends or Stop is called: when its postmaster
// dies (killed, crashed, the OOM killer) it is started again — PostgreSQL recovers
// from its WAL — with a log line and a growing delay between failed attempts. Clients
// reconnect by themselves (pgx pools do).
func (s *Server) Supervise(ctx context.Context) error {
	delay := restartFirstDelay
	for {
		if err := s.waitExit(ctx); err != nil {
			return nil // ctx ended
		}
		s.mu.Lock()
		stopped := s.stopped
		s.mu.Unlock()
		if stopped {
			return nil
		}
		s.log.Error("embedded PostgreSQL exited; restarting it", "pid", s.pid, "log", logTail(filepath.Join(filepath.Dir(s.runDir), "postgres.log")))
		for {
			t := time.NewTimer(delay)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil
			case <-t.C:
			}
			n, err := Start(ctx, s.cfg)
			if err == nil {
				s.mu.Lock()
				if s.stopped { // Stop ran meanwhile: stop the new one too
					s.mu.Unlock()
					return n.Stop(context.WithoutCancel(ctx))
				}
				s.pid, s.exited = n.pid, n.exited
				s.mu.Unlock()
				s.log.Info("embedded PostgreSQL restarted", "pid", n.pid)
				delay = restartFirstDelay
				break
			}
			if ctx.Err() != nil {
				return nil
			}
			s.log.Error("restart embedded PostgreSQL", "err", err, "retry_in", min(delay*2, restartMaxDelay))
			delay = min(delay*2, restartMaxDelay)
		}
	}
}

// waitExit returns once the postmaster is gone, or ctx's error.
func (s *Server) waitExit(ctx context.Context) error {
	s.mu.Lock()
	exited, pid := s.exited, s.pid
	s.mu.Unlock()
	if exited != nil {
		select {
		case <-exited:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	t := time.NewTicker(watchPoll)
	defer t.Stop()
	for alive(pid) {
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// PID is the postmaster's process id now.
func (s *Server) PID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pid
}

// URL returns a connection string for the database "space" over the unix socket.
func (s *Server) URL() string { return connURL(s.runDir, dbName) }

// Stop shuts the cluster down: a fast shutdown (SIGINT: roll back open transactions,
// checkpoint) waited for until ctx is done or 30s pass, then an immediate shutdown
// (SIGQUIT), then SIGKILL. It returns once no process of the cluster is left. Stopping a
// stopped Server returns nil.
func (s *Server) Stop(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return nil
	}
	s.stopped = true
	gone := func() bool { return !s.running() }
	if gone() {
		// Killed behind our back: remove what it left, but not the processes of a
		// postmaster started since on the same cluster.
		return killLeftovers(context.WithoutCancel(ctx), s.dataDir, s.livePostmaster())
	}
	_ = syscall.Kill(s.pid, syscall.SIGINT) // errors: it is gone, checked below
	if waitFor(ctx, fastStopTimeout, gone) == nil {
		s.log.Info("stopped postgres", "pid", s.pid)
		return nil
	}
	// Stopping must finish even when ctx is done: leaving postgres running is worse.
	bg := context.WithoutCancel(ctx)
	s.log.Warn("postgres fast shutdown did not finish; immediate shutdown", "pid", s.pid)
	_ = syscall.Kill(s.pid, syscall.SIGQUIT)
	if waitFor(bg, hardStopTimeout, gone) == nil {
		return nil
	}
	s.log.Warn("postgres immediate shutdown did not finish; killing", "pid", s.pid)
	_ = syscall.Kill(s.pid, syscall.SIGKILL)
	if err := waitFor(bg, hardStopTimeout, gone); err != nil {
		return fmt.Errorf("pgmanaged: postgres pid %d survived SIGKILL: %w", s.pid, err)
	}
	return killLeftovers(bg, s.dataDir, 0)
}

// running reports whether the postmaster is still up.
func (s *Server) running() bool {
	if s.exited != nil {
		select {
		case <-s.exited:
			return false
		default:
			return true
		}
	}
	return alive(s.pid)
}

// livePostmaster returns the pid of the postmaster currently serving the cluster, or 0.
func (s *Server) livePostmaster() int {
	pid, err := readPostmasterPID(s.dataDir)
	if err != nil || pid == 0 || !alive(pid) {
		return 0
	}
	if yes, _ := servesDataDir(pid, s.dataDir); !yes {
		return 0
	}
	return pid
}

func (s *Server) startPostmaster(bins binaries, acct account, logFile *os.File) error {
	// Settings go on the command line, so they hold whatever postgresql.conf says.
	cmd := exec.Command(bins.postgres, "-D", s.dataDir,
		"-c", "listen_addresses=", // no TCP at all
		"-c", "unix_socket_directories="+quoteListItem(s.runDir),
		"-c", "unix_socket_permissions=0700",
		"-c", "port="+strconv.Itoa(port),
		"-c", "max_connections=200",
		"-c", "shared_buffers=128MB",
		"-c", "fsync=on",
		"-c", "logging_collector=off", // stderr goes to postgres.log
		"-c", "timezone=UTC",
		"-c", "log_timezone=UTC",
	)
	// Not CommandContext: the server outlives the call that started it.
	cmd.Dir = s.dataDir
	cmd.Env = childEnv()
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = acct.sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait() // its exit status is in postgres.log
		close(exited)
	}()
	s.pid, s.exited = cmd.Process.Pid, exited
	return nil
}

// waitReady polls by connecting until the server accepts connections, gives up early
// when the postmaster exits.
func (s *Server) waitReady(ctx context.Context, logPath string) error {
	var last error
	err := waitFor(ctx, readyTimeout, func() bool {
		if !s.running() {
			return true
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		conn, err := pgx.Connect(cctx, connURL(s.runDir, "postgres"))
		if err != nil {
			last = err
			return false
		}
		_ = conn.Close(cctx)
		return true
	})
	if !s.running() {
		return fmt.Errorf("postgres pid %d exited: %s", s.pid, logTail(logPath))
	}
	if err != nil {
		return fmt.Errorf("postgres not ready: %w (last error: %v)", err, last)
	}
	return nil
}

func (s *Server) ensureDatabase(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, connURL(s.runDir, "postgres"))
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", dbName).Scan(&exists); err != nil {
		return fmt.Errorf("look up database %s: %w", dbName, err)
	}
	if exists {
		return nil
	}
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{dbName}.Sanitize())
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P04" { // duplicate_database: raced
		return nil
	}
	if err != nil {
		return fmt.Errorf("create database %s: %w", dbName, err)
	}
	return nil
}

// initCluster runs initdb when dataDir holds no cluster yet. initdb writes into a
// scratch directory renamed into place when complete, so an interrupted first run never
// leaves a half-initialized data/ behind.
func initCluster(ctx context.Context, bins binaries, acct account, dir, dataDir string, logFile *os.File, log *slog.Logger) error {
	if fi, err := os.Stat(filepath.Join(dataDir, "PG_VERSION")); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && acct.drop && int(st.Uid) != acct.uid {
			log.Warn("data directory belongs to another account; changing owner", "dir", dataDir, "user", acct.name)
			if err := chownTree(dataDir, acct.uid, acct.gid); err != nil {
				return fmt.Errorf("chown %s: %w", dataDir, err)
			}
		}
		return nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if _, err := os.Stat(dataDir); err == nil {
		return fmt.Errorf("%s exists but holds no cluster (no PG_VERSION); move it away", dataDir)
	}
	tmp := filepath.Join(dir, "data.initdb")
	if err := os.RemoveAll(tmp); err != nil { // left by an interrupted first run
		return err
	}
	log.Info("initializing PostgreSQL cluster", "dir", dataDir, "initdb", bins.initdb, "user", acct.name)
	cmd := exec.CommandContext(ctx, bins.initdb, "-D", tmp, "-U", superuser,
		"-E", "UTF8", "--locale=C", "--auth-local=trust", "--auth-host=reject")
	cmd.Dir = dir
	cmd.Env = childEnv()
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = acct.sysProcAttr()
	if err := cmd.Run(); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("initdb: %w: %s", err, logTail(logFile.Name()))
	}
	if err := os.Rename(tmp, dataDir); err != nil {
		_ = os.RemoveAll(tmp)
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync() // make the rename durable
}

// childEnv is the whole environment of initdb and postgres: space's own environment
// (which may hold secrets) is not passed on.
func childEnv() []string {
	return []string{"PATH=/usr/local/bin:/usr/bin:/bin", "LC_ALL=C", "LANG=C"}
}

// connURL is a pgx-compatible URL for db over the unix socket in runDir.
func connURL(runDir, db string) string {
	q := url.Values{"host": {runDir}, "port": {strconv.Itoa(port)}, "sslmode": {"disable"}}
	// libpq (whose URI syntax pgx follows) decodes only %XX, not '+', in query values;
	// Encode writes a literal '+' as %2B, so every '+' it emits is a space.
	u := url.URL{Scheme: "postgres", User: url.User(superuser), Path: "/" + db, RawQuery: strings.ReplaceAll(q.Encode(), "+", "%20")}
	return u.String()
}

// quoteListItem quotes a directory for a list-valued setting such as
// unix_socket_directories, where commas and spaces separate items.
func quoteListItem(s string) string {
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

// mkdirAll creates dir and missing parents and returns the topmost directory it
// created ("" when dir existed), which removing undoes the call.
func mkdirAll(dir string) (created string, err error) {
	for p := dir; ; p = filepath.Dir(p) {
		if _, err := os.Stat(p); err == nil {
			break
		} else if !errors.Is(err, os.ErrNotExist) {
			return "", err
		}
		created = p
		if p == filepath.Dir(p) {
			break
		}
	}
	if created == "" {
		return "", nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		_ = os.RemoveAll(created)
		return "", err
	}
	return created, nil
}

// lockDir takes an exclusive flock on dir/pgmanaged.lock, polling so that ctx is
// honoured (flock itself cannot be interrupted by a context).
func lockDir(ctx context.Context, dir string) (unlock func(), err error) {
	f, err := os.OpenFile(filepath.Join(dir, "pgmanaged.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	var lerr error
	err = waitFor(ctx, readyTimeout, func() bool {
		lerr = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		return !errors.Is(lerr, syscall.EWOULDBLOCK)
	})
	if err == nil {
		err = lerr
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", f.Name(), err)
	}
	return func() { f.Close() }, nil // closing releases the lock
}

// logTail returns the last lines of postgres.log, for error messages.
func logTail(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	const max = 2048
	if fi, err := f.Stat(); err == nil && fi.Size() > max {
		_, _ = f.Seek(-max, io.SeekEnd)
	}
	b, _ := io.ReadAll(f)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 10 {
		lines = lines[len(lines)-10:]
	}
	return "postgres.log: " + strings.Join(lines, " | ")
}
