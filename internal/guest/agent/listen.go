package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spacedev/space/internal/guest/agentlink"
)

// listenSpec is a parsed Config.Listen: "unix:/path", "connect:/path", "vsock:PORT" or
// "serial:/dev/vportNpM".
type listenSpec struct {
	network string
	address string
}

func parseListen(s string) (listenSpec, error) {
	network, address, ok := strings.Cut(s, ":")
	if !ok || address == "" {
		return listenSpec{}, fmt.Errorf("listen address %q: want unix:PATH, connect:PATH, vsock:PORT or serial:DEVICE", s)
	}
	switch network {
	case "unix", "connect":
		if !filepath.IsAbs(address) {
			return listenSpec{}, fmt.Errorf("listen address %q: socket path must be absolute", s)
		}
	case "vsock":
		if _, err := strconv.ParseUint(address, 10, 32); err != nil {
			return listenSpec{}, fmt.Errorf("listen address %q: bad vsock port", s)
		}
	case "serial":
	default:
		return listenSpec{}, fmt.Errorf("listen address %q: unknown transport %q", s, network)
	}
	return listenSpec{network: network, address: address}, nil
}

// listen opens the listener for s. Every transport yields a net.Listener, so the HTTP
// server above does not care which one it is: vsock is an AF_VSOCK socket, serial a
// yamux session over the port (yamux.Session implements net.Listener), and connect the
// connections the agent makes to the host's unix socket when the host asks for them.
func listen(ctx context.Context, s string, key *agentlink.Key) (net.Listener, error) {
	ls, err := parseListen(s)
	if err != nil {
		return nil, err
	}
	switch ls.network {
	case "unix":
		return listenUnix(ctx, ls.address)
	case "connect":
		return listenConnect(ctx, ls.address, key)
	case "serial":
		return listenSerial(ctx, ls.address)
	case "vsock":
		return listenVsock(ctx, ls.address)
	default:
		return nil, fmt.Errorf("listen %s: transport %q not implemented yet", s, ls.network)
	}
}

func listenUnix(ctx context.Context, path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	// A socket left by an earlier agent (crash, restore) blocks bind: remove it, but
	// never anything that is not a socket.
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("listen %s: exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("listen %s: remove stale socket: %w", path, err)
		}
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	// Only root should connect. gVisor refuses chmod on a host-backed socket (EPERM);
	// there the run directory itself is private to the host (mode 0700), which is what
	// keeps other host users out, so the failure is not fatal.
	_ = os.Chmod(path, 0o600)
	return ln, nil
}

// listenConnect serves the host over connections the agent makes to the host's unix
// socket at path (gVisor: the node listens on it, in the run directory; package
// agentlink): a control connection, and one plain connection per HTTP connection the
// node asks for. Under gVisor the agent then binds no socket on a host file system, so
// runsc can run with --host-uds=open: a socket a program binds on the disk is the
// Sentry's, which a checkpoint saves (with --host-uds=create it was a host socket, and
// the sandbox could not be suspended while it existed). key is the agent's for its
// life: it presents it whenever it connects.
func listenConnect(ctx context.Context, path string, key *agentlink.Key) (net.Listener, error) {
	return agentlink.Listen(ctx, path, key)
}
