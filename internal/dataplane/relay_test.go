package dataplane_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/token"
)

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// When a node stops, the api role's streams that it relays to an agent and that the
// api resumes by itself (wire.ResumableHeader: exec output, watches) end at once, so
// that they do not hold the node's stop for its grace; a relayed stream without the
// header goes on to its end, and the stop waits for it.
func TestRelayedStreamsEndAtStop(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	c := ctx(t)
	epoch, _, err := s.Store.TokenEpoch(c, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	tok, _, err := s.Signer.Mint(token.Claims{Sandbox: sb.ID, Rights: []string{token.RightNode}, Epoch: epoch}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	stop, stopNow := context.WithCancel(c)
	defer stopNow()
	served := make(chan error, 1)
	go func() {
		served <- rest.Serve(stop, &http.Server{Handler: s.Handler()}, ln, rest.Drain{Grace: time.Minute})
	}()
	base := "http://" + ln.Addr().String() + "/internal/v1/sandboxes/" + sb.ID + "/agent"
	auth := func() (string, error) { return tok, nil }
	rt := &http.Transport{}
	defer rt.CloseIdleConnections()
	resumable := agentclient.NewVia(base, rt, auth)
	plain := agentclient.NewVia(base, roundTripFunc(func(r *http.Request) (*http.Response, error) {
		r.Header.Del(wire.ResumableHeader) // as a caller that does not resume
		return rt.RoundTrip(r)
	}), auth)

	// Each process writes a, then b a second later, and exits.
	spec := wire.ProcessSpec{Argv: []string{"sh", "-c", "echo a; sleep 1; echo b"}}
	var xs [2]*agentclient.Execution
	for i, a := range []*agentclient.Client{resumable, plain} {
		if xs[i], err = a.Exec(c, spec, nil); err != nil {
			t.Fatal(err)
		}
		defer xs[i].Out.Close()
		f, err := xs[i].Out.Next()
		for err == nil && f.Type != wire.FrameStdout && f.Type != wire.FrameExit {
			f, err = xs[i].Out.Next() // the start frame
		}
		if err != nil || f.Type != wire.FrameStdout || string(f.Payload) != "a\n" {
			t.Fatalf("stream %d: first output %d %q, %v", i, f.Type, f.Payload, err)
		}
	}
	stopNow()
	// The resumable stream is cut before b.
	for {
		f, err := xs[0].Out.Next()
		if err != nil {
			if errors.Is(err, io.EOF) {
				t.Fatal("resumable stream: ended cleanly, want cut")
			}
			break
		}
		if f.Type == wire.FrameStdout || f.Type == wire.FrameExit {
			t.Fatalf("resumable stream: got frame %d %q after the stop began, want it cut", f.Type, f.Payload)
		}
	}
	// The other one gets b and the exit, and the stop waits for it.
	var out string
	for {
		f, err := xs[1].Out.Next()
		if err != nil {
			t.Fatalf("plain stream: %v after %q", err, out)
		}
		select {
		case err := <-served:
			t.Fatalf("the stop ended (%v) before the plain stream", err)
		default:
		}
		if f.Type == wire.FrameStdout {
			out += string(f.Payload)
		}
		if f.Type == wire.FrameExit {
			break
		}
	}
	if out != "b\n" {
		t.Errorf("plain stream after the stop began: %q, want b", out)
	}
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the stop did not end after the plain stream did")
	}
}
