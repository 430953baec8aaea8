package dataplane_test

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// sse reads a whole event stream: every "event:" name and data line, in order.
func sse(t *testing.T, req *http.Request) (int, []string) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, []string{string(b)}
	}
	var out []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "event: ") || strings.HasPrefix(line, "data: ") || strings.HasPrefix(line, "id: ") {
			out = append(out, line)
		}
	}
	return 200, out
}

func attachReq(t *testing.T, sess *api.CommandSession, query string, hdr ...string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx(t), "GET", sess.AttachURL+query, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(query, "token=") {
		req.Header.Set("Authorization", "Bearer "+sess.Token)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return req
}

func TestAttachReplayAndTokens(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	sess, err := s.C.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: "printf hello; printf world >&2; exit 7"})
	if err != nil {
		t.Fatal(err)
	}
	code, events := sse(t, attachReq(t, sess, "?encoding=text"))
	all := strings.Join(events, "\n")
	if code != 200 || !strings.Contains(all, "event: start") || !strings.Contains(all, `"text":"hello"`) ||
		!strings.Contains(all, `"text":"world"`) || !strings.Contains(all, `"exit_code":7`) {
		t.Fatalf("attach: %d\n%s", code, all)
	}
	// Replay from an offset: only what follows it. stdout and stderr are read by two
	// pumps, so either may be journaled first; the first attach says which.
	first, second := "hello", "world"
	if !strings.Contains(all, `{"offset":0,"text":"hello"}`) {
		first, second = second, first
	}
	code, events = sse(t, attachReq(t, sess, "?encoding=text", "Last-Event-ID", "5"))
	replay := strings.Join(events, "\n")
	if code != 200 || strings.Contains(replay, first) || !strings.Contains(replay, `{"offset":5,"text":"`+second+`"}`) {
		t.Fatalf("replay from 5: %d\n%s\n(first attach:\n%s)", code, replay, all)
	}
	// The token as a query parameter; base64 data; no follow.
	code, events = sse(t, attachReq(t, sess, "?follow=0&token="+sess.Token))
	if all = strings.Join(events, "\n"); code != 200 || !strings.Contains(all, `"data":"aGVsbG8="`) {
		t.Fatalf("query token: %d\n%s", code, all)
	}
	for _, tc := range []struct {
		name  string
		req   func() *http.Request
		want  int
		about string
	}{
		{"no token", func() *http.Request {
			r, _ := http.NewRequest("GET", sess.AttachURL, nil)
			return r
		}, 401, "missing"},
		{"bad token", func() *http.Request { return attachReq(t, sess, "?token=spt1.x.y") }, 401, ""},
		{"bad offset", func() *http.Request { return attachReq(t, sess, "?from=-3") }, 400, "offset"},
		{"bad encoding", func() *http.Request { return attachReq(t, sess, "?encoding=rot13") }, 400, "encoding"},
		{"other pid", func() *http.Request {
			r, _ := http.NewRequest("GET", strings.Replace(sess.AttachURL, "/processes/", "/processes/9", 1), nil)
			r.Header.Set("Authorization", "Bearer "+sess.Token)
			return r
		}, 403, ""},
	} {
		resp, err := http.DefaultClient.Do(tc.req())
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.want || !strings.Contains(string(b), tc.about) {
			t.Errorf("%s: %d %s", tc.name, resp.StatusCode, b)
		}
	}
	// A read-only token cannot write stdin.
	ro, err := s.C.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: "cat", Stdin: true, Rights: []string{api.RightRead}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.C.WriteStdin(ctx(t), ro, strings.NewReader("x"), true); err == nil || !strings.Contains(err.Error(), "403") && !strings.Contains(err.Error(), "right") {
		t.Fatalf("stdin with a read token: %v", err)
	}
	// Revoking ends every token.
	if err := s.C.RevokeTokens(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	if code, _ := sse(t, attachReq(t, sess, "")); code != 401 {
		t.Fatalf("revoked token: %d", code)
	}
}

