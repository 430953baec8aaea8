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
	"sync/atomic"
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
	return hostWith(t, path, Keys{})
}

func hostWith(t *testing.T, path string, keys Keys) *Host {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	h := NewHost(ln, slog.New(slog.DiscardHandler), keys)
	t.Cleanup(h.Close)
	return h
}

// agent connects to path as a new agent does and answers every request with name; the
// returned function stops it (its listener closed, as a quiesce does).
func agent(t *testing.T, ctx context.Context, path, name string) (stop func(), err error) {
	return agentWith(t, ctx, path, name, new(Key))
}

// agentWith is agent with the key an agent keeps across its listeners.
func agentWith(t *testing.T, ctx context.Context, path, name string, key *Key) (stop func(), err error) {
	ln, err := Listen(ctx, path, key)
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
// second control connection is refused while the agent's answers, and also once the
// agent's has ended unless it presents the agent's key (the agent connecting again
// does); a data connection without the key gets nothing.
func TestLink(t *testing.T) {
	path := filepath.Join(t.TempDir(), "node.sock")
	h := host(t, path)
	c := client(h)
	ctx := ctxFor(t, 30*time.Second)
	var key Key
	stopAgent, err := agentWith(t, ctx, path, "agent", &key)
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

	// Once the agent's connection ends, a control connection without its key is
	// refused (the node no longer waits for a ping), with a key made up too, or as an
	// agent from before keys; the agent itself takes its place again.
	stopAgent()
	c.CloseIdleConnections()
	waitFree(t, h)
	if _, err := agent(t, ctxFor(t, 5*time.Second), path, "impostor"); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("a control connection without the key after the agent left: %v", err)
	}
	made := new(Key)
	made.set(strings.Repeat("ab", 32))
	if _, err := agentWith(t, ctxFor(t, 5*time.Second), path, "impostor", made); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("a control connection with a made-up key: %v", err)
	}
	if refusedAsOld(t, path) {
		t.Fatal("a control connection greeting as an agent from before keys took the place")
	}
	if _, err := agentWith(t, ctx, path, "agent again", &key); err != nil {
		t.Fatal(err)
	}
	if got, err := get(ctx, c); err != nil || got != "agent again" {
		t.Fatalf("after the agent came back: %q %v", got, err)
	}
}

// waitFree waits until h has seen its control connection end.
func waitFree(t *testing.T, h *Host) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		h.mu.Lock()
		c := h.ctl
		h.mu.Unlock()
		if c == nil || c.isClosed() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the node did not see the agent's control connection end")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// refusedAsOld greets as an agent from before 2026-12-07 (no key) and reports whether
// the node took the connection (sent it a key) rather than closing it.
func refusedAsOld(t *testing.T, path string) (taken bool) {
	t.Helper()
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	io.WriteString(conn, helloControl+"\n")
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	line, err := readLine(conn)
	return err == nil && strings.HasPrefix(line, keyPrefix)
}

// TestLinkKeyAcrossNodes: the key the agent confirmed is saved; a node process that
// starts with it (Keys.Known) refuses control connections without it, and takes the
// agent's. One that knows no key (an agent from before keys, or a node stopped before
// it saved one) takes the first control connection, and an agent from before keys
// keeps no key there. After Forget (a start again), the first one is taken and gets a
// new key.
func TestLinkKeyAcrossNodes(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "node.sock")
	ctx := ctxFor(t, 30*time.Second)
	saved := make(chan string, 4)
	save := func(key string) error { saved <- key; return nil }
	h := hostWith(t, path, Keys{Save: save})
	var key Key
	stop, err := agentWith(t, ctx, path, "agent", &key)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := get(ctx, client(h)); err != nil || got != "agent" {
		t.Fatalf("%q %v", got, err)
	}
	var known string
	select {
	case known = <-saved:
	case <-ctx.Done():
		t.Fatal("the agent's key was not saved")
	}
	if known != key.get() || len(known) != 64 {
		t.Fatalf("saved %q, the agent holds %q", known, key.get())
	}
	// The node restarts: the agent's connection ends, a new Host knows the key.
	h.Close()
	os.Remove(path)
	h2 := hostWith(t, path, Keys{Known: known, Save: save})
	for range 3 {
		if _, err := agent(t, ctxFor(t, 5*time.Second), path, "impostor"); err == nil || !strings.Contains(err.Error(), "refused") {
			t.Fatalf("a new agent's control connection at a node that knows the key: %v", err)
		}
		if refusedAsOld(t, path) {
			t.Fatal("a greeting as an agent from before keys took the place at a node that knows the key")
		}
	}
	if got, err := get(ctx, client(h2)); err != nil || got != "agent" { // the agent, reconnecting in its loop
		t.Fatalf("after the node's restart: %q %v", got, err)
	}
	if key.get() != known {
		t.Fatal("the agent's key changed across the node's restart")
	}
	stop()

	// A node that knows no key takes the first control connection, whatever it presents.
	h2.Close()
	os.Remove(path)
	h3 := hostWith(t, path, Keys{Save: save})
	stopRestored, err := agentWith(t, ctx, path, "restored", &key)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := get(ctx, client(h3)); err != nil || got != "restored" {
		t.Fatalf("%q %v", got, err)
	}
	if fresh := <-saved; fresh == known || fresh != key.get() {
		t.Fatalf("a node that knew no key gave the agent %q (before %q), saved %q", key.get(), known, fresh)
	}
	// Forget: the next first control connection takes the place.
	h3.Forget()
	stopRestored()
	waitFree(t, h3)
	if _, err := agent(t, ctx, path, "after a start"); err != nil {
		t.Fatal(err)
	}
	if got, err := get(ctx, client(h3)); err != nil || got != "after a start" {
		t.Fatalf("after Forget: %q %v", got, err)
	}
}

// TestLinkQuiesce: while the agent has closed its listener (a quiesce), a Dial waits
// rather than return a connection of the ended session, and is answered once the
// agent connects again.
func TestLinkQuiesce(t *testing.T) {
	path := filepath.Join(t.TempDir(), "node.sock")
	h := host(t, path)
	ctx := ctxFor(t, 30*time.Second)
	var key Key // the agent's, across its quiesces
	for round := range 3 {
		stop, err := agentWith(t, ctx, path, fmt.Sprint("agent", round), &key)
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
	h.kmu.Lock()
	known := h.known
	h.kmu.Unlock()
	h.Close()
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if _, err := h.Dial(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("Dial after Close: %v", err)
	}
	h2 := hostWith(t, path, Keys{Known: known})
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
	var opened atomic.Int64
	go func() {
		var open []net.Conn
		defer func() {
			for _, c := range open {
				c.Close()
			}
			flooded <- int(opened.Load())
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
			opened.Add(1)
		}
	}()
	// The requests start once the flood is on (until 2026-12-07 they could all end
	// before its first connection).
	deadline := time.Now().Add(10 * time.Second)
	for opened.Load() < 2*maxPending {
		if time.Now().After(deadline) {
			t.Fatalf("the flood opened %d connections in 10 s", opened.Load())
		}
		time.Sleep(time.Millisecond)
	}
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
