// Package agent is space-agent, the program that runs as PID 1 inside every sandbox. It
// owns the processes started in the sandbox (start, gate, reap, signal, stdin, PTY,
// timeout), their bounded output journals, file access (read, write, list, stat, mkdir,
// move, delete, watch), the sandbox identity (entropy, clock, hostname, default
// environment) and the quiesce/resume seam that checkpoints need. It serves the HTTP
// protocol defined in package wire.
package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacedev/space/internal/guest/agentlink"
	"github.com/spacedev/space/internal/guest/rundirs"
	"github.com/spacedev/space/internal/guest/wire"
)

// Config configures an Agent. Zero values take the documented defaults.
type Config struct {
	// Listen is where the agent serves: "connect:/run/space/node.sock" (gVisor:
	// connections the agent makes to the node's socket; package agentlink), "unix:/path/agent.sock"
	// (a socket the agent listens on: gVisor before 2026-12-06, and tests), "vsock:PORT"
	// (Firecracker's hybrid vsock) or "serial:/dev/vportNpM" (yamux over a virtio-serial
	// port, QEMU).
	Listen string
	// RunDir is the directory in which the host drops the resume file after a quiesce
	// (wire.ResumeFileName). Default: the directory of a unix socket, else
	// wire.RunMountDir.
	RunDir string
	// JournalBytes bounds each process's output journal. Default 8 MiB.
	JournalBytes int
	// ReaderStall is how long a following output stream may stay behind without taking
	// a byte before its process's output stops waiting for it (journal.follow): until
	// then the process's writes wait rather than evict bytes the stream has not
	// read. Default 1 s; negative: never wait (every reader that falls a whole journal
	// behind gets a gap).
	ReaderStall time.Duration
	// Retention is how long an exited process (and its output) stays readable. Default
	// 10 minutes.
	Retention time.Duration
	// MaxExited caps the number of exited processes retained. Default 256.
	MaxExited int
	// HeartbeatInterval is the idle time after which output and watch streams get a
	// heartbeat. Default 15 s.
	HeartbeatInterval time.Duration
	// StopGrace is how long children get between SIGTERM and SIGKILL when the agent
	// stops. Default 5 s.
	StopGrace time.Duration
	// StdinStallTimeout fails a stdin request (409 stdin_stalled) when the process
	// accepts none of it for this long. Default 30 s.
	StdinStallTimeout time.Duration
	// EtcDir holds the passwd and group files users are resolved from. Default "/etc".
	EtcDir string
	// StateDir is where the agent keeps its own files inside the sandbox (the file
	// metadata store of metadata.go). Default "/.space/state".
	StateDir string
	// CgroupRoot is the cgroup v2 mount inside the sandbox. With it set, the agent keeps
	// user processes in a child cgroup of its own whose pids limit leaves room for the
	// agent's threads (tasks.go). Empty: off. space-agent sets /sys/fs/cgroup when it
	// runs as PID 1.
	CgroupRoot string
	// RunTree is where the agent, as it starts, makes the directories and links that the
	// host listed in RunDir (rundirs.FileName): the template's /run, over which the
	// sandbox's /run tmpfs is mounted. Empty: off. space-agent sets /run when it runs as
	// PID 1.
	RunTree string
	// Version is reported by /v1/health.
	Version string
	// Reaper collects exited children; exactly one must exist per OS process (see
	// NewReaper). Required.
	Reaper *Reaper
	Logger *slog.Logger
}

const (
	defaultMaxExited  = 256
	defaultHeartbeat  = 15 * time.Second
	defaultStopGrace  = 5 * time.Second
	defaultStdinStall = 30 * time.Second
	// defaultReaderStall: long enough for a reader that keeps up to ride out a
	// scheduling hiccup of a loaded host, short enough that a reader gone without a
	// word (a half-open connection) costs its process one such pause.
	defaultReaderStall = time.Second
	resumePoll         = 2 * time.Millisecond
)

