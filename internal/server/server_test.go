package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// do sends a raw request with the admin key and returns status and body.
func do(t *testing.T, s *spacetest.Space, method, path, body string, hdr ...string) (int, string) {
	t.Helper()
	code, b, _ := s.Request(method, path, body, hdr...)
	return code, b
}

func TestSandboxCommandAndFiles(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	c := ctx(t)
	sb := s.Create(api.CreateSandboxRequest{Env: map[string]string{"FOO": "bar"}, Metadata: map[string]string{"owner": "alice"}})
	if sb.State != api.StateRunning || sb.TemplateDigest != s.Base || sb.StartPath != "boot" {
		t.Fatalf("sandbox %+v", sb)
	}
	var out bytes.Buffer
	code, err := s.C.Exec(c, sb.ID, api.CreateSessionRequest{Command: "echo $FOO $FROM_TEMPLATE; echo err >&2; exit 3"}, client.Output{Stdout: &out, Stderr: &out})
	if err != nil || code != 3 || !strings.Contains(out.String(), "bar yes") || !strings.Contains(out.String(), "err") {
		t.Fatalf("exec: code %d, err %v, output %q", code, err, out.String())
	}
	procs, err := s.C.ListProcesses(c, sb.ID)
	if err != nil || len(procs) == 0 {
		t.Fatalf("processes %v, %v", procs, err)
	}
	if _, err := s.C.GetProcess(c, sb.ID, procs[0].PID); err != nil {
		t.Fatal(err)
	}

	// Files: write, read, stat, list, mkdir, move, remove.
	if _, err := s.C.Mkdir(c, sb.ID, api.MkdirRequest{Path: "x", Parents: true}); err != nil {
		t.Fatal(err)
	}
	fi, err := s.C.WriteFile(c, sb.ID, "x/data.txt", strings.NewReader("hello"), client.FileOptions{})
	if err != nil || fi.Size != 5 {
		t.Fatalf("write: %+v %v", fi, err)
	}
	rc, err := s.C.ReadFile(c, sb.ID, "x/data.txt", client.FileOptions{})
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(rc)
	rc.Close()
	if string(data) != "hello" {
		t.Fatalf("read %q", data)
	}
	if fi, err := s.C.StatFile(c, sb.ID, "x/data.txt", client.FileOptions{}); err != nil || fi.Size != 5 {
		t.Fatalf("stat %+v %v", fi, err)
	}
	if list, err := s.C.ListDir(c, sb.ID, "x", 1, client.FileOptions{}); err != nil || len(list) != 1 {
		t.Fatalf("list %+v %v", list, err)
	}
	if _, err := s.C.Move(c, sb.ID, api.MoveRequest{From: "x/data.txt", To: "x/moved.txt"}); err != nil {
		t.Fatal(err)
	}
	if err := s.C.Remove(c, sb.ID, "x", true, client.FileOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.C.StatFile(c, sb.ID, "x", client.FileOptions{}); err == nil {
		t.Fatal("removed directory still there")
	}

	// Listing with filters.
	list, err := s.C.ListSandboxes(c, client.ListOptions{States: []string{api.StateRunning}, Metadata: map[string]string{"owner": "alice"}})
	if err != nil || len(list) != 1 || list[0].ID != sb.ID {
		t.Fatalf("list %+v %v", list, err)
	}
	if code, body := do(t, s, "GET", "/v1/sandboxes?state=bogus", ""); code != 400 || !strings.Contains(body, "bogus") {
		t.Fatalf("bad state filter: %d %s", code, body)
	}
	// A runtime the live node does not run is refused at create, naming the one it runs.
	if code, body := do(t, s, "POST", "/v1/sandboxes", `{"runtime":"qemu"}`); code != 422 || !strings.Contains(body, "runtimes on offer: fake") {
		t.Fatalf("runtime nobody offers: %d %s", code, body)
	}

	// Delete.
	op, err := s.C.DeleteSandbox(c, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	got, err := s.C.GetSandbox(c, sb.ID)
	if err != nil || got.State != api.StateDeleted {
		t.Fatalf("after delete: %+v %v", got, err)
	}
	insts, _ := s.Runtime.List(c)
	if len(insts) != 0 {
		t.Fatalf("instances left: %+v", insts)
	}
}

func TestBadInput(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{NoNode: true})
	for _, tc := range []struct {
		method, path, body string
		want               int
		contains           string
	}{
		{"POST", "/v1/sandboxes", `null`, 400, "null"},
		{"POST", "/v1/sandboxes", `{"cpu":99}`, 400, "cpu"},
		{"POST", "/v1/sandboxes", `{"memory_mb":1}`, 400, "memory_mb"},
		{"POST", "/v1/sandboxes", `{"template":"nope"}`, 404, "nope"},
		{"POST", "/v1/sandboxes", `{"runtime":"vmware"}`, 400, "runtime"},
		{"POST", "/v1/sandboxes", `{"ttl":"forever"}`, 400, "ttl"},
		{"POST", "/v1/sandboxes", `{"idle_timeout":"-1s"}`, 400, "idle_timeout"},
		{"POST", "/v1/sandboxes", `{"env":{"1BAD":"x"}}`, 400, "env"},
		{"POST", "/v1/sandboxes", `{"bogus":1}`, 400, "unknown field"},
		{"POST", "/v1/sandboxes", `{`, 400, "malformed"},
		{"GET", "/v1/sandboxes/nosuch", "", 404, "not found"},
		{"GET", "/v1/sandboxes?limit=0", "", 400, "limit"},
		{"POST", "/v1/sandboxes/nosuch/pause", "", 404, "not found"},
		{"GET", "/v1/operations/op_nosuch", "", 404, "not found"},
		{"GET", "/v1/operations/op_nosuch/wait?timeout=1h", "", 400, "timeout"},
		{"GET", "/v1/nowhere", "", 404, "no route"},
		{"PUT", "/v1/pools", `{"template":"base","size":-1}`, 400, "size"},
		{"PUT", "/v1/pools", `{"template":"base@sha256:` + strings.Repeat("a", 64) + `","size":1}`, 400, "digest"},
		{"POST", "/v1/apikeys", `{"name":"","tenant":"default"}`, 400, "name"},
		{"POST", "/v1/apikeys", `{"name":"x","kind":"other"}`, 400, "kind"},
		{"DELETE", "/v1/templates/base", "", 400, "base:TAG"},
		{"POST", "/v1/templates", "", 400, "empty"},
		// A runtime no live node offers: refused at create, naming what is on offer.
		{"POST", "/v1/sandboxes", `{"runtime":"qemu"}`, 422, "runtimes on offer: none"},
		// Control characters: refused in metadata and env values (a tab is fine), in
		// names, in session env and cwd; the field is named.
		{"POST", "/v1/sandboxes", `{"metadata":{"k":"a\u001b[31mb"}}`, 400, `metadata value for \"k\" contains the control character U+001B`},
		{"POST", "/v1/sandboxes", `{"metadata":{"k":"a\rb"}}`, 400, `metadata value for \"k\"`},
		{"POST", "/v1/sandboxes", `{"env":{"K":"a\nb"}}`, 400, `env value for \"K\"`},
		{"POST", "/v1/sandboxes", `{"metadata":{"k":"\u0085"}}`, 400, "U+0085"},
		{"POST", "/v1/apikeys", `{"name":"ci\u0007","tenant":"default"}`, 400, "name contains the control character"},
		{"POST", "/v1/tenants", `{"name":"Bad Name"}`, 400, "tenant name"},
		{"POST", "/v1/tenants", `{"name":"x\ny"}`, 400, "tenant name"},
		// Unknown filter values.
		{"GET", "/v1/sandboxes?state=bogus", "", 400, "bogus"},
		{"GET", "/v1/sandboxes?tenant=nosuch", "", 404, "tenant"},
		{"GET", "/v1/operations?kind=bogus", "", 400, "kind"},
		{"GET", "/v1/sandboxes/x/processes?wake=maybe", "", 400, "wake"},
		// Keys: an operator names the tenant; revoke takes an id, not a prefix.
		{"POST", "/v1/apikeys", `{"name":"ci"}`, 400, "tenant is required"},
		{"POST", "/v1/apikeys", `{"name":"ci","tenant":"nosuch"}`, 404, "tenant"},
		{"POST", "/v1/apikeys", `{"name":"ci","tenant":"default","kind":"e2b","admin":true}`, 400, "E2B keys are member keys"},
		{"POST", "/v1/apikeys", `{"name":"ci","tenant":"default","role":"root"}`, 400, "role"},
		{"DELETE", "/v1/apikeys/space_abcdef", "", 400, "key id"},
		{"DELETE", "/v1/apikeys/key_nosuch", "", 404, "not found"},
		{"DELETE", "/v1/tenants/default", "", 409, "cannot be removed"},
	} {
		code, body := do(t, s, tc.method, tc.path, tc.body)
		if code != tc.want || !strings.Contains(body, tc.contains) {
			t.Errorf("%s %s %s: %d %s, want %d containing %q", tc.method, tc.path, tc.body, code, body, tc.want, tc.contains)
		}
	}
	// No key, a bad key, an attachment token, an E2B key.
	for _, key := range []string{"", "nope", "spt1.abc.def", s.NewKey("default", false, "e2b")} {
		req, _ := http.NewRequest("GET", s.URL+"/v1/sandboxes", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 401 {
			t.Errorf("key %q: %d", key, resp.StatusCode)
		}
	}
	// A tab is fine in a value; a control character stored nothing.
	if code, body := do(t, s, "POST", "/v1/sandboxes", `{"metadata":{"k":"a\tb"}}`); code != 202 {
		t.Errorf("a tab in a metadata value: %d %s", code, body)
	}
	if list, err := s.C.ListSandboxes(ctx(t), client.ListOptions{}); err != nil || len(list) != 1 {
		t.Errorf("sandboxes after the refused creates: %d %v", len(list), err)
	}
	// A non-admin key cannot manage keys or pools.
	user := client.New(s.URL, s.NewKey("default", false, "space"))
	if _, err := user.ListAPIKeys(ctx(t)); err == nil || !strings.Contains(err.Error(), "admin") {
		t.Errorf("non-admin listed keys: %v", err)
	}
	if _, err := user.SetPool(ctx(t), api.SetPoolRequest{Template: "base", Size: 1}); err == nil {
		t.Error("non-admin set a pool")
	}
}

func TestIdempotentCreate(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{NoNode: true})
	body := `{"metadata":{"k":"v"}}`
	c1, b1 := do(t, s, "POST", "/v1/sandboxes", body, "Idempotency-Key", "abc")
	c2, b2 := do(t, s, "POST", "/v1/sandboxes", body, "Idempotency-Key", "abc")
	if c1 != 202 || c2 != 202 || b1 != b2 {
		t.Fatalf("replay: %d %s / %d %s", c1, b1, c2, b2)
	}
	if c3, b3 := do(t, s, "POST", "/v1/sandboxes", `{"metadata":{"k":"w"}}`, "Idempotency-Key", "abc"); c3 != 422 {
		t.Fatalf("same key, other body: %d %s", c3, b3)
	}
	if c4, _ := do(t, s, "POST", "/v1/sandboxes", body, "Idempotency-Key", strings.Repeat("k", 300)); c4 != 400 {
		t.Fatalf("long key: %d", c4)
	}
}

// TestIdempotentVerbsClonesSnapshots: lifecycle verbs, clones and snapshots take an
// Idempotency-Key as creates do. A retry gets the first answer (Idempotent-Replayed)
// and makes nothing again, also once the verb has taken effect (asking again without
// the key is a conflict then); the key with another request is 422; twins sent at once
// get one answer and make one clone.
func TestIdempotentVerbsClonesSnapshots(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	c := ctx(t)
	sb := s.Create(api.CreateSandboxRequest{})
	keyed := func(method, path, body, key string) (int, string, http.Header) {
		t.Helper()
		return s.Request(method, path, body, "Idempotency-Key", key)
	}
	base := "/v1/sandboxes/" + sb.ID

	// A verb: the retry after it took effect gets the same operation.
	code, first, h := keyed("POST", base+"/pause", "", "pause-1")
	var op api.Operation
	if code != 202 || json.Unmarshal([]byte(first), &op) != nil || op.ID == "" || h.Get("Idempotent-Replayed") != "" {
		t.Fatalf("pause: %d %s", code, first)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	if code, again, h := keyed("POST", base+"/pause", "", "pause-1"); code != 202 || again != first || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("pause sent again with its key: %d %s %v", code, again, h)
	}
	if code, body := do(t, s, "POST", base+"/pause", ""); code != 409 {
		t.Fatalf("pause sent again without a key: %d %s", code, body)
	}
	if code, body, _ := keyed("POST", base+"/resume", "", "pause-1"); code != 422 {
		t.Fatalf("the pause's key on a resume: %d %s", code, body)
	}
	code, body, _ := keyed("POST", base+"/resume", "", "resume-1")
	if code != 202 || json.Unmarshal([]byte(body), &op) != nil {
		t.Fatalf("resume: %d %s", code, body)
	}
	s.WaitOp(op.ID, api.OpSucceeded)

	// A clone, sent by eight twins at once: one answer, one clone.
	answers := make([]string, 8)
	var wg sync.WaitGroup
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code, body, _ := keyed("POST", base+"/clone", `{"count":1}`, "clone-1")
			answers[i] = strconv.Itoa(code) + " " + body
		}()
	}
	wg.Wait()
	for _, a := range answers {
		if a != answers[0] || !strings.HasPrefix(a, "202 ") {
			t.Fatalf("twin clones answered differently: %q", answers)
		}
	}
	var cloned api.CloneResponse
	if err := json.Unmarshal([]byte(strings.TrimPrefix(answers[0], "202 ")), &cloned); err != nil || len(cloned.Sandboxes) != 1 {
		t.Fatalf("clone answer: %s %v", answers[0], err)
	}
	s.WaitOp(cloned.Sandboxes[0].Operation.ID, api.OpSucceeded)
	if code, body, _ := keyed("POST", base+"/clone", `{"count":2}`, "clone-1"); code != 422 {
		t.Fatalf("the clone's key with another body: %d %s", code, body)
	}
	list, err := s.C.ListSandboxes(c, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	clones := 0
	for _, x := range list {
		if x.CloneOf == sb.ID {
			clones++
		}
	}
	if clones != 1 {
		t.Fatalf("%d clones made, want 1", clones)
	}

	// A snapshot.
	code, first, h = keyed("POST", base+"/snapshots", `{"name":"keyed"}`, "snap-1")
	var sn api.Snapshot
	if code != 202 || json.Unmarshal([]byte(first), &sn) != nil || h.Get("Location") != "/v1/snapshots/"+sn.ID {
		t.Fatalf("snapshot: %d %s %v", code, first, h)
	}
	s.WaitOp(sn.Operation.ID, api.OpSucceeded)
	if code, again, h := keyed("POST", base+"/snapshots", `{"name":"keyed"}`, "snap-1"); code != 202 || again != first || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("snapshot sent again with its key: %d %s %v", code, again, h)
	}
	if snaps, err := s.C.ListSnapshots(c, client.SnapshotListOptions{Sandbox: sb.ID}); err != nil || len(snaps) != 1 {
		t.Fatalf("snapshots of the sandbox: %d %v", len(snaps), err)
	}

}

