package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/spacedev/space/api"
)

// GetNetwork returns a sandbox's network policy and whether it is in force.
func (c *Client) GetNetwork(ctx context.Context, sandboxID string) (*api.NetworkState, error) {
	var st api.NetworkState
	err := c.do(ctx, http.MethodGet, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/network", nil, &st, nil)
	return &st, err
}

// PatchNetwork changes a sandbox's network policy with a JSON merge patch (RFC 7386):
// fields in patch replace the current ones, null removes one, absent ones stay.
func (c *Client) PatchNetwork(ctx context.Context, sandboxID string, patch any) (*api.NetworkState, error) {
	var st api.NetworkState
	err := c.do(ctx, http.MethodPatch, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/network", patch, &st, nil)
	return &st, err
}

// SetNetwork replaces a sandbox's network policy whole.
func (c *Client) SetNetwork(ctx context.Context, sandboxID string, n api.Network) (*api.NetworkState, error) {
	var st api.NetworkState
	err := c.do(ctx, http.MethodPut, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/network", n, &st, nil)
	return &st, err
}

// NetLogOptions select what FollowNetLog reads.
type NetLogOptions struct {
	// From is the offset to start at (an event id received earlier resumes after it).
	From int64
	// Follow waits for new entries; otherwise the stream ends at the newest.
	Follow bool
}

// FollowNetLog streams a sandbox's egress audit log to fn (gap > 0 when that many
// entries were dropped before fn got them), resuming from the last event id after a
// disconnect, until ctx ends, fn fails, or (without Follow) the newest entry was read.
func (c *Client) FollowNetLog(ctx context.Context, sandboxID string, o NetLogOptions, fn func(ev api.NetworkEvent, gap int64) error) error {
	from := o.From
	delay := readRetryFirst
	for {
		n, err := c.netlogOnce(ctx, sandboxID, from, o.Follow, func(ev api.NetworkEvent, gap int64) error {
			from = ev.Offset + 1
			return fn(ev, gap)
		})
		if err == nil && !o.Follow {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		var fnErr fnError
		if errors.As(err, &fnErr) {
			return fnErr.err
		}
		if err != nil && !transient(err) && !errors.Is(err, io.ErrUnexpectedEOF) {
			return err
		}
		if n > 0 {
			delay = readRetryFirst
		}
		sleepCtx(ctx, delay)
		delay = min(delay*2, readRetryMax)
	}
}

type fnError struct{ err error }

func (e fnError) Error() string { return e.err.Error() }

// netlogOnce reads one netlog stream; it returns the number of events it read.
func (c *Client) netlogOnce(ctx context.Context, sandboxID string, from int64, follow bool, fn func(api.NetworkEvent, int64) error) (int, error) {
	q := url.Values{"from": {strconv.FormatInt(from, 10)}}
	if !follow {
		q.Set("follow", "false")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.BaseURL+"/v1/sandboxes/"+url.PathEscape(sandboxID)+"/netlog?"+q.Encode(), nil)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Accept", "text/event-stream")
	if c.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.APIKey)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, decodeError(resp)
	}
	st := &Stream{resp: resp, br: newReader(resp.Body)}
	n := 0
	var gap int64
	for {
		ev, err := st.Next()
		if errors.Is(err, io.EOF) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
		switch ev.Name {
		case api.EventGap:
			var g api.GapEvent
			if err := json.Unmarshal(ev.Data, &g); err != nil {
				return n, fmt.Errorf("netlog gap event: %w", err)
			}
			gap += g.Dropped
		case api.EventNetwork:
			var ne api.NetworkEvent
			if err := json.Unmarshal(ev.Data, &ne); err != nil {
				return n, fmt.Errorf("netlog event: %w", err)
			}
			n++
			if err := fn(ne, gap); err != nil {
				return n, fnError{err}
			}
			gap = 0
		}
	}
}

// DialPort opens a TCP connection to port inside a sandbox through the API (an HTTP
// upgrade the API relays to the sandbox's agent, which connects inside the sandbox):
// what `space port-forward` does for each local connection. It works whatever the
// sandbox's network policy. Deadlines on the returned connection are not supported.
func (c *Client) DialPort(ctx context.Context, sandboxID string, port int) (net.Conn, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.BaseURL+"/v1/sandboxes/"+url.PathEscape(sandboxID)+"/ports/"+strconv.Itoa(port), nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", PortUpgrade)
	if c.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.APIKey)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		defer resp.Body.Close()
		return nil, decodeError(resp)
	}
	rwc, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		resp.Body.Close()
		return nil, fmt.Errorf("port %d: the upgraded connection is not writable", port)
	}
	return &portConn{ReadWriteCloser: rwc, port: port}, nil
}

// PortUpgrade is the Upgrade token of the API's port tunnels.
const PortUpgrade = "space-tcp"

type portConn struct {
	io.ReadWriteCloser
	port int
}

func (c *portConn) LocalAddr() net.Addr              { return portAddr(0) }
func (c *portConn) RemoteAddr() net.Addr             { return portAddr(c.port) }
func (c *portConn) SetDeadline(time.Time) error      { return nil }
func (c *portConn) SetReadDeadline(time.Time) error  { return nil }
func (c *portConn) SetWriteDeadline(time.Time) error { return nil }

type portAddr int

func (portAddr) Network() string  { return "space-tunnel" }
func (a portAddr) String() string { return "sandbox:" + strconv.Itoa(int(a)) }
