package agentclient

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/wire"
)

// A reply that is not the agent's protocol (a status the call does not expect, an
// oversized body) is the gateway's fault: 502, never a 500 of space's own.
func TestRepliesOutsideTheProtocolAreBadGateway(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/files/mkdir": // 200 where 201 is expected
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"name":"x"}`))
		case "/v1/files/stat": // larger than MaxSmallReply
			_, _ = w.Write([]byte(`{"name":"` + strings.Repeat("x", MaxSmallReply) + `"}`))
		default:
			http.Error(w, `{"code":"not_found","message":"no such file"}`, http.StatusNotFound)
		}
	}))
	defer srv.Close()
	c := NewVia(srv.URL, http.DefaultTransport, nil)
	ctx := context.Background()
	if _, err := c.Mkdir(ctx, wire.MkdirRequest{Path: "/tmp/x"}); fault.KindOf(err) != fault.BadGateway {
		t.Errorf("mkdir answered 200: %v (kind %v), want bad gateway", err, fault.KindOf(err))
	}
	if _, err := c.Stat(ctx, "/etc/hostname", ""); fault.KindOf(err) != fault.BadGateway {
		t.Errorf("oversized stat: %v (kind %v), want bad gateway", err, fault.KindOf(err))
	}
	if _, err := c.List(ctx, "/nope", "", 1); fault.KindOf(err) != fault.NotFound || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("agent 404: %v (kind %v), want not found with the agent's words", err, fault.KindOf(err))
	}
}

// An agent without POST /v1/exec (one restored from an older snapshot) answers 404
// with no error code: Exec then takes the gated three-call path, and stops asking.
func TestExecFallsBackForOlderAgents(t *testing.T) {
	var mu sync.Mutex
	var calls []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls = append(calls, r.Method+" "+r.URL.Path)
		mu.Unlock()
		switch r.Method + " " + r.URL.Path {
		case "POST /v1/processes":
			var spec wire.ProcessSpec
			if err := json.NewDecoder(r.Body).Decode(&spec); err != nil || !spec.Gated || !spec.Stdin {
				http.Error(w, `{"code":"bad_request","message":"want a gated spec with stdin"}`, http.StatusBadRequest)
				return
			}
			w.WriteHeader(http.StatusCreated)
			_ = json.NewEncoder(w).Encode(wire.ProcessInfo{PID: 7, UID: "b.1", State: wire.StateCreated})
		case "GET /v1/processes/7/output":
			w.WriteHeader(http.StatusOK)
			_ = wire.WriteFrame(w, wire.Frame{Type: wire.FrameStdout, Payload: []byte("hi")})
			_ = wire.WriteFrame(w, wire.Frame{Type: wire.FrameExit, Offset: 2, Payload: []byte(`{"exit_code":0}`)})
		case "POST /v1/processes/7/start", "POST /v1/processes/7/stdin":
			w.WriteHeader(http.StatusNoContent)
		default:
			http.NotFound(w, r) // what Go's mux of an older agent answers
		}
	}))
	defer srv.Close()
	c := NewVia(srv.URL, http.DefaultTransport, nil)
	ctx := context.Background()
	for i := 0; i < 2; i++ {
		x, err := c.Exec(ctx, wire.ProcessSpec{Argv: []string{"cat"}}, []byte("in"))
		if err != nil {
			t.Fatal(err)
		}
		f, err := x.Out.Next()
		if err != nil || x.PID != 7 || x.UID != "b.1" || string(f.Payload) != "hi" {
			t.Fatalf("exec %d: %+v %q %v", i, x, f.Payload, err)
		}
		x.Out.Close()
	}
	mu.Lock()
	defer mu.Unlock()
	if n := strings.Count(strings.Join(calls, ","), "POST /v1/exec"); n != 1 {
		t.Errorf("POST /v1/exec asked %d times, want once: %v", n, calls)
	}
}
