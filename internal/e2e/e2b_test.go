package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/template"
)

// e2bSDKDir holds the Node.js scripts that drive the real E2B JS SDK
// (internal/e2e/e2bsdk, installed by scripts/setup.sh with npm ci).
func e2bSDKDir(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	dir := filepath.Join(filepath.Dir(file), "e2bsdk")
	if _, err := exec.LookPath("node"); err != nil {
		t.Skip("needs node (Node.js 20+) for the E2B SDK tests")
	}
	for _, pkg := range []string{"e2b", "e2b-old"} {
		if _, err := os.Stat(filepath.Join(dir, "node_modules", pkg, "package.json")); err != nil {
			t.Skipf("E2B SDK %s not installed: run `npm ci` in %s (scripts/setup.sh does)", pkg, dir)
		}
	}
	return dir
}

// e2bServer starts space serve with the E2B listener and makes an E2B key. builtins
// are builtin templates besides base to have ready.
func e2bServer(t *testing.T, builtins ...string) (s *srv, e2bURL, key string) {
	addr := freeAddr(t)
	s = start(t, options{Args: []string{"--e2b-listen", addr}, Builtins: builtins})
	out, errOut, code := s.cli(t, "apikey", "create", "e2b-sdk", "--e2b", "--tenant", "default")
	if code != 0 {
		t.Fatalf("apikey create --e2b: %s", errOut)
	}
	return s, "http://" + addr, strings.TrimSpace(out)
}

// TestE2BSDK runs the unmodified E2B JS SDK's scenarios (suite.mjs) against space: the
// current SDK (v2 create/connect endpoints) and an older 2.x (v1 endpoints).
func TestE2BSDK(t *testing.T) {
	dir := e2bSDKDir(t)
	s, url, key := e2bServer(t)
	for _, sdk := range []string{"e2b", "e2b-old"} {
		t.Run(sdk, func(t *testing.T) {
			cmd := exec.CommandContext(ctx(t, 4*time.Minute), "node", "--test", "--test-reporter=spec", "suite.mjs")
			cmd.Dir = dir
			cmd.Env = append(os.Environ(), "E2B_SDK="+sdk, "E2B_API_KEY="+key, "E2B_API_URL="+url, "E2B_SANDBOX_URL="+url,
				"E2B_DOMAIN=", "E2B_DEBUG=")
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			start := time.Now()
			err := cmd.Run()
			t.Logf("%s suite took %s", sdk, time.Since(start).Round(time.Millisecond))
			for _, line := range strings.Split(out.String(), "\n") {
				if i := strings.Index(line, "TIMING "); i >= 0 {
					t.Logf("%s: %s", sdk, line[i+len("TIMING "):])
				}
			}
			if err != nil {
				t.Fatalf("E2B SDK suite (%s) failed: %v\n%s", sdk, err, out.String())
			}
			if testing.Verbose() {
				t.Log(out.String())
			}
		})
	}
	if t.Failed() {
		return
	}
	// Everything the suites created is gone (killed, or expired) except what the
	// lifecycle tests left paused… which they kill too.
	waitFor(t, time.Minute, "the suites' sandboxes to be deleted", func() bool {
		list, err := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{})
		return err == nil && len(list) == 0
	})
	// And the snapshots it took, with their files.
	waitFor(t, time.Minute, "the suites' snapshots to be deleted", func() bool {
		list, err := s.C.ListSnapshots(ctx(t, time.Minute), client.SnapshotListOptions{})
		ents, _ := os.ReadDir(filepath.Join(s.DataDir, "store", "snapshots"))
		return err == nil && len(list) == 0 && len(ents) == 0
	})
}

// TestE2BCodeInterpreter runs E2B's code interpreter SDK (@e2b/code-interpreter,
// codeinterp.mjs) against the builtin template code-interpreter-v1.
func TestE2BCodeInterpreter(t *testing.T) {
	dir := e2bSDKDir(t)
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "@e2b", "code-interpreter", "package.json")); err != nil {
		t.Skipf("@e2b/code-interpreter not installed: run `npm ci` in %s (scripts/setup.sh does)", dir)
	}
	s, url, key := e2bServer(t, template.CodeInterpreterTemplate)
	cmd := exec.CommandContext(ctx(t, 8*time.Minute), "node", "--test", "--test-reporter=spec", "codeinterp.mjs")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "E2B_API_KEY="+key, "E2B_API_URL="+url, "E2B_SANDBOX_URL="+url, "E2B_DOMAIN=", "E2B_DEBUG=")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err := cmd.Run()
	t.Logf("code interpreter suite took %s", time.Since(start).Round(time.Millisecond))
	if err != nil {
		t.Fatalf("code interpreter suite failed: %v\n%s", err, out.String())
	}
	if testing.Verbose() {
		t.Log(out.String())
	}
	waitFor(t, time.Minute, "the suite's sandboxes to be deleted", func() bool {
		list, err := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{})
		return err == nil && len(list) == 0
	})
}

