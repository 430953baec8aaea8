package agentlink

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"
)

// Key is the agent's key for its link: the one the node gave it, which it presents
// whenever it connects again. The agent keeps one Key for its life, across Listens (a
// quiesce closes the listener, and the agent listens again after it).
type Key struct {
	mu  sync.Mutex
	key string
}

func (k *Key) get() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.key
}

func (k *Key) set(key string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.key = key
}

// Listen is the agent's end: it connects to the node's socket at path and returns a
// listener whose Accept yields the data connections the node asks for. It returns once
// the node has accepted a control connection (so the caller can let user processes
// run only then), or with the error of the first attempt. A control connection that
// ends later (the node restarted) is made again until the listener is closed: at once
// after one that lasted a second, else after a pause that doubles from 10 ms to a
// second. Every control connection presents key and keeps the one the node answers
// with in it. The listener is closed when ctx ends.
func Listen(ctx context.Context, path string, key *Key) (net.Listener, error) {
	ctx, cancel := context.WithCancel(ctx)
	l := &listener{path: path, key: key, ctx: ctx, cancel: cancel, conns: make(chan *primed), pending: map[net.Conn]bool{}}
	ctl, current, err := l.connect()
	if err != nil {
		cancel()
		return nil, err
	}
	l.setControl(ctl)
	go l.run(ctl, current)
	go func() {
		<-ctx.Done() // ctx's end, or Close
		l.Close()
	}()
	return l, nil
}

type listener struct {
	path   string
	key    *Key
	ctx    context.Context // ends at Close
	cancel context.CancelFunc
	conns  chan *primed // to Accept
	mu     sync.Mutex
	ctl    net.Conn // the current control connection, closed by Close
	done   bool     // Close was called
	// pending are the data connections made and not yet accepted, closed by Close.
	pending map[net.Conn]bool
	// dials are the dialData calls under way: Close waits for them, so that none
	// leaves a connection open after it (added under mu while not done).
	dials sync.WaitGroup
}

// connect makes a control connection and reads its key.
func (l *listener) connect() (net.Conn, string, error) {
	var d net.Dialer
	conn, err := d.DialContext(l.ctx, "unix", l.path)
	if err != nil {
		return nil, "", err
	}
	_ = conn.SetDeadline(time.Now().Add(helloTimeout))
	if _, err := io.WriteString(conn, helloControl+" "+cmp.Or(l.key.get(), noKey)+"\n"); err != nil {
		conn.Close()
		return nil, "", fmt.Errorf("agent link: %w", err)
	}
	line, err := readLine(conn)
	if err != nil {
		conn.Close()
		return nil, "", fmt.Errorf("agent link: the node refused the control connection: %w", err)
	}
	key, ok := strings.CutPrefix(line, keyPrefix)
	if !ok || len(key) != 64 {
		conn.Close()
		return nil, "", fmt.Errorf("agent link: unexpected answer %q", line)
	}
	_ = conn.SetDeadline(time.Time{})
	l.key.set(key)
	return conn, key, nil
}

// setControl records ctl as the current control connection; false (and ctl closed)
// once the listener is closed.
func (l *listener) setControl(ctl net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done {
		ctl.Close()
		return false
	}
	l.ctl = ctl
	return true
}

// run answers the node on ctl, and on the control connections made after it ends.
func (l *listener) run(ctl net.Conn, key string) {
	var pause time.Duration
	for {
		start := time.Now()
		l.serveControl(ctl, key)
		if l.ctx.Err() != nil {
			return
		}
		for {
			if time.Since(start) < settled {
				pause = min(max(2*pause, 10*time.Millisecond), time.Second)
			} else {
				pause = 0
			}
			t := time.NewTimer(pause)
			select {
			case <-l.ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			start = time.Now()
			var err error
			if ctl, key, err = l.connect(); err == nil {
				break
			}
		}
		if !l.setControl(ctl) {
			return
		}
	}
}

// serveControl answers the node's requests on ctl until it ends.
func (l *listener) serveControl(ctl net.Conn, key string) {
	defer ctl.Close()
	for {
		line, err := readLine(ctl)
		if err != nil {
			return
		}
		switch line {
		case reqDial:
			l.mu.Lock()
			if !l.done {
				l.dials.Add(1)
				go func() {
					defer l.dials.Done()
					l.dialData(key)
				}()
			}
			l.mu.Unlock()
		case reqPing:
			_ = ctl.SetWriteDeadline(time.Now().Add(helloTimeout))
			if _, err := io.WriteString(ctl, ansPong+"\n"); err != nil {
				return
			}
		}
	}
}

// dialData makes one data connection for Accept.
func (l *listener) dialData(key string) {
	var d net.Dialer
	conn, err := d.DialContext(l.ctx, "unix", l.path)
	if err != nil {
		return // the node asks again, or the control connection ends
	}
	_ = conn.SetWriteDeadline(time.Now().Add(helloTimeout))
	if _, err := io.WriteString(conn, helloData+key+"\n"); err != nil {
		conn.Close()
		return
	}
	_ = conn.SetWriteDeadline(time.Time{})
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		conn.Close()
		return
	}
	// Registered under the lock Close takes: a connection made while the listener
	// closes is closed, never left open (a checkpoint follows a quiesce's Close).
	l.mu.Lock()
	if l.done {
		l.mu.Unlock()
		conn.Close()
		return
	}
	l.pending[conn] = true
	l.mu.Unlock()
	// The node may keep it as a spare for a while: the HTTP server gets it with its
	// first byte, so that its timeouts count from the request, not from the dial.
	p := &primed{UnixConn: uc, first: make([]byte, 1)}
	n, err := uc.Read(p.first)
	if err != nil || n != 1 {
		l.mu.Lock()
		delete(l.pending, conn)
		l.mu.Unlock()
		conn.Close()
		return
	}
	select {
	case l.conns <- p:
	case <-l.ctx.Done(): // Close closes it
	}
}

// primed is a data connection whose first byte was read before the HTTP server got
// it. It keeps the unix connection's other methods (SyscallConn: the agent polls the
// descriptor to notice a client that went away).
type primed struct {
	*net.UnixConn
	first []byte // what was read ahead, until the server reads it
}

func (p *primed) Read(b []byte) (int, error) {
	if len(p.first) > 0 {
		n := copy(b, p.first)
		p.first = p.first[n:]
		return n, nil
	}
	return p.UnixConn.Read(b)
}

// Accept returns the next data connection.
func (l *listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		l.mu.Lock()
		delete(l.pending, c.UnixConn)
		l.mu.Unlock()
		return c, nil
	case <-l.ctx.Done():
		return nil, net.ErrClosed
	}
}

// Close ends the control connection and every data connection not yet accepted.
func (l *listener) Close() error {
	l.mu.Lock()
	l.done = true
	ctl, pending := l.ctl, l.pending
	l.pending = map[net.Conn]bool{}
	l.mu.Unlock()
	l.cancel()
	if ctl != nil {
		ctl.Close()
	}
	for c := range pending {
		c.Close()
	}
	// A dial that connected while Close ran closes its connection when it sees done;
	// wait for that (bounded: the dial ends with ctx, its greeting has a deadline), so
	// that no data connection is open once Close returns (a quiesce's checkpoint
	// follows). Until 2026-12-08 one could still be, for a moment: a node that asked
	// then got it as a live spare of the ended session (TestLinkQuiesce, 1 run in 300).
	l.dials.Wait()
	return nil
}

// Addr is the node's socket.
func (l *listener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }
