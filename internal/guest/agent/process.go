package agent

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

const (
	defaultPATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	// outputGrace is how long after reaping the exit frame waits for the output pipes
	// to close; descendants may keep them open indefinitely.
	outputGrace = 200 * time.Millisecond
	pumpBuf     = 64 << 10
	// pumpWindow is how long a pump in full flow lets small writes gather in the pipe,
	// which holds pumpPipeSize bytes (Linux's default pipe-max-size) where allowed.
	pumpWindow   = time.Millisecond
	pumpPipeSize = 1 << 20
	// pumpTarget is what a read of a pipe in flow aims at (a quarter of the pipe), and
	// pumpMaxWindow the longest wait between two reads: what a stream's last bytes and
	// EOF can be delayed by while a writer keeps the pipe in flow.
	pumpTarget    = pumpPipeSize / 4
	pumpMaxWindow = 8 * time.Millisecond
)

// process is one program started by the agent.
type process struct {
	a       *Agent
	pid     int
	seq     uint64
	spec    wire.ProcessSpec
	user    string
	cwd     string
	journal *journal
	// keySum identifies the command of a keyed start (spec.Key; see execSum).
	keySum [sha256.Size]byte
	// reapedCh is closed once the process has been reaped.
	reapedCh chan struct{}

	mu          sync.Mutex
	state       string
	startedAt   time.Time
	endedAt     time.Time
	exit        wire.Exit
	reaped      bool
	openOutputs int  // output pumps still reading
	statusOpen  bool // exec status pipe of a gate not yet at EOF
	graceOver   bool
	done        bool
	timedOut    bool
	oomNote     string   // why it may end: the agent killed it, or a process of its group, out of memory (memory.go)
	gate        *os.File // write end of the gate pipe until started
	stdin       *os.File // pipe write end, or the PTY master
	stdinClosed bool
	ptm         *os.File // PTY master
	timer       *time.Timer

	stdinMu sync.Mutex // serializes stdin writers
}

