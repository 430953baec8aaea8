package agentclient

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
)

// closedIdleRetries bounds the retries of one request. Each retry goes out on another
// connection (the closed one has left the pool), and net/http drops a pooled
// connection as soon as it reads the server's close: a request meets at most the few
// the server closed in the same instant (a node that stops closes all of them).
const closedIdleRetries = 3

// retryClosedIdle sends a request again when the reused connection it went out on
// had already been closed by the server: net/http's "server closed idle connection".
// net/http reports that only when the server's close arrived before the request was
// registered on the connection, so the server never read the request and sending it
// again cannot make a command run twice. net/http retries such a request by itself
// only when its method is idempotent; a process start and a one-request exec are
// POSTs, and without this one failed with 503 now and then on a busy server
// ("sandbox agent unreachable (POST /v1/exec): http: server closed idle connection",
// a neighbour's probe in the adversary suite's session flood). Both the node's own
// connections to an agent and the api role's to a node's agent proxy retry so.
//
// A body is sent again when net/http can replay it (GetBody: the JSON this package
// builds in memory, a short body Relay read first), and a streamed body when nothing
// has been read from it yet (heldBody: an upload relayed from its client, whose bytes
// still wait in the client's connection). A streamed body of which anything was read
// fails as before: those bytes are gone.
type retryClosedIdle struct{ inner http.RoundTripper }

func (t retryClosedIdle) RoundTrip(req *http.Request) (*http.Response, error) {
	var held *heldBody
	if req.Body != nil && req.Body != http.NoBody && req.GetBody == nil {
		held = &heldBody{inner: req.Body}
		req = req.Clone(req.Context())
		req.Body = held.attempt()
	}
	resp, err := t.inner.RoundTrip(req)
	for range closedIdleRetries {
		if err == nil || !serverClosedIdle(err) || req.Context().Err() != nil {
			break
		}
		body, ok := resend(req, held)
		if !ok {
			break
		}
		req = req.Clone(req.Context())
		req.Body = body
		resp, err = t.inner.RoundTrip(req)
	}
	if held != nil {
		held.settle()
	}
	return resp, err
}

// resend returns the body to send req again with, or false if it cannot be sent again.
func resend(req *http.Request, held *heldBody) (io.ReadCloser, bool) {
	switch {
	case held != nil:
		body := held.attempt()
		return body, body != nil
	case req.Body == nil || req.Body == http.NoBody:
		return req.Body, true
	case req.GetBody != nil:
		body, err := req.GetBody()
		return body, err == nil
	}
	return nil, false
}

// heldBody lends a streamed request body to one attempt at a time, and keeps it for
// the next while no attempt has read from it: net/http closes the body of a request it
// failed, and that close waits until RoundTrip knows whether another attempt follows
// (settle). Once anything was read, or RoundTrip has returned, a close closes.
type heldBody struct {
	inner io.ReadCloser

	mu      sync.Mutex
	cur     *heldAttempt // the attempt the body is lent to
	read    bool         // an attempt read from inner: no other may
	settled bool         // RoundTrip returned
	closed  bool
}

// errBodyMoved answers the reads of an attempt whose body went to the next one.
var errBodyMoved = errors.New("agentclient: request body moved to a retry")

// heldAttempt is one attempt's view of a heldBody.
type heldAttempt struct {
	h           *heldBody
	closeWanted bool // closed before the body could tell whether a retry follows
}

// attempt lends the body to a new attempt, or returns nil if it was read or closed.
func (h *heldBody) attempt() io.ReadCloser {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.read || h.closed {
		return nil
	}
	h.cur = &heldAttempt{h: h}
	return h.cur
}

// settle ends the lending: the body is closed now if its attempt already asked to.
func (h *heldBody) settle() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.settled = true
	if h.cur == nil || h.cur.closeWanted {
		h.closeLocked()
	}
}

func (h *heldBody) closeLocked() error {
	if h.closed {
		return nil
	}
	h.closed = true
	return h.inner.Close()
}

func (a *heldAttempt) Read(p []byte) (int, error) {
	h := a.h
	h.mu.Lock()
	if h.cur != a || h.closed {
		h.mu.Unlock()
		return 0, errBodyMoved
	}
	h.read = true
	h.mu.Unlock()
	return h.inner.Read(p)
}

func (a *heldAttempt) Close() error {
	h := a.h
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case h.cur != a: // an earlier attempt's; the body is lent on
		return nil
	case !h.read && !h.settled:
		a.closeWanted = true
		return nil
	}
	return h.closeLocked()
}

// serverClosedIdle reports net/http's errServerClosedIdle, which it does not export;
// its text is part of its behaviour since Go 1.10.
func serverClosedIdle(err error) bool {
	return strings.Contains(err.Error(), "http: server closed idle connection")
}

// CloseIdleConnections passes through (http.Client calls it on its transport).
func (t retryClosedIdle) CloseIdleConnections() {
	if c, ok := t.inner.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}
