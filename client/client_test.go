package client

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/api"
)

// TestWritesRepeatUnderOneKey: the writes the server makes safe with an Idempotency-Key
// (create, verbs, clone, snapshot, session, template build, deletes of sandboxes and
// snapshots) carry one (the caller's, or one of the client's own per call) and are sent
// again under it after a transient failure; another call gets another key. A write
// that met a client error is not sent again.
func TestWritesRepeatUnderOneKey(t *testing.T) {
	var mu sync.Mutex
	keys := map[string][]string{} // path → Idempotency-Key of each attempt
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys[r.URL.Path] = append(keys[r.URL.Path], r.Header.Get("Idempotency-Key"))
		n := len(keys[r.URL.Path])
		mu.Unlock()
		if b, _ := io.ReadAll(r.Body); r.URL.Path == "/v1/templates" && (r.Header.Get("Content-Type") != "application/yaml" || !strings.HasPrefix(string(b), "name: x\n")) {
			t.Errorf("a build sent %q as %q", b, r.Header.Get("Content-Type"))
		}
		switch {
		case strings.HasSuffix(r.URL.Path, "/bad"):
			http.Error(w, `{"error":{"code":"invalid","message":"no"}}`, http.StatusBadRequest)
		case n == 1:
			// The first attempt of each path: the database went away (as a server
			// answers when its transaction failed, or when its commit was cut off).
			http.Error(w, `{"error":{"code":"unavailable","message":"database restarting"}}`, http.StatusServiceUnavailable)
		case strings.HasSuffix(r.URL.Path, "/clone"):
			_, _ = w.Write([]byte(`{"sandboxes":[{"id":"c1"}]}`))
		default:
			_, _ = w.Write([]byte(`{"id":"x1"}`))
		}
	}))
	defer srv.Close()
	c := New(srv.URL, "k")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	if _, err := c.CreateSandbox(ctx, api.CreateSandboxRequest{}, "mine"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Lifecycle(ctx, "sb1", api.OpPause); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Clone(ctx, "sb1", api.CloneRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateSnapshot(ctx, "sb1", api.CreateSnapshotRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Lifecycle(ctx, "sb2", api.OpPause); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateSession(ctx, "sb1", api.CreateSessionRequest{Command: "true"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.BuildTemplate(ctx, []byte("name: x\nfrom:\n  template: base\n"), "application/yaml"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteSandbox(ctx, "sb1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteSnapshot(ctx, "snap1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Lifecycle(ctx, "sb1", "bad"); err == nil {
		t.Fatal("a 400 succeeded")
	}
	mu.Lock()
	defer mu.Unlock()
	if got := keys["/v1/sandboxes"]; len(got) != 2 || got[0] != "mine" || got[1] != "mine" {
		t.Errorf("create: keys %q, want the caller's twice", got)
	}
	for _, p := range []string{"/v1/sandboxes/sb1/pause", "/v1/sandboxes/sb1/clone", "/v1/sandboxes/sb1/snapshots", "/v1/sandboxes/sb2/pause", "/v1/sandboxes/sb1/sessions", "/v1/templates", "/v1/sandboxes/sb1", "/v1/snapshots/snap1"} {
		if got := keys[p]; len(got) != 2 || got[0] == "" || got[0] != got[1] {
			t.Errorf("%s: keys %q, want one key of the client's, twice", p, got)
		}
	}
	if keys["/v1/sandboxes/sb1/pause"][0] == keys["/v1/sandboxes/sb2/pause"][0] {
		t.Error("two calls share a key")
	}
	if got := keys["/v1/sandboxes/sb1/bad"]; len(got) != 1 {
		t.Errorf("a 400: %d attempts, want 1", len(got))
	}
}

// TestRunRepeatsUnderOneKey: Run sends its exec with a key of its own and, after a
// transient failure before the stream began, sends it again under the same key (the
// server then streams the process the first request may have started); the output
// and exit arrive once. Two calls use two keys.
func TestRunRepeatsUnderOneKey(t *testing.T) {
	var mu sync.Mutex
	var keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		n := len(keys)
		mu.Unlock()
		if n%2 == 1 {
			http.Error(w, `{"error":{"code":"unavailable","message":"node is still starting up"}}`, http.StatusServiceUnavailable)
			return
		}
		frame := func(typ byte, off int64, payload string) []byte {
			h := make([]byte, api.FrameHeaderSize)
			h[0] = typ
			binary.BigEndian.PutUint64(h[1:9], uint64(off))
			binary.BigEndian.PutUint32(h[9:13], uint32(len(payload)))
			return append(h, payload...)
		}
		w.Header().Set("Content-Type", api.FramesContentType)
		_, _ = w.Write(frame(api.FrameStart, 0, `{"pid":7,"process_uid":"b.1","offset":0}`))
		_, _ = w.Write(frame(api.FrameStdout, 0, "hi\n"))
		_, _ = w.Write(frame(api.FrameExit, 3, `{"exit_code":0,"offset":3}`))
	}))
	defer srv.Close()
	c := New(srv.URL, "k")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for range 2 {
		var out bytes.Buffer
		x, err := c.Run(ctx, "sb1", api.ExecRequest{Argv: []string{"echo", "hi"}}, Output{Stdout: &out})
		if err != nil || x.ExitCode == nil || *x.ExitCode != 0 || out.String() != "hi\n" {
			t.Fatalf("run: %+v %v %q", x, err, out.String())
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(keys) != 4 || keys[0] == "" || keys[0] != keys[1] || keys[2] != keys[3] || keys[0] == keys[2] {
		t.Fatalf("keys of the attempts: %q, want one per call, twice each", keys)
	}
}

// TestBusyWritesWait: a keyed write answered 409 with Retry-After (a transition in
// flight) is sent again under its key once that has passed, until it is accepted; a 409
// without Retry-After is returned at once, as is one whose wait would pass BusyWait.
func TestBusyWritesWait(t *testing.T) {
	var mu sync.Mutex
	keys := map[string][]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys[r.URL.Path] = append(keys[r.URL.Path], r.Header.Get("Idempotency-Key"))
		n := len(keys[r.URL.Path])
		mu.Unlock()
		switch {
		case strings.HasPrefix(r.URL.Path, "/v1/sandboxes/busy/") && n <= 2:
			w.Header().Set("Retry-After", "0")
			http.Error(w, `{"error":{"code":"conflict","message":"sandbox busy is suspending (desired suspended); wait for that to finish"}}`, http.StatusConflict)
		case r.URL.Path == "/v1/sandboxes/long/pause":
			w.Header().Set("Retry-After", "3600")
			http.Error(w, `{"error":{"code":"conflict","message":"busy for an hour"}}`, http.StatusConflict)
		case strings.HasPrefix(r.URL.Path, "/v1/sandboxes/stuck/"):
			http.Error(w, `{"error":{"code":"conflict","message":"cannot pause a sandbox that is stopped"}}`, http.StatusConflict)
		default:
			_, _ = w.Write([]byte(`{"id":"op1"}`))
		}
	}))
	defer srv.Close()
	c := New(srv.URL, "k")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.Lifecycle(ctx, "busy", api.OpPause); err != nil {
		t.Fatalf("a pause that met a transition in flight: %v", err)
	}
	if got := keys["/v1/sandboxes/busy/pause"]; len(got) != 3 || got[0] == "" || got[0] != got[1] || got[1] != got[2] {
		t.Errorf("busy pause: keys %q, want one key three times", got)
	}
	_, err := c.Lifecycle(ctx, "stuck", api.OpPause)
	var e *Error
	if !errors.As(err, &e) || e.Status != http.StatusConflict || e.RetryAfter != 0 || len(keys["/v1/sandboxes/stuck/pause"]) != 1 {
		t.Errorf("a 409 without Retry-After: %v, %d attempts", err, len(keys["/v1/sandboxes/stuck/pause"]))
	}
	_, err = c.Lifecycle(ctx, "long", api.OpPause)
	if !errors.As(err, &e) || e.RetryAfter != time.Hour || len(keys["/v1/sandboxes/long/pause"]) != 1 {
		t.Errorf("a 409 to retry after an hour: %v, %d attempts", err, len(keys["/v1/sandboxes/long/pause"]))
	}
}