// startProcess creates a process from spec. Any failure undoes what was set up.
//
// With follow, it also returns a follower of the process's output from offset 0,
// registered before the program runs: a caller that streams the output from the first
// byte (POST /v1/exec, envd's Start) is then owed every byte from the start, even when
// the program writes more than the journal holds before the caller's first read. A
// follower registered after the start would come too late for such a program: the
// bytes it wrote in between are evicted without waiting, and the stream would begin
// with a gap. The caller closes the follower.
func (a *Agent) startProcess(spec wire.ProcessSpec, follow bool) (*process, *follower, error) {
	if len(spec.Argv) == 0 || spec.Argv[0] == "" {
		return nil, nil, badRequest("argv is empty")
	}
	if spec.PTY != nil && (spec.PTY.Rows == 0 || spec.PTY.Cols == 0) {
		return nil, nil, badRequest("pty size must be non-zero")
	}
	if spec.TimeoutMs < 0 {
		return nil, nil, badRequest("timeout_ms is negative")
	}
	acct, err := a.users.lookup(spec.User)
	if err != nil {
		return nil, nil, err
	}
	cred, err := credentialFor(acct)
	if err != nil {
		return nil, nil, err
	}
	env, err := a.processEnv(acct, spec)
	if err != nil {
		return nil, nil, err
	}
	cwd, err := processCwd(acct, spec.Cwd)
	if err != nil {
		return nil, nil, err
	}

	path, argv := "/proc/self/exe", append([]string{gateArg0}, spec.Argv...)
	if !spec.Gated {
		path, err = lookPath(spec.Argv[0], env["PATH"], cwd)
		if err != nil {
			return nil, nil, &apiError{status: http.StatusBadRequest, code: wire.ErrCodeExecFailed, msg: err.Error()}
		}
		argv = spec.Argv
	}

	p := &process{
		a:        a,
		spec:     spec,
		user:     acct.Name,
		cwd:      cwd,
		reapedCh: make(chan struct{}),
		state:    wire.StateCreated,
	}
	p.journal = newJournal(a.cfg.JournalBytes, a.touch)
	p.journal.stall = a.cfg.ReaderStall

	// parentFiles are ours after the start; childFiles are closed after the start.
	var parentFiles, childFiles []*os.File
	closeAll := func(fs []*os.File) {
		for _, f := range fs {
			f.Close()
		}
	}
	var fol *follower
	if follow {
		fol = p.journal.follow(0)
	}
	fail := func(err error) (*process, *follower, error) {
		closeAll(childFiles)
		closeAll(parentFiles)
		return nil, nil, err
	}
	sys := &syscall.SysProcAttr{Setsid: true, Credential: cred}
	intoCgroup := func() {
		fd := a.tasks.userCgroupFD() // tasks.go
		sys.UseCgroupFD, sys.CgroupFD = fd >= 0, max(fd, 0)
	}
	intoCgroup()
	var files []*os.File
	var outputs []*os.File
	if spec.PTY != nil {
		ptm, pts, err := openPTY(*spec.PTY)
		if err != nil {
			return fail(fmt.Errorf("open pty: %w", err))
		}
		parentFiles = append(parentFiles, ptm)
		childFiles = append(childFiles, pts)
		if cred != nil {
			// The terminal belongs to the user, as login(1) would do it.
			if err := pts.Chown(int(cred.Uid), int(cred.Gid)); err != nil {
				return fail(fmt.Errorf("chown pty: %w", err))
			}
		}
		files = []*os.File{pts, pts, pts}
		sys.Setctty, sys.Ctty = true, 0
		p.ptm, p.stdin = ptm, ptm
		outputs = []*os.File{ptm}
	} else {
		var stdin *os.File
		if spec.Stdin {
			r, w, err := os.Pipe()
			if err != nil {
				return fail(fmt.Errorf("stdin pipe: %w", err))
			}
			parentFiles = append(parentFiles, w)
			childFiles = append(childFiles, r)
			stdin, p.stdin = r, w
		} else {
			devnull, err := os.Open(os.DevNull)
			if err != nil {
				return fail(fmt.Errorf("open %s: %w", os.DevNull, err))
			}
			childFiles = append(childFiles, devnull)
			stdin = devnull
		}
		or, ow, err := outputPipe()
		if err != nil {
			return fail(fmt.Errorf("stdout pipe: %w", err))
		}
		parentFiles = append(parentFiles, or)
		childFiles = append(childFiles, ow)
		er, ew, err := outputPipe()
		if err != nil {
			return fail(fmt.Errorf("stderr pipe: %w", err))
		}
		parentFiles = append(parentFiles, er)
		childFiles = append(childFiles, ew)
		files = []*os.File{stdin, ow, ew}
		outputs = []*os.File{or, er}
	}
	var statusR *os.File
	if spec.Gated {
		gr, gw, err := os.Pipe()
		if err != nil {
			return fail(fmt.Errorf("gate pipe: %w", err))
		}
		parentFiles = append(parentFiles, gw)
		childFiles = append(childFiles, gr)
		sr, sw, err := os.Pipe()
		if err != nil {
			return fail(fmt.Errorf("status pipe: %w", err))
		}
		parentFiles = append(parentFiles, sr)
		childFiles = append(childFiles, sw)
		files = append(files, gr, sw) // fds 3 (gateFD) and 4 (statusFD)
		p.gate, statusR = gw, sr
		p.statusOpen = true
	}

	envList := make([]string, 0, len(env))
	for k, v := range env {
		envList = append(envList, k+"="+v)
	}
	sort.Strings(envList)
	attr := &os.ProcAttr{Dir: cwd, Env: envList, Files: files, Sys: sys}
	// A fast child can exit, and onExit run, before spawn returns: everything onExit
	// reads is set before the child exists or inside start, which runs under the
	// reaper's lock and so before onExit. p is not shared yet, so p.mu is not needed.
	p.openOutputs = len(outputs)
	pid, err := a.reaper.spawn(func() (int, error) {
		// No start while user code is frozen for a checkpoint, and no freeze while a
		// start is under way (freeze takes freezeMu too). A child between its fork and
		// its exec still holds the agent's descriptors, the listener among them: frozen
		// there, it kept gVisor's host-backed socket open, and the checkpoint failed
		// ("Cannot save endpoint with bound host socket"). os.StartProcess returns only
		// once the exec has closed them.
		a.freezeMu.Lock()
		defer a.freezeMu.Unlock()
		if a.frozen {
			return 0, errQuiesced
		}
		proc, err := os.StartProcess(path, argv, attr)
		if err != nil && sys.UseCgroupFD && a.tasks.lost() {
			intoCgroup()
			proc, err = os.StartProcess(path, argv, attr)
		}
		if err != nil {
			return 0, err
		}
		p.pid = proc.Pid
		_ = proc.Release() // the reaper collects it; signals go to the process group
		if !spec.Gated {
			p.markRunningLocked()
		}
		return p.pid, nil
	}, p.onExit)
	if errors.Is(err, errQuiesced) {
		return fail(errQuiesced)
	}
	if err != nil {
		return fail(&apiError{status: http.StatusBadRequest, code: wire.ErrCodeExecFailed, msg: err.Error()})
	}
	closeAll(childFiles)
	for i, f := range outputs {
		stream := wire.FrameStdout
		if i == 1 {
			stream = wire.FrameStderr
		}
		go p.pump(f, stream)
	}
	if statusR != nil {
		go p.readStatus(statusR)
	}

	a.procMu.Lock()
	a.seq++
	p.seq = a.seq
	a.procs[pid] = p
	a.procMu.Unlock()
	a.prune() // keep MaxExited even between janitor runs
	a.log.Debug("process started", "pid", pid, "argv", spec.Argv, "user", acct.Name, "gated", spec.Gated)
	return p, fol, nil
}