// Agent serves the agent protocol and supervises the sandbox's processes.
type Agent struct {
	cfg     Config
	log     *slog.Logger
	reaper  *Reaper
	users   *userDB
	meta    *metaStore
	bootID  string
	handler http.Handler
	tasks   taskSplit // user processes' own task limit (tasks.go)

	lastActivity atomic.Int64 // unix nanoseconds

	idMu       sync.Mutex
	generation int64
	defaultEnv map[string]string

	procMu sync.Mutex
	procs  map[int]*process
	seq    uint64
	// keyMu serializes keyed starts between looking for their key's process and
	// starting one (startKeyed), so that twins start one process.
	keyMu sync.Mutex

	quiesce chan struct{}
	tunnels tunnels
	// linkKey is the key of the link to the node (gVisor), kept across quiesces: the
	// agent presents it whenever it connects again (package agentlink).
	linkKey agentlink.Key

	freezeMu sync.Mutex
	frozen   bool
	stopped  []int // the processes freeze stopped as PID 1 (thaw continues exactly these)
}

// New checks cfg and returns an agent that serves nothing until Run.
func New(cfg Config) (*Agent, error) {
	if cfg.Reaper == nil {
		return nil, errors.New("agent: Config.Reaper is required")
	}
	if cfg.Listen == "" {
		cfg.Listen = "unix:" + filepath.Join(wire.RunMountDir, wire.AgentSocketName)
	}
	ls, err := parseListen(cfg.Listen)
	if err != nil {
		return nil, err
	}
	if cfg.RunDir == "" {
		cfg.RunDir = wire.RunMountDir
		if ls.network == "unix" || ls.network == "connect" {
			cfg.RunDir = filepath.Dir(ls.address)
		}
	}
	if cfg.JournalBytes <= 0 {
		cfg.JournalBytes = wire.DefaultJournalBytes
	}
	if cfg.Retention <= 0 {
		cfg.Retention = wire.DefaultRetention
	}
	if cfg.MaxExited <= 0 {
		cfg.MaxExited = defaultMaxExited
	}
	if cfg.ReaderStall == 0 {
		cfg.ReaderStall = defaultReaderStall
	}
	if cfg.HeartbeatInterval <= 0 {
		cfg.HeartbeatInterval = defaultHeartbeat
	}
	if cfg.StopGrace <= 0 {
		cfg.StopGrace = defaultStopGrace
	}
	if cfg.StdinStallTimeout <= 0 {
		cfg.StdinStallTimeout = defaultStdinStall
	}
	if cfg.EtcDir == "" {
		cfg.EtcDir = "/etc"
	}
	if cfg.StateDir == "" {
		cfg.StateDir = "/.space/state"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	var id [16]byte
	_, _ = rand.Read(id[:]) // crypto/rand.Read never fails on Linux
	a := &Agent{
		cfg:     cfg,
		log:     cfg.Logger,
		reaper:  cfg.Reaper,
		users:   newUserDB(cfg.EtcDir),
		meta:    newMetaStore(filepath.Join(cfg.StateDir, metaStoreFile)),
		bootID:  hex.EncodeToString(id[:]),
		procs:   make(map[int]*process),
		quiesce: make(chan struct{}, 1),
		tasks:   taskSplit{root: cfg.CgroupRoot, log: cfg.Logger, self: ownCgroup, memTotal: memTotalMiB},
	}
	a.touch()
	a.handler = a.routes()
	return a, nil
}

// Handler returns the agent's HTTP handler (Run serves it; tests may mount it
// elsewhere, without the quiesce loop).
func (a *Agent) Handler() http.Handler { return a.handler }

// Run serves until ctx is done, then terminates every process it started (SIGTERM,
// SIGKILL after StopGrace) and returns. A quiesce request stops serving (listener and
// connections closed) until the resume file appears; processes keep running.
func (a *Agent) Run(ctx context.Context) error {
	defer a.terminateAll()
	if a.cfg.RunTree != "" {
		// Before the listener: no user process runs until the tree is there.
		if err := rundirs.Apply(filepath.Join(a.cfg.RunDir, rundirs.FileName), a.cfg.RunTree); err != nil {
			a.log.Warn("make the template's /run directories", "err", err)
		}
	}
	janitorDone := make(chan struct{})
	jctx, stopJanitor := context.WithCancel(ctx)
	go func() {
		defer close(janitorDone)
		a.janitor(jctx)
	}()
	defer func() {
		stopJanitor()
		<-janitorDone
	}()
	resumed := false
	for {
		ln, err := a.listenThenThaw(ctx, resumed)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		quiesced, err := a.serve(ctx, ln)
		if err != nil || !quiesced {
			return err
		}
		if err := a.enterQuiesce(); err != nil {
			return err
		}
		if err := a.waitResume(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		marker := filepath.Join(a.cfg.RunDir, wire.QuiescedFileName)
		if err := os.Remove(marker); err != nil && !errors.Is(err, os.ErrNotExist) {
			a.log.Warn("remove quiesced marker", "err", err)
		}
		resumed = true
	}
}

// listenThenThaw opens the listener and only then lets user code run: after a resume
// the socket's path is free (the host removed the old file) and a user process that
// ran first could bind it and answer the host in the agent's place.
func (a *Agent) listenThenThaw(ctx context.Context, retry bool) (net.Listener, error) {
	ln, err := a.listen(ctx, retry)
	if err == nil && retry {
		a.thaw()
	}
	return ln, err
}

// listen opens the listener. After a resume it retries until it succeeds: a socket
// file the agent could not remove (gVisor) blocks the address until the host removes
// it. An agent that connects to the host always retries: the host may be restarting.
func (a *Agent) listen(ctx context.Context, retry bool) (net.Listener, error) {
	if ls, err := parseListen(a.cfg.Listen); err == nil && ls.network == "connect" {
		retry = true
	}
	delay := 2 * time.Millisecond
	var lastErr string
	for {
		ln, err := listen(ctx, a.cfg.Listen, &a.linkKey)
		if err == nil || !retry {
			return ln, err
		}
		if msg := err.Error(); msg != lastErr {
			a.log.Warn("listen after resume failed, retrying", "err", err)
			lastErr = msg
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(delay):
		}
		delay = min(delay*2, 100*time.Millisecond)
	}
}

// serve serves ln until ctx is done (false, nil), a quiesce request (true, nil) or a
// listener failure.
func (a *Agent) serve(ctx context.Context, ln net.Listener) (quiesced bool, err error) {
	a.log.Info("agent listening", "listen", a.cfg.Listen, "boot_id", a.bootID)
	srv := &http.Server{
		Handler:           a.handler,
		ReadHeaderTimeout: 30 * time.Second,
		ErrorLog:          slog.NewLogLogger(a.log.Handler(), slog.LevelDebug),
		ConnContext:       withConn,
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	select {
	case <-ctx.Done():
		_ = srv.Close()
		a.tunnels.closeAll()
		<-serveErr
		return false, nil
	case err := <-serveErr:
		return false, fmt.Errorf("serve %s: %w", a.cfg.Listen, err)
	case <-a.quiesce:
		// Close, not Shutdown: streaming responses never finish on their own, and a
		// checkpoint needs every host connection gone now (port tunnels too: the server
		// does not close connections it handed over).
		_ = srv.Close()
		a.tunnels.closeAll()
		<-serveErr
		return true, nil
	}
}

// enterQuiesce runs once the listener and every connection are closed: it removes the
// socket file when it can (Go's listener unlinks it on Close already; gVisor refuses
// that for a socket backed by the host, EPERM, and then the host removes it before
// resuming) and creates the quiesced marker the host waits for.
func (a *Agent) enterQuiesce() error {
	if ls, err := parseListen(a.cfg.Listen); err == nil && ls.network == "unix" {
		if err := os.Remove(ls.address); err != nil && !errors.Is(err, os.ErrNotExist) {
			a.log.Info("agent socket file stays until the host removes it", "path", ls.address, "err", err)
		}
	}
	// Written aside and renamed into place: the host checkpoints as soon as it sees the
	// name, and a file the agent still held open then would be part of the saved state.
	// A restore re-opens every open file of a gofer mount, and a clone's run directory
	// starts empty: the clone's restore failed ("failed to walk "quiesced"") whenever
	// the checkpoint came between the marker's create and its close.
	marker := filepath.Join(a.cfg.RunDir, wire.QuiescedFileName)
	tmp := marker + ".tmp"
	err := os.WriteFile(tmp, []byte(strconv.FormatInt(a.currentGeneration(), 10)+"\n"), 0o644)
	if err == nil {
		err = os.Rename(tmp, marker)
	}
	if err != nil {
		// Without the marker the host cannot tell when to checkpoint: stop in a way it
		// notices rather than hang quiesced.
		return fmt.Errorf("quiesce: write marker: %w", err)
	}
	a.log.Info("quiesced: listener closed, waiting for resume file", "dir", a.cfg.RunDir)
	return nil
}

// waitResume polls the resume file until it holds a newer identity, applies it and
// removes the file. User code stays frozen: Run thaws it once it listens again.
func (a *Agent) waitResume(ctx context.Context) error {
	path := filepath.Join(a.cfg.RunDir, wire.ResumeFileName)
	t := time.NewTicker(resumePoll)
	defer t.Stop()
	var lastBad string
	for {
		data, err := os.ReadFile(path)
		if err == nil {
			var id wire.Identity
			switch err := json.Unmarshal(data, &id); {
			case err != nil:
				// Possibly written in place and still incomplete; try again.
				if msg := err.Error(); msg != lastBad {
					a.log.Warn("resume file unreadable, waiting", "err", err)
					lastBad = msg
				}
			case id.Generation <= a.currentGeneration():
				if msg := fmt.Sprint("stale ", id.Generation); msg != lastBad {
					a.log.Warn("resume file has a stale generation, waiting", "generation", id.Generation)
					lastBad = msg
				}
			default:
				// User code stays frozen until the listener is back (listenThenThaw).
				if err := a.setIdentity(id); err != nil {
					return fmt.Errorf("resume: %w", err)
				}
				if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
					a.log.Warn("remove resume file", "err", err)
				}
				a.log.Info("resumed", "generation", id.Generation)
				return nil
			}
		} else if !errors.Is(err, os.ErrNotExist) {
			if msg := err.Error(); msg != lastBad {
				a.log.Warn("read resume file", "err", err)
				lastBad = msg
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

func (a *Agent) touch() { a.lastActivity.Store(time.Now().UnixNano()) }

func (a *Agent) health() wire.Health {
	a.idMu.Lock()
	gen := a.generation
	a.idMu.Unlock()
	a.freezeMu.Lock()
	frozen := a.frozen
	a.freezeMu.Unlock()
	return wire.Health{
		Version:      a.cfg.Version,
		BootID:       a.bootID,
		Generation:   gen,
		Frozen:       frozen,
		Time:         time.Now(),
		LastActivity: time.Unix(0, a.lastActivity.Load()),
	}
}

// janitor forgets exited processes past their retention.
func (a *Agent) janitor(ctx context.Context) {
	every := min(max(a.cfg.Retention/4, 10*time.Millisecond), 30*time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			a.prune()
		}
	}
}

// prune drops exited processes older than Retention, and the oldest exited ones beyond
// MaxExited.
func (a *Agent) prune() {
	now := time.Now()
	a.procMu.Lock()
	defer a.procMu.Unlock()
	var exited []*process
	for pid, p := range a.procs {
		ended, done := p.endedTime()
		if !done {
			continue
		}
		if now.Sub(ended) >= a.cfg.Retention {
			delete(a.procs, pid)
			continue
		}
		exited = append(exited, p)
	}
	if len(exited) > a.cfg.MaxExited {
		sort.Slice(exited, func(i, j int) bool {
			ei, _ := exited[i].endedTime()
			ej, _ := exited[j].endedTime()
			return ei.Before(ej)
		})
		for _, p := range exited[:len(exited)-a.cfg.MaxExited] {
			delete(a.procs, p.pid)
		}
	}
}

// terminateAll stops every live process: gates are closed, groups get SIGTERM, then
// SIGKILL after StopGrace; it returns once all are reaped (or a last deadline passes).
func (a *Agent) terminateAll() {
	a.procMu.Lock()
	var live []*process
	for _, p := range a.procs {
		live = append(live, p)
	}
	a.procMu.Unlock()
	var waiting []*process
	for _, p := range live {
		if p.terminate() {
			waiting = append(waiting, p)
		}
	}
	if len(waiting) == 0 {
		return
	}
	a.log.Info("stopping processes", "count", len(waiting))
	grace := time.NewTimer(a.cfg.StopGrace)
	defer grace.Stop()
	var last <-chan time.Time // set once SIGKILL was sent
	for _, p := range waiting {
		if last == nil {
			select {
			case <-p.reapedCh:
				continue
			case <-grace.C:
				for _, q := range waiting {
					q.kill()
				}
				last = time.After(2 * time.Second)
			}
		}
		select {
		case <-p.reapedCh:
		case <-last:
			a.log.Warn("processes not reaped after SIGKILL")
			return
		}
	}
}

func (a *Agent) currentGeneration() int64 {
	a.idMu.Lock()
	defer a.idMu.Unlock()
	return a.generation
}
