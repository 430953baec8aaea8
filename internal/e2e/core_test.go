package e2e

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// TestEndToEnd is the walking skeleton: the CLI creates a sandbox from base, runs python
// in it, and deletes it, leaving nothing behind.
func TestEndToEnd(t *testing.T) {
	s := start(t, options{})

	out, stderr, code := s.cli(t, "sandbox", "create", "--template", "base", "--wait", "--env", "GREETING=hello", "--metadata", "owner=alice")
	if code != 0 {
		t.Fatalf("sandbox create: exit %d: %s", code, stderr)
	}
	if !regexp.MustCompile(`^[a-z0-9]{20}\n$`).MatchString(out) {
		t.Fatalf("sandbox create printed %q, want the id alone", out)
	}
	id := strings.TrimSpace(out)

	sb, err := s.C.GetSandbox(ctx(t, time.Minute), id)
	if err != nil {
		t.Fatal(err)
	}
	if sb.State != api.StateRunning || !strings.HasPrefix(sb.TemplateDigest, "sha256:") || sb.StartPath != "boot" || sb.Template != "base:latest" {
		t.Fatalf("sandbox = %+v", sb)
	}

	out, stderr, code = s.cli(t, "exec", id, "--", "python3", "-c", "print(6*7)")
	if code != 0 || out != "42\n" {
		t.Fatalf("exec python: exit %d, stdout %q, stderr %q", code, out, stderr)
	}
	out, stderr, code = s.cli(t, "exec", id, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
	if code != 3 || out != "out\n" || stderr != "err\n" {
		t.Fatalf("exec split streams: exit %d, stdout %q, stderr %q", code, out, stderr)
	}
	out, _, _ = s.cli(t, "exec", id, "--user", "user", "--cwd", "/tmp", "--", "sh", "-c", `echo "$(id -un) $(pwd) $GREETING $HOME"`)
	if out != "user /tmp hello /home/user\n" {
		t.Fatalf("exec as user: %q", out)
	}
	// Coreutils work (ls and stat use statx, see the gVisor compatibility shim).
	out, stderr, code = s.cli(t, "exec", id, "--", "sh", "-c", "ls -d /tmp /home/user && stat -c %U /home/user")
	if code != 0 || out != "/home/user\n/tmp\nuser\n" {
		t.Fatalf("ls/stat: exit %d, %q %q", code, out, stderr)
	}
	// An end the program did not choose is explained on stderr; the exit code stays.
	if _, stderr, code = s.cli(t, "exec", id, "--", "no-such-program"); code != 127 || !strings.Contains(stderr, "no-such-program: executable file not found") {
		t.Fatalf("exec of a missing program: exit %d, stderr %q, want 127 and why", code, stderr)
	}
	if _, stderr, code = s.cli(t, "exec", id, "--timeout", "1s", "--", "sleep", "60"); code != 137 || !strings.Contains(stderr, "timed out") {
		t.Fatalf("exec past its timeout: exit %d, stderr %q, want 137 and why", code, stderr)
	}
	if _, stderr, code = s.cli(t, "exec", id, "--", "sh", "-c", "kill -TERM $$"); code != 143 || stderr != "space: the process was killed by SIGTERM\n" {
		t.Fatalf("exec of a process a signal kills: exit %d, stderr %q", code, stderr)
	}

	// List with filters, text and JSON.
	out, _, _ = s.cli(t, "sandbox", "list", "--metadata", "owner=alice", "-o", "json")
	var list []api.Sandbox
	if err := json.Unmarshal([]byte(out), &list); err != nil || len(list) != 1 || list[0].ID != id {
		t.Fatalf("list by metadata: %v %s", err, out)
	}
	out, _, _ = s.cli(t, "sandbox", "list", "--metadata", "owner=bob", "-o", "json")
	if strings.TrimSpace(out) != "[]" {
		t.Fatalf("list owner=bob = %s", out)
	}
	out, _, _ = s.cli(t, "sandbox", "list", "--state", "running")
	if !strings.Contains(out, id) {
		t.Fatalf("list --state running:\n%s", out)
	}

	// Delete: nothing may be left on disk or in runsc.
	if _, stderr, code := s.cli(t, "sandbox", "rm", "--wait", id); code != 0 {
		t.Fatalf("rm: %s", stderr)
	}
	sb, err = s.C.GetSandbox(ctx(t, time.Minute), id)
	if err != nil || sb.State != api.StateDeleted {
		t.Fatalf("after delete: %+v %v", sb, err)
	}
	assertGone(t, s, id)
	if _, err := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, code := s.cli(t, "exec", id, "--", "true"); code == 0 {
		t.Fatal("exec in a deleted sandbox succeeded")
	}
}

// assertGone checks that no runsc container, subvolume or runtime state remains.
func assertGone(t *testing.T, s *srv, id string) {
	t.Helper()
	if slices.Contains(s.runscIDs(), id) {
		t.Errorf("runsc still lists %s", id)
	}
	for _, p := range []string{
		filepath.Join(s.DataDir, "store", "sandboxes", id),
		filepath.Join(s.DataDir, "runtime", id),
	} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s still exists (%v)", p, err)
		}
	}
	out, _ := execOut("pgrep", "-f", id)
	if strings.TrimSpace(out) != "" {
		t.Errorf("processes of %s remain: %s", id, out)
	}
}