// credentialFor returns the credential to run as acct, or nil to run as the agent's
// own user.
func credentialFor(acct account) (*syscall.Credential, error) {
	euid := os.Geteuid()
	if euid != 0 {
		if uint32(euid) != acct.UID {
			return nil, badRequest("cannot run as %s: the agent is not root", acct.Name)
		}
		return nil, nil
	}
	return &syscall.Credential{Uid: acct.UID, Gid: acct.GID, Groups: acct.Groups}, nil
}

// processEnv merges, lowest first: PATH/HOME/USER/LOGNAME (and TERM for a PTY), the
// identity's default environment, the spec's environment.
func (a *Agent) processEnv(acct account, spec wire.ProcessSpec) (map[string]string, error) {
	env := map[string]string{
		"PATH":    defaultPATH,
		"HOME":    acct.Home,
		"USER":    acct.Name,
		"LOGNAME": acct.Name,
	}
	if spec.PTY != nil {
		env["TERM"] = "xterm-256color"
	}
	a.idMu.Lock()
	for k, v := range a.defaultEnv {
		env[k] = v
	}
	a.idMu.Unlock()
	for k, v := range spec.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.Contains(v, "\x00") {
			return nil, badRequest("bad environment variable %q", k)
		}
		env[k] = v
	}
	return env, nil
}

// processCwd resolves the working directory: relative paths and "~" against the
// user's home; empty means home, or / when home does not exist.
func processCwd(acct account, cwd string) (string, error) {
	if cwd == "" {
		if fi, err := os.Stat(acct.Home); err == nil && fi.IsDir() {
			return acct.Home, nil
		}
		return "/", nil
	}
	p, err := resolvePath(acct, cwd)
	if err != nil {
		return "", err
	}
	fi, err := os.Stat(p)
	if err != nil {
		return "", badRequest("cwd %s: %v", p, errors.Unwrap(err))
	}
	if !fi.IsDir() {
		return "", badRequest("cwd %s: not a directory", p)
	}
	return p, nil
}