// TestIdempotentDeletes: a delete of a sandbox or a snapshot sent again with its
// Idempotency-Key gets the first answer (one operation), also once the deletion is
// done and the same request without the key, or with another key, is a 404.
func TestIdempotentDeletes(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	c := ctx(t)
	sb := s.Create(api.CreateSandboxRequest{})
	keeper := s.Create(api.CreateSandboxRequest{})
	sn, err := s.C.CreateSnapshotAndWait(c, keeper.ID, api.CreateSnapshotRequest{Name: "to-delete"})
	if err != nil || sn.State != api.SnapshotReady {
		t.Fatalf("snapshot: %+v %v", sn, err)
	}
	keyed := func(method, path, key string) (int, string, http.Header) {
		t.Helper()
		return s.Request(method, path, "", "Idempotency-Key", key)
	}

	// Four twins at once: one answer, one operation.
	answers := make([]string, 4)
	var wg sync.WaitGroup
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code, body, _ := keyed("DELETE", "/v1/sandboxes/"+sb.ID, "del-1")
			answers[i] = strconv.Itoa(code) + " " + body
		}()
	}
	wg.Wait()
	for _, a := range answers {
		if a != answers[0] || !strings.HasPrefix(a, "202 ") {
			t.Fatalf("twin deletes answered differently: %q", answers)
		}
	}
	first := strings.TrimPrefix(answers[0], "202 ")
	var op api.Operation
	if err := json.Unmarshal([]byte(first), &op); err != nil || op.Kind != api.OpDelete {
		t.Fatalf("delete answer: %s %v", first, err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	s.Eventually(time.Minute, "the sandbox to be deleted", func() bool {
		got, err := s.C.GetSandbox(c, sb.ID)
		return err != nil || got.State == api.StateDeleted
	})
	if code, again, h := keyed("DELETE", "/v1/sandboxes/"+sb.ID, "del-1"); code != 202 || again != first || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("delete sent again with its key once done: %d %s %v", code, again, h)
	}
	if code, body := do(t, s, "DELETE", "/v1/sandboxes/"+sb.ID, ""); code != 404 {
		t.Fatalf("delete sent again without a key: %d %s", code, body)
	}
	if code, body, _ := keyed("DELETE", "/v1/sandboxes/"+sb.ID, "del-2"); code != 404 {
		t.Fatalf("delete sent again with another key: %d %s", code, body)
	}
	if code, body, _ := keyed("DELETE", "/v1/sandboxes/"+keeper.ID, "del-1"); code != 422 {
		t.Fatalf("the delete's key on another sandbox: %d %s", code, body)
	}

	// A snapshot's delete.
	path := "/v1/snapshots/" + sn.ID
	code, first, _ := keyed("DELETE", path, "sdel-1")
	var gone api.Snapshot
	if code != 202 || json.Unmarshal([]byte(first), &gone) != nil || gone.ID != sn.ID || gone.State != api.SnapshotDeleting {
		t.Fatalf("snapshot delete: %d %s", code, first)
	}
	s.Eventually(time.Minute, "the snapshot to be gone", func() bool {
		code, _ := do(t, s, "GET", path, "")
		return code == 404
	})
	if code, again, h := keyed("DELETE", path, "sdel-1"); code != 202 || again != first || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("snapshot delete sent again with its key once done: %d %s %v", code, again, h)
	}
	if code, body := do(t, s, "DELETE", path, ""); code != 404 {
		t.Fatalf("snapshot delete sent again without a key: %d %s", code, body)
	}
}

