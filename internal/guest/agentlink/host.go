package agentlink

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Host is the node's end: it accepts the agent's connections on a listener and
// dials the agent by asking for data connections.
type Host struct {
	ln    net.Listener
	log   *slog.Logger
	done  chan struct{} // closed when accept returns
	conns chan spare    // data connections that wait for a Dial
	mu    sync.Mutex    // guards ctl and chg
	ctl   *control      // the control connection holding the place, or nil
	chg   chan struct{} // closed and replaced whenever ctl is set
	once  sync.Once     // of Close

	pmu     sync.Mutex
	pending []net.Conn     // connections whose greeting is awaited, oldest first
	wg      sync.WaitGroup // greet goroutines

	cmu      sync.Mutex // serializes the control connections' admission
	answered time.Time  // ctl last answered a ping (cmu)

	rmu     sync.Mutex
	refused int       // connections refused since the last log line
	logged  time.Time // of the last refusal logged

	kmu   sync.Mutex
	known string             // the key the agent has (kmu); empty: not known yet
	save  func(string) error // records a key the agent confirmed
}

// Keys is what a Host knows of the agent's key when it starts.
type Keys struct {
	// Known is the key the instance's agent holds, as an earlier node process saved it:
	// only a control connection that presents it takes the agent's place. Empty after a
	// start or a restore (no user process runs before the agent has connected, so the
	// first control connection is the agent's) and for an agent from before 2026-12-07,
	// which presents none.
	Known string
	// Save records a key the agent confirmed (its first data connection carried it)
	// for the next node process; nil keeps it in memory only.
	Save func(key string) error
}

// spare is a data connection that arrived, with its session: Dial takes none whose
// session ended or whose agent end is closed (the agent closes every connection when
// it quiesces). The agent keeps a spare as long as the node does: its HTTP server gets
// the connection with the first request's first byte.
type spare struct {
	conn net.Conn
	ctl  *control
}

// control is one control connection held by the node.
type control struct {
	conn net.Conn
	key  string
	// unconfirmed: a new key given to an agent that keeps its key (it presented one,
	// or that it has none), not yet seen on a data connection.
	unconfirmed atomic.Bool
	wmu         sync.Mutex
	pong        chan struct{} // one token per pong
	closed      chan struct{}
	once        sync.Once
}

func (c *control) send(line string) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_ = c.conn.SetWriteDeadline(time.Now().Add(helloTimeout))
	_, err := io.WriteString(c.conn, line+"\n")
	return err
}

func (c *control) close() {
	c.once.Do(func() {
		c.conn.Close()
		close(c.closed)
	})
}

func (c *control) isClosed() bool {
	select {
	case <-c.closed:
		return true
	default:
		return false
	}
}

// NewHost serves the agent's connections arriving on ln (which it owns from then on)
// in the background. log receives refusals and protocol errors.
func NewHost(ln net.Listener, log *slog.Logger, keys Keys) *Host {
	h := &Host{ln: ln, log: log, done: make(chan struct{}), conns: make(chan spare, spareConns), chg: make(chan struct{}),
		known: keys.Known, save: keys.Save}
	go h.accept()
	return h
}

// accept takes connections until the listener is closed. Each one's first line is
// read by a goroutine of its own (within greetTimeout): the agent writes it at once,
// and a process of the sandbox that connects and says nothing holds nothing up. At
// most maxPending connections wait for their greeting; a new one beyond that closes
// the oldest, so silent connections cannot crowd out the agent's (which greet within
// microseconds) nor run the node out of descriptors.
func (h *Host) accept() {
	defer close(h.done)
	for {
		conn, err := h.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			h.log.Warn("agent link: accept", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if line, ok := ready(conn); ok {
			// Already sent, as the agent does right after its connect: handled at once,
			// never among the connections that wait for theirs.
			h.handle(conn, line, nil)
			continue
		}
		h.pmu.Lock()
		if len(h.pending) >= maxPending {
			h.pending[0].Close()
			h.pending = h.pending[1:]
		}
		h.pending = append(h.pending, conn)
		h.pmu.Unlock()
		h.wg.Add(1)
		go h.greet(conn)
	}
}

// ready returns conn's first line when all of it has arrived, reading nothing
// otherwise (a peek that does not wait).
func ready(conn net.Conn) (string, bool) {
	var buf [maxLine + 1]byte
	n, err := peek(conn, buf[:])
	if err != nil || n <= 0 {
		return "", false
	}
	i := bytes.IndexByte(buf[:n], '\n')
	if i < 0 {
		return "", false
	}
	if _, err := io.ReadFull(conn, buf[:i+1]); err != nil {
		return "", false
	}
	return string(buf[:i]), true
}

// peek copies into buf what has arrived on conn, without consuming it or waiting: n
// bytes, or the receive's error (EAGAIN: nothing yet; none and n 0: the peer closed).
// errors.ErrUnsupported for a connection without a descriptor.
func peek(conn net.Conn, buf []byte) (int, error) {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return 0, errors.ErrUnsupported
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var rerr error
	if err := rc.Control(func(fd uintptr) {
		n, _, rerr = unix.Recvfrom(int(fd), buf, unix.MSG_PEEK|unix.MSG_DONTWAIT)
	}); err != nil {
		return 0, err
	}
	return n, rerr
}

// greet reads conn's first line and hands it on.
func (h *Host) greet(conn net.Conn) {
	defer h.wg.Done()
	_ = conn.SetReadDeadline(time.Now().Add(greetTimeout))
	hello, err := readLine(conn)
	_ = conn.SetReadDeadline(time.Time{})
	h.pmu.Lock()
	i := slices.Index(h.pending, conn)
	if i >= 0 {
		h.pending = slices.Delete(h.pending, i, i+1)
	}
	h.pmu.Unlock()
	if i < 0 { // closed by a newer connection, or by Close
		conn.Close()
		return
	}
	h.handle(conn, hello, err)
}

// handle hands a connection on by its greeting (or refuses it for err). A control
// connection's admission may wait for a ping, so it goes on in a goroutine of its own.
func (h *Host) handle(conn net.Conn, hello string, err error) {
	switch {
	case err != nil:
		conn.Close()
		h.refuse("no greeting", err)
	case hello == helloControl, strings.HasPrefix(hello, helloControl+" "):
		presented, keyed := strings.CutPrefix(hello, helloControl+" ")
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			h.takeControl(conn, presented, keyed)
		}()
	case strings.HasPrefix(hello, helloData):
		h.takeData(conn, strings.TrimPrefix(hello, helloData))
	default:
		conn.Close()
		h.refuse("unknown greeting", nil)
	}
}