// lookPath finds file like execvp(3) does, in pathEnv (not the agent's own PATH).
// exec.LookPath would consult the agent's environment, hence this small copy.
func lookPath(file, pathEnv, cwd string) (string, error) {
	if strings.Contains(file, "/") {
		p := file
		if !filepath.IsAbs(p) {
			p = filepath.Join(cwd, p)
		}
		if err := checkExecutable(p); err != nil {
			return "", fmt.Errorf("exec %s: %w", file, err)
		}
		return p, nil
	}
	for _, dir := range filepath.SplitList(pathEnv) {
		if dir == "" {
			dir = "."
		}
		if !filepath.IsAbs(dir) {
			dir = filepath.Join(cwd, dir)
		}
		p := filepath.Join(dir, file)
		if checkExecutable(p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("exec %s: executable file not found in PATH", file)
}

func checkExecutable(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return errors.Unwrap(err)
	}
	if fi.IsDir() || fi.Mode()&0o111 == 0 {
		return fs.ErrPermission
	}
	return nil
}

// markRunningLocked records the start of the program and arms the timeout.
func (p *process) markRunningLocked() {
	p.state = wire.StateRunning
	p.startedAt = time.Now()
	if p.spec.TimeoutMs > 0 {
		p.timer = time.AfterFunc(time.Duration(p.spec.TimeoutMs)*time.Millisecond, p.timeout)
	}
	p.journal.wake()
}

func (p *process) timeout() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.reaped {
		return
	}
	p.timedOut = true
	_ = unix.Kill(-p.pid, unix.SIGKILL)
}

// start releases a gated process. It is idempotent.
func (p *process) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.reaped {
		return conflict("process %d has exited", p.pid)
	}
	if p.gate == nil {
		return nil
	}
	_, err := p.gate.Write([]byte{1})
	p.gate.Close()
	p.gate = nil
	if err != nil {
		return conflict("process %d: start: %v", p.pid, err)
	}
	p.markRunningLocked()
	return nil
}

// outputPipe returns a pipe for a process's stdout or stderr, in blocking mode: its
// pump reads it with plain blocking reads, outside Go's poller. A pipe in the poller
// wakes the agent's poller thread on every write of the program, even while the pump
// is not reading; under gVisor each wake-up is a costly trap.
func outputPipe() (r, w *os.File, err error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil {
		return nil, nil, err
	}
	return os.NewFile(uintptr(fds[0]), "|0"), os.NewFile(uintptr(fds[1]), "|1"), nil
}

// pump drains one output of the process into the journal at full speed.
//
// A program writing a stream of small pieces (head, cat, a shell loop: 4–8 KiB each)
// would cost a read, a journal append and a reader's wake-up per piece, each a trap into
// the sentry under gVisor. Once two small reads come within pumpWindow, the pump is in
// flow: it lets the pipe (enlarged to pumpPipeSize, so the writer does not block
// meanwhile) gather the pieces between reads. A lone burst (a line, the first bytes of a
// stream) is read at once, and EOF ends the pump at once while it waits in a read.
//
// An output pipe in flow is read without blocking (see flow) and its window adapts to
// the writer's rate, so that each read takes about pumpTarget bytes whatever the load:
// a fixed window would make the reads (and everything downstream of them: appends,
// wake-ups, host writes) smaller, and so more numerous per byte, exactly when the
// sandbox is short of CPU. A PTY master keeps plain blocking reads: it is shared with
// stdin writes.
func (p *process) pump(f *os.File, stream byte) {
	var fl *flow
	if f != p.ptm {
		if rc, err := f.SyscallConn(); err == nil {
			_ = rc.Control(func(fd uintptr) { fl = &flow{fd: int(fd)} })
		}
	}
	buf := make([]byte, pumpBuf)
	var last time.Time
	for {
		var n int
		var err error
		if fl != nil && fl.on {
			n, err = fl.read(buf)
		} else {
			n, err = f.Read(buf)
		}
		if n > 0 {
			p.journal.append(stream, buf[:n])
			now := time.Now()
			soon := now.Sub(last) < pumpWindow
			switch {
			case err != nil:
			case fl != nil:
				if !fl.on && soon {
					fl.start()
				}
				if !fl.on {
					break
				}
				if fl.step(n, len(buf)) {
					// The pipe held more than the buffer: read on at once, with a
					// buffer that takes the whole pipe.
					if len(buf) < pumpPipeSize {
						buf = make([]byte, pumpPipeSize)
					}
					break
				}
				time.Sleep(fl.window)
				now = time.Now()
			case n < len(buf)/2 && soon:
				time.Sleep(pumpWindow)
				now = time.Now()
			}
			last = now
		}
		if errors.Is(err, errFlowIdle) {
			// The writer paused: wait in a blocking read again, where its next bytes
			// (or EOF) end the wait at once.
			fl.stop()
			continue
		}
		if err != nil {
			// EOF for pipes; EIO for a PTY master once the terminal is gone.
			break
		}
	}
	runtime.KeepAlive(f)
	f.Close()
	p.mu.Lock()
	p.openOutputs--
	if f == p.ptm {
		p.stdin, p.ptm = nil, nil
	}
	p.checkDoneLocked()
	p.mu.Unlock()
}

// errFlowIdle ends a pump's flow: the pipe was empty after a whole window.
var errFlowIdle = errors.New("output idle")

// flow is the state of an output pipe read in flow: the descriptor is non-blocking and
// read directly, every window, instead of blocking in a read per piece the program
// writes. The window grows (doubling, up to pumpMaxWindow) while reads return less
// than pumpTarget and shrinks while they return more, so a read takes about a quarter
// of the pipe: the writer never fills it, and each read carries a bulk.
type flow struct {
	fd     int
	on     bool
	sized  bool // the pipe was enlarged to pumpPipeSize
	window time.Duration
	after  bool // the last read filled the buffer (see step)
}

// start puts the pipe in flow. The first time, it enlarges the pipe (only then: a
// short command's pipes never need it, and every call is a trap into the sentry).
func (fl *flow) start() {
	if !fl.sized {
		_, _ = unix.FcntlInt(uintptr(fl.fd), unix.F_SETPIPE_SZ, pumpPipeSize)
		fl.sized = true
	}
	fl.on, fl.window = true, pumpWindow
	if err := unix.SetNonblock(fl.fd, true); err != nil {
		fl.on = false
	}
}

// stop makes the descriptor blocking again; while it cannot, the pump stays in flow
// at its longest window.
func (fl *flow) stop() {
	if err := unix.SetNonblock(fl.fd, false); err != nil {
		fl.window = pumpMaxWindow
		time.Sleep(fl.window)
		return
	}
	fl.on = false
}

// read reads what the pipe holds without blocking: io.EOF at the end of the output,
// errFlowIdle when the pipe is empty (the writer paused for a whole window).
func (fl *flow) read(buf []byte) (int, error) {
	for {
		n, err := unix.Read(fl.fd, buf)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return 0, errFlowIdle
		case err != nil:
			return 0, err
		case n == 0:
			return 0, io.EOF
		}
		return n, nil
	}
}

// step takes a read of n bytes into a buffer of size bytes, made after a window (or at
// once, after a read that filled the buffer), and reports whether the pump reads on at
// once (the buffer was filled) or waits the next window first.
//
// A read that took the whole pipe means the writer waited on a full pipe for part of
// the window: the window shrinks. The read that follows a full one at once takes only
// what came in the instants between the two, so it says nothing of the window and
// leaves it. (Before 2026-12-06 that read counted as a short one and doubled the
// window, so a writer that fills the pipe within a window drove it up to pumpMaxWindow
// and then waited on a full pipe most of the time: `head -c 1G` streamed at 128 MiB/s
// where the pipe allows half again as much; docs/benchmarks.md, twenty-second pass.)
func (fl *flow) step(n, size int) (again bool) {
	after := fl.after
	fl.after = n == size
	switch {
	case n == size:
		if n >= pumpPipeSize {
			fl.window = max(fl.window/2, pumpWindow)
		}
	case !after:
		fl.adapt(n)
	}
	return fl.after
}

// adapt sets the next window from the size of the last read.
func (fl *flow) adapt(n int) {
	switch {
	case n < pumpTarget/2:
		fl.window = min(fl.window*2, pumpMaxWindow)
	case n > pumpTarget*2:
		fl.window = max(fl.window/2, pumpWindow)
	}
}

// readStatus reads a gate's exec status pipe: bytes are an exec error, plain EOF
// means the program runs.
func (p *process) readStatus(f *os.File) {
	msg, _ := io.ReadAll(io.LimitReader(f, 4096))
	f.Close()
	p.mu.Lock()
	p.statusOpen = false
	if len(msg) > 0 {
		p.exit.Error = string(msg)
	}
	p.checkDoneLocked()
	p.mu.Unlock()
}

