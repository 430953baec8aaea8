package agentclient

import (
	"net/http"
	"strings"
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
// Only a request whose body can be sent again is retried: none, or one net/http can
// replay (GetBody: the JSON this package builds in memory, a short body Relay read
// first). A longer relayed body streams from its client once and fails as before.
type retryClosedIdle struct{ inner http.RoundTripper }

func (t retryClosedIdle) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := t.inner.RoundTrip(req)
	for range closedIdleRetries {
		if err == nil || !serverClosedIdle(err) || req.Context().Err() != nil {
			break
		}
		if req.Body != nil && req.Body != http.NoBody {
			if req.GetBody == nil {
				break
			}
			body, gerr := req.GetBody()
			if gerr != nil {
				break
			}
			req = req.Clone(req.Context())
			req.Body = body
		}
		resp, err = t.inner.RoundTrip(req)
	}
	return resp, err
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
