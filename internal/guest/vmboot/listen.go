package vmboot

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

// portClassDir lists the guest's virtio-serial ports; each has a "name" file.
const portClassDir = "/sys/class/virtio-ports"

// ResolvePort turns a port given as a device path (/dev/vport1p1), a udev-style path
// (/dev/virtio-ports/NAME, which needs no udev here) or a bare port name into the
// device path.
func ResolvePort(port string) (string, error) {
	name, isName := strings.CutPrefix(port, "/dev/virtio-ports/")
	if !isName && !strings.Contains(port, "/") {
		name, isName = port, true
	}
	if !isName {
		return port, nil
	}
	if _, err := os.Stat(port); err == nil && strings.HasPrefix(port, "/") {
		return port, nil // udev made the link after all
	}
	entries, err := os.ReadDir(portClassDir)
	if err != nil {
		return "", fmt.Errorf("resolve port %q: %w", port, err)
	}
	for _, e := range entries {
		data, err := os.ReadFile(filepath.Join(portClassDir, e.Name(), "name"))
		if err == nil && strings.TrimSpace(string(data)) == name {
			return filepath.Join("/dev", e.Name()), nil
		}
	}
	return "", fmt.Errorf("resolve port %q: no virtio-serial port named %q", port, name)
}

// Listen returns the guest end of the serial transport on the virtio-serial port dev (a
// device path or port name, see ResolvePort): a net.Listener whose connections are the
// streams the host opens. It survives host disconnections: when the host goes away the
// yamux session is dropped and a new one starts after the next host's handshake; Accept
// just waits meanwhile. Close (or ctx ending) stops it and closes the device.
func Listen(ctx context.Context, dev string, log *slog.Logger) (net.Listener, error) {
	path, err := ResolvePort(dev)
	if err != nil {
		return nil, err
	}
	return listen(ctx, path, func() (io.ReadWriteCloser, error) {
		// os.OpenFile registers the character device with the runtime poller, so a
		// blocked read or write ends when the file is closed.
		return os.OpenFile(path, os.O_RDWR, 0)
	}, log)
}

// listen is Listen with the device opener abstracted (tests use socket pairs).
func listen(ctx context.Context, name string, open func() (io.ReadWriteCloser, error), log *slog.Logger) (net.Listener, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// Fail early when the device cannot be opened at all.
	probe, err := open()
	if err != nil {
		return nil, fmt.Errorf("listen serial %s: %w", name, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	l := &listener{
		addr:   serialAddr(name),
		open:   open,
		log:    log,
		cancel: cancel,
		conns:  make(chan net.Conn),
		done:   make(chan struct{}),
	}
	context.AfterFunc(ctx, l.closePort)
	go func() {
		defer close(l.done)
		l.run(ctx, probe)
	}()
	return l, nil
}

type serialAddr string

func (a serialAddr) Network() string { return "serial" }
func (a serialAddr) String() string  { return string(a) }

type listener struct {
	addr   serialAddr
	open   func() (io.ReadWriteCloser, error)
	log    *slog.Logger
	cancel context.CancelFunc
	conns  chan net.Conn
	done   chan struct{}

	mu   sync.Mutex
	port io.ReadWriteCloser // the open device, closed by Close to unblock run
}

// reopenDelay is the pause before reopening the device after it failed to open or to
// handshake without a host disconnect explaining it (guards against a hot loop).
const reopenDelay = 100 * time.Millisecond

// run handshakes and serves sessions, one after the other, until ctx is done.
func (l *listener) run(ctx context.Context, port io.ReadWriteCloser) {
	for ctx.Err() == nil {
		if port == nil {
			var err error
			if port, err = l.open(); err != nil {
				l.log.Warn("serial: open port", "port", l.addr, "err", err)
				sleepCtx(ctx, reopenDelay)
				continue
			}
		}
		if !l.setPort(ctx, port) {
			port.Close()
			return
		}
		start := time.Now()
		rw, err := accept(port)
		if err != nil {
			// EOF: the host went away mid-handshake. Reopening drops unread input.
			port.Close()
			port = nil
			if !errors.Is(err, io.EOF) && ctx.Err() == nil {
				l.log.Warn("serial: handshake", "port", l.addr, "err", err)
				sleepCtx(ctx, reopenDelay)
			}
			continue
		}
		sess, err := yamux.Server(rw, YamuxConfig(l.log))
		if err != nil { // only for an invalid config
			port.Close()
			l.log.Error("serial: yamux", "err", err)
			return
		}
		l.log.Info("serial: host connected", "port", l.addr, "handshake", time.Since(start))
		l.serve(ctx, sess)
		sess.Close() // closes port
		port = nil
		l.log.Info("serial: host disconnected", "port", l.addr)
	}
}

// setPort records the open device so that Close can close it; false once closed.
func (l *listener) setPort(ctx context.Context, port io.ReadWriteCloser) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ctx.Err() != nil {
		return false
	}
	l.port = port
	return true
}

// serve hands the session's streams to Accept until the session ends.
func (l *listener) serve(ctx context.Context, sess *yamux.Session) {
	for {
		c, err := sess.Accept()
		if err != nil {
			return
		}
		select {
		case l.conns <- c:
		case <-ctx.Done():
			c.Close()
			return
		}
	}
}

func (l *listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting, closes the session and the device and waits for the listener's
// goroutine. Streams already accepted are closed with the session.
func (l *listener) Close() error {
	l.cancel() // runs closePort
	<-l.done
	return nil
}

// closePort closes the open device, which unblocks whatever run is doing; setPort
// refuses new ones from then on.
func (l *listener) closePort() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.port != nil {
		l.port.Close()
	}
}

func (l *listener) Addr() net.Addr { return l.addr }

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