// onExit is the reaper's callback.
func (p *process) onExit(reap func() unix.WaitStatus) {
	p.mu.Lock()
	defer p.mu.Unlock()
	ws := reap()
	p.reaped = true
	p.endedAt = time.Now()
	close(p.reapedCh)
	switch {
	case ws.Exited():
		code := ws.ExitStatus()
		p.exit.ExitCode = &code
	case ws.Signaled():
		p.exit.Signal = unix.SignalName(ws.Signal())
	}
	if p.timer != nil {
		p.timer.Stop()
	}
	if p.gate != nil {
		p.gate.Close()
		p.gate = nil
	}
	if p.openOutputs > 0 {
		time.AfterFunc(outputGrace, func() {
			p.mu.Lock()
			p.graceOver = true
			p.checkDoneLocked()
			p.mu.Unlock()
		})
	}
	p.checkDoneLocked()
	p.a.log.Debug("process exited", "pid", p.pid, "status", int(ws))
}

// checkDoneLocked moves the process to exited once its exit status, its exec status
// and its output are all known.
func (p *process) checkDoneLocked() {
	if p.done || !p.reaped || p.statusOpen || (p.openOutputs > 0 && !p.graceOver) {
		return
	}
	p.done = true
	p.state = wire.StateExited
	p.exit.TimedOut = p.timedOut
	if p.oomNote != "" && p.exit.Error == "" && (p.exit.Signal != "" || (p.exit.ExitCode != nil && *p.exit.ExitCode != 0)) {
		p.exit.Error = p.oomNote
	}
	if p.stdin != nil && p.stdin != p.ptm && !p.stdinClosed {
		p.stdin.Close()
	}
	p.stdinClosed = true
	p.journal.wake()
}

func (p *process) endedTime() (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.endedAt, p.done
}

// uid identifies the process among every process of the sandbox, ever: the agent's
// boot id and the process's sequence number.
func (p *process) uid() string { return p.a.bootID + "." + strconv.FormatUint(p.seq, 10) }

func (p *process) info() wire.ProcessInfo {
	first, end := p.journal.bounds()
	p.mu.Lock()
	defer p.mu.Unlock()
	pi := wire.ProcessInfo{
		PID:      p.pid,
		UID:      p.uid(),
		Argv:     p.spec.Argv,
		Env:      p.spec.Env,
		Cwd:      p.cwd,
		User:     p.user,
		Tag:      p.spec.Tag,
		State:    p.state,
		PTY:      p.spec.PTY != nil,
		Stdin:    p.spec.Stdin || p.spec.PTY != nil,
		Written:  end,
		Retained: first,
	}
	if !p.startedAt.IsZero() {
		t := p.startedAt
		pi.StartedAt = &t
	}
	if p.done {
		t := p.endedAt
		pi.EndedAt = &t
		pi.ExitCode = p.exit.ExitCode
		pi.Signal = p.exit.Signal
		pi.Error = p.exit.Error
		pi.TimedOut = p.exit.TimedOut
	}
	return pi
}

// exitInfo returns the exit payload once the process is done.
func (p *process) exitInfo() (wire.Exit, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exit, p.done
}

func (p *process) signal(sig unix.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.reaped {
		return conflict("process %d has exited", p.pid)
	}
	// Every process leads its own session and group: signal the whole group, like a
	// terminal does, so that children of a shell get it too.
	if err := unix.Kill(-p.pid, sig); err != nil {
		return fmt.Errorf("signal %d: %w", p.pid, err)
	}
	return nil
}

