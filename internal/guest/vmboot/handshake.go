package vmboot

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"time"

	"github.com/hashicorp/yamux"
)

// The serial transport: the agent's HTTP connections run as yamux streams over one
// virtio-serial port. The host end of the port is a unix socket served by QEMU (one
// client at a time); the guest end is a character device. The host is the yamux client
// (it opens one stream per HTTP connection), the guest the yamux server.
//
// Neither end of a virtio-serial port sees the other's connection boundaries cleanly:
// the guest learns of a host (dis)connection asynchronously, guest bytes written while
// no host was connected are delivered to the next host, and after a restore the guest
// still runs the yamux session of the checkpointed host connection. So every new host
// connection starts with a handshake that puts both ends at a known byte position:
//
//	host  → guest  "\nSPACE-RESET <h>\n"      repeated every ResendInterval, and on every
//	                                         "SPACE-HELLO - <g>", until answered
//	guest → host   "SPACE-HELLO <h> <g>\n"    once per distinct <h>
//	host  → guest  "SPACE-ACK <g>\n"          then yamux starts on both ends
//
// <h> and <g> are fresh random nonces (16 hex digits) of the host connection and of the
// guest's current handshake. The guest also writes "SPACE-HELLO - <g>" first thing in
// each handshake: that write blocks until a host is connected, which is how the guest
// waits for one (a read on a port without host returns EOF at once). Each side skips
// every line it does not expect, so bytes left over from an earlier session (yamux
// frames, stale lines) are discarded. A RESET arriving while the guest still runs an old
// session is not valid yamux (the first byte of a yamux frame is its version, 0), so the
// old session fails, the guest starts a new handshake and answers a repeated RESET; the
// host ignores HELLOs that do not carry its <h>, so no stale HELLO can be mistaken for
// an answer, and answers only once, so nothing but yamux follows the ACK on either side.
// Whenever the guest reads EOF (the host went away) it closes the device, which drops
// unread input, and starts over.

// PortName is the name of the agent's virtio-serial port (QEMU virtserialport name=).
const PortName = "space.agent"

// ResendInterval is how often the host repeats its RESET line until the guest answers.
const ResendInterval = 500 * time.Millisecond

const (
	lineReset = "SPACE-RESET"
	lineHello = "SPACE-HELLO"
	lineAck   = "SPACE-ACK"
	// maxLine bounds a handshake line; longer runs without a newline are garbage.
	maxLine = 128
)

// YamuxConfig is the yamux configuration of both ends. Keep-alives are off: a paused or
// checkpointed VM cannot answer pings, and a dead peer shows as EOF on the port (QEMU
// closes the socket, the guest's port reports the hang-up). Stream opens never time out
// for the same reason.
func YamuxConfig(log *slog.Logger) *yamux.Config {
	c := yamux.DefaultConfig()
	c.EnableKeepAlive = false
	c.StreamOpenTimeout = 0
	c.LogOutput = nil
	c.Logger = slog.NewLogLogger(logHandler(log), slog.LevelDebug)
	return c
}

func logHandler(log *slog.Logger) slog.Handler {
	if log == nil {
		return slog.DiscardHandler
	}
	return log.Handler()
}

func nonce() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails on Linux
	return hex.EncodeToString(b[:])
}

// Connect runs the host side of the handshake on conn, a new connection to the host end
// of the agent's port, and returns a yamux client session over it. It gives up when ctx
// is done; conn is closed on failure. The session owns conn.
func Connect(ctx context.Context, conn net.Conn, log *slog.Logger) (*yamux.Session, error) {
	sess, err := connect(ctx, conn, log)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("agent port handshake: %w", err)
	}
	return sess, nil
}

func connect(ctx context.Context, conn net.Conn, log *slog.Logger) (*yamux.Session, error) {
	h := nonce()
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	reset := []byte("\n" + lineReset + " " + h + "\n")
	lr := &lineReader{r: conn}
	for {
		if _, err := conn.Write(reset); err != nil {
			return nil, ctxErr(ctx, err)
		}
		if err := conn.SetReadDeadline(time.Now().Add(ResendInterval)); err != nil {
			return nil, err
		}
		for {
			line, err := lr.next()
			if errors.Is(err, os.ErrDeadlineExceeded) && ctx.Err() == nil {
				break // resend
			}
			if err != nil {
				return nil, ctxErr(ctx, err)
			}
			f := strings.Fields(line)
			if len(f) == 3 && f[0] == lineHello && f[1] == "-" {
				// A guest starting a handshake that has not seen our RESET (an old
				// session swallowed it): repeat it now rather than at the next tick.
				if _, err := conn.Write(reset); err != nil {
					return nil, ctxErr(ctx, err)
				}
				continue
			}
			if len(f) != 3 || f[0] != lineHello || f[1] != h {
				continue
			}
			if _, err := conn.Write([]byte(lineAck + " " + f[2] + "\n")); err != nil {
				return nil, ctxErr(ctx, err)
			}
			if !stop() {
				return nil, ctx.Err()
			}
			if err := conn.SetDeadline(time.Time{}); err != nil {
				return nil, err
			}
			return yamux.Client(lr.rest(conn), YamuxConfig(log))
		}
	}
}

func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// accept runs the guest side of the handshake on port, a freshly opened device, and
// returns what yamux must read from (bytes already buffered, then port).
func accept(port io.ReadWriteCloser) (io.ReadWriteCloser, error) {
	g := nonce()
	// Blocks until a host is connected.
	if _, err := io.WriteString(port, "\n"+lineHello+" - "+g+"\n"); err != nil {
		return nil, err
	}
	lr := &lineReader{r: port}
	answered := ""
	for {
		line, err := lr.next()
		if err != nil {
			return nil, err
		}
		f := strings.Fields(line)
		switch {
		case len(f) == 2 && f[0] == lineReset && f[1] != answered:
			if _, err := io.WriteString(port, lineHello+" "+f[1]+" "+g+"\n"); err != nil {
				return nil, err
			}
			answered = f[1]
		case len(f) == 2 && f[0] == lineAck && f[1] == g:
			return lr.rest(port), nil
		}
	}
}

// lineReader reads handshake lines without losing bytes to read errors (deadlines) and
// without swallowing what follows the last line.
type lineReader struct {
	r   io.Reader
	buf []byte
}

// next returns the next line without its newline. Runs longer than maxLine without a
// newline are dropped. On error the partial line is kept for the next call.
func (l *lineReader) next() (string, error) {
	var chunk [256]byte
	for {
		if i := bytes.IndexByte(l.buf, '\n'); i >= 0 {
			line := string(l.buf[:i])
			l.buf = l.buf[i+1:]
			return line, nil
		}
		if len(l.buf) > maxLine {
			l.buf = l.buf[:0]
		}
		n, err := l.r.Read(chunk[:])
		l.buf = append(l.buf, chunk[:n]...)
		if err != nil && n == 0 {
			return "", err
		}
	}
}

// rest returns rw with the bytes read past the last line put back in front.
func (l *lineReader) rest(rw io.ReadWriteCloser) io.ReadWriteCloser {
	if len(l.buf) == 0 {
		return rw
	}
	return &prefixed{ReadWriteCloser: rw, prefix: bytes.Clone(l.buf)}
}

type prefixed struct {
	io.ReadWriteCloser
	prefix []byte
}

func (p *prefixed) Read(b []byte) (int, error) {
	if len(p.prefix) > 0 {
		n := copy(b, p.prefix)
		p.prefix = p.prefix[n:]
		return n, nil
	}
	return p.ReadWriteCloser.Read(b)
}