// TestBadInput checks that malformed requests get clear JSON errors and create nothing.
// A server started under a strict umask (a unit's UMask=0077) starts sandboxes all the
// same (runsc's directories must stay readable to the sandbox's unprivileged host uid),
// and its private files stay private.
func TestStrictUmask(t *testing.T) {
	s := start(t, options{Umask: "077"})
	out, stderr, code := s.cli(t, "sandbox", "create", "--template", "base", "--wait")
	if code != 0 {
		t.Fatalf("sandbox create under umask 077: exit %d: %s", code, stderr)
	}
	id := strings.TrimSpace(out)
	if out, stderr, code = s.cli(t, "exec", id, "--", "echo", "ok"); code != 0 || out != "ok\n" {
		t.Fatalf("exec: exit %d, %q %q", code, out, stderr)
	}
	if fi, err := os.Stat(filepath.Join(s.DataDir, "admin.key")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("admin.key: %v %v, want mode 0600", fi, err)
	}
}

// TestStartOnTakenAddress: the harness starts a server whose --listen address another
// process holds (another test's server took it after FreeAddr picked it) on another
// address, even when the holder answers /healthz: its clients reach this server, not
// the holder. Before, the holder's answer was taken for this server's.
func TestStartOnTakenAddress(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	holder := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"status":"ok"}`)
	})}
	go func() { _ = holder.Serve(ln) }()
	t.Cleanup(func() { _ = holder.Close() })
	s := start(t, options{Addr: ln.Addr().String()})
	if s.Addr == ln.Addr().String() {
		t.Fatalf("the server was taken to listen on %s, which another process holds", s.Addr)
	}
	if _, err := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{}); err != nil {
		t.Fatalf("the server's client: %v", err)
	}
}

func TestBadInput(t *testing.T) {
	s := start(t, options{})
	big := `{"metadata":{"k":"` + strings.Repeat("x", 2<<20) + `"}}`
	cases := []struct {
		name, method, path, body, key string
		status                        int
		code                          string
	}{
		{"unknown template", "POST", "/v1/sandboxes", `{"template":"nope"}`, s.Key, 404, "not_found"},
		{"unknown template digest", "POST", "/v1/sandboxes", `{"template":"base@sha256:` + strings.Repeat("0", 64) + `"}`, s.Key, 404, "not_found"},
		{"invalid template name", "POST", "/v1/sandboxes", `{"template":"../etc"}`, s.Key, 400, "invalid_argument"},
		{"malformed json", "POST", "/v1/sandboxes", `{"template":`, s.Key, 400, "invalid_argument"},
		{"wrong type", "POST", "/v1/sandboxes", `{"cpu":"two"}`, s.Key, 400, "invalid_argument"},
		{"unknown field", "POST", "/v1/sandboxes", `{"cpus":2}`, s.Key, 400, "invalid_argument"},
		{"trailing data", "POST", "/v1/sandboxes", `{} {}`, s.Key, 400, "invalid_argument"},
		{"too much memory", "POST", "/v1/sandboxes", `{"memory_mb":999999}`, s.Key, 400, "invalid_argument"},
		{"bad ttl", "POST", "/v1/sandboxes", `{"ttl":"soon"}`, s.Key, 400, "invalid_argument"},
		{"bad env key", "POST", "/v1/sandboxes", `{"env":{"A=B":"c"}}`, s.Key, 400, "invalid_argument"},
		{"oversized body", "POST", "/v1/sandboxes", big, s.Key, 413, "too_large"},
		{"unknown sandbox", "GET", "/v1/sandboxes/doesnotexist", "", s.Key, 404, "not_found"},
		{"delete unknown sandbox", "DELETE", "/v1/sandboxes/doesnotexist", "", s.Key, 404, "not_found"},
		{"unknown operation", "GET", "/v1/operations/op_nope", "", s.Key, 404, "not_found"},
		{"session in unknown sandbox", "POST", "/v1/sandboxes/nope/sessions", `{"argv":["true"]}`, s.Key, 404, "not_found"},
		{"unknown route", "GET", "/v1/nothing", "", s.Key, 404, "not_found"},
		{"missing key", "GET", "/v1/sandboxes", "", "", 401, "unauthorized"},
		{"bad key", "GET", "/v1/sandboxes", "", "space_wrong", 401, "unauthorized"},
		{"attachment token as key", "GET", "/v1/sandboxes", "", "spt1.abc.def", 401, "unauthorized"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, _ := http.NewRequest(c.method, s.URL+c.path, strings.NewReader(c.body))
			if c.key != "" {
				req.Header.Set("Authorization", "Bearer "+c.key)
			}
			if c.body != "" {
				req.Header.Set("Content-Type", "application/json")
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var e api.Error
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != c.status || json.Unmarshal(b, &e) != nil || e.Error.Code != c.code || e.Error.Message == "" {
				t.Fatalf("%s %s: status %d body %s; want %d %s", c.method, c.path, resp.StatusCode, b, c.status, c.code)
			}
			if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
				t.Fatalf("content type %q", ct)
			}
		})
	}
	list, err := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{States: []string{"pending", "creating", "running", "failed", "deleted"}})
	if err != nil || len(list) != 0 {
		t.Fatalf("bad requests created sandboxes: %v %v", list, err)
	}
	// Huge headers are refused before any handler runs.
	req0, _ := http.NewRequest("GET", s.URL+"/v1/sandboxes", nil)
	req0.Header.Set("Authorization", "Bearer "+s.Key)
	req0.Header.Set("X-Filler", strings.Repeat("x", 200<<10))
	if resp, err := http.DefaultClient.Do(req0); err != nil || resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("huge header: %v %v", resp, err)
	}
	// X-API-Key works as well as Authorization.
	req, _ := http.NewRequest("GET", s.URL+"/v1/sandboxes", nil)
	req.Header.Set("X-API-Key", s.Key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("X-API-Key: %v %v", resp.Status, err)
	}
	resp.Body.Close()
}

// TestIdempotentCreate checks that a retried create with the same key returns the same
// sandbox, and that reusing the key for another request is refused.
func TestIdempotentCreate(t *testing.T) {
	s := start(t, options{})
	req := api.CreateSandboxRequest{Metadata: map[string]string{"try": "1"}}
	a, err := s.C.CreateSandbox(ctx(t, time.Minute), req, "create-abc")
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.C.CreateSandbox(ctx(t, time.Minute), req, "create-abc")
	if err != nil {
		t.Fatal(err)
	}
	if a.ID != b.ID || a.Operation.ID != b.Operation.ID {
		t.Fatalf("retry made a new sandbox: %s vs %s", a.ID, b.ID)
	}
	_, err = s.C.CreateSandbox(ctx(t, time.Minute), api.CreateSandboxRequest{Metadata: map[string]string{"try": "2"}}, "create-abc")
	if ce, ok := err.(*client.Error); !ok || ce.Status != 422 {
		t.Fatalf("key reuse with another body: %v", err)
	}
	list, _ := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{})
	if len(list) != 1 {
		t.Fatalf("%d sandboxes after retries, want 1", len(list))
	}
	if _, err := s.C.WaitOperation(ctx(t, 3*time.Minute), a.Operation.ID); err != nil {
		t.Fatal(err)
	}
}

// TestAPIKeys covers key management through the CLI and the admin check.
func TestAPIKeys(t *testing.T) {
	s := start(t, options{})
	if fi, err := os.Stat(filepath.Join(s.DataDir, "admin.key")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("admin.key: %v %v", fi.Mode(), err)
	}
	// The key is in the file only: never in the log (serve's output is no terminal).
	if !strings.Contains(s.Log(), "created the operator API key") || strings.Contains(s.Log(), s.Key) {
		t.Fatal("first start logged the admin key, or did not say where it is")
	}
	// An operator names the key's tenant.
	if _, stderr, code := s.cli(t, "apikey", "create", "ci-bot"); code == 0 || !strings.Contains(stderr, "tenant is required") {
		t.Fatalf("apikey create without --tenant: %d %s", code, stderr)
	}
	if _, stderr, code := s.cli(t, "tenant", "create", "ci"); code != 0 {
		t.Fatal(stderr)
	}
	out, stderr, code := s.cli(t, "apikey", "create", "ci-bot", "--tenant", "ci", "-o", "json")
	if code != 0 {
		t.Fatal(stderr)
	}
	var k api.APIKey
	if err := json.Unmarshal([]byte(out), &k); err != nil || !strings.HasPrefix(k.Secret, "space_") || k.Admin || k.Tenant != "ci" {
		t.Fatalf("apikey create: %s", out)
	}
	bot := client.New(s.URL, k.Secret)
	if _, err := bot.ListSandboxes(ctx(t, time.Minute), client.ListOptions{}); err != nil {
		t.Fatalf("new key rejected: %v", err)
	}
	if _, err := bot.CreateAPIKey(ctx(t, time.Minute), api.CreateAPIKeyRequest{Name: "x"}); err == nil || err.(*client.Error).Status != 403 {
		t.Fatalf("non-admin created a key: %v", err)
	}
	out, _, _ = s.cli(t, "apikey", "list")
	if !strings.Contains(out, "ci-bot") || strings.Contains(out, k.Secret) {
		t.Fatalf("apikey list:\n%s", out)
	}
	if _, stderr, code := s.cli(t, "apikey", "revoke", k.Prefix); code == 0 || !strings.Contains(stderr, "key id") {
		t.Fatalf("revoke by prefix: %d %s", code, stderr)
	}
	if _, stderr, code := s.cli(t, "apikey", "revoke", k.ID); code != 0 {
		t.Fatal(stderr)
	}
	if _, err := bot.ListSandboxes(ctx(t, time.Minute), client.ListOptions{}); err == nil || err.(*client.Error).Status != 401 {
		t.Fatalf("revoked key still works: %v", err)
	}
	// An E2B key is refused on the space API.
	out, _, _ = s.cli(t, "apikey", "create", "sdk", "--e2b", "--tenant", "ci")
	if !regexp.MustCompile(`^e2b_[0-9a-f]{40}\n$`).MatchString(out) {
		t.Fatalf("e2b key %q", out)
	}
	e2b := client.New(s.URL, strings.TrimSpace(out))
	if _, err := e2b.ListSandboxes(ctx(t, time.Minute), client.ListOptions{}); err == nil || err.(*client.Error).Status != 401 {
		t.Fatalf("e2b key accepted on the space API: %v", err)
	}
}

// TestObservability checks /healthz, /metrics (an operator's on the API address, and
// anyone's on --metrics-listen) and the OpenAPI document.
func TestObservability(t *testing.T) {
	metricsAddr := freeAddr(t)
	s := start(t, options{Args: []string{"--metrics-listen", metricsAddr}})
	s.create(t, api.CreateSandboxRequest{})
	getFrom := func(base, path, key string, want int) string {
		req, _ := http.NewRequest("GET", base+path, nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil || resp.StatusCode != want {
			t.Fatalf("GET %s%s: %v %v", base, path, resp, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	get := func(path string) string { return getFrom(s.URL, path, "", 200) }
	if !strings.Contains(get("/healthz"), `"ok"`) {
		t.Fatal("healthz")
	}
	getFrom(s.URL, "/metrics", "", http.StatusUnauthorized)
	if m := getFrom("http://"+metricsAddr, "/metrics", "", 200); !strings.Contains(m, "space_sandboxes") {
		t.Fatal("--metrics-listen serves no metrics")
	}
	// An idle sandbox's resource samples come from its host cgroup, its agent left
	// alone (docs/operations.md, "Sandbox metrics"): from the second round on.
	waitFor(t, 30*time.Second, "a resource sample from the host alone", func() bool {
		return regexp.MustCompile(`space_node_metric_samples_total\{node="[^"]*",source="host"\} [1-9]`).MatchString(getFrom(s.URL, "/metrics", s.Key, 200))
	})
	m := getFrom(s.URL, "/metrics", s.Key, 200)
	for _, want := range []string{`space_sandboxes{state="running"} 1`, `space_operation_duration_seconds_count{kind="create",result="succeeded"} 1`, "space_http_request_duration_seconds"} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	var doc struct {
		OpenAPI string                     `json:"openapi"`
		Paths   map[string]json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal([]byte(get("/v1/openapi.json")), &doc); err != nil || !strings.HasPrefix(doc.OpenAPI, "3.") {
		t.Fatalf("openapi: %v %q", err, doc.OpenAPI)
	}
	for _, p := range []string{"/v1/sandboxes", "/v1/sandboxes/{id}", "/v1/operations/{id}/wait", "/v1/sandboxes/{id}/sessions", "/v1/dp/sandboxes/{id}/processes/{pid}/attach"} {
		if _, ok := doc.Paths[p]; !ok {
			t.Errorf("openapi lacks %s", p)
		}
	}
}

