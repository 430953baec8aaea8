package dataplane_test

import (
	"bufio"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
)

// TestKeyRevocationEndsTokens: an attachment token carries the id of the API key that
// minted it; once that key is revoked the token stops working within a second, and the
// streams it opened are cut. Tokens of other keys keep working.
func TestKeyRevocationEndsTokens(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	keyID, secret := s.NewKeyRole("acme", store.RoleMember, "space")
	_, otherSecret := s.NewKeyRole("acme", store.RoleMember, "space")
	c, other := client.New(s.URL, secret), client.New(s.URL, otherSecret)
	sb, err := c.CreateSandbox(ctx(t), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	if op, err := c.WaitOperation(ctx(t), sb.Operation.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("create: %+v %v", op, err)
	}
	sess, err := c.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: "cat", Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	kept, err := other.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: "cat", Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	stdin := func(sess *api.CommandSession, data string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx(t), "POST", strings.TrimSuffix(sess.AttachURL, "/attach")+"/stdin", strings.NewReader(data))
		req.Header.Set("Authorization", "Bearer "+sess.Token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// Open streams of both sessions; the process echoes what stdin sends.
	open := func(sess *api.CommandSession) <-chan string {
		resp, err := http.DefaultClient.Do(attachReq(t, sess, "?encoding=text"))
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("attach: %v %v", resp, err)
		}
		lines := make(chan string, 100)
		go func() {
			defer resp.Body.Close()
			defer close(lines)
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				lines <- sc.Text()
			}
		}()
		return lines
	}
	revokedStream, keptStream := open(sess), open(kept)
	for _, x := range []struct {
		sess  *api.CommandSession
		lines <-chan string
	}{{sess, revokedStream}, {kept, keptStream}} {
		if code, body := stdin(x.sess, "ping\n"); code != http.StatusNoContent {
			t.Fatalf("stdin: %d %s", code, body)
		}
		waitFor(t, x.lines, "ping", true)
	}

	if _, err := s.C.RevokeAPIKey(ctx(t), keyID); err != nil {
		t.Fatal(err)
	}
	revokedAt := time.Now()
	// The stream is cut (it ends without an exit event) and stdin is refused, within
	// a second.
	waitFor(t, revokedStream, "", false)
	if took := time.Since(revokedAt); took > time.Second {
		t.Fatalf("the stream was cut %s after the revocation", took)
	}
	var code int
	var body string
	for {
		if code, body = stdin(sess, "again\n"); code == http.StatusUnauthorized || time.Since(revokedAt) > time.Second {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if took := time.Since(revokedAt); code != http.StatusUnauthorized || !strings.Contains(body, "API key that minted it was revoked") || took > time.Second {
		t.Fatalf("stdin with a token of a revoked key after %s: %d %s", took, code, body)
	}
	if resp, err := http.DefaultClient.Do(attachReq(t, sess, "")); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("attach with a token of a revoked key: %v %v", resp.StatusCode, err)
	}
	// The other key's token and stream are untouched.
	if code, body := stdin(kept, "pong\n"); code != http.StatusNoContent {
		t.Fatalf("stdin of the other key's session: %d %s", code, body)
	}
	waitFor(t, keptStream, "pong", true)
}

// waitFor reads lines until one contains want (open: the stream must stay open), or
// until the stream ends (want "", open false: the stream must end without an exit).
func waitFor(t *testing.T, lines <-chan string, want string, open bool) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				if open {
					t.Fatalf("the stream ended before %q", want)
				}
				return
			}
			if strings.Contains(l, "event: exit") {
				t.Fatalf("the process exited: %s", l)
			}
			if open && strings.Contains(l, want) {
				return
			}
		case <-deadline:
			if open {
				t.Fatalf("no %q on the stream", want)
			}
			t.Fatal("the stream was not cut")
		}
	}
}
