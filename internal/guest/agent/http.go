package agent

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

// apiError is an error with its HTTP status and wire error code.
type apiError struct {
	status int
	code   string
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func badRequest(format string, args ...any) error {
	return &apiError{status: http.StatusBadRequest, code: wire.ErrCodeBadRequest, msg: fmt.Sprintf(format, args...)}
}

func conflict(format string, args ...any) error {
	return &apiError{status: http.StatusConflict, code: wire.ErrCodeConflict, msg: fmt.Sprintf(format, args...)}
}

// classify is the one mapping from errors to HTTP status and wire code.
func classify(err error) (int, string) {
	var ae *apiError
	switch {
	case errors.As(err, &ae):
		return ae.status, ae.code
	case errors.Is(err, errUnknownUser):
		return http.StatusBadRequest, wire.ErrCodeUnknownUser
	case errors.Is(err, unix.ENOTEMPTY):
		return http.StatusConflict, wire.ErrCodeNotEmpty
	case errors.Is(err, fs.ErrExist):
		return http.StatusConflict, wire.ErrCodeExists
	case errors.Is(err, fs.ErrNotExist):
		return http.StatusNotFound, wire.ErrCodeNotFound
	case errors.Is(err, unix.ENOTDIR):
		return http.StatusBadRequest, wire.ErrCodeNotDir
	case errors.Is(err, unix.EISDIR):
		return http.StatusBadRequest, wire.ErrCodeIsDir
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT):
		return http.StatusInsufficientStorage, wire.ErrCodeNoSpace
	case errors.Is(err, fs.ErrPermission), errors.Is(err, unix.EROFS):
		return http.StatusForbidden, wire.ErrCodePermission
	case errors.Is(err, unix.EXDEV):
		return http.StatusBadRequest, wire.ErrCodeCrossDevice
	case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENAMETOOLONG), errors.Is(err, unix.ELOOP):
		return http.StatusBadRequest, wire.ErrCodeBadRequest
	}
	return http.StatusInternalServerError, wire.ErrCodeInternal
}

func (a *Agent) writeError(w http.ResponseWriter, r *http.Request, err error) {
	status, code := classify(err)
	if status >= 500 {
		a.log.Warn("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeJSON(w, status, wire.Error{Code: code, Message: err.Error()})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func decodeJSON(r *http.Request, v any) error {
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(v); err != nil {
		return badRequest("bad request body: %v", err)
	}
	return nil
}

// handle adapts a handler that returns an error (written as a JSON error when nothing
// was written yet).
func (a *Agent) handle(h func(w http.ResponseWriter, r *http.Request) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := h(w, r); err != nil {
			a.writeError(w, r, err)
		}
	}
}

func (a *Agent) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/health", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, a.health())
	})
	mux.HandleFunc("POST /v1/identity", a.handle(a.handleIdentity))
	mux.HandleFunc("POST /v1/quiesce", a.handleQuiesce)
	mux.HandleFunc("POST /v1/processes", a.handle(a.handleStartProcess))
	mux.HandleFunc("GET /v1/processes", a.handle(a.handleListProcesses))
	mux.HandleFunc("GET /v1/processes/{pid}", a.handle(a.handleGetProcess))
	mux.HandleFunc("POST /v1/processes/{pid}/start", a.handle(a.handleStart))
	mux.HandleFunc("GET /v1/processes/{pid}/output", a.handle(a.handleOutput))
	mux.HandleFunc("POST /v1/processes/{pid}/stdin", a.handle(a.handleStdin))
	mux.HandleFunc("POST /v1/processes/{pid}/signal", a.handle(a.handleSignal))
	mux.HandleFunc("POST /v1/processes/{pid}/resize", a.handle(a.handleResize))
	mux.HandleFunc("POST /v1/exec", a.handle(a.handleExec))
	mux.HandleFunc("POST /v1/memory/reclaim", a.handle(a.handleReclaim))
	mux.HandleFunc("GET /v1/files/content", a.handle(a.handleReadFile))
	mux.HandleFunc("PUT /v1/files/content", a.handle(a.handleWriteFile))
	mux.HandleFunc("GET /v1/files/stat", a.handle(a.handleStat))
	mux.HandleFunc("GET /v1/files/list", a.handle(a.handleList))
	mux.HandleFunc("POST /v1/files/mkdir", a.handle(a.handleMkdir))
	mux.HandleFunc("POST /v1/files/move", a.handle(a.handleMove))
	mux.HandleFunc("DELETE /v1/files", a.handle(a.handleRemove))
	mux.HandleFunc("GET /v1/files/watch", a.handle(a.handleWatch))
	// The status tunnel (envdpb.TunnelHeader) lets a caller behind proxies that turn
	// error statuses into their own errors read the agent's refusal whole.
	mux.Handle("GET /v1/ports/{port}/connect", tunnelStatus(a.handle(a.handlePortConnect)))
	a.registerEnvd(mux) // E2B's envd under /envd (envd.go)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/health" {
			a.touch()
		}
		mux.ServeHTTP(w, r)
	})
}

