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

// serveAs connects to the link's socket as an agent would (agentlink.Listen, tried
// again until the node takes it, as the agent does) and answers every request with
// name.
func serveAs(t *testing.T, path, name string) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, name) })}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			ln, err := agentlink.Listen(ctx, path)
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
// the agent's place; a second one is refused while the first answers; once the first
// ends, the next connection takes the place. Closing the link ends waiting dials and
// removes the socket.
func TestAgentLink(t *testing.T) {
	dir := t.TempDir()
	// A stale socket of an earlier node process is replaced.
	stale, err := net.Listen("unix", filepath.Join(dir, wire.NodeSocketName))
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()
	l, err := listenLink("abc", dir, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	c := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return l.dial(ctx) },
	}}
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
	stopA := serveAs(t, path, "agent")
	if got := get(); got != "agent" {
		t.Fatalf("first connection: %q", got)
	}
	stopB := serveAs(t, path, "impostor")
	defer stopB()
	for range 20 {
		c.CloseIdleConnections() // every request on a new stream
		if got := get(); got != "agent" {
			t.Fatalf("a second connection took the agent's place: %q", got)
		}
		time.Sleep(10 * time.Millisecond)
	}
	stopA()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c.CloseIdleConnections()
		if get() == "impostor" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the place stayed with a connection that ended")
		}
		time.Sleep(10 * time.Millisecond)
	}
	l.close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := l.dial(ctx); !errors.Is(err, errLinkClosed) {
		t.Fatalf("dial after close: %v", err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket after close: %v", err)
	}
	if _, err := listenLink("abc", filepath.Join(dir, "missing"), slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "agent link") {
		t.Fatalf("listen in a missing directory: %v", err)
	}
}
