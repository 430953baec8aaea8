package agentclient

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// finConn is the client's end of a connection whose server closes it after its first
// answer. It hands the server's close (EOF) to net/http only once allow is closed, and
// reports when net/http closed the connection for it.
type finConn struct {
	net.Conn
	allow  chan struct{}
	closed chan struct{}
	once   sync.Once
}

func (c *finConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n == 0 && err == io.EOF {
		<-c.allow
	}
	return n, err
}

func (c *finConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// closedIdleScenario reproduces net/http's "server closed idle connection" for a POST
// without a race: the server answers a first request on a keep-alive connection and
// closes it; the next POST, which post sends through rt (with ctx) to the server at
// base, takes that connection from the pool, and only then does net/http learn of the
// close. It returns post's error and how many POSTs the server read.
func closedIdleScenario(t *testing.T, wrap func(http.RoundTripper) http.RoundTripper, post func(ctx context.Context, rt http.RoundTripper, base string) error) (error, int64) {
	t.Helper()
	var posts atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.Method == http.MethodPost {
			posts.Add(1)
		}
		if r.URL.Path == "/first" {
			// Answer as a keep-alive connection would, then close it (a server that
			// could not reuse it after all).
			conn, buf, err := http.NewResponseController(w).Hijack()
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = buf.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			_ = buf.Flush()
			_ = conn.Close()
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(srv.Close)
	var first *finConn
	var dials atomic.Int64
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil || dials.Add(1) > 1 {
			return c, err
		}
		first = &finConn{Conn: c, allow: make(chan struct{}), closed: make(chan struct{})}
		return first, nil
	}}
	t.Cleanup(tr.CloseIdleConnections)
	hc := &http.Client{Transport: wrap(tr)}
	resp, err := hc.Get(srv.URL + "/first")
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
		t.Fatalf("first answer %q", b)
	}
	_ = resp.Body.Close()
	var once sync.Once
	trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
		if info.Reused && info.Conn == net.Conn(first) {
			once.Do(func() {
				close(first.allow)
				select {
				case <-first.closed:
				case <-time.After(10 * time.Second):
					t.Error("net/http did not close the connection the server closed")
				}
			})
		}
	}}
	err = post(httptrace.WithClientTrace(context.Background(), trace), hc.Transport, srv.URL)
	return err, posts.Load()
}

// postExec is a POST whose body net/http can replay (the JSON the client builds).
func postExec(ctx context.Context, rt http.RoundTripper, base string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/exec", strings.NewReader(`{"argv":["true"]}`))
	if err != nil {
		return err
	}
	resp, err := (&http.Client{Transport: rt}).Do(req)
	if err == nil {
		_ = resp.Body.Close()
	}
	return err
}

// TestRetryClosedIdle: a POST that went out on a pooled connection the server had
// closed is sent again on another one, once, and the server reads it once. Without
// the retry it fails ("server closed idle connection"): the scenario is real.
func TestRetryClosedIdle(t *testing.T) {
	err, posts := closedIdleScenario(t, func(rt http.RoundTripper) http.RoundTripper { return rt }, postExec)
	if err == nil || !serverClosedIdle(err) {
		t.Fatalf("without the retry: %v", err)
	}
	if posts != 0 {
		t.Fatalf("the server read %d POSTs of a request on a closed connection", posts)
	}
	err, posts = closedIdleScenario(t, func(rt http.RoundTripper) http.RoundTripper { return retryClosedIdle{inner: rt} }, postExec)
	if err != nil {
		t.Fatalf("with the retry: %v", err)
	}
	if posts != 1 {
		t.Fatalf("the server read %d POSTs, want 1", posts)
	}
}

// TestRelayRetriesClosedIdle: Relay reads a short body of declared length first (an
// envd call relayed for an E2B SDK), so that it too is sent again on another connection;
// the server reads it once and the client gets the agent's answer.
func TestRelayRetriesClosedIdle(t *testing.T) {
	err, posts := closedIdleScenario(t, func(rt http.RoundTripper) http.RoundTripper { return rt },
		func(ctx context.Context, rt http.RoundTripper, base string) error {
			c := NewVia(base, rt, nil)
			in := httptest.NewRequestWithContext(ctx, http.MethodPost, "/process.Process/Start", strings.NewReader(`{"process":{"cmd":"true"}}`))
			w := httptest.NewRecorder()
			if err := c.Relay(w, in, "/v1/exec", nil); err != nil {
				return err
			}
			if w.Code != http.StatusNoContent {
				t.Errorf("relayed answer %d", w.Code)
			}
			return nil
		})
	if err != nil {
		t.Fatalf("relay: %v", err)
	}
	if posts != 1 {
		t.Fatalf("the server read %d POSTs, want 1", posts)
	}
}
