package server_test

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
)

// execEvent is one event of an exec stream.
type execEvent struct{ id, name, data string }

// execRaw posts an exec request with key (and headers hdr: name, value, …) and returns
// the status and, for a stream, its events.
func execRaw(t *testing.T, s *spacetest.Space, key, id, query, body string, hdr ...string) (int, []execEvent, string) {
	t.Helper()
	req, err := http.NewRequest("POST", s.URL+"/v1/sandboxes/"+id+"/exec"+query, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" {
		var b bytes.Buffer
		_, _ = b.ReadFrom(resp.Body)
		return resp.StatusCode, nil, b.String()
	}
	var evs []execEvent
	var cur execEvent
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 4<<20)
	for sc.Scan() {
		l := sc.Text()
		switch {
		case l == "":
			if cur.name != "" {
				evs = append(evs, cur)
			}
			cur = execEvent{}
		case strings.HasPrefix(l, "id: "):
			cur.id = l[4:]
		case strings.HasPrefix(l, "event: "):
			cur.name = l[7:]
		case strings.HasPrefix(l, "data: "):
			cur.data = l[6:]
		}
	}
	return resp.StatusCode, evs, ""
}

// TestExecIdempotencyKey: an exec sent again with its Idempotency-Key (its first answer
// lost) streams the process the first one started, from offset 0 to its exit, and runs
// nothing twice; the key with another command is 422; the same key sent with another
// API key is another caller's and runs the command again.
func TestExecIdempotencyKey(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	marker := filepath.Join(t.TempDir(), "runs")
	body := `{"command":"echo run >> ` + marker + `; echo hi"}`
	run := func(apiKey, body string) (int, *api.StartEvent, string, string) {
		t.Helper()
		code, evs, msg := execRaw(t, s, apiKey, sb.ID, "?encoding=text", body, "Idempotency-Key", "run-1")
		if code != 200 {
			return code, nil, "", msg
		}
		var start api.StartEvent
		out := ""
		for _, ev := range evs {
			switch ev.name {
			case api.EventStart:
				_ = json.Unmarshal([]byte(ev.data), &start)
			case api.EventStdout:
				var o api.OutputEvent
				_ = json.Unmarshal([]byte(ev.data), &o)
				out += o.Text
			case api.EventExit:
				out += "|exit " + ev.data
			}
		}
		return code, &start, out, ""
	}
	runs := func() int {
		b, _ := os.ReadFile(marker)
		return strings.Count(string(b), "run\n")
	}
	code, first, out, msg := run(s.AdminKey, body)
	if code != 200 || !strings.HasPrefix(out, "hi\n|exit ") || runs() != 1 {
		t.Fatalf("first: %d %s %q, %d runs", code, msg, out, runs())
	}
	code, again, out2, msg := run(s.AdminKey, body)
	if code != 200 || again.PID != first.PID || again.ProcessUID != first.ProcessUID || out2 != out || runs() != 1 {
		t.Fatalf("sent again: %d %s %+v %q (first %+v %q), %d runs", code, msg, again, out2, first, out, runs())
	}
	if code, _, _, msg := run(s.AdminKey, `{"command":"true"}`); code != 422 {
		t.Fatalf("the key with another command: %d %s", code, msg)
	}
	other := s.NewKey("default", false, "space")
	if code, third, _, msg := run(other, body); code != 200 || third.PID == first.PID || runs() != 2 {
		t.Fatalf("the key sent by another API key: %d %s %+v, %d runs", code, msg, third, runs())
	}
}

// TestSessionIdempotencyKey: a command session created again with its Idempotency-Key
// (its first answer lost) is a session for the same process, which runs once when
// attached; the key with another command is a 422, and another API key with the same
// key, or an exec with it, gets its own process.
func TestSessionIdempotencyKey(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	marker := filepath.Join(t.TempDir(), "runs")
	body := `{"command":"echo run >> ` + marker + `; echo hi"}`
	create := func(apiKey, body string) (int, api.CommandSession, string) {
		t.Helper()
		code, b, _ := s.Request("POST", "/v1/sandboxes/"+sb.ID+"/sessions", body, "Authorization", "Bearer "+apiKey, "Idempotency-Key", "sess-1")
		var sess api.CommandSession
		_ = json.Unmarshal([]byte(b), &sess)
		return code, sess, b
	}
	runs := func() int {
		b, _ := os.ReadFile(marker)
		return strings.Count(string(b), "run\n")
	}
	code, first, msg := create(s.AdminKey, body)
	if code != 201 || first.PID <= 0 {
		t.Fatalf("first: %d %s", code, msg)
	}
	code, again, msg := create(s.AdminKey, body)
	if code != 201 || again.PID != first.PID || again.ProcessUID != first.ProcessUID || again.SessionID == first.SessionID {
		t.Fatalf("sent again: %d %s (first %+v)", code, msg, first)
	}
	for _, sess := range []*api.CommandSession{&first, &again} {
		var out strings.Builder
		x, err := s.C.Follow(ctx(t), sess, client.Output{Stdout: &out})
		if err != nil || client.ExitCode(x) != 0 || out.String() != "hi\n" {
			t.Fatalf("session %s: %q %+v %v", sess.SessionID, out.String(), x, err)
		}
	}
	if runs() != 1 {
		t.Fatalf("the command ran %d times, want once", runs())
	}
	if code, _, msg := create(s.AdminKey, `{"command":"true"}`); code != 422 {
		t.Fatalf("the key with another command: %d %s", code, msg)
	}
	other := s.NewKey("default", false, "space")
	if code, third, msg := create(other, body); code != 201 || third.PID == first.PID {
		t.Fatalf("the key sent by another API key: %d %s", code, msg)
	}
	code, evs, msg := execRaw(t, s, s.AdminKey, sb.ID, "?encoding=text", body, "Idempotency-Key", "sess-1")
	var st api.StartEvent
	if code != 200 || len(evs) == 0 || json.Unmarshal([]byte(evs[0].data), &st) != nil || st.PID == first.PID || runs() != 2 {
		t.Fatalf("an exec with the key: %d %s %+v, %d runs; want a process of its own", code, msg, evs, runs())
	}
}

