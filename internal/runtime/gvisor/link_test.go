package gvisor

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agentlink"
	"github.com/spacedev/space/internal/guest/wire"
)

// serveAs connects to the link's socket as an agent would (agentlink.Listen with key,
// tried again until the node takes it, as the agent does) and answers every request
// with name.
func serveAs(t *testing.T, path, name string, key *agentlink.Key) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, name) })}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			ln, err := agentlink.Listen(ctx, path, key)
			if err != nil {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			srv.Serve(ln)
			return
		}
	}()
	return func() {
		cancel()
		srv.Close()
		<-done
	}
}

// TestAgentLink: the node's end of the agent's transport. The first connection holds
// the agent's place; a second one is refused while the first answers, and also once
// the first has ended, unless it presents the agent's key, which the node saved in the
// instance's state directory (out of the sandbox's run directory). A node process
// after this one (a link opened again) knows the key; a start (fresh) forgets it.
// Closing the link ends waiting dials and removes the socket.
func TestAgentLink(t *testing.T) {
	stateDir := t.TempDir()
	dir := filepath.Join(stateDir, runDir)
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// A stale socket of an earlier node process is replaced.
	stale, err := net.Listen("unix", filepath.Join(dir, wire.NodeSocketName))
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()
	// So is the key of an earlier instance.
	keyFile := filepath.Join(stateDir, linkKeyFile)
	if err := os.WriteFile(keyFile, []byte("earlier\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	l, err := listenLink("abc", stateDir, true, log)
	if err != nil {
		t.Fatal(err)
	}
	var c *http.Client
	connect := func(l *agentLink) {
		c = &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return l.dial(ctx) },
		}}
	}
	connect(l)
	get := func() string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://agent/v1/health", nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	path := filepath.Join(dir, wire.NodeSocketName)
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("node socket: %v %v", fi, err)
	}
	var key agentlink.Key
	stopA := serveAs(t, path, "agent", &key)
	if got := get(); got != "agent" {
		t.Fatalf("first connection: %q", got)
	}
	stopB := serveAs(t, path, "impostor", new(agentlink.Key))
	defer stopB()
	// only asks for requests on new connections while the impostor tries, and says
	// whether all of them reached the agent.
	only := func(want string) {
		t.Helper()
		for range 20 {
			c.CloseIdleConnections() // every request on a new stream
			if got := get(); got != want {
				t.Fatalf("%q took the agent's place", got)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	only("agent")
	b, err := os.ReadFile(keyFile)
	if fi, serr := os.Stat(keyFile); err != nil || serr != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("saved key: %v %v %v", fi, err, serr)
	}
	if strings.TrimSpace(string(b)) == "earlier" || len(strings.TrimSpace(string(b))) != 64 {
		t.Fatalf("saved key %q", b)
	}
	// The agent's connection ends (and the node restarts): the impostor, trying all the
	// while, never takes the place; the agent, with its key, does.
	stopA()
	l.close()
	if l, err = listenLink("abc", stateDir, false, log); err != nil {
		t.Fatal(err)
	}
	connect(l)
	// The impostor, trying every 5 ms, alone for 600 ms: a dial succeeds only if it
	// took the place.
	ctx, cancel := context.WithTimeout(context.Background(), 600*time.Millisecond)
	if conn, err := l.dial(ctx); err == nil {
		conn.Close()
		t.Fatal("a control connection without the agent's key took its place after a restart of the node")
	}
	cancel()
	stopA = serveAs(t, path, "agent again", &key)
	defer stopA()
	only("agent again")
	l.close()
	ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := l.dial(ctx); !errors.Is(err, errLinkClosed) {
		t.Fatalf("dial after close: %v", err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket after close: %v", err)
	}
	// A start forgets the key.
	if l, err = listenLink("abc", stateDir, true, log); err != nil {
		t.Fatal(err)
	}
	defer l.close()
	if _, err := os.Stat(keyFile); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the key after a start: %v", err)
	}
	if _, err := listenLink("abc", filepath.Join(stateDir, "missing"), true, log); err == nil || !strings.Contains(err.Error(), "agent link") {
		t.Fatalf("listen in a missing directory: %v", err)
	}
}
