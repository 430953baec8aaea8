package client

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/spacedev/space/api"
)

// CreateSnapshot asks for a named snapshot of a sandbox; the returned snapshot is
// creating and carries the operation that takes it. Sent again on a transient failure
// under the same Idempotency-Key (doKeyed).
func (c *Client) CreateSnapshot(ctx context.Context, sandboxID string, req api.CreateSnapshotRequest) (*api.Snapshot, error) {
	var out api.Snapshot
	return &out, c.doKeyed(ctx, http.MethodPost, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/snapshots", req, &out, "")
}

// CreateSnapshotAndWait takes a named snapshot and waits until it is ready.
func (c *Client) CreateSnapshotAndWait(ctx context.Context, sandboxID string, req api.CreateSnapshotRequest) (*api.Snapshot, error) {
	sn, err := c.CreateSnapshot(ctx, sandboxID, req)
	if err != nil {
		return nil, err
	}
	op, err := c.WaitOperation(ctx, sn.Operation.ID)
	if err != nil {
		return nil, err
	}
	if op.State != api.OpSucceeded {
		return nil, &Error{Status: http.StatusConflict, Code: "failed", Message: "snapshot failed: " + op.Error}
	}
	return c.GetSnapshot(ctx, sn.ID)
}

// SnapshotListOptions filters ListSnapshots.
type SnapshotListOptions struct {
	// Sandbox lists the snapshots of one sandbox.
	Sandbox string
	// Name lists the snapshot with this name or id.
	Name  string
	Limit int
	// After continues after this snapshot id.
	After string
}

// ListSnapshots lists snapshots, newest first.
func (c *Client) ListSnapshots(ctx context.Context, o SnapshotListOptions) ([]api.Snapshot, error) {
	q := url.Values{}
	for k, v := range map[string]string{"sandbox": o.Sandbox, "name": o.Name, "after": o.After} {
		if v != "" {
			q.Set(k, v)
		}
	}
	if o.Limit > 0 {
		q.Set("limit", strconv.Itoa(o.Limit))
	}
	path := "/v1/snapshots"
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	var out api.SnapshotList
	err := c.do(ctx, http.MethodGet, path, nil, &out, nil)
	return out.Snapshots, err
}

// GetSnapshot returns a snapshot by id or name.
func (c *Client) GetSnapshot(ctx context.Context, ref string) (*api.Snapshot, error) {
	var out api.Snapshot
	return &out, c.do(ctx, http.MethodGet, "/v1/snapshots/"+url.PathEscape(ref), nil, &out, nil)
}

// DeleteSnapshot asks for a snapshot to be deleted (by id or name). It is sent again on
// a transient failure under an Idempotency-Key of its own (doKeyed).
func (c *Client) DeleteSnapshot(ctx context.Context, ref string) (*api.Snapshot, error) {
	var out api.Snapshot
	return &out, c.doKeyed(ctx, http.MethodDelete, "/v1/snapshots/"+url.PathEscape(ref), nil, &out, "")
}

// SandboxMetrics returns a sandbox's resource samples from start to end (zero times:
// open ends), oldest first.
func (c *Client) SandboxMetrics(ctx context.Context, sandboxID string, start, end time.Time) (*api.MetricList, error) {
	q := url.Values{}
	if !start.IsZero() {
		q.Set("start", start.UTC().Format(time.RFC3339Nano))
	}
	if !end.IsZero() {
		q.Set("end", end.UTC().Format(time.RFC3339Nano))
	}
	path := "/v1/sandboxes/" + url.PathEscape(sandboxID) + "/metrics"
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	var out api.MetricList
	return &out, c.do(ctx, http.MethodGet, path, nil, &out, nil)
}
