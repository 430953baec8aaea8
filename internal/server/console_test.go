package server_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/server"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
	"github.com/spacedev/space/internal/token"
)

// consoleEnv is an API on a real PostgreSQL database with keys in two tenants.
type consoleEnv struct {
	st                *store.Store
	srv               *httptest.Server
	t1, t2, admin     string // secrets
	benchFile, nodeID string
}

func newConsoleEnv(t *testing.T) *consoleEnv {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	log := slog.New(slog.DiscardHandler)
	st, err := store.Open(ctx, store.Config{URL: testenv.Postgres(t), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	signer, err := token.NewSigner([]byte(strings.Repeat("k", 32)))
	if err != nil {
		t.Fatal(err)
	}
	e := &consoleEnv{st: st, benchFile: filepath.Join(t.TempDir(), "bench", "last.json")}
	svc := service.New(service.Config{Store: st, Signer: signer, Logger: log,
		DefaultCPU: 1, DefaultMemoryMB: 512, MaxCPU: 4, MaxMemoryMB: 4096, BuiltinTemplates: []string{"base"}})
	a := server.NewAPI(server.Config{Service: svc, Logger: log, Registry: prometheus.NewRegistry(), BenchFile: e.benchFile})
	go svc.Run(ctx)
	e.srv = httptest.NewServer(a.Handler())
	t.Cleanup(e.srv.Close)
	key := func(tenant string, admin bool) string {
		secret, prefix, err := store.NewKeySecret("space")
		if err != nil {
			t.Fatal(err)
		}
		role := store.RoleMember
		if admin {
			role = store.RoleOperator
		}
		if err := st.EnsureTenant(ctx, tenant); err != nil {
			t.Fatal(err)
		}
		if err := st.CreateAPIKey(ctx, &store.APIKey{ID: ids.APIKey(), Name: tenant, Prefix: prefix, Kind: "space", Tenant: tenant, Role: role}, secret); err != nil {
			t.Fatal(err)
		}
		return secret
	}
	e.t1, e.t2, e.admin = key("t1", false), key("t2", false), key("t1", true)
	n := &store.Node{ID: ids.Node(), Name: "node-a", Runtime: "gvisor", DataPlaneURL: "http://node-a.internal:7701"}
	if err := st.RegisterNode(ctx, n); err != nil {
		t.Fatal(err)
	}
	e.nodeID = n.ID
	return e
}

func (e *consoleEnv) do(t *testing.T, method, path, key string, body io.Reader) *http.Response {
	t.Helper()
	req, err := http.NewRequest(method, e.srv.URL+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func (e *consoleEnv) json(t *testing.T, method, path, key, body string, want int, out any) {
	t.Helper()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	resp := e.do(t, method, path, key, r)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		t.Fatalf("%s %s: %d %s, want %d", method, path, resp.StatusCode, b, want)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("%s %s: %v: %s", method, path, err, b)
		}
	}
}

type sseEvent struct{ name, data string }

// stream reads an event stream into a channel.
func (e *consoleEnv) stream(t *testing.T, key string) <-chan sseEvent {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.srv.URL+"/v1/events", nil)
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("GET /v1/events: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	ch := make(chan sseEvent, 100)
	go func() {
		defer resp.Body.Close()
		defer close(ch)
		sc := bufio.NewScanner(resp.Body)
		var ev sseEvent
		for sc.Scan() {
			line := sc.Text()
			switch {
			case strings.HasPrefix(line, "event: "):
				ev.name = line[7:]
			case strings.HasPrefix(line, "data: "):
				ev.data = line[6:]
			case line == "" && ev.name != "":
				ch <- ev
				ev = sseEvent{}
			}
		}
	}()
	return ch
}

// next returns the next event that is not a keepalive-level resync, failing after d.
func next(t *testing.T, ch <-chan sseEvent, d time.Duration, accept func(sseEvent) bool) sseEvent {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				t.Fatal("the event stream ended")
			}
			if accept(ev) {
				return ev
			}
		case <-timer.C:
			t.Fatalf("no matching event within %s", d)
		}
	}
}