// TestVerbDuringTransitionWaits: a clone asked for while the sandbox is being suspended
// (an idle suspend as its user comes back) is a 409 that says when to ask again
// (Retry-After); the Go client waits for the suspend to finish and then clones the
// suspended sandbox.
func TestVerbDuringTransitionWaits(t *testing.T) {
	s, sb, op, unblock := suspendHeld(t)
	c := ctx(t)
	code, body, h := s.Request("POST", "/v1/sandboxes/"+sb.ID+"/clone", `{"count":1}`)
	if code != http.StatusConflict || h.Get("Retry-After") != "1" || !strings.Contains(body, "wait for that to finish") {
		t.Fatalf("a clone during the suspend: %d %s, Retry-After %q", code, body, h.Get("Retry-After"))
	}
	type result struct {
		out []api.Sandbox
		err error
	}
	done := make(chan result, 1)
	go func() {
		out, err := s.C.Clone(c, sb.ID, api.CloneRequest{Count: 1})
		done <- result{out, err}
	}()
	select {
	case r := <-done:
		t.Fatalf("the client's clone returned while the suspend was under way: %+v %v", r.out, r.err)
	case <-time.After(1500 * time.Millisecond):
		// Still waiting (without Retry-After it returned the 409 at once).
	}
	unblock()
	s.WaitOp(op.ID, api.OpSucceeded)
	r := <-done
	if r.err != nil || len(r.out) != 1 {
		t.Fatalf("the client's clone after the suspend: %+v %v", r.out, r.err)
	}
	s.Eventually(time.Minute, "the clone to run", func() bool {
		got, err := s.C.GetSandbox(c, r.out[0].ID)
		return err == nil && got.State == api.StateRunning
	})
	if got, err := s.C.GetSandbox(c, sb.ID); err != nil || got.State != api.StateSuspended {
		t.Fatalf("the source after the clone: %+v %v", got, err)
	}
}