func TestStdinSignalResize(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	sess, err := s.C.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: "read line; echo got:$line", Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan string, 1)
	go func() {
		_, events := sse(t, attachReq(t, sess, "?encoding=text"))
		done <- strings.Join(events, "\n")
	}()
	s.Eventually(20*time.Second, "the process to start", func() bool {
		p, err := s.C.GetProcess(ctx(t), sb.ID, sess.PID)
		return err == nil && p.State == "running"
	})
	if err := s.C.WriteStdin(ctx(t), sess, strings.NewReader("ping\n"), true); err != nil {
		t.Fatal(err)
	}
	if out := <-done; !strings.Contains(out, "got:ping") {
		t.Fatalf("stdin: %s", out)
	}
	// A terminal: resize, then a signal ends it.
	pty, err := s.C.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: "sleep 60", PTY: &api.PTYSize{Rows: 24, Cols: 80}})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		_, events := sse(t, attachReq(t, pty, "?encoding=text"))
		done <- strings.Join(events, "\n")
	}()
	s.Eventually(20*time.Second, "the terminal process to start", func() bool {
		p, err := s.C.GetProcess(ctx(t), sb.ID, pty.PID)
		return err == nil && p.State == "running"
	})
	if err := s.C.Resize(ctx(t), pty, 40, 120); err != nil {
		t.Fatal(err)
	}
	if err := s.C.Resize(ctx(t), pty, 0, 120); err == nil {
		t.Fatal("resize to 0 rows accepted")
	}
	if err := s.C.SignalSession(ctx(t), pty, "TERM"); err != nil {
		t.Fatal(err)
	}
	if out := <-done; !strings.Contains(out, `"signal"`) {
		t.Fatalf("signal: %s", out)
	}
}

// The internal agent proxy takes node tokens only.
func TestInternalProxyNeedsNodeToken(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	sess, err := s.C.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: "true"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{"", sess.Token, s.AdminKey} {
		req, _ := http.NewRequest("GET", s.URL+"/internal/v1/sandboxes/"+sb.ID+"/agent/v1/health", nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 401 && resp.StatusCode != 403 {
			t.Errorf("token %.10q: %d", tok, resp.StatusCode)
		}
	}
}

// A process the sandbox lost (its instance died and was booted again) is never
// confused with a new one that got its pid: the open stream and a later attach both
// end with a "lost" event, and stdin with the old token is refused.
func TestLostProcessEndsWithLost(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	sess, err := s.C.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: "echo before; sleep 600", Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	if sess.ProcessUID == "" {
		t.Fatal("no process identity")
	}
	open := make(chan string, 1)
	go func() {
		_, events := sse(t, attachReq(t, sess, "?encoding=text"))
		open <- strings.Join(events, "\n")
	}()
	s.Eventually(20*time.Second, "the output", func() bool {
		p, err := s.C.GetProcess(ctx(t), sb.ID, sess.PID)
		return err == nil && p.State == "running"
	})
	if err := s.Runtime.Kill(sb.ID); err != nil {
		t.Fatal(err)
	}
	if out := <-open; !strings.Contains(out, "event: lost") {
		t.Fatalf("open stream: %s", out)
	}
	s.Eventually(30*time.Second, "the sandbox to be booted again", func() bool {
		got, err := s.C.GetSandbox(ctx(t), sb.ID)
		return err == nil && got.State == api.StateRunning && strings.Contains(got.Error, "lost")
	})
	// The new instance's processes start over: make one with the old pid's number
	// likely taken by something else, then attach with the old token.
	code, events := sse(t, attachReq(t, sess, "?encoding=text", "Last-Event-ID", "7"))
	if all := strings.Join(events, "\n"); code != 200 || !strings.Contains(all, "event: lost") || strings.Contains(all, "event: stdout") {
		t.Fatalf("re-attach: %d %s", code, all)
	}
	if err := s.C.WriteStdin(ctx(t), sess, strings.NewReader("x"), false); err == nil {
		t.Fatal("stdin to a lost process accepted")
	}
	if _, err := s.C.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{PID: sess.PID, ProcessUID: sess.ProcessUID}); err == nil {
		t.Fatal("re-attach by pid and identity to a lost process accepted")
	}
}
