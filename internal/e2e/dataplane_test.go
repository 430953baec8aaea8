package e2e

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// status sends a raw request and returns its status code and body.
func status(t testing.TB, method, url, bearer string, body io.Reader) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, body)
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(b)
}

func dpURL(sess *api.CommandSession, verb string) string {
	return strings.TrimSuffix(sess.AttachURL, "/attach") + "/" + verb
}

// TestTokens checks attachment token scoping: a token works only for its sandbox, its
// process and its rights, until it expires or is revoked, and never on the control plane.
func TestTokens(t *testing.T) {
	s := start(t, options{})
	a := s.create(t, api.CreateSandboxRequest{})
	b := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 2*time.Minute)
	sessA, err := s.C.CreateSession(c, a.ID, api.CreateSessionRequest{Argv: []string{"cat"}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	sessA2, err := s.C.CreateSession(c, a.ID, api.CreateSessionRequest{Argv: []string{"sleep", "600"}})
	if err != nil {
		t.Fatal(err)
	}
	sessB, err := s.C.CreateSession(c, b.ID, api.CreateSessionRequest{Argv: []string{"sleep", "600"}})
	if err != nil {
		t.Fatal(err)
	}
	// Two-step start: the process exists, but runs only once attached.
	p, err := s.C.GetProcess(c, a.ID, sessA.PID)
	if err != nil || p.State != api.ProcCreated {
		t.Fatalf("before attach: %+v %v", p, err)
	}
	readOnly, err := s.C.CreateSession(c, a.ID, api.CreateSessionRequest{PID: sessA.PID, Rights: []string{api.RightRead}})
	if err != nil {
		t.Fatal(err)
	}
	short, err := s.C.CreateSession(c, a.ID, api.CreateSessionRequest{PID: sessA.PID, TokenTTL: "1s"})
	if err != nil {
		t.Fatal(err)
	}

	// A valid token attaches (query parameter form, as browsers' EventSource needs).
	req, _ := http.NewRequestWithContext(c, "GET", sessA.AttachURL+"?token="+sessA.Token, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("attach with ?token=: %v %v", resp.Status, err)
	}
	resp.Body.Close()
	waitFor(t, 30*time.Second, "the attached process to run", func() bool {
		p, err := s.C.GetProcess(c, a.ID, sessA.PID)
		return err == nil && p.State == api.ProcRunning
	})

	tampered := sessA.Token[:len(sessA.Token)-4] + "AAAA"
	if tampered == sessA.Token {
		tampered = sessA.Token[:len(sessA.Token)-4] + "BBBB"
	}
	cases := []struct {
		name, method, url, token string
		want                     int
	}{
		{"pid A token on pid B", "GET", sessA2.AttachURL, sessA.Token, 403},
		{"sandbox A token on sandbox B (answered as missing)", "GET", sessB.AttachURL, sessA.Token, 404},
		{"token on the control plane", "GET", s.URL + "/v1/sandboxes", sessA.Token, 401},
		{"token on control-plane sessions", "POST", s.URL + "/v1/sandboxes/" + a.ID + "/sessions", sessA.Token, 401},
		{"tampered token", "GET", sessA.AttachURL, tampered, 401},
		{"no token", "GET", sessA.AttachURL, "", 401},
		{"read-only token writes stdin", "POST", dpURL(sessA, "stdin"), readOnly.Token, 403},
		{"read-only token signals", "POST", dpURL(sessA, "signal"), readOnly.Token, 403},
		{"api key on the data plane", "GET", sessA.AttachURL, s.Key, 401},
	}
	for _, tc := range cases {
		var body io.Reader
		if tc.method == "POST" {
			body = strings.NewReader(`{"signal":"TERM"}`)
		}
		if code, b := status(t, tc.method, tc.url, tc.token, body); code != tc.want {
			t.Errorf("%s: status %d (%s), want %d", tc.name, code, b, tc.want)
		}
	}
	// Expired.
	time.Sleep(1100 * time.Millisecond) // the token's own 1 s lifetime, not a readiness wait
	if code, b := status(t, "GET", short.AttachURL+"?follow=0", short.Token, nil); code != 401 || !strings.Contains(b, "expired") {
		t.Errorf("expired token: %d %s", code, b)
	}
	// Revoked: every token of the sandbox dies at once.
	if code, _ := status(t, "GET", readOnly.AttachURL+"?follow=0", readOnly.Token, nil); code != 200 {
		t.Fatalf("read-only token before revoke: %d", code)
	}
	if err := s.C.RevokeTokens(c, a.ID); err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{sessA.Token, readOnly.Token} {
		if code, b := status(t, "GET", sessA.AttachURL+"?follow=0", tok, nil); code != 401 || !strings.Contains(b, "revoked") {
			t.Errorf("revoked token: %d %s", code, b)
		}
	}
	// Sessions made after the revoke work again.
	fresh, err := s.C.CreateSession(c, a.ID, api.CreateSessionRequest{PID: sessA.PID})
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := status(t, "GET", fresh.AttachURL+"?follow=0", fresh.Token, nil); code != 200 {
		t.Errorf("fresh token after revoke: %d", code)
	}
	// Deleting a sandbox revokes its tokens.
	if _, err := s.C.DeleteSandbox(c, b.ID); err != nil {
		t.Fatal(err)
	}
	if code, _ := status(t, "GET", sessB.AttachURL+"?follow=0", sessB.Token, nil); code != 401 {
		t.Errorf("token of a deleted sandbox: %d", code)
	}
}

// TestStdinSignalsPTY covers stdin, signals and a PTY through the data plane.
func TestStdinSignalsPTY(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 2*time.Minute)

	// stdin: write, then close; cat echoes and exits 0.
	sess, err := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Argv: []string{"cat"}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	done := make(chan error, 1)
	var exit *api.ExitEvent
	go func() {
		var err error
		exit, err = s.C.Follow(c, sess, client.Output{Stdout: &out})
		done <- err
	}()
	waitFor(t, 30*time.Second, "cat to run", func() bool {
		p, err := s.C.GetProcess(c, sb.ID, sess.PID)
		return err == nil && p.State == api.ProcRunning
	})
	if err := s.C.WriteStdin(c, sess, strings.NewReader("hello\n"), false); err != nil {
		t.Fatal(err)
	}
	if err := s.C.WriteStdin(c, sess, strings.NewReader("world\n"), true); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || out.String() != "hello\nworld\n" || client.ExitCode(exit) != 0 {
		t.Fatalf("cat: %q %+v %v", out.String(), exit, err)
	}
	// stdin to a process without stdin, and after exit: 409.
	if err := s.C.WriteStdin(c, sess, strings.NewReader("x"), false); err == nil || err.(*client.Error).Status != 409 {
		t.Fatalf("stdin after exit: %v", err)
	}
	noStdin, _ := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Argv: []string{"sleep", "60"}})
	if err := s.C.WriteStdin(c, noStdin, strings.NewReader("x"), false); err == nil || err.(*client.Error).Status != 409 {
		t.Fatalf("stdin to a process without stdin: %v", err)
	}

	// Signals by name; a bad name is 400.
	if err := s.C.SignalSession(c, noStdin, "SIGBOGUS"); err == nil || err.(*client.Error).Status != 400 {
		t.Fatalf("bad signal: %v", err)
	}
	go func() {
		var err error
		exit, err = s.C.Follow(c, noStdin, client.Output{})
		done <- err
	}()
	waitFor(t, 30*time.Second, "sleep to run", func() bool {
		p, err := s.C.GetProcess(c, sb.ID, noStdin.PID)
		return err == nil && p.State == api.ProcRunning
	})
	if err := s.C.SignalSession(c, noStdin, "TERM"); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || exit.Signal != "SIGTERM" || client.ExitCode(exit) != 143 {
		t.Fatalf("sleep after TERM: %+v %v", exit, err)
	}
	// Resize of a non-PTY process is a conflict.
	pty, err := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Argv: []string{"bash", "--norc", "-i"}, Stdin: true, PTY: &api.PTYSize{Rows: 24, Cols: 80}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.C.Resize(c, noStdin, 10, 10); err == nil {
		t.Fatal("resize of an exited non-PTY process succeeded")
	}

	// A PTY: stty size reports the size, and follows a resize.
	var term syncBuffer
	go func() {
		var err error
		exit, err = s.C.Follow(c, pty, client.Output{Stdout: &term})
		done <- err
	}()
	waitFor(t, 30*time.Second, "bash to run", func() bool {
		p, err := s.C.GetProcess(c, sb.ID, pty.PID)
		return err == nil && p.State == api.ProcRunning
	})
	if err := s.C.WriteStdin(c, pty, strings.NewReader("stty size\n"), false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "stty size 24 80", func() bool { return strings.Contains(term.String(), "24 80") })
	if err := s.C.Resize(c, pty, 30, 100); err != nil {
		t.Fatal(err)
	}
	if err := s.C.WriteStdin(c, pty, strings.NewReader("stty size; exit 7\n"), false); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || client.ExitCode(exit) != 7 || !strings.Contains(term.String(), "30 100") {
		t.Fatalf("pty: %q %+v %v", term.String(), exit, err)
	}
	procs, err := s.C.ListProcesses(c, sb.ID)
	if err != nil || len(procs) < 3 {
		t.Fatalf("ps: %+v %v", procs, err)
	}
}

