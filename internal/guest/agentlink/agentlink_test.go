package agentlink

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func ctxFor(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// host listens on a new socket and serves it with a Host.
func host(t *testing.T, path string) *Host {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	h := NewHost(ln, slog.New(slog.DiscardHandler))
	t.Cleanup(h.Close)
	return h
}

// agent connects to path as the agent does and answers every request with name; the
// returned function stops it (its listener closed, as a quiesce does).
func agent(t *testing.T, ctx context.Context, path, name string) (stop func(), err error) {
	ln, err := Listen(ctx, path)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, name) })}
	done := make(chan struct{})
	go func() { srv.Serve(ln); close(done) }()
	var once sync.Once
	stop = func() { once.Do(func() { srv.Close(); <-done }) }
	t.Cleanup(stop)
	return stop, nil
}

func client(h *Host) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return h.Dial(ctx) },
	}}
}

func get(ctx context.Context, c *http.Client) (string, error) {
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://agent/", nil)
	resp, err := c.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// TestLink: requests reach the agent over connections it dials, also many at once; a
// second control connection is refused while the agent's answers, and takes the place
// once the agent's has ended; a data connection without the key gets nothing.
func TestLink(t *testing.T) {
	path := filepath.Join(t.TempDir(), "node.sock")
	h := host(t, path)
	c := client(h)
	ctx := ctxFor(t, 30*time.Second)
	stopAgent, err := agent(t, ctx, path, "agent")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for range 20 { // 20 at once: as many data connections
		wg.Add(1)
		go func() {
			defer wg.Done()
			if got, err := get(ctx, c); err != nil || got != "agent" {
				errs <- fmt.Errorf("%q %v", got, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	// An impostor's control connection is refused while the agent answers.
	if _, err := agent(t, ctxFor(t, 5*time.Second), path, "impostor"); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("second control connection: %v", err)
	}
	// A data connection with a made-up key gets no request and is closed.
	raw, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(raw, helloData+strings.Repeat("0", 64)+"\n")
	raw.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := raw.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("data connection without the key: %d %v", n, err)
	}
	raw.Close()
	c.CloseIdleConnections()
	if got, err := get(ctx, c); err != nil || got != "agent" {
		t.Fatalf("after the impostors: %q %v", got, err)
	}

	// Once the agent's connection ends, the next control connection takes the place.
	stopAgent()
	c.CloseIdleConnections()
	for { // as the agent does, until the node has seen the first one go
		if _, err := agent(t, ctx, path, "next"); err == nil {
			break
		} else if ctx.Err() != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got, err := get(ctx, c); err != nil || got != "next" {
		t.Fatalf("after the agent left: %q %v", got, err)
	}
}

// TestLinkQuiesce: while the agent has closed its listener (a quiesce), a Dial waits
// rather than return a connection of the ended session, and is answered once the
// agent connects again.
func TestLinkQuiesce(t *testing.T) {
	path := filepath.Join(t.TempDir(), "node.sock")
	h := host(t, path)
	ctx := ctxFor(t, 30*time.Second)
	for round := range 3 {
		stop, err := agent(t, ctx, path, fmt.Sprint("agent", round))
		if err != nil {
			t.Fatal(err)
		}
		c := client(h)
		if got, err := get(ctx, c); err != nil || got != fmt.Sprint("agent", round) {
			t.Fatalf("round %d: %q %v", round, got, err)
		}
		stop()
		short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		conn, err := h.Dial(short)
		cancel()
		if err == nil {
			conn.Close()
			t.Fatalf("round %d: Dial returned a connection while the agent was away", round)
		}
	}
}

// TestLinkNodeRestart: the agent connects again to a new node process's socket and
// serves it; Dial ends with ErrClosed once the Host is closed.
func TestLinkNodeRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "node.sock")
	h := host(t, path)
	ctx := ctxFor(t, 30*time.Second)
	if _, err := agent(t, ctx, path, "agent"); err != nil {
		t.Fatal(err)
	}
	if got, err := get(ctx, client(h)); err != nil || got != "agent" {
		t.Fatalf("%q %v", got, err)
	}
	h.Close()
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if _, err := h.Dial(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("Dial after Close: %v", err)
	}
	h2 := host(t, path)
	if got, err := get(ctx, client(h2)); err != nil || got != "agent" {
		t.Fatalf("after the node's restart: %q %v", got, err)
	}
	// A Dial waiting for an agent that is not there ends when the Host closes.
	path3 := filepath.Join(t.TempDir(), "node.sock")
	h3 := host(t, path3)
	errc := make(chan error, 1)
	go func() { _, err := h3.Dial(ctx); errc <- err }()
	time.Sleep(50 * time.Millisecond) // let it wait; the assertion below does not depend on it
	h3.Close()
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Fatalf("waiting Dial at Close: %v", err)
	}
}

// TestLinkSilentFlood: a process of the sandbox that opens connections and says
// nothing, as fast as it can, neither holds up the agent's connections nor makes the
// node keep more than maxPending of them open.
func TestLinkSilentFlood(t *testing.T) {
	path := filepath.Join(t.TempDir(), "node.sock")
	h := host(t, path)
	c := client(h)
	ctx := ctxFor(t, 60*time.Second)
	if _, err := agent(t, ctx, path, "agent"); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	flooded := make(chan int)
	go func() {
		var open []net.Conn
		opened := 0
		defer func() {
			for _, c := range open {
				c.Close()
			}
			flooded <- opened
		}()
		for { // at most 500 open at once; then the oldest makes way for a new one
			select {
			case <-stop:
				return
			default:
			}
			if len(open) == 500 {
				open[0].Close()
				open = open[1:]
			}
			conn, err := net.Dial("unix", path)
			if err != nil {
				time.Sleep(time.Millisecond)
				continue
			}
			open = append(open, conn)
			opened++
		}
	}()
	for i := range 20 {
		c.CloseIdleConnections() // every request on a new data connection
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		got, err := get(rctx, c)
		cancel()
		if err != nil || got != "agent" {
			t.Fatalf("request %d during the flood: %q %v", i, got, err)
		}
		h.pmu.Lock()
		n := len(h.pending)
		h.pmu.Unlock()
		if n > maxPending {
			t.Fatalf("%d connections wait for a greeting, more than %d", n, maxPending)
		}
	}
	close(stop)
	t.Logf("silent connections opened: %d", <-flooded)
}