// refuse counts a refused connection and logs at most once a refuseLog.
func (h *Host) refuse(why string, err error) {
	h.rmu.Lock()
	defer h.rmu.Unlock()
	h.refused++
	if time.Since(h.logged) >= refuseLog {
		h.log.Warn("agent link: refused connections", "why", why, "err", err, "refused", h.refused)
		h.refused, h.logged = 0, time.Now()
	}
}

// takeControl gives conn the agent's place unless the control connection holding it
// answers a ping, or the agent's key is known and conn did not present it (keyed:
// conn's greeting carried presented, a key or noKey).
func (h *Host) takeControl(conn net.Conn, presented string, keyed bool) {
	h.cmu.Lock()
	defer h.cmu.Unlock()
	if h.held() {
		conn.Close()
		h.refuse("another control connection holds the agent's place", nil)
		return
	}
	h.kmu.Lock()
	key := h.known
	h.kmu.Unlock()
	if key != "" && (!keyed || subtle.ConstantTimeCompare([]byte(presented), []byte(key)) != 1) {
		conn.Close()
		h.refuse("control connection without the agent's key", nil)
		return
	}
	c := &control{conn: conn, key: key, pong: make(chan struct{}, 1), closed: make(chan struct{})}
	if key == "" {
		var k [32]byte
		_, _ = rand.Read(k[:]) // never fails (crypto/rand)
		c.key = hex.EncodeToString(k[:])
		c.unconfirmed.Store(keyed)
	}
	if err := c.send(keyPrefix + c.key); err != nil {
		conn.Close()
		h.refuse("write key", err)
		return
	}
	h.mu.Lock()
	old := h.ctl
	h.ctl = c
	close(h.chg)
	h.chg = make(chan struct{})
	h.mu.Unlock()
	if old != nil {
		old.close()
	}
	h.drain()
	h.answered = time.Time{}
	h.log.Debug("agent link: agent connected")
	go h.read(c)
	_ = c.send(reqDial) // a spare for the first Dial
}

// read reads the agent's answers on c until it ends.
func (h *Host) read(c *control) {
	defer c.close()
	for {
		line, err := readLine(c.conn)
		if err != nil {
			h.log.Debug("agent link: control connection ended", "err", err)
			return
		}
		if line == ansPong {
			select {
			case c.pong <- struct{}{}:
			default:
			}
		}
	}
}

// takeData hands conn to a Dial when key is the current control session's.
func (h *Host) takeData(conn net.Conn, key string) {
	h.mu.Lock()
	c := h.ctl
	h.mu.Unlock()
	if c == nil || c.isClosed() || subtle.ConstantTimeCompare([]byte(key), []byte(c.key)) != 1 {
		conn.Close()
		h.refuse("data connection without the current key", nil)
		return
	}
	if c.unconfirmed.Swap(false) {
		h.confirm(c.key)
	}
	select {
	case h.conns <- spare{conn: conn, ctl: c}:
	default:
		conn.Close() // more than any Dial asked for
	}
}