type syncBuffer struct {
	lockedWriter
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	if b.b == nil {
		b.mu.Lock()
		b.b = &bytes.Buffer{}
		b.mu.Unlock()
	}
	return b.lockedWriter.Write(p)
}

func (b *syncBuffer) String() string {
	if b.b == nil {
		return ""
	}
	return b.lockedWriter.String()
}

// TestReplayAfterDisconnect reads part of a stream, drops the connection, and resumes
// with Last-Event-ID: the bytes received equal exactly what the process wrote.
func TestReplayAfterDisconnect(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 2*time.Minute)
	sess, err := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Command: "seq 1 300000"})
	if err != nil {
		t.Fatal(err)
	}
	var got bytes.Buffer
	st, err := s.C.Attach(c, sess, "")
	if err != nil {
		t.Fatal(err)
	}
	last := ""
	for got.Len() < 200_000 {
		ev, err := st.Next()
		if err != nil {
			t.Fatal(err)
		}
		if ev.Name == api.EventStdout {
			got.Write(decodeOutput(t, ev.Data))
			last = ev.ID
		}
	}
	st.Close() // disconnect mid-stream
	exit, err := s.C.FollowFrom(c, sess, last, client.Output{Stdout: &got})
	if err != nil || client.ExitCode(exit) != 0 {
		t.Fatalf("resume: %+v %v", exit, err)
	}
	want := seq(300000)
	if got.String() != want {
		t.Fatalf("received %d bytes (sha %s), want %d (sha %s)", got.Len(), sha(got.Bytes()), len(want), sha([]byte(want)))
	}
	// A reader starting from an offset gets exactly the bytes from there.
	var tail bytes.Buffer
	if _, err := s.C.FollowFrom(c, sess, "1000", client.Output{Stdout: &tail}); err != nil {
		t.Fatal(err)
	}
	if tail.String() != want[1000:] {
		t.Fatalf("from=1000: got %d bytes", tail.Len())
	}
	// Offsets beyond the end and negative ones are rejected.
	if code, _ := status(t, "GET", sess.AttachURL+"?from=-5", sess.Token, nil); code != 400 {
		t.Errorf("negative offset: %d", code)
	}
	if code, _ := status(t, "GET", sess.AttachURL+"?from=99999999999", sess.Token, nil); code != 400 {
		t.Errorf("offset beyond the end: %d", code)
	}
}