// handleQuiesce prepares a checkpoint: user processes are frozen until the next
// identity. ?transport=keep leaves the listener up (VM transports, which survive a
// restore); otherwise the agent closes it and waits for the resume file (gVisor, which
// cannot checkpoint a host socket). An agent listening on a unix socket of the disk
// (runsc --host-uds=create) refuses when the sandbox holds a host socket of its own
// (sockets.go): 409 cannot_checkpoint, and its processes run on. One that connects to
// the host (--host-uds=open) has none to look for: sockets bound on the disk are the
// Sentry's.
func (a *Agent) handleQuiesce(w http.ResponseWriter, r *http.Request) {
	keep := r.URL.Query().Get("transport") == "keep"
	a.freeze()
	if ls, err := parseListen(a.cfg.Listen); err == nil && ls.network == "unix" && !keep {
		// Checked once user code is frozen, so that nothing binds another meanwhile.
		if socks := unsavableSockets(ls.address); len(socks) > 0 {
			a.thaw()
			err := errUnsavable(socks)
			a.log.Warn("quiesce refused", "err", err)
			a.writeError(w, r, err)
			return
		}
	}
	a.tunnels.closeAll() // connections to frozen programs: a checkpoint cannot keep them
	w.WriteHeader(http.StatusNoContent)
	_ = http.NewResponseController(w).Flush()
	if keep {
		return
	}
	select {
	case a.quiesce <- struct{}{}:
	default:
	}
}

