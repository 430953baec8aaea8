package firecracker

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The agent transport is Firecracker's hybrid vsock: the VM's vsock device is a unix
// socket in the chroot (vsockSocket). The host connects, writes "CONNECT <port>\n" and
// reads "OK <host port>\n"; from then on the connection is a byte stream to the guest's
// AF_VSOCK listener on that port (the agent's, SPACE_AGENT_LISTEN=vsock:AgentVsockPort).
// If nothing listens in the guest (still booting, or just restored) Firecracker closes
// the connection. Each Dial is one such connection: no multiplexing is needed.

// vsockHandshakeTimeout bounds the CONNECT exchange. Firecracker gives the guest 2 s to
// accept before it closes the connection; a paused guest never does.
const vsockHandshakeTimeout = 3 * time.Second

// maxOKLine bounds Firecracker's answer line ("OK 1073741824\n").
const maxOKLine = 32

// dialVsock opens a connection to port of the guest behind the hybrid vsock socket path.
func dialVsock(ctx context.Context, path string, port uint32) (net.Conn, error) {
	c, err := dialUnix(ctx, path)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(vsockHandshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := c.SetDeadline(deadline); err != nil {
		c.Close()
		return nil, err
	}
	if _, err := fmt.Fprintf(c, "CONNECT %d\n", port); err != nil {
		c.Close()
		return nil, fmt.Errorf("vsock connect: %w", err)
	}
	// Byte by byte: whatever follows the line is the agent's and must stay unread.
	var line []byte
	b := make([]byte, 1)
	for {
		if _, err := c.Read(b); err != nil {
			c.Close()
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, fmt.Errorf("vsock connect to port %d: no answer (nothing listening in the guest yet?): %w", port, err)
		}
		if b[0] == '\n' {
			break
		}
		if line = append(line, b[0]); len(line) > maxOKLine {
			c.Close()
			return nil, fmt.Errorf("vsock connect to port %d: answer too long", port)
		}
	}
	if f := strings.Fields(string(line)); len(f) != 2 || f[0] != "OK" {
		c.Close()
		return nil, fmt.Errorf("vsock connect to port %d: unexpected answer %q", port, line)
	}
	if !stop() {
		c.Close()
		return nil, ctx.Err()
	}
	if err := c.SetDeadline(time.Time{}); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// maxSunPath is the longest path a sockaddr_un holds (with its terminating NUL).
const maxSunPath = 107

// dialUnix connects to the unix socket at path. Paths too long for a sockaddr_un (jails
// nest deep) are reached through an O_PATH descriptor of their directory.
func dialUnix(ctx context.Context, path string) (net.Conn, error) {
	var d net.Dialer
	if len(path) <= maxSunPath {
		return d.DialContext(ctx, "unix", path)
	}
	fd, err := unix.Open(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &net.OpError{Op: "dial", Net: "unix", Err: os.NewSyscallError("open", err)}
	}
	defer unix.Close(fd)
	short := "/proc/self/fd/" + strconv.Itoa(fd) + "/" + filepath.Base(path)
	if len(short) > maxSunPath {
		return nil, errors.New("socket name too long: " + path)
	}
	return d.DialContext(ctx, "unix", short)
}
