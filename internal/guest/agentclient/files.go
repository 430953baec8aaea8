package agentclient

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"github.com/spacedev/space/internal/guest/wire"
)

// ReadOptions selects a range of a file: Length bytes from Offset; Length <= 0 means
// to the end.
type ReadOptions struct {
	User   string
	Offset int64
	Length int64
}

// ReadFile streams a file's content (or a range). The caller closes the reader. size
// is the whole file's size.
func (c *Client) ReadFile(ctx context.Context, path string, opts ReadOptions) (rc io.ReadCloser, size int64, err error) {
	q := url.Values{"path": {path}}
	if opts.User != "" {
		q.Set("user", opts.User)
	}
	if opts.Offset > 0 {
		q.Set("offset", strconv.FormatInt(opts.Offset, 10))
	}
	if opts.Length > 0 {
		q.Set("length", strconv.FormatInt(opts.Length, 10))
	}
	resp, err := c.request(ctx, http.MethodGet, "/v1/files/content", q, nil, "", http.StatusOK)
	if err != nil {
		return nil, 0, err
	}
	size, err = strconv.ParseInt(resp.Header.Get(wire.FileSizeHeader), 10, 64)
	if err != nil {
		size = resp.ContentLength
	}
	return resp.Body, size, nil
}

// WriteOptions controls WriteFile.
type WriteOptions struct {
	// User owns the file and created parent directories; relative paths are relative
	// to its home.
	User string
	// Mode is the permission bits; 0 keeps an existing file's mode (0644 for new ones).
	Mode uint32
	// Append appends instead of replacing atomically.
	Append bool
}

// WriteFile streams r into path: written to a temporary file and renamed over path
// (or appended with opts.Append). It returns the new entry.
func (c *Client) WriteFile(ctx context.Context, path string, r io.Reader, opts WriteOptions) (wire.EntryInfo, error) {
	q := url.Values{"path": {path}}
	if opts.User != "" {
		q.Set("user", opts.User)
	}
	if opts.Mode != 0 {
		q.Set("mode", strconv.FormatUint(uint64(opts.Mode), 8))
	}
	if opts.Append {
		q.Set("append", "1")
	}
	if r == nil {
		r = http.NoBody
	}
	resp, err := c.request(ctx, http.MethodPut, "/v1/files/content", q, r, "application/octet-stream", http.StatusOK)
	if err != nil {
		return wire.EntryInfo{}, err
	}
	defer resp.Body.Close()
	var info wire.EntryInfo
	if err := decodeBounded(resp.Body, MaxSmallReply, &info, "a file write"); err != nil {
		return wire.EntryInfo{}, err
	}
	return info, nil
}

// Stat describes path (symbolic links are not followed).
func (c *Client) Stat(ctx context.Context, path, user string) (wire.EntryInfo, error) {
	var info wire.EntryInfo
	err := c.doJSON(ctx, http.MethodGet, "/v1/files/stat", pathQuery(path, user), nil, &info, MaxSmallReply, http.StatusOK)
	return info, err
}

// List lists the entries below directory path, depth levels deep (1 = its children).
func (c *Client) List(ctx context.Context, path, user string, depth int) ([]wire.EntryInfo, error) {
	q := pathQuery(path, user)
	if depth > 0 {
		q.Set("depth", strconv.Itoa(depth))
	}
	var out []wire.EntryInfo
	err := c.doJSON(ctx, http.MethodGet, "/v1/files/list", q, nil, &out, MaxListReply, http.StatusOK)
	return out, err
}

// Mkdir creates a directory.
func (c *Client) Mkdir(ctx context.Context, req wire.MkdirRequest) (wire.EntryInfo, error) {
	var info wire.EntryInfo
	err := c.doJSON(ctx, http.MethodPost, "/v1/files/mkdir", nil, req, &info, MaxSmallReply, http.StatusCreated)
	return info, err
}

// Move renames req.From to req.To.
func (c *Client) Move(ctx context.Context, req wire.MoveRequest) (wire.EntryInfo, error) {
	var info wire.EntryInfo
	err := c.doJSON(ctx, http.MethodPost, "/v1/files/move", nil, req, &info, MaxSmallReply, http.StatusOK)
	return info, err
}

// Remove deletes path; a non-empty directory needs recursive.
func (c *Client) Remove(ctx context.Context, path, user string, recursive bool) error {
	q := pathQuery(path, user)
	if recursive {
		q.Set("recursive", "1")
	}
	return c.doJSON(ctx, http.MethodDelete, "/v1/files", q, nil, nil, MaxSmallReply, http.StatusNoContent)
}

func pathQuery(path, user string) url.Values {
	q := url.Values{"path": {path}}
	if user != "" {
		q.Set("user", user)
	}
	return q
}

// WatchStream reads the events of a directory watch.
type WatchStream struct {
	// Start is the agent's first event: the watch is in place (its Path is the
	// resolved directory).
	Start wire.WatchEvent
	body  io.ReadCloser
	sc    *bufio.Scanner
}

// Watch watches directory path (and its subdirectories with recursive). It returns
// once the watch is in place: changes made after Watch returns are reported.
func (c *Client) Watch(ctx context.Context, path, user string, recursive bool) (*WatchStream, error) {
	q := pathQuery(path, user)
	if recursive {
		q.Set("recursive", "1")
	}
	resp, err := c.stream(ctx, http.MethodGet, "/v1/files/watch", q, nil, "", http.StatusOK)
	if err != nil {
		return nil, err
	}
	s := &WatchStream{body: resp.Body, sc: bufio.NewScanner(resp.Body)}
	s.sc.Buffer(make([]byte, 4096), 1<<20)
	ev, err := s.Next()
	if err != nil {
		resp.Body.Close()
		return nil, fmt.Errorf("agent watch %s: %w", path, err)
	}
	if ev.Type != wire.WatchStart {
		resp.Body.Close()
		return nil, fmt.Errorf("agent watch %s: first event is %q, want %q", path, ev.Type, wire.WatchStart)
	}
	s.Start = ev
	return s, nil
}

// Next returns the next event, heartbeats included; io.EOF when the stream ends (the
// watched directory went away).
func (s *WatchStream) Next() (wire.WatchEvent, error) {
	if !s.sc.Scan() {
		if err := s.sc.Err(); err != nil {
			return wire.WatchEvent{}, err
		}
		return wire.WatchEvent{}, io.EOF
	}
	var ev wire.WatchEvent
	if err := json.Unmarshal(s.sc.Bytes(), &ev); err != nil {
		return wire.WatchEvent{}, fmt.Errorf("agent watch: bad event: %w", err)
	}
	return ev, nil
}

// Close ends the watch.
func (s *WatchStream) Close() error { return s.body.Close() }