func (a *Agent) handleIdentity(w http.ResponseWriter, r *http.Request) error {
	var id wire.Identity
	if err := decodeJSON(r, &id); err != nil {
		return err
	}
	if err := a.applyIdentity(id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (a *Agent) handleStartProcess(w http.ResponseWriter, r *http.Request) error {
	var spec wire.ProcessSpec
	if err := decodeJSON(r, &spec); err != nil {
		return err
	}
	p, _, err := a.startKeyed(spec, nil, func() (*process, error) {
		p, _, err := a.startProcess(spec, false)
		return p, err
	})
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, p.info())
	return nil
}

func (a *Agent) handleListProcesses(w http.ResponseWriter, r *http.Request) error {
	a.procMu.Lock()
	ps := make([]*process, 0, len(a.procs))
	for _, p := range a.procs {
		ps = append(ps, p)
	}
	a.procMu.Unlock()
	sort.Slice(ps, func(i, j int) bool { return ps[i].seq < ps[j].seq })
	out := make([]wire.ProcessInfo, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.info())
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (a *Agent) lookupProcess(r *http.Request) (*process, error) {
	s := r.PathValue("pid")
	pid, err := strconv.Atoi(s)
	if err != nil || pid <= 0 {
		return nil, badRequest("bad pid %q", s)
	}
	a.procMu.Lock()
	p := a.procs[pid]
	a.procMu.Unlock()
	uid := r.URL.Query().Get(wire.UIDQuery)
	if p == nil && uid != "" && !strings.HasPrefix(uid, a.bootID+".") {
		// The process ran under an earlier boot of the sandbox, whose processes were lost.
		return nil, &apiError{status: http.StatusGone, code: wire.ErrCodeProcessGone,
			msg: fmt.Sprintf("process %d (%s) was lost with an earlier instance of this sandbox", pid, uid)}
	}
	if p == nil {
		return nil, &apiError{status: http.StatusNotFound, code: wire.ErrCodeProcessNotFound, msg: fmt.Sprintf("no process %d", pid)}
	}
	if uid != "" && uid != p.uid() {
		return nil, &apiError{status: http.StatusGone, code: wire.ErrCodeProcessGone,
			msg: fmt.Sprintf("process %d is not the process %s any more (the sandbox lost that process)", pid, uid)}
	}
	return p, nil
}

func (a *Agent) handleGetProcess(w http.ResponseWriter, r *http.Request) error {
	p, err := a.lookupProcess(r)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, p.info())
	return nil
}

func (a *Agent) handleStart(w http.ResponseWriter, r *http.Request) error {
	p, err := a.lookupProcess(r)
	if err != nil {
		return err
	}
	if err := p.start(); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (a *Agent) handleStdin(w http.ResponseWriter, r *http.Request) error {
	p, err := a.lookupProcess(r)
	if err != nil {
		return err
	}
	if err := p.writeStdin(r.Context(), r.Body, queryBool(r, "eof")); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (a *Agent) handleSignal(w http.ResponseWriter, r *http.Request) error {
	p, err := a.lookupProcess(r)
	if err != nil {
		return err
	}
	var body wire.Signal
	if err := decodeJSON(r, &body); err != nil {
		return err
	}
	sig, err := parseSignal(body.Signal)
	if err != nil {
		return err
	}
	if err := p.signal(sig); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (a *Agent) handleResize(w http.ResponseWriter, r *http.Request) error {
	p, err := a.lookupProcess(r)
	if err != nil {
		return err
	}
	var size wire.Resize
	if err := decodeJSON(r, &size); err != nil {
		return err
	}
	if err := p.resize(size); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func queryBool(r *http.Request, name string) bool {
	switch r.URL.Query().Get(name) {
	case "1", "true", "yes":
		return true
	}
	return false
}

func queryInt(r *http.Request, name string, def int64) (int64, error) {
	s := r.URL.Query().Get(name)
	if s == "" {
		return def, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, badRequest("bad %s %q", name, s)
	}
	return n, nil
}

const (
	// outputWriteBuf gathers the frames of one flush (a whole outputReadBuf frame fits).
	// It stays under a host unix socket's default send buffer (208 KiB), the most a
	// write through gVisor's host socket takes at once: a larger flush is two writes
	// and a wait for the socket in between.
	outputWriteBuf = 192 << 10
	// bulkOutput is the output per flush above which a stream counts as in full flow,
	// and coalesceWindow how long such a stream gathers output between writes.
	bulkOutput     = 32 << 10
	coalesceWindow = time.Millisecond
	outputReadBuf  = 128 << 10
	// flushEvery bounds how much is written between flushes while catching up.
	flushEvery = 1 << 20
)

// handleOutput streams the journal as frames; see the rules in package wire.
func (a *Agent) handleOutput(w http.ResponseWriter, r *http.Request) error {
	p, err := a.lookupProcess(r)
	if err != nil {
		return err
	}
	from, err := queryInt(r, "from", 0)
	if err != nil {
		return err
	}
	follow := queryBool(r, "follow")
	if _, end := p.journal.bounds(); from > end {
		return &apiError{status: http.StatusBadRequest, code: wire.ErrCodeOffsetBeyondEnd,
			msg: fmt.Sprintf("offset %d beyond end %d", from, end)}
	}
	var f *follower
	if follow {
		f = p.journal.follow(from)
	}
	a.streamOutput(w, r, p, from, f)
	return nil
}

// handleExec is POST /v1/exec: one call that creates a process, feeds its stdin and
// streams its output from offset 0 to the exit frame (see wire.ExecRequest). The
// process is not gated: this handler reads its journal from the first byte, and a
// writer faster than the journal's bound is reported by a gap frame, as for any reader.
// A program that cannot be executed is created gated instead, so that the failure
// comes back as an exit frame (127/126 with its error) like on the two-step path.
func (a *Agent) handleExec(w http.ResponseWriter, r *http.Request) error {
	var req wire.ExecRequest
	if err := decodeJSON(r, &req); err != nil {
		return err
	}
	spec := req.ProcessSpec
	spec.Gated = false
	if req.StdinData != nil {
		spec.Stdin = true
	}
	p, f, repeat, err := a.startExec(spec, req.StdinData)
	if err != nil {
		return err
	}
	w.Header().Set(wire.PIDHeader, strconv.Itoa(p.pid))
	w.Header().Set(wire.UIDHeader, p.uid())
	if req.StdinData != nil && !repeat {
		go func() {
			if err := p.writeStdin(r.Context(), bytes.NewReader(req.StdinData), true); err != nil {
				a.log.Debug("exec stdin", "pid", p.pid, "err", err)
			}
		}()
	}
	a.streamOutput(w, r, p, 0, f)
	return nil
}

// startExec starts spec's process for POST /v1/exec (stdin is what the caller writes to
// it) with a follower of its output from offset 0. A keyed exec whose key names a
// process the agent keeps (its first answer was lost on the way, and the caller sends
// it again) gets that process instead, with a follower from offset 0 (repeat): see
// startKeyed.
func (a *Agent) startExec(spec wire.ProcessSpec, stdin []byte) (p *process, f *follower, repeat bool, err error) {
	p, repeat, err = a.startKeyed(spec, stdin, func() (p *process, err error) {
		p, f, err = a.startProcess(spec, true)
		var ae *apiError
		if errors.As(err, &ae) && ae.code == wire.ErrCodeExecFailed {
			// A program that cannot be executed: created gated, so that the failure
			// comes back as an exit frame.
			spec.Gated = true
			if p, f, err = a.startProcess(spec, true); err == nil {
				if err = p.start(); err != nil {
					f.close()
				}
			}
		}
		return p, err
	})
	if err != nil {
		return nil, nil, false, err
	}
	if repeat {
		f = p.journal.follow(0)
	}
	return p, f, repeat, nil
}

// startKeyed calls start for a process with spec, unless spec.Key names a process the
// agent keeps: a repeat of a keyed start (POST /v1/exec, or POST /v1/processes for a
// command session) whose first answer was lost gets that process (repeat) and starts
// nothing. Twins sent at once start one process; a key sent with another command (or,
// for an exec, other stdin) is refused with 422 key_reused.
func (a *Agent) startKeyed(spec wire.ProcessSpec, stdin []byte, start func() (*process, error)) (p *process, repeat bool, err error) {
	if spec.Key == "" {
		p, err = start()
		return p, false, err
	}
	sum := execSum(spec, stdin)
	a.keyMu.Lock()
	defer a.keyMu.Unlock()
	if p := a.keyed(spec.Key); p != nil {
		if p.keySum != sum {
			return nil, false, &apiError{status: http.StatusUnprocessableEntity, code: wire.ErrCodeKeyReused,
				msg: fmt.Sprintf("key %q was used for another command (process %d)", spec.Key, p.pid)}
		}
		return p, true, nil
	}
	if p, err = start(); err != nil {
		return nil, false, err
	}
	p.keySum = sum // read only under keyMu, which this start holds
	return p, false, nil
}

// keyed returns the process started under key (startKeyed), or nil. The caller holds
// keyMu.
func (a *Agent) keyed(key string) *process {
	a.procMu.Lock()
	defer a.procMu.Unlock()
	for _, p := range a.procs {
		if p.spec.Key == key {
			return p
		}
	}
	return nil
}

// execSum identifies the command of a keyed start: its spec (the key and the gate
// aside) and the bytes an exec writes to its stdin.
func execSum(spec wire.ProcessSpec, stdin []byte) [sha256.Size]byte {
	spec.Key, spec.Gated = "", false
	b, _ := json.Marshal(spec) // map keys are sorted: the same spec, the same bytes
	h := sha256.New()
	h.Write(b)
	h.Write([]byte{0})
	h.Write(stdin)
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum
}

// streamOutput writes the frames of p's journal from offset from; see the rules in
// package wire. With a follower f (at from) it follows the journal until the exit and
// closes f when it returns; with nil it writes what the journal holds.
func (a *Agent) streamOutput(w http.ResponseWriter, r *http.Request, p *process, from int64, f *follower) {
	if f != nil {
		defer f.close()
	}
	follow := f != nil
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	// Headers go out now: a client attaching to a gated process must not wait for the
	// first frame to learn that the stream is open. A started process has its start
	// frame ready, so the headers go out with it (a short command's whole answer, start
	// to exit, is then one host write).
	if !p.hasStarted() {
		if err := rc.Flush(); err != nil {
			return
		}
	}
	ctx := r.Context()
	// Frames gather in bw and go out in one write per flush: under gVisor every write
	// to the host socket is a costly host system call.
	bw := bufio.NewWriterSize(w, outputWriteBuf)
	flush := func() error {
		if err := bw.Flush(); err != nil {
			return err
		}
		return rc.Flush()
	}
	// bulkFlush passes a bulk of frames on without flushing the HTTP layer: net/http
	// writes a chunk's data of more than its 4 KiB buffer through to the connection, and
	// only the chunk's closing CRLF waits in that buffer for the next chunk (or the
	// next flush): one host write fewer per bulk. The reader has every byte of the
	// chunk's data meanwhile.
	bulkFlush := func() error {
		if bw.Buffered() < bulkOutput {
			return flush()
		}
		return bw.Flush()
	}
	var lastBulk time.Time // when a flush last carried a bulk of output

	pos := from
	read := p.journal.readAt
	if follow {
		read = f.readAt
	}
	sentStart := false
	buf := make([]byte, outputReadBuf)
	hb := time.NewTimer(a.cfg.HeartbeatInterval)
	defer hb.Stop()
	for {
		changed := p.journal.changed()
		wrote := 0
		if !sentStart && p.hasStarted() {
			payload, _ := json.Marshal(wire.Start{PID: p.pid})
			if err := wire.WriteFrame(bw, wire.Frame{Type: wire.FrameStart, Offset: pos, Payload: payload}); err != nil {
				return
			}
			sentStart = true
			wrote++
		}
		caughtUp := false
		// Output exists only once the program runs, so nothing is read before the start
		// frame went out.
		for sentStart && wrote < flushEvery {
			stream, n, gap := read(pos, buf)
			if gap > 0 {
				var payload [8]byte
				binary.BigEndian.PutUint64(payload[:], uint64(gap))
				if err := wire.WriteFrame(bw, wire.Frame{Type: wire.FrameGap, Offset: pos + gap, Payload: payload[:]}); err != nil {
					return
				}
				pos += gap
				wrote++
				continue
			}
			if n == 0 {
				caughtUp = true
				break
			}
			if err := wire.WriteFrame(bw, wire.Frame{Type: stream, Offset: pos, Payload: buf[:n]}); err != nil {
				return
			}
			pos += int64(n)
			wrote += n
		}
		if !sentStart {
			caughtUp = true
		}
		if caughtUp {
			if exit, done := p.exitInfo(); done {
				if _, end := p.journal.bounds(); pos >= end {
					payload, _ := json.Marshal(exit)
					if err := wire.WriteFrame(bw, wire.Frame{Type: wire.FrameExit, Offset: pos, Payload: payload}); err != nil {
						return
					}
					_ = flush()
					return
				}
				continue // output arrived meanwhile: send it first
			}
			if !follow {
				_ = flush()
				return
			}
		}
		if wrote > 0 {
			if err := bulkFlush(); err != nil {
				return
			}
			if wrote >= bulkOutput {
				lastBulk = time.Now()
			} else {
				lastBulk = time.Time{}
			}
			hb.Reset(a.cfg.HeartbeatInterval)
			if !caughtUp {
				continue
			}
		}
		select {
		case <-changed:
			// A stream in full flow (the last flush carried a bulk) gathers output for the
			// rest of a window before the next write, so a writer of small pieces costs
			// one host write per window, not one per piece. A quiet stream's first bytes
			// and every exit go out at once, and so does a bulk that is already there
			// (a pump in flow gathers output in windows of its own).
			if _, end := p.journal.bounds(); end-pos >= bulkOutput {
				break
			}
			if wait := coalesceWindow - time.Since(lastBulk); !lastBulk.IsZero() && wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-t.C:
				case <-ctx.Done():
					t.Stop()
					return
				}
			}
		case <-ctx.Done():
			return
		case <-hb.C:
			if err := wire.WriteFrame(bw, wire.Frame{Type: wire.FrameHeartbeat, Offset: pos}); err != nil {
				return
			}
			if err := flush(); err != nil {
				return
			}
			hb.Reset(a.cfg.HeartbeatInterval)
		}
	}
}

func (p *process) hasStarted() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.startedAt.IsZero()
}