func seq(n int) string {
	var b strings.Builder
	for i := 1; i <= n; i++ {
		fmt.Fprintf(&b, "%d\n", i)
	}
	return b.String()
}

func sha(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:8])
}

func decodeOutput(t testing.TB, data []byte) []byte {
	t.Helper()
	var o api.OutputEvent
	if err := jsonUnmarshal(data, &o); err != nil {
		t.Fatalf("%v: %.200q", err, data)
	}
	b, err := base64Decode(o.Data)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestReplayAcrossServerKill kills space serve while a process keeps printing and a
// client follows it: after the restart the client resumes, and the checksum of the
// stream equals the checksum of what the process wrote.
func TestReplayAcrossServerKill(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 3*time.Minute)
	// About 2 MB over ~6 s; the process also keeps its own copy to compare with.
	script := `for i in $(seq 1 60); do head -c 35000 /dev/urandom | base64 -w 100 | tee -a /tmp/copy; sleep 0.1; done`
	sess, err := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Command: script})
	if err != nil {
		t.Fatal(err)
	}
	var got syncBuffer
	done := make(chan error, 1)
	var exit *api.ExitEvent
	go func() {
		var err error
		exit, err = s.C.Follow(c, sess, client.Output{Stdout: &got})
		done <- err
	}()
	waitFor(t, time.Minute, "output to flow", func() bool { return len(got.String()) > 100_000 })
	s.Kill()
	killedAt := len(got.String())
	s.Restart()
	if err := <-done; err != nil || client.ExitCode(exit) != 0 {
		t.Fatalf("follow across the restart: %+v %v", exit, err)
	}
	rc, err := s.C.ReadFile(c, sb.ID, "/tmp/copy", client.FileOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want, _ := io.ReadAll(rc)
	rc.Close()
	if got.String() != string(want) {
		t.Fatalf("stream %d bytes sha %s, process wrote %d bytes sha %s (killed at %d)", len(got.String()), sha([]byte(got.String())), len(want), sha(want), killedAt)
	}
	if killedAt >= len(want) {
		t.Fatalf("the server was killed after the output ended (%d of %d bytes): the test proved nothing", killedAt, len(want))
	}
}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

func base64Decode(s string) ([]byte, error) { return base64.StdEncoding.DecodeString(s) }