func (p *process) resize(size wire.Size) error {
	if size.Rows == 0 || size.Cols == 0 {
		return badRequest("rows and cols must be non-zero")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.spec.PTY == nil {
		return &apiError{status: http.StatusConflict, code: wire.ErrCodeNotPTY, msg: fmt.Sprintf("process %d has no terminal", p.pid)}
	}
	if p.reaped || p.ptm == nil {
		return conflict("process %d has exited", p.pid)
	}
	if err := setWinsize(p.ptm, size); err != nil {
		return fmt.Errorf("resize %d: %w", p.pid, err)
	}
	return nil
}

// writeStdin copies r into the process's stdin; eof closes it afterwards (for a PTY
// it sends the terminal's end-of-file character, ^D, instead: closing the master would
// hang up the terminal). A process that does not read blocks the request, until the
// client gives up (see peerGone).
func (p *process) writeStdin(ctx context.Context, r io.Reader, eof bool) error {
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	p.mu.Lock()
	f := p.stdin
	usable := f != nil && !p.stdinClosed && !p.reaped
	p.mu.Unlock()
	if !usable {
		return &apiError{status: http.StatusConflict, code: wire.ErrCodeStdinUnavailable, msg: fmt.Sprintf("process %d has no open stdin", p.pid)}
	}
	defer func() { _ = f.SetWriteDeadline(time.Time{}) }()
	buf := make([]byte, 32<<10)
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			if err := p.writeSome(ctx, f, buf[:n]); err != nil {
				return err
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			return badRequest("read request body: %v", rerr)
		}
	}
	if !eof {
		return nil
	}
	if p.spec.PTY != nil {
		return p.writeSome(ctx, f, []byte{4})
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.stdinClosed {
		p.stdinClosed = true
		f.Close()
	}
	return nil
}

// stdinPoll is how often a blocked stdin write checks whether its client is gone.
const stdinPoll = 100 * time.Millisecond

// writeSome writes b to stdin f. While the process does not read, it checks between
// short write deadlines whether the client is gone, and gives up after
// StdinStallTimeout without progress (where hang-ups cannot be detected, e.g. gVisor's
// host sockets, that is what frees the stdin for the next request).
func (p *process) writeSome(ctx context.Context, f *os.File, b []byte) error {
	progress := time.Now()
	for len(b) > 0 {
		_ = f.SetWriteDeadline(time.Now().Add(stdinPoll))
		n, err := f.Write(b)
		b = b[n:]
		if n > 0 {
			progress = time.Now()
		}
		if err == nil {
			continue
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return p.stdinError(err)
		}
		if peerGone(ctx) {
			return &apiError{status: http.StatusRequestTimeout, code: wire.ErrCodeStdinStalled,
				msg: fmt.Sprintf("process %d: client gone while its stdin was full", p.pid)}
		}
		if stalled := time.Since(progress); stalled >= p.a.cfg.StdinStallTimeout {
			p.a.log.Warn("stdin write abandoned: process does not read", "pid", p.pid, "stalled", stalled)
			return &apiError{status: http.StatusConflict, code: wire.ErrCodeStdinStalled,
				msg: fmt.Sprintf("process %d read none of its stdin for %v", p.pid, stalled.Round(time.Millisecond))}
		}
	}
	return nil
}

func (p *process) stdinError(err error) error {
	if errors.Is(err, unix.EPIPE) || errors.Is(err, os.ErrClosed) || errors.Is(err, unix.EIO) {
		return &apiError{status: http.StatusConflict, code: wire.ErrCodeStdinUnavailable, msg: fmt.Sprintf("process %d: stdin closed", p.pid)}
	}
	return fmt.Errorf("write stdin of %d: %w", p.pid, err)
}

// terminate starts stopping the process for agent shutdown; false if it is already
// reaped.
func (p *process) terminate() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.reaped {
		return false
	}
	if p.gate != nil {
		// A gate that reads EOF exits without running the program.
		p.gate.Close()
		p.gate = nil
	}
	_ = unix.Kill(-p.pid, unix.SIGTERM)
	return true
}

func (p *process) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.reaped {
		_ = unix.Kill(-p.pid, unix.SIGKILL)
	}
}

// parseSignal accepts "SIGTERM", "TERM", "term" or a number.
func parseSignal(s string) (unix.Signal, error) {
	s = strings.TrimSpace(s)
	if n, err := strconv.Atoi(s); err == nil {
		if n <= 0 || n > 64 {
			return 0, &apiError{status: http.StatusBadRequest, code: wire.ErrCodeUnknownSignal, msg: fmt.Sprintf("unknown signal %q", s)}
		}
		return unix.Signal(n), nil
	}
	name := strings.ToUpper(s)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	if sig := unix.SignalNum(name); sig != 0 {
		return sig, nil
	}
	return 0, &apiError{status: http.StatusBadRequest, code: wire.ErrCodeUnknownSignal, msg: fmt.Sprintf("unknown signal %q", s)}
}