func TestLifecycleVerbs(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	c := ctx(t)
	sb := s.Create(api.CreateSandboxRequest{})
	verb := func(v, wantState string) {
		t.Helper()
		op, err := s.C.Lifecycle(c, sb.ID, v)
		if err != nil {
			t.Fatalf("%s: %v", v, err)
		}
		s.WaitOp(op.ID, api.OpSucceeded)
		got, err := s.C.GetSandbox(c, sb.ID)
		if err != nil || got.State != wantState {
			t.Fatalf("after %s: %+v %v", v, got, err)
		}
	}
	verb(api.OpPause, api.StatePaused)
	if _, err := s.C.Lifecycle(c, sb.ID, api.OpPause); err == nil || !strings.Contains(err.Error(), "paused") {
		t.Fatalf("pause twice: %v", err)
	}
	verb(api.OpResume, api.StateRunning)
	verb(api.OpSuspend, api.StateSuspended)
	verb(api.OpWake, api.StateRunning)
	verb(api.OpStop, api.StateStopped)
	verb(api.OpStart, api.StateRunning)
	verb(api.OpWake, api.StateRunning) // already running: done at once
	// Clone: a new sandbox from the source's memory and disk.
	clones, err := s.C.Clone(c, sb.ID, api.CloneRequest{Count: 2})
	if err != nil || len(clones) != 2 {
		t.Fatalf("clone: %v %v", clones, err)
	}
	for _, cl := range clones {
		s.WaitOp(cl.Operation.ID, api.OpSucceeded)
	}
	if code, body := do(t, s, "POST", "/v1/sandboxes/"+sb.ID+"/clone", `{"count":99}`); code != 400 {
		t.Fatalf("clone 99: %d %s", code, body)
	}
	code, body := do(t, s, "GET", "/v1/sandboxes/"+sb.ID+"/operations", "")
	if code != 200 || !strings.Contains(body, `"kind":"start"`) {
		t.Fatalf("operations: %d %s", code, body)
	}
	// A request that needs the sandbox running wakes it.
	verb(api.OpSuspend, api.StateSuspended)
	if _, err := s.C.ListProcesses(c, sb.ID); err != nil {
		t.Fatalf("processes of a suspended sandbox (wakes it): %v", err)
	}
	if got, _ := s.C.GetSandbox(c, sb.ID); got.State != api.StateRunning {
		t.Fatalf("not woken: %+v", got)
	}
	// ?wake=false does not.
	verb(api.OpSuspend, api.StateSuspended)
	if code, body := do(t, s, "GET", "/v1/sandboxes/"+sb.ID+"/processes?wake=false", ""); code != 409 {
		t.Fatalf("no wake: %d %s", code, body)
	}
	if code, body := do(t, s, "POST", "/v1/sandboxes/"+sb.ID+"/revoke-tokens", ""); code != 200 || !strings.Contains(body, "token_epoch") {
		t.Fatalf("revoke: %d %s", code, body)
	}
}

