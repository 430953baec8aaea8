package agentclient

import (
	"context"
	"errors"
	"io"
	"log/slog"
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
// close. It returns post's error and how many POSTs the server read, and their
// bodies' bytes.
func closedIdleScenario(t *testing.T, wrap func(http.RoundTripper) http.RoundTripper, post func(ctx context.Context, rt http.RoundTripper, base string) error) (error, int64, int64) {
	t.Helper()
	var posts, bodies atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		if r.Method == http.MethodPost {
			posts.Add(1)
			bodies.Add(n)
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
	return err, posts.Load(), bodies.Load()
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
	err, posts, _ := closedIdleScenario(t, func(rt http.RoundTripper) http.RoundTripper { return rt }, postExec)
	if err == nil || !serverClosedIdle(err) {
		t.Fatalf("without the retry: %v", err)
	}
	if posts != 0 {
		t.Fatalf("the server read %d POSTs of a request on a closed connection", posts)
	}
	err, posts, _ = closedIdleScenario(t, func(rt http.RoundTripper) http.RoundTripper { return retryClosedIdle{inner: rt} }, postExec)
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
	body := `{"process":{"cmd":"true"}}`
	err, posts, _ := closedIdleScenario(t, func(rt http.RoundTripper) http.RoundTripper { return rt },
		relayPost(t, "/v1/exec", strings.NewReader(body), int64(len(body))))
	if err != nil {
		t.Fatalf("relay: %v", err)
	}
	if posts != 1 {
		t.Fatalf("the server read %d POSTs, want 1", posts)
	}
}

// relayPost relays a POST of body (length bytes declared) from a client through Relay
// to path on the scenario's server, and expects its 204.
func relayPost(t *testing.T, path string, body io.Reader, length int64) func(ctx context.Context, rt http.RoundTripper, base string) error {
	return func(ctx context.Context, rt http.RoundTripper, base string) error {
		c := NewVia(base, rt, nil)
		in := httptest.NewRequestWithContext(ctx, http.MethodPost, "/relayed", body)
		in.ContentLength = length
		w := httptest.NewRecorder()
		if err := c.Relay(w, in, path, nil, slog.New(slog.DiscardHandler)); err != nil {
			return err
		}
		if w.Code != http.StatusNoContent {
			t.Errorf("relayed answer %d", w.Code)
		}
		return nil
	}
}

// countingBody is a streamed request body (no length net/http knows of, no GetBody)
// that counts its reads and closes.
type countingBody struct {
	r      io.Reader
	reads  atomic.Int64
	closes atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) { b.reads.Add(1); return b.r.Read(p) }
func (b *countingBody) Close() error               { b.closes.Add(1); return nil }

// TestRetryClosedIdleStreamedBody: an upload that streams from its client (a relayed
// body longer than Relay reads first, or one of unknown length) and went out on a
// pooled connection the server had closed is sent again, whole, on another one: net/http
// had not read a byte of it. The server reads it once; the body is closed once. Without
// the retry it failed with "server closed idle connection" (and 503 at the API).
func TestRetryClosedIdleStreamedBody(t *testing.T) {
	const size = 1 << 20
	var body *countingBody
	send := func(ctx context.Context, rt http.RoundTripper, base string) error {
		body = &countingBody{r: io.LimitReader(zeros{}, size)}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/files", body)
		if err != nil {
			return err
		}
		resp, err := rt.RoundTrip(req)
		if err == nil {
			_ = resp.Body.Close()
		}
		return err
	}
	err, posts, _ := closedIdleScenario(t, func(rt http.RoundTripper) http.RoundTripper { return rt }, send)
	if err == nil || !serverClosedIdle(err) {
		t.Fatalf("without the retry: %v", err)
	}
	if posts != 0 || body.reads.Load() != 0 {
		t.Fatalf("the failed attempt: %d POSTs read, %d body reads", posts, body.reads.Load())
	}
	err, posts, bytes := closedIdleScenario(t, func(rt http.RoundTripper) http.RoundTripper { return retryClosedIdle{inner: rt} }, send)
	if err != nil {
		t.Fatalf("with the retry: %v", err)
	}
	if posts != 1 || bytes != size {
		t.Fatalf("the server read %d POSTs of %d bytes, want 1 of %d", posts, bytes, size)
	}
	waitFor(t, func() bool { return body.closes.Load() == 1 }, "the body closed once (closed %d times)", body.closes.Load)

	// Relayed: a declared body above ReplayableBody streams from the client's connection.
	err, posts, bytes = closedIdleScenario(t, func(rt http.RoundTripper) http.RoundTripper { return rt },
		relayPost(t, "/v1/files", io.LimitReader(zeros{}, size), size))
	if err != nil {
		t.Fatalf("relay: %v", err)
	}
	if posts != 1 || bytes != size {
		t.Fatalf("relayed: the server read %d POSTs of %d bytes, want 1 of %d", posts, bytes, size)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// waitFor polls cond for up to 5 s (net/http closes a request's body on its own
// goroutine, after RoundTrip may have returned).
func waitFor(t *testing.T, cond func() bool, msg string, arg func() int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf(msg, arg())
		}
		time.Sleep(time.Millisecond) // poll interval
	}
}

// TestHeldBody: a streamed body goes to a second attempt only while nothing was read
// from it; the first attempt's close waits for RoundTrip's end (settle), a stale
// attempt can no longer read, and the body is closed exactly once in every case.
func TestHeldBody(t *testing.T) {
	t.Run("unread, closed by the failed attempt, sent again", func(t *testing.T) {
		in := &countingBody{r: strings.NewReader("abc")}
		h := &heldBody{inner: in}
		first := h.attempt()
		_ = first.Close() // net/http closing the body of the request it failed
		if in.closes.Load() != 0 {
			t.Fatal("closed before RoundTrip knew whether a retry follows")
		}
		second := h.attempt()
		if second == nil {
			t.Fatal("an unread body was not lent again")
		}
		if _, err := first.Read(make([]byte, 1)); !errors.Is(err, errBodyMoved) {
			t.Fatalf("a stale attempt read: %v", err)
		}
		_ = first.Close()
		if b, err := io.ReadAll(second); err != nil || string(b) != "abc" {
			t.Fatalf("the retry's body %q %v", b, err)
		}
		_ = second.Close()
		h.settle()
		if in.closes.Load() != 1 {
			t.Fatalf("closed %d times", in.closes.Load())
		}
	})
	t.Run("read, not sent again", func(t *testing.T) {
		in := &countingBody{r: strings.NewReader("abc")}
		h := &heldBody{inner: in}
		first := h.attempt()
		_, _ = first.Read(make([]byte, 1))
		_ = first.Close()
		if in.closes.Load() != 1 {
			t.Fatal("a read body's close was held")
		}
		if h.attempt() != nil {
			t.Fatal("a body something was read from was lent again")
		}
		h.settle()
		if in.closes.Load() != 1 {
			t.Fatalf("closed %d times", in.closes.Load())
		}
	})
	t.Run("unread, closed after RoundTrip returned", func(t *testing.T) {
		in := &countingBody{r: strings.NewReader("abc")}
		h := &heldBody{inner: in}
		first := h.attempt()
		h.settle() // an answer that came before net/http wrote the body
		if in.closes.Load() != 0 {
			t.Fatal("settle closed a body its attempt still holds")
		}
		_ = first.Close()
		if in.closes.Load() != 1 {
			t.Fatalf("closed %d times", in.closes.Load())
		}
	})
	t.Run("unread, failed for good", func(t *testing.T) {
		in := &countingBody{r: strings.NewReader("abc")}
		h := &heldBody{inner: in}
		_ = h.attempt().Close()
		h.settle()
		if in.closes.Load() != 1 {
			t.Fatalf("closed %d times", in.closes.Load())
		}
	})
}