// TestE2BWire checks what the SDK suites cannot see: status codes, error bodies and
// routing rules of the E2B listener, with plain HTTP.
func TestE2BWire(t *testing.T) {
	_, url, key := e2bServer(t)
	do := func(method, path string, body any, hdr map[string]string) (int, map[string]any, http.Header) {
		t.Helper()
		var rd io.Reader
		if body != nil {
			b, _ := json.Marshal(body)
			rd = bytes.NewReader(b)
		}
		req, err := http.NewRequest(method, url+path, rd)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-API-KEY", key)
		for k, v := range hdr {
			if v == "" {
				req.Header.Del(k)
			} else {
				req.Header.Set(k, v)
			}
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var m map[string]any
		_ = json.Unmarshal(b, &m)
		return resp.StatusCode, m, resp.Header
	}
	wantError := func(what string, status int, gotStatus int, m map[string]any) {
		t.Helper()
		if gotStatus != status || m["code"] != float64(status) || m["message"] == "" {
			t.Errorf("%s: %d %v, want %d with an E2B error body", what, gotStatus, m, status)
		}
	}

	code, m, _ := do("GET", "/v2/sandboxes", nil, map[string]string{"X-API-KEY": "e2b_" + strings.Repeat("0", 40)})
	wantError("bad key", 401, code, m)
	code, m, _ = do("GET", "/sandboxes/nosuchsandbox00000000", nil, nil)
	wantError("unknown sandbox", 404, code, m)
	code, m, _ = do("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "timeout": -1}, nil)
	wantError("negative timeout", 400, code, m)
	code, m, _ = do("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 100 * 3600}, nil)
	wantError("timeout over the cap", 400, code, m)

	// v1 create (Python and older JS), with the space key form the E2B CLI sends.
	code, sb, _ := do("POST", "/sandboxes", map[string]any{"templateID": "base", "timeout": 300, "metadata": map[string]string{"k": "v"},
		"secure": true, "allow_internet_access": true}, map[string]string{"X-API-KEY": "", "Authorization": "Bearer " + key})
	if code != 201 {
		t.Fatalf("v1 create: %d %v", code, sb)
	}
	for _, f := range []string{"sandboxID", "templateID", "clientID", "envdVersion", "envdAccessToken", "domain"} {
		if v, _ := sb[f].(string); v == "" {
			t.Errorf("create answer lacks %s: %v", f, sb)
		}
	}
	id, token := sb["sandboxID"].(string), sb["envdAccessToken"].(string)
	code, detail, _ := do("GET", "/sandboxes/"+id, nil, nil)
	if code != 200 || detail["envdAccessToken"] != token || detail["state"] != "running" {
		t.Errorf("get: %d %v", code, detail)
	}
	for _, f := range []string{"startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB", "clientID", "envdVersion"} {
		if _, ok := detail[f]; !ok {
			t.Errorf("detail lacks %s", f)
		}
	}
	code, _, hdr := do("GET", "/v2/sandboxes?state=running&metadata=k%3Dv", nil, nil)
	if code != 200 || hdr.Get("X-Total-Running") != "1" {
		t.Errorf("list: %d %v", code, hdr)
	}
	code, m, _ = do("POST", "/v2/sandboxes/"+id+"/connect", map[string]any{}, nil)
	if code != 200 || m["envdAccessToken"] != token {
		t.Errorf("connect running: %d %v", code, m)
	}
	code, m, _ = do("POST", "/sandboxes/"+id+"/resume", map[string]any{}, nil)
	wantError("resume a running sandbox", 409, code, m)

	// The sandbox plane: header routing, the access token first (health included), 502
	// for what is not there.
	envd := map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "49983", "X-API-KEY": ""}
	code, m, _ = do("GET", "/health", nil, envd)
	wantError("envd health without access token", 401, code, m)
	code, m, _ = do("GET", "/envs", nil, envd)
	wantError("envd without access token", 401, code, m)
	envd["X-Access-Token"] = token
	if code, _, _ := do("GET", "/health", nil, envd); code != 204 {
		t.Errorf("envd health: %d", code)
	}
	if code, _, _ := do("GET", "/envs", nil, envd); code != 200 {
		t.Errorf("envd envs: %d", code)
	}
	code, m, _ = do("GET", "/files?path=/nope", nil, envd)
	wantError("envd missing file", 404, code, m)
	code, m, _ = do("GET", "/v1/processes", nil, envd)
	wantError("agent path through envd", 404, code, m)
	code, m, _ = do("GET", "/health", nil, map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "8080"})
	// E2B's own words for a closed port, with space's detail.
	if code != 502 || m["message"] != "The sandbox is running but port is not open" || !strings.Contains(fmt.Sprint(m["detail"]), "port 8080") {
		t.Errorf("closed port: %d %v", code, m)
	}
	code, m, _ = do("GET", "/health", nil, map[string]string{"E2b-Sandbox-Id": "nosuchsandbox00000000", "E2b-Sandbox-Port": "49983",
		"X-Access-Token": token})
	wantError("unknown sandbox on the envd plane (its token cannot be verified)", 401, code, m)
	code, m, _ = do("GET", "/health", nil, map[string]string{"E2b-Sandbox-Id": id})
	wantError("sandbox id without port", 400, code, m)
	// /files naming no sandbox: a signed link behind a single E2B_SANDBOX_URL, else
	// envd's refusals.
	for q, msg := range map[string]string{
		"path=x":                     "missing signature query parameter",
		"path=x&signature=v1_forged": "invalid signature",
		"path=x&signature=v1_forged&signature_expiration=1": "invalid signature",
	} {
		code, m, _ = do("GET", "/files?"+q, nil, map[string]string{"X-API-KEY": ""})
		if code != 401 || m["message"] != msg {
			t.Errorf("unrouted /files?%s: %d %v, want 401 %q", q, code, m, msg)
		}
	}
	// Host routing: <port>-<id>.<domain>.
	req, _ := http.NewRequest("GET", url+"/health", nil)
	req.Host = "49983-" + id + ".sandbox.example"
	req.Header.Set("X-Access-Token", token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 204 {
		t.Errorf("host-routed health: %d", resp.StatusCode)
	}

	if code, _, _ := do("DELETE", "/sandboxes/"+id, nil, nil); code != 204 {
		t.Errorf("kill: %d", code)
	}
	code, m, _ = do("DELETE", "/sandboxes/"+id, nil, nil)
	wantError("kill twice", 404, code, m)
	if code, _, _ := do("GET", "/health", nil, map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "49983", "X-API-KEY": "",
		"X-Access-Token": token}); code != 502 {
		t.Errorf("envd of a killed sandbox: %d", code)
	}
}

// TestDatabaseOutage: a restart of the embedded PostgreSQL (killed; back in about a
// second) is ridden out: requests that need it, an E2B create among them, wait for it
// and succeed (until 2026-12-07 they were answered 503, and the E2B SDKs do not retry
// a create or a kill). An outage longer than --database-wait is answered 503 with
// Retry-After (which clients and the SDKs retry), never as if a credential were
// wrong, and no answer names the database's internals (its user, socket path, the
// data dir). Until 2026-12-07 an envd request got E2B's 401 "access token present in
// header but does not match" and an attach stream 401 "token was revoked" (seen as
// E2B SDK file calls failing for good under PostgreSQL kills), and the 503s carried
// the driver's message whole. Once PostgreSQL is back the same requests work.
func TestDatabaseOutage(t *testing.T) {
	const wait = 2 * time.Second
	addr := freeAddr(t)
	s := start(t, options{Embedded: true, Args: []string{"--e2b-listen", addr, "--database-wait", wait.String()}})
	e2bURL := "http://" + addr
	out, errOut, code := s.cli(t, "apikey", "create", "outage", "--e2b", "--tenant", "default")
	if code != 0 {
		t.Fatalf("apikey create --e2b: %s", errOut)
	}
	key := strings.TrimSpace(out)
	type answer struct {
		code       int
		body       string
		retryAfter string
	}
	send := func(method, url string, body any, hdr map[string]string) answer {
		t.Helper()
		var rd io.Reader
		if body != nil {
			b, _ := json.Marshal(body)
			rd = bytes.NewReader(b)
		}
		req, err := http.NewRequestWithContext(ctx(t, 30*time.Second), method, url, rd)
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
			return answer{code: resp.StatusCode} // an open stream: its status is the answer
		}
		b, _ := io.ReadAll(resp.Body)
		return answer{resp.StatusCode, string(b), resp.Header.Get("Retry-After")}
	}
	created := send("POST", e2bURL+"/v2/sandboxes", map[string]any{"templateID": "base"}, map[string]string{"X-API-KEY": key})
	var sb struct{ SandboxID, EnvdAccessToken string }
	if err := json.Unmarshal([]byte(created.body), &sb); created.code != 201 || err != nil {
		t.Fatalf("E2B create: %+v", created)
	}
	sess, err := s.C.CreateSession(ctx(t, time.Minute), sb.SandboxID, api.CreateSessionRequest{Command: "echo attached; sleep 600"})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(sess.AttachURL, "http") {
		sess.AttachURL = s.URL + sess.AttachURL
	}
	requests := map[string]func() answer{
		"envd file read": func() answer {
			return send("GET", e2bURL+"/files?path=/etc/hostname", nil, map[string]string{
				"E2b-Sandbox-Id": sb.SandboxID, "E2b-Sandbox-Port": "49983", "X-Access-Token": sb.EnvdAccessToken})
		},
		"attach": func() answer {
			return send("GET", sess.AttachURL, nil, map[string]string{"Authorization": "Bearer " + sess.Token, "Accept": "text/event-stream"})
		},
		"API read": func() answer {
			return send("GET", s.URL+"/v1/sandboxes/"+sb.SandboxID, nil, map[string]string{"Authorization": "Bearer " + s.Key})
		},
	}
	// all sends the requests at once and returns their answers and the slowest's time.
	all := func(requests map[string]func() answer) (map[string]answer, time.Duration) {
		var mu sync.Mutex
		answers := map[string]answer{}
		var wg sync.WaitGroup
		began := time.Now()
		for name, do := range requests {
			wg.Go(func() {
				a := do()
				mu.Lock()
				answers[name] = a
				mu.Unlock()
			})
		}
		wg.Wait()
		return answers, time.Since(began)
	}
	var made []string
	requests["E2B create"] = func() answer {
		a := send("POST", e2bURL+"/v2/sandboxes", map[string]any{"templateID": "base"}, map[string]string{"X-API-KEY": key})
		var sb struct{ SandboxID string }
		if json.Unmarshal([]byte(a.body), &sb) == nil && sb.SandboxID != "" {
			made = append(made, sb.SandboxID)
		}
		return a
	}

	t.Run("restart ridden out", func(t *testing.T) {
		s.KillPostgres() // the supervisor starts it again after half a second
		answers, took := all(requests)
		for name, a := range answers {
			if a.code >= 300 {
				t.Errorf("%s while PostgreSQL restarts: %+v, want it to wait and succeed", name, a)
			}
		}
		if took < 300*time.Millisecond {
			t.Errorf("the requests took %v: they did not meet the restart", took)
		}
	})

	t.Run("longer outage answers 503", func(t *testing.T) {
		back := s.PostgresAway(t)
		defer back()
		internals := []string{".s.PGSQL", "user=", "database=", s.DataDir}
		answers, took := all(requests)
		for name, a := range answers {
			if a.code != http.StatusServiceUnavailable || a.retryAfter != "1" {
				t.Errorf("%s while the database is down: %+v, want 503 with Retry-After: 1", name, a)
			}
			for _, s := range internals {
				if strings.Contains(a.body, s) {
					t.Errorf("%s while the database is down: the answer names %q: %s", name, s, a.body)
				}
			}
		}
		if took < wait || took > wait+5*time.Second {
			t.Errorf("the 503s came after %v, want about --database-wait (%v)", took, wait)
		}
		back()
		for name, do := range requests {
			if a := do(); a.code >= 300 {
				t.Errorf("%s once the database is back: %+v", name, a)
			}
		}
	})
	for _, id := range made {
		if a := send("DELETE", e2bURL+"/sandboxes/"+id, nil, map[string]string{"X-API-KEY": key}); a.code != http.StatusNoContent {
			t.Errorf("E2B kill of %s: %+v", id, a)
		}
	}
}