func isSync(ev sseEvent) bool { return ev.name == "ready" || ev.name == "resync" }

func sandboxEvent(id, state string) func(sseEvent) bool {
	return func(ev sseEvent) bool {
		if ev.name != "sandbox" {
			return false
		}
		var sb api.Sandbox
		return json.Unmarshal([]byte(ev.data), &sb) == nil && sb.ID == id && (state == "" || sb.State == state)
	}
}

// TestEventStream checks GET /v1/events: it starts with ready, carries sandbox and
// operation changes driven by the store's notifications, and only to the streams whose
// key may see them (the tenant's, and admin keys').
func TestEventStream(t *testing.T) {
	e := newConsoleEnv(t)
	ctx := context.Background()
	s1, s2, sa := e.stream(t, e.t1), e.stream(t, e.t2), e.stream(t, e.admin)
	for _, s := range []<-chan sseEvent{s1, s2, sa} {
		next(t, s, 30*time.Second, isSync)
	}

	// A sandbox of t1 reaches running on a node: t1 and the admin see it.
	var sb api.Sandbox
	e.json(t, "POST", "/v1/sandboxes", e.t1, `{"metadata":{"k":"v"}}`, http.StatusAccepted, &sb)
	if ok, err := e.st.AssignNode(ctx, sb.ID, e.nodeID, "gvisor"); err != nil || !ok {
		t.Fatalf("assign: %v %v", ok, err)
	}
	if _, err := e.st.ReportObserved(ctx, sb.ID, e.nodeID, store.Observed{State: api.StateRunning, ObservedGeneration: 1}); err != nil {
		t.Fatal(err)
	}
	got := next(t, s1, 30*time.Second, sandboxEvent(sb.ID, api.StateRunning))
	var full api.Sandbox
	if err := json.Unmarshal([]byte(got.data), &full); err != nil || full.Metadata["k"] != "v" || full.Node != e.nodeID {
		t.Errorf("sandbox event %s", got.data)
	}
	next(t, sa, 30*time.Second, sandboxEvent(sb.ID, api.StateRunning))

	// A sandbox of t2: its stream gets that one and never t1's before it.
	var sb2 api.Sandbox
	e.json(t, "POST", "/v1/sandboxes", e.t2, `{}`, http.StatusAccepted, &sb2)
	if _, err := e.st.AssignNode(ctx, sb2.ID, e.nodeID, "gvisor"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.st.ReportObserved(ctx, sb2.ID, e.nodeID, store.Observed{State: api.StateCreating}); err != nil {
		t.Fatal(err)
	}
	next(t, s2, 30*time.Second, func(ev sseEvent) bool {
		if strings.Contains(ev.data, sb.ID) {
			t.Fatalf("tenant t2 saw t1's sandbox: %s %s", ev.name, ev.data)
		}
		return sandboxEvent(sb2.ID, api.StateCreating)(ev)
	})

	// A lifecycle verb: its operation's progress arrives as operation events, with the
	// sandbox's new desired state.
	var op api.Operation
	e.json(t, "POST", "/v1/sandboxes/"+sb.ID+"/suspend", e.t1, "", http.StatusAccepted, &op)
	if err := e.st.UpdateOperation(ctx, op.ID, api.OpRunning, "saving memory", ""); err != nil {
		t.Fatal(err)
	}
	next(t, s1, 30*time.Second, func(ev sseEvent) bool {
		var o api.Operation
		return ev.name == "operation" && json.Unmarshal([]byte(ev.data), &o) == nil && o.ID == op.ID && o.Message == "saving memory"
	})
	next(t, s1, 30*time.Second, func(ev sseEvent) bool {
		var s api.Sandbox
		return ev.name == "sandbox" && json.Unmarshal([]byte(ev.data), &s) == nil && s.ID == sb.ID && s.DesiredState == api.StateSuspended
	})

	// Without a key: 401 in the API's words.
	resp := e.do(t, "GET", "/v1/events", "", nil)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 401 || !strings.Contains(string(b), "missing API key") {
		t.Errorf("no key: %d %s", resp.StatusCode, b)
	}
}

// TestConsoleEndpoints checks /ui/, whoami, the build list and the bench results.
func TestConsoleEndpoints(t *testing.T) {
	e := newConsoleEnv(t)

	// The console: public files, the data plane's origin in connect-src.
	resp := e.do(t, "GET", "/ui/", "", nil)
	resp.Body.Close()
	csp := resp.Header.Get("Content-Security-Policy")
	if resp.StatusCode != 200 || !strings.Contains(csp, "connect-src 'self' http://node-a.internal:7701") {
		t.Errorf("/ui/: %d, CSP %q", resp.StatusCode, csp)
	}
	resp = e.do(t, "GET", "/ui", "", nil) // the mux redirects to /ui/ (the client follows)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Request.URL.Path != "/ui/" {
		t.Errorf("/ui: %d at %s", resp.StatusCode, resp.Request.URL.Path)
	}

	var who api.WhoAmI
	e.json(t, "GET", "/v1/whoami", e.admin, "", 200, &who)
	if who.Tenant != "t1" || !who.Admin || who.KeyID == "" {
		t.Errorf("whoami: %+v", who)
	}
	var apiErr api.Error
	e.json(t, "GET", "/v1/whoami", "space_nope", "", 401, &apiErr)
	if apiErr.Error.Message != "invalid API key" {
		t.Errorf("bad key: %+v", apiErr)
	}

	// Builds: only template builds are listed, per tenant.
	e.json(t, "GET", "/v1/operations", e.t1, "", 400, nil)
	e.json(t, "GET", "/v1/operations?kind=create", e.t1, "", 400, nil)
	e.json(t, "GET", "/v1/operations?kind=template_build&limit=0", e.t1, "", 400, nil)
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild, Tenant: "t1", Params: map[string]any{"template": "tools:1"}}
	if err := e.st.CreateOperation(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	var list struct {
		Operations []api.Operation `json:"operations"`
	}
	e.json(t, "GET", "/v1/operations?kind=template_build", e.t1, "", 200, &list)
	if len(list.Operations) != 1 || list.Operations[0].Template != "tools:1" || list.Operations[0].ID != op.ID {
		t.Errorf("t1 builds: %+v", list.Operations)
	}
	e.json(t, "GET", "/v1/operations?kind=template_build", e.t2, "", 200, &list)
	if len(list.Operations) != 0 {
		t.Errorf("t2 sees t1's builds: %+v", list.Operations)
	}

	// Bench results: 404 with advice until space bench saved some, then served as saved;
	// a broken file is a 422 that says where it is.
	e.json(t, "GET", "/v1/bench", e.t1, "", 404, &apiErr)
	if !strings.Contains(apiErr.Error.Message, "space bench") {
		t.Errorf("no results: %q", apiErr.Error.Message)
	}
	if err := os.MkdirAll(filepath.Dir(e.benchFile), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.benchFile, []byte(`{"template":"base","runs":3,"results":[{"scenario":"exec","median":31.5}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Runs    int `json:"runs"`
		Results []struct {
			Scenario string  `json:"scenario"`
			Median   float64 `json:"median"`
		} `json:"results"`
	}
	e.json(t, "GET", "/v1/bench", e.t1, "", 200, &rep)
	if rep.Runs != 3 || len(rep.Results) != 1 || rep.Results[0].Median != 31.5 {
		t.Errorf("bench: %+v", rep)
	}
	if err := os.WriteFile(e.benchFile, []byte(`{"template":`), 0o644); err != nil {
		t.Fatal(err)
	}
	e.json(t, "GET", "/v1/bench", e.t1, "", 422, &apiErr)
	if !strings.Contains(apiErr.Error.Message, e.benchFile) {
		t.Errorf("broken file: %q", apiErr.Error.Message)
	}
}