// TestExecOneRequest runs commands through POST /v1/sandboxes/{id}/exec: the stream's
// events and offsets, stdin, text encoding, validation, a byte-exact larger output
// through the Go client, tenancy with a warm target cache, and the cache's
// invalidation by a pause (the exec wakes the sandbox) and a delete.
func TestExecOneRequest(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	c := ctx(t)
	sb := s.Create(api.CreateSandboxRequest{})

	code, evs, body := execRaw(t, s, s.AdminKey, sb.ID, "", `{"argv":["sh","-c","echo out; echo err >&2; exit 3"]}`)
	if code != 200 || len(evs) < 3 {
		t.Fatalf("exec: %d %v %s", code, evs, body)
	}
	var start api.StartEvent
	if evs[0].name != api.EventStart || json.Unmarshal([]byte(evs[0].data), &start) != nil || start.PID <= 0 || start.ProcessUID == "" {
		t.Fatalf("first event %+v", evs[0])
	}
	streams := map[string]string{}
	var offset int64
	for _, ev := range evs[1 : len(evs)-1] {
		var o api.OutputEvent
		if err := json.Unmarshal([]byte(ev.data), &o); err != nil {
			t.Fatal(err)
		}
		b, _ := base64.StdEncoding.DecodeString(o.Data)
		if o.Offset != offset || ev.id != jsonInt(offset+int64(len(b))) {
			t.Fatalf("event %+v at offset %d: offsets do not chain", ev, offset)
		}
		offset += int64(len(b))
		streams[ev.name] += string(b)
	}
	var exit api.ExitEvent
	last := evs[len(evs)-1]
	if last.name != api.EventExit || json.Unmarshal([]byte(last.data), &exit) != nil || exit.ExitCode == nil || *exit.ExitCode != 3 || exit.Offset != offset {
		t.Fatalf("last event %+v", last)
	}
	if streams["stdout"] != "out\n" || streams["stderr"] != "err\n" {
		t.Fatalf("output %q", streams)
	}

	// stdin is written and closed; text encoding carries UTF-8 as is.
	code, evs, body = execRaw(t, s, s.AdminKey, sb.ID, "?encoding=text", `{"argv":["cat"],"stdin":"héllo"}`)
	if code != 200 || len(evs) != 3 || !strings.Contains(evs[1].data, `"text":"héllo"`) || !strings.Contains(evs[2].data, `"exit_code":0`) {
		t.Fatalf("stdin: %d %+v %s", code, evs, body)
	}

	// Refused before anything runs.
	for _, bad := range []struct{ query, body string }{
		{"", `{"argv":["true"],"command":"true"}`},
		{"", `{}`},
		{"", `{"argv":["true"],"stdin":"a","stdin_base64":"YQ=="}`},
		{"", `{"argv":["true"],"stdin_base64":"%%%"}`},
		{"", `{"argv":["true"],"pty":{"rows":1,"cols":1}}`},
		{"?encoding=utf16", `{"argv":["true"]}`},
	} {
		if code, _, body := execRaw(t, s, s.AdminKey, sb.ID, bad.query, bad.body); code != 400 {
			t.Errorf("%s %s: %d %s, want 400", bad.query, bad.body, code, body)
		}
	}

	// A larger output arrives byte-exact through the client (which uses the route).
	var out, errb bytes.Buffer
	n, err := s.C.Exec(c, sb.ID, api.CreateSessionRequest{Command: "head -c 3000000 /dev/urandom | tee /tmp/r | base64 -w0 >/dev/null; cat /tmp/r"},
		client.Output{Stdout: &out, Stderr: &errb})
	if err != nil || n != 0 || out.Len() != 3000000 {
		t.Fatalf("large output: code %d, err %v, %d bytes, stderr %q", n, err, out.Len(), errb.String())
	}
	var sum bytes.Buffer
	if n, err := s.C.Exec(c, sb.ID, api.CreateSessionRequest{Command: "sha256sum </tmp/r | cut -c1-64"}, client.Output{Stdout: &sum}); err != nil || n != 0 {
		t.Fatal(n, err)
	}
	want := sha256.Sum256(out.Bytes())
	if strings.TrimSpace(sum.String()) != fmt.Sprintf("%x", want) {
		t.Fatalf("output differs from what the process wrote: %s vs %x", sum.String(), want)
	}

	// Another tenant's key gets the answer of a missing sandbox, cache warm or not.
	other := s.NewKey("other", false, service.KeySpace)
	if code, _, body := execRaw(t, s, other, sb.ID, "", `{"argv":["true"]}`); code != 404 {
		t.Fatalf("other tenant: %d %s", code, body)
	}

	// Revoking the API key cuts its open exec streams (the process is not killed).
	keyID, member := s.NewKeyRole("default", "member", service.KeySpace)
	type streamEnd struct {
		code int
		evs  []execEvent
	}
	ended := make(chan streamEnd, 1)
	go func() {
		code, evs, _ := execRaw(t, s, member, sb.ID, "", `{"argv":["sleep","30"]}`)
		ended <- streamEnd{code, evs}
	}()
	s.Eventually(30*time.Second, "the sleep to run", func() bool {
		procs, err := s.C.ListProcesses(c, sb.ID)
		for _, p := range procs {
			if err == nil && p.State == "running" && len(p.Argv) == 2 && p.Argv[0] == "sleep" {
				return true
			}
		}
		return false
	})
	if _, err := s.C.RevokeAPIKey(c, keyID); err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-ended:
		if e.code != 200 || len(e.evs) < 2 || e.evs[len(e.evs)-1].name != api.EventError || !strings.Contains(e.evs[len(e.evs)-1].data, "cut") {
			t.Fatalf("after the key's revocation: %d %+v", e.code, e.evs)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the exec stream outlived its key's revocation by 10 s")
	}

	// Pause: the cached target is dropped and the exec wakes the sandbox.
	op, err := s.C.Lifecycle(c, sb.ID, api.OpPause)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	if code, evs, body := execRaw(t, s, s.AdminKey, sb.ID, "?wake=false", `{"argv":["true"]}`); code != 409 {
		t.Fatalf("paused, wake=false: %d %v %s", code, evs, body)
	}
	if code, evs, body := execRaw(t, s, s.AdminKey, sb.ID, "", `{"argv":["echo","awake"]}`); code != 200 || len(evs) != 3 || !strings.Contains(evs[2].data, `"exit_code":0`) {
		t.Fatalf("paused: %d %v %s", code, evs, body)
	}

	// Delete: the route answers 404 at once, however warm the cache was.
	if op, err = s.C.DeleteSandbox(c, sb.ID); err != nil {
		t.Fatal(err)
	}
	if code, _, body := execRaw(t, s, s.AdminKey, sb.ID, "", `{"argv":["true"]}`); code != 404 && code != 409 {
		t.Fatalf("deleting: %d %s", code, body)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	if code, _, body := execRaw(t, s, s.AdminKey, sb.ID, "", `{"argv":["true"]}`); code != 404 {
		t.Fatalf("deleted: %d %s", code, body)
	}
}

func jsonInt(n int64) string { b, _ := json.Marshal(n); return string(b) }

// TestRequestDuringSuspendWakes: a command that comes while the sandbox is being
// suspended (an idle suspend as its user returns) waits for the suspend to finish and
// then wakes the sandbox; before, it failed with 409 "is suspending; it must be running".
func TestRequestDuringSuspendWakes(t *testing.T) {
	s, sb, op, unblock := suspendHeld(t)
	c := ctx(t)
	type result struct {
		code int
		body string
		err  error
	}
	done := make(chan result, 1)
	go func() {
		req, _ := http.NewRequestWithContext(c, "POST", s.URL+"/v1/sandboxes/"+sb.ID+"/exec", strings.NewReader(`{"argv":["echo","awake"]}`))
		req.Header.Set("Authorization", "Bearer "+s.AdminKey)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- result{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		done <- result{resp.StatusCode, string(b), err}
	}()
	select {
	case r := <-done:
		t.Fatalf("the command answered while the suspend was under way: %d %s %v", r.code, r.body, r.err)
	case <-time.After(time.Second):
		// Still waiting: the old code answered 409 at once. (No event says that a
		// request waits, so this window is the test.)
	}
	unblock()
	s.WaitOp(op.ID, api.OpSucceeded)
	r := <-done
	if r.err != nil || r.code != http.StatusOK || !strings.Contains(r.body, base64.StdEncoding.EncodeToString([]byte("awake\n"))) || !strings.Contains(r.body, `"exit_code":0`) {
		t.Fatalf("the command after the suspend: %d %q %v", r.code, r.body, r.err)
	}
	if got, err := s.C.GetSandbox(c, sb.ID); err != nil || got.State != api.StateRunning {
		t.Fatalf("after the command: %+v %v", got, err)
	}
}
