package service

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
)

// Inbound traffic to a sandbox's ports never needs a routable sandbox: it travels
// through the sandbox's agent (api → node → agent), which opens the TCP connection
// inside the sandbox (GET /v1/ports/{port}/connect, an HTTP Upgrade every hop relays
// as it is). So it works whatever the sandbox's network policy is, also with no
// network at all, and the sandbox's egress rules never have to let anything in.

// errPortClosedCode is the agent's error code when nothing listens on the port.
const errPortClosedCode = wire.ErrCodePortClosed

// portDialTimeout bounds opening a tunnel (the agent's own connect is 5 s).
const portDialTimeout = 20 * time.Second

// ValidPort checks a sandbox port number.
func ValidPort(s string) (int, error) {
	port, err := strconv.Atoi(s)
	if err != nil || port < 1 || port > 65535 {
		return 0, invalid("port %q must be a number between 1 and 65535", s)
	}
	return port, nil
}

// DialPort opens a TCP connection to port inside a sandbox p may see (the sandbox's
// loopback, where the agent dials). A resting sandbox is woken first unless noWake.
// When nothing listens there the error is fault.BadGateway and names the port.
func (s *Service) DialPort(ctx context.Context, p *Principal, id string, port int, noWake bool) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, invalid("port must be between 1 and 65535")
	}
	t, err := s.Running(ctx, p, id, noWake)
	if err != nil {
		return nil, err
	}
	agent, err := s.Agent(ctx, t)
	if err != nil {
		return nil, err
	}
	dctx, cancel := context.WithTimeout(ctx, portDialTimeout)
	defer cancel()
	type result struct {
		resp *http.Response
		err  error
	}
	ch := make(chan result, 1)
	go func() {
		// The request's context must outlive the dial: it governs the upgraded connection.
		resp, err := agent.Upgrade(context.WithoutCancel(ctx), "/v1/ports/"+strconv.Itoa(port)+"/connect", wire.PortUpgrade)
		ch <- result{resp, err}
	}()
	var r result
	select {
	case r = <-ch:
	case <-dctx.Done():
		go func() {
			if r := <-ch; r.resp != nil {
				r.resp.Body.Close()
			}
		}()
		return nil, fault.New(fault.Timeout, "port %d of sandbox %s: no tunnel within %s", port, id, portDialTimeout)
	}
	if r.err != nil {
		return nil, fault.Wrap(fault.Unavailable, fmt.Errorf("port %d of sandbox %s: node unreachable: %w", port, id, r.err))
	}
	if r.resp.StatusCode != http.StatusSwitchingProtocols {
		defer r.resp.Body.Close()
		err := agentclient.DecodeError(r.resp)
		var ae *agentclient.Error
		if errors.As(err, &ae) && ae.Code == errPortClosedCode {
			return nil, fault.New(fault.BadGateway, "nothing listens on port %d in sandbox %s", port, id)
		}
		return nil, fmt.Errorf("port %d of sandbox %s: %w", port, id, err)
	}
	rwc, ok := r.resp.Body.(io.ReadWriteCloser)
	if !ok {
		r.resp.Body.Close()
		return nil, fault.New(fault.BadGateway, "port %d of sandbox %s: the tunnel is not writable", port, id)
	}
	s.touch(id)
	return &tunnelConn{ReadWriteCloser: rwc, port: port}, nil
}

// tunnelConn is a port tunnel as a net.Conn. Deadlines are not supported (the
// upgraded body has none): callers bound their copies with contexts.
type tunnelConn struct {
	io.ReadWriteCloser
	port int
}

func (c *tunnelConn) LocalAddr() net.Addr              { return tunnelAddr{} }
func (c *tunnelConn) RemoteAddr() net.Addr             { return tunnelAddr{port: c.port} }
func (c *tunnelConn) SetDeadline(time.Time) error      { return nil }
func (c *tunnelConn) SetReadDeadline(time.Time) error  { return nil }
func (c *tunnelConn) SetWriteDeadline(time.Time) error { return nil }

type tunnelAddr struct{ port int }

func (tunnelAddr) Network() string  { return "space-tunnel" }
func (a tunnelAddr) String() string { return "sandbox:" + strconv.Itoa(a.port) }
