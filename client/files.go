package client

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"github.com/spacedev/space/api"
)

func (c *Client) fileURL(sandboxID, suffix string, q url.Values) string {
	return c.BaseURL + "/v1/sandboxes/" + url.PathEscape(sandboxID) + "/files" + suffix + "?" + q.Encode()
}

func (c *Client) send(ctx context.Context, method, u string, body io.Reader, ctype string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, err
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	req.Header.Set("Authorization", "Bearer "+c.APIKey)
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode >= 300 {
		defer resp.Body.Close()
		return nil, decodeError(resp)
	}
	return resp, nil
}

// FileOptions are optional parameters of file calls.
type FileOptions struct {
	// User resolves relative paths and owns created files (default root).
	User string
	// Mode of a written file (default 0644).
	Mode uint32
	// Offset and Length select a byte range of a read (Length 0 = to the end).
	Offset, Length int64
	Append         bool
}

func fileQuery(path string, o FileOptions) url.Values {
	q := url.Values{"path": {path}}
	if o.User != "" {
		q.Set("user", o.User)
	}
	if o.Mode != 0 {
		q.Set("mode", strconv.FormatUint(uint64(o.Mode), 8))
	}
	if o.Offset > 0 {
		q.Set("offset", strconv.FormatInt(o.Offset, 10))
	}
	if o.Length > 0 {
		q.Set("length", strconv.FormatInt(o.Length, 10))
	}
	if o.Append {
		q.Set("append", "1")
	}
	return q
}

// ReadFile streams a file out of a sandbox. The caller closes the reader.
func (c *Client) ReadFile(ctx context.Context, sandboxID, path string, o FileOptions) (io.ReadCloser, error) {
	resp, err := c.send(ctx, http.MethodGet, c.fileURL(sandboxID, "", fileQuery(path, o)), nil, "")
	if err != nil {
		return nil, err
	}
	return resp.Body, nil
}

// WriteFile streams r into a file in a sandbox (parents are created; the file is
// replaced atomically).
func (c *Client) WriteFile(ctx context.Context, sandboxID, path string, r io.Reader, o FileOptions) (*api.FileInfo, error) {
	resp, err := c.send(ctx, http.MethodPut, c.fileURL(sandboxID, "", fileQuery(path, o)), r, "application/octet-stream")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var fi api.FileInfo
	return &fi, json.NewDecoder(resp.Body).Decode(&fi)
}

// StatFile describes a file.
func (c *Client) StatFile(ctx context.Context, sandboxID, path string, o FileOptions) (*api.FileInfo, error) {
	resp, err := c.send(ctx, http.MethodGet, c.fileURL(sandboxID, "/stat", fileQuery(path, FileOptions{User: o.User})), nil, "")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var fi api.FileInfo
	return &fi, json.NewDecoder(resp.Body).Decode(&fi)
}

// ListDir lists a directory to the given depth (1 = its entries).
func (c *Client) ListDir(ctx context.Context, sandboxID, path string, depth int, o FileOptions) ([]api.FileInfo, error) {
	q := fileQuery(path, FileOptions{User: o.User})
	if depth > 0 {
		q.Set("depth", strconv.Itoa(depth))
	}
	resp, err := c.send(ctx, http.MethodGet, c.fileURL(sandboxID, "/list", q), nil, "")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var out []api.FileInfo
	return out, json.NewDecoder(resp.Body).Decode(&out)
}

// Mkdir creates a directory.
func (c *Client) Mkdir(ctx context.Context, sandboxID string, req api.MkdirRequest) (*api.FileInfo, error) {
	var fi api.FileInfo
	return &fi, c.do(ctx, http.MethodPost, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/files/mkdir", req, &fi, nil)
}

// Move renames a file or directory.
func (c *Client) Move(ctx context.Context, sandboxID string, req api.MoveRequest) (*api.FileInfo, error) {
	var fi api.FileInfo
	return &fi, c.do(ctx, http.MethodPost, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/files/move", req, &fi, nil)
}

// Remove deletes a file (or, with recursive, a directory tree).
func (c *Client) Remove(ctx context.Context, sandboxID, path string, recursive bool, o FileOptions) error {
	q := fileQuery(path, FileOptions{User: o.User})
	if recursive {
		q.Set("recursive", "1")
	}
	resp, err := c.send(ctx, http.MethodDelete, c.fileURL(sandboxID, "", q), nil, "")
	if err != nil {
		return err
	}
	return resp.Body.Close()
}

// Watch streams file events under a directory until ctx ends; events are delivered to
// fn. It returns once the watch is in place (after the server's start event).
func (c *Client) Watch(ctx context.Context, sandboxID, path string, recursive bool, fn func(api.WatchEvent)) (stop func(), err error) {
	q := fileQuery(path, FileOptions{})
	if recursive {
		q.Set("recursive", "1")
	}
	ctx, cancel := context.WithCancel(ctx)
	resp, err := c.send(ctx, http.MethodGet, c.fileURL(sandboxID, "/watch", q), nil, "")
	if err != nil {
		cancel()
		return nil, err
	}
	st := &Stream{resp: resp, br: newReader(resp.Body)}
	ev, err := st.Next()
	if err != nil || ev.Name != "start" {
		cancel()
		resp.Body.Close()
		return nil, fmt.Errorf("watch did not start: %v %s", err, ev.Name)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer resp.Body.Close()
		for {
			ev, err := st.Next()
			if err != nil {
				return
			}
			var we api.WatchEvent
			if json.Unmarshal(ev.Data, &we) == nil {
				fn(we)
			}
		}
	}()
	return func() { cancel(); <-done }, nil
}
