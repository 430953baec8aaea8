package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

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