// A runtime whose instances may hold more than their memory size (gVisor) gets that
// much room for checkpoints in the sandbox's disk limit.
func TestDiskLimitKeepsRoomForMemoryBound(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{MemoryOverheadMB: 160})
	sb := s.Create(api.CreateSandboxRequest{DiskMB: 2048, MemoryMB: 256})
	if got, want := s.Disk.Limit(sb.ID), int64(2048+256+160+64)<<20; got != want {
		t.Fatalf("limit %d MiB, want %d MiB", got>>20, want>>20)
	}
}

// A suspend needs free room for a checkpoint as large as the runtime's memory bound,
// not only the memory size: with room for the size alone it is refused with 507 and
// the sandbox runs on; with room for the bound it suspends.
func TestSuspendNeedsRoomForMemoryBound(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{MemoryOverheadMB: 160})
	sb := s.Create(api.CreateSandboxRequest{MemoryMB: 256})
	c := ctx(t)
	s.Disk.SetFree(300 << 20) // above 256 MiB, under 256 + 160
	op, err := s.C.Lifecycle(c, sb.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.WaitOp(op.ID, api.OpFailed); !strings.Contains(got.Error, "MiB free") {
		t.Fatalf("suspend with room for the memory size only: %+v", got)
	}
	if got, _ := s.C.GetSandbox(c, sb.ID); got.State != api.StateRunning {
		t.Fatalf("after the refused suspend: %+v", got)
	}
	s.Disk.SetFree(-1)
	op, err = s.C.Lifecycle(c, sb.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
}

// Disk: every sandbox gets a limit (its disk plus room for a snapshot of its memory),
// and a node whose free disk is at the reserve refuses creates and wakes with 507.
func TestDiskLimitAndReserve(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	c := ctx(t)
	sb := s.Create(api.CreateSandboxRequest{DiskMB: 2048, MemoryMB: 256})
	if sb.DiskMB != 2048 {
		t.Fatalf("disk_mb %d", sb.DiskMB)
	}
	if got, want := s.Disk.Limit(sb.ID), int64(2048+256+64)<<20; got != want {
		t.Fatalf("limit %d, want %d", got, want)
	}
	if code, body := do(t, s, "POST", "/v1/sandboxes", `{"disk_mb":1}`); code != 400 || !strings.Contains(body, "disk_mb") {
		t.Fatalf("tiny disk: %d %s", code, body)
	}
	op, err := s.C.Lifecycle(c, sb.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	s.Disk.SetFull("the store is at its reserve (test)")
	s.Eventually(10*time.Second, "creates to be refused", func() bool {
		code, body := do(t, s, "POST", "/v1/sandboxes", `{}`)
		return code == 507 && strings.Contains(body, "reserve")
	})
	if code, body := do(t, s, "POST", "/v1/sandboxes/"+sb.ID+"/wake", ""); code != 507 {
		t.Fatalf("wake on a full node: %d %s", code, body)
	}
	if got, _ := s.C.GetSandbox(c, sb.ID); got.State != api.StateSuspended {
		t.Fatalf("the refused wake changed the sandbox: %+v", got)
	}
	if code, body := do(t, s, "POST", "/v1/sandboxes/"+sb.ID+"/clone", `{}`); code != 507 || !strings.Contains(body, "clone sandboxes") {
		t.Fatalf("clone on a full node: %d %s", code, body)
	}
	s.Disk.SetFull("")
	s.Eventually(10*time.Second, "creates to be accepted again", func() bool {
		code, _ := do(t, s, "POST", "/v1/sandboxes", `{}`)
		return code == 202
	})
}

// TestCloneWithoutRoomFailsCleanly: a clone accepted while its node still had room, but
// whose source's memory image no longer fits when the node comes to take it, fails at
// once with the store's reason (insufficient storage), and the source runs on
// untouched. Before, the checkpoint was begun and failed half-way with the file
// system's "no space left on device".
func TestCloneWithoutRoomFailsCleanly(t *testing.T) {
	var checkpoints atomic.Int64
	s := spacetest.Start(t, spacetest.Options{BeforeCheckpoint: func(string) { checkpoints.Add(1) }})
	c := ctx(t)
	src := s.Create(api.CreateSandboxRequest{MemoryMB: 256})
	s.Disk.SetFree(1 << 20) // room for small writes, not for a memory image
	defer s.Disk.SetFree(-1)
	clones, err := s.C.Clone(c, src.ID, api.CloneRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, cl := range clones {
		op := s.WaitOp(cl.Operation.ID, api.OpFailed)
		if !strings.Contains(op.Error, "free above the reserve") {
			t.Errorf("clone %s failed with %q, want the store's reason", cl.ID, op.Error)
		}
	}
	got, err := s.C.GetSandbox(c, src.ID)
	if err != nil || got.State != api.StateRunning || got.Error != "" {
		t.Fatalf("the source after the refused clone: %+v %v", got, err)
	}
	if n := checkpoints.Load(); n != 0 {
		t.Errorf("the source was checkpointed %d times for clones that had no room", n)
	}
}

// suspendHeld starts a space with a running sandbox whose suspend is under way and held
// in the fake runtime's Checkpoint until unblock is called (an idle suspend as its user
// comes back, frozen); it returns the suspend's operation.
func suspendHeld(t *testing.T) (s *spacetest.Space, sb api.Sandbox, op *api.Operation, unblock func()) {
	t.Helper()
	release := make(chan struct{})
	var blocking atomic.Bool
	s = spacetest.Start(t, spacetest.Options{BeforeCheckpoint: func(string) {
		if blocking.Load() {
			<-release
		}
	}})
	var once sync.Once
	unblock = func() { once.Do(func() { blocking.Store(false); close(release) }) }
	t.Cleanup(unblock) // before the space stops, which waits for the suspend
	sb = s.Create(api.CreateSandboxRequest{})
	blocking.Store(true)
	c := ctx(t)
	op, err := s.C.Lifecycle(c, sb.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	s.Eventually(30*time.Second, "the suspend to be under way", func() bool {
		got, err := s.C.GetSandbox(c, sb.ID)
		return err == nil && got.State == api.StateSuspending
	})
	return s, sb, op, unblock
}