// confirm makes key, which the agent has shown it holds, the one a control connection
// must present from now on, and saves it for the next node process.
func (h *Host) confirm(key string) {
	h.kmu.Lock()
	h.known = key
	save := h.save
	h.kmu.Unlock()
	if save != nil {
		if err := save(key); err != nil {
			h.log.Warn("agent link: save the agent's key (after a restart of the node, the first control connection will take its place)", "err", err)
		}
	}
}

// Forget forgets the agent's key: the next control connection takes the place, as
// after a start (the instance is started or restored again).
func (h *Host) Forget() {
	h.kmu.Lock()
	h.known = ""
	h.kmu.Unlock()
}

// drain closes data connections that wait for a Dial.
func (h *Host) drain() {
	for {
		select {
		case s := <-h.conns:
			s.conn.Close()
		default:
			return
		}
	}
}

// held reports whether a control connection holds the agent's place: it exists and
// answers a ping in time. One that does not is closed. The caller holds cmu.
func (h *Host) held() bool {
	h.mu.Lock()
	c := h.ctl
	h.mu.Unlock()
	if c == nil || c.isClosed() {
		return false
	}
	if time.Since(h.answered) < answerFresh {
		return true
	}
	select { // a stale pong
	case <-c.pong:
	default:
	}
	if err := c.send(reqPing); err == nil {
		t := time.NewTimer(pingTimeout)
		defer t.Stop()
		select {
		case <-c.pong:
			h.answered = time.Now()
			return true
		case <-c.closed:
		case <-t.C:
		}
	}
	c.close()
	return false
}

// current returns the control connection holding the place, waiting for one until
// ctx ends.
func (h *Host) current(ctx context.Context) (*control, error) {
	for {
		h.mu.Lock()
		c, chg := h.ctl, h.chg
		h.mu.Unlock()
		if c != nil && !c.isClosed() {
			return c, nil
		}
		select {
		case <-chg:
		case <-h.done:
			return nil, ErrClosed
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for the agent to connect: %w", ctx.Err())
		}
	}
}

// Dial returns a new connection to the agent's HTTP server: it asks the agent for a
// data connection and waits for it (for the agent's control connection first, if
// none holds the place) until ctx ends.
func (h *Host) Dial(ctx context.Context) (net.Conn, error) {
	for {
		c, err := h.current(ctx)
		if err != nil {
			return nil, err
		}
		// One the agent made ahead (takeControl asks for one, and every Dial for the
		// next): a new connection costs no round trip into the sandbox.
		if conn := h.spare(); conn != nil {
			if err := c.send(reqDial); err != nil {
				c.close()
			}
			return conn, nil
		}
		if err := c.send(reqDial); err != nil {
			c.close()
			continue
		}
		if conn, err := h.take(ctx, c); conn != nil || err != nil {
			if conn != nil {
				_ = c.send(reqDial) // the next one's spare
			}
			return conn, err
		}
		// The session ended before its connection came: ask the next one.
	}
}

// spare returns a usable data connection that is waiting, or nil.
func (h *Host) spare() net.Conn {
	for {
		select {
		case s := <-h.conns:
			if !usable(s) {
				continue
			}
			return s.conn
		default:
			return nil
		}
	}
}

// usable reports whether a waiting data connection can be handed out: its session
// goes on and the agent's end is open. One that cannot is closed.
func usable(s spare) bool {
	if s.ctl.isClosed() || !alive(s.conn) {
		s.conn.Close()
		return false
	}
	return true
}

// alive reports whether the agent's end of conn, on which nothing was sent yet, is
// still open (the agent closes every connection when it quiesces, and the node may not
// have seen its control connection end yet): a peek that does not wait.
func alive(conn net.Conn) bool {
	var b [1]byte
	n, err := peek(conn, b[:])
	if errors.Is(err, errors.ErrUnsupported) {
		return true
	}
	return n > 0 || errors.Is(err, unix.EAGAIN)
}

// take waits for a usable data connection of session c: nil, nil once c ends. It asks
// again every redialEvery.
func (h *Host) take(ctx context.Context, c *control) (net.Conn, error) {
	t := time.NewTicker(redialEvery)
	defer t.Stop()
	for {
		select {
		case s := <-h.conns:
			if !usable(s) {
				continue
			}
			return s.conn, nil
		case <-t.C:
			if err := c.send(reqDial); err != nil {
				c.close()
				return nil, nil
			}
		case <-c.closed:
			return nil, nil
		case <-h.done:
			return nil, ErrClosed
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for the agent's connection: %w", ctx.Err())
		}
	}
}

// Close stops accepting, ends the control connection and closes waiting data
// connections. Connections Dial returned stay open. The listener's socket file is the
// caller's to remove.
func (h *Host) Close() {
	h.once.Do(func() {
		h.ln.Close()
		<-h.done
		h.pmu.Lock()
		for _, c := range h.pending {
			c.Close()
		}
		h.pending = nil
		h.pmu.Unlock()
		h.wg.Wait()
		h.mu.Lock()
		c := h.ctl
		h.mu.Unlock()
		if c != nil {
			c.close()
		}
		h.drain()
	})
}