// TestOperationStream checks the long-poll and SSE views of an operation.
func TestOperationStream(t *testing.T) {
	s := start(t, options{})
	sb, err := s.C.CreateSandbox(ctx(t, time.Minute), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequestWithContext(ctx(t, 2*time.Minute), "GET", s.URL+"/v1/operations/"+sb.Operation.ID+"/events", nil)
	req.Header.Set("Authorization", "Bearer "+s.Key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("events: %v %v", resp, err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	events := strings.Split(strings.TrimSpace(string(body)), "\n\n")
	last := events[len(events)-1]
	if !strings.Contains(last, "event: operation") || !strings.Contains(last, `"state":"succeeded"`) {
		t.Fatalf("last event %q of\n%s", last, body)
	}
	// Long-poll on a finished operation returns at once.
	start := time.Now()
	op, err := s.C.WaitOperation(ctx(t, time.Minute), sb.Operation.ID)
	if err != nil || op.State != api.OpSucceeded || time.Since(start) > 5*time.Second {
		t.Fatalf("wait: %+v %v", op, err)
	}
	out, _, code := s.cli(t, "op", "get", sb.Operation.ID, "-o", "json")
	if code != 0 || !strings.Contains(out, `"succeeded"`) {
		t.Fatalf("op get: %s", out)
	}
}

// TestTTL checks that a sandbox is deleted when its TTL ends.
func TestTTL(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{TTL: "2s"})
	waitFor(t, time.Minute, "ttl deletion", func() bool {
		got, err := s.C.GetSandbox(ctx(t, time.Minute), sb.ID)
		return err == nil && got.State == api.StateDeleted
	})
	assertGone(t, s, sb.ID)
}

func execOut(name string, args ...string) (string, error) {
	var b bytes.Buffer
	cmd := execCommand(name, args...)
	cmd.Stdout = &b
	err := cmd.Run()
	return b.String(), err
}
