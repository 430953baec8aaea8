package e2b_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/e2b"
	"github.com/spacedev/space/internal/guest/envdpb"
	filesystem "github.com/spacedev/space/internal/guest/envdpb/filesystem"
	"github.com/spacedev/space/internal/guest/envdpb/filesystem/filesystempbconnect"
	process "github.com/spacedev/space/internal/guest/envdpb/process"
	"github.com/spacedev/space/internal/guest/envdpb/process/processpbconnect"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// gateway is an E2B gateway over an in-process space, served over HTTP.
type gateway struct {
	t   *testing.T
	s   *spacetest.Space
	url string
	// key is an E2B key of tenant "default".
	key string
}

func startGateway(t *testing.T, opts spacetest.Options) *gateway {
	t.Helper()
	return startGatewayOver(t, opts, func(c *e2b.Config) {})
}

// startGatewayOver is startGateway with the gateway's configuration changed by edit
// (its API and store wrapped, say).
func startGatewayOver(t *testing.T, opts spacetest.Options, edit func(*e2b.Config)) *gateway {
	t.Helper()
	s := spacetest.Start(t, opts)
	cfg := e2b.Config{API: s.Service, Store: s.Store, BuiltinTemplates: []string{"base", "builtin-later"}}
	edit(&cfg)
	g, err := e2b.New(s.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g)
	t.Cleanup(srv.Close)
	return &gateway{t: t, s: s, url: srv.URL, key: s.NewKey("default", false, service.KeyE2B)}
}

type reply struct {
	code int
	hdr  http.Header
	body []byte
}

func (r reply) String() string { return fmt.Sprintf("%d %s", r.code, bytes.TrimSpace(r.body)) }

// json decodes the body into v, failing the test if it is not JSON.
func (r reply) json(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("decode %s: %v", r, err)
	}
}

// do sends a request; hdr are header name/value pairs ("Host" sets the host). The
// E2B key goes in X-API-KEY unless hdr sets X-API-KEY or Authorization.
func (g *gateway) do(method, path string, body any, hdr ...string) reply {
	g.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			g.t.Fatal(err)
		}
		rd = bytes.NewReader(j)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, g.url+path, rd)
	if err != nil {
		g.t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	keySet := false
	for i := 0; i+1 < len(hdr); i += 2 {
		switch http.CanonicalHeaderKey(hdr[i]) {
		case "Host":
			req.Host = hdr[i+1]
			continue
		case "X-Api-Key", "Authorization":
			keySet = true
		}
		req.Header.Set(hdr[i], hdr[i+1])
	}
	if !keySet {
		req.Header.Set("X-API-KEY", g.key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		g.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		g.t.Fatalf("%s %s: read body: %v", method, path, err)
	}
	return reply{resp.StatusCode, resp.Header, b}
}

// want fails the test unless r has status code and its body contains every string.
func want(t *testing.T, what string, r reply, code int, contains ...string) {
	t.Helper()
	if r.code != code {
		t.Fatalf("%s: got %s, want %d", what, r, code)
	}
	for _, c := range contains {
		if !strings.Contains(string(r.body), c) {
			t.Fatalf("%s: got %s, want it to contain %q", what, r, c)
		}
	}
}

// created is E2B's Sandbox answer.
type created struct {
	TemplateID         string  `json:"templateID"`
	SandboxID          string  `json:"sandboxID"`
	Alias              string  `json:"alias"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             string  `json:"domain"`
}

// detail is E2B's SandboxDetail (and ListedSandbox, a subset).
type detail struct {
	TemplateID      string            `json:"templateID"`
	SandboxID       string            `json:"sandboxID"`
	StartedAt       time.Time         `json:"startedAt"`
	EndAt           time.Time         `json:"endAt"`
	CPUCount        int               `json:"cpuCount"`
	MemoryMB        int               `json:"memoryMB"`
	Metadata        map[string]string `json:"metadata"`
	State           string            `json:"state"`
	EnvdVersion     string            `json:"envdVersion"`
	EnvdAccessToken string            `json:"envdAccessToken"`
	Domain          string            `json:"domain"`
	Lifecycle       struct {
		OnTimeout  string `json:"onTimeout"`
		AutoResume bool   `json:"autoResume"`
	} `json:"lifecycle"`
}

func (g *gateway) create(path string, body any) created {
	g.t.Helper()
	r := g.do("POST", path, body)
	want(g.t, "create", r, http.StatusCreated)
	var c created
	r.json(g.t, &c)
	return c
}

func (g *gateway) get(id string) detail {
	g.t.Helper()
	r := g.do("GET", "/sandboxes/"+id, nil)
	want(g.t, "get "+id, r, http.StatusOK)
	var d detail
	r.json(g.t, &d)
	return d
}

func (g *gateway) row(id string) *store.Sandbox {
	g.t.Helper()
	sb, err := g.s.Store.GetSandbox(g.s.Context(), id)
	if err != nil {
		g.t.Fatal(err)
	}
	return sb
}

// list returns the ids of a listing.
func (g *gateway) list(path string) ([]string, reply) {
	g.t.Helper()
	r := g.do("GET", path, nil)
	want(g.t, "list "+path, r, http.StatusOK)
	var l []detail
	r.json(g.t, &l)
	out := []string{}
	for _, d := range l {
		out = append(out, d.SandboxID)
	}
	return out, r
}

// envd sends an envd request for sandbox id by the SDKs' headers.
func (g *gateway) envd(method, id, path string, body any, hdr ...string) reply {
	g.t.Helper()
	return g.do(method, path, body, append([]string{"E2b-Sandbox-Id", id, "E2b-Sandbox-Port", strconv.Itoa(envdpb.Port)}, hdr...)...)
}

// near reports whether t is within slack of now+d.
func near(t time.Time, d, slack time.Duration) bool {
	diff := time.Until(t) - d
	return diff > -slack && diff < slack
}

// sign is an SDK's signature of a /files URL expiring at exp (0: none).
func sign(path, op, user, token string, exp int64) string {
	raw := path + ":" + op + ":" + user + ":" + token
	if exp != 0 {
		raw += ":" + strconv.FormatInt(exp, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// signedURL is a signed /files URL for reading path, expiring at exp (0: none).
func signedURL(path, token string, exp int64) string {
	q := url.Values{"path": {path}, "signature": {sign(path, "read", "", token, exp)}}
	if exp != 0 {
		q.Set("signature_expiration", strconv.FormatInt(exp, 10))
	}
	return "/files?" + q.Encode()
}

// envdTransport adds the SDK's routing headers and the access token to every request.
type envdTransport struct{ id, token string }

func (e envdTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", e.id)
	r.Header.Set("E2b-Sandbox-Port", strconv.Itoa(envdpb.Port))
	if e.token != "" {
		r.Header.Set("X-Access-Token", e.token)
	}
	return http.DefaultTransport.RoundTrip(r)
}

// Serve serves a listener until its context ends.
func TestServe(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{NoNode: true, NoController: true})
	g, err := e2b.New(s.Context(), e2b.Config{API: s.Service, Store: s.Store})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Serve(ctx, ln, rest.Drain{}) }()
	resp, err := http.Get("http://" + ln.Addr().String() + "/health")
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "OK" {
		t.Errorf("health: %d %q", resp.StatusCode, body)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Serve: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Serve did not return after its context ended")
	}
}

func TestGatewayNeedsAPIAndStore(t *testing.T) {
	if _, err := e2b.New(context.Background(), e2b.Config{}); err == nil {
		t.Fatal("a gateway without API and Store was made")
	}
}

// Everything that is refused before a sandbox exists, on a space without a node.
func TestAuthAndBadRequests(t *testing.T) {
	g := startGateway(t, spacetest.Options{NoNode: true})

	// Authentication: missing, malformed, unknown, a space key, a revoked key.
	revokedID, revoked := g.s.NewKeyRole("default", store.RoleMember, service.KeyE2B)
	if _, err := g.s.Store.RevokeAPIKey(g.s.Context(), revokedID); err != nil {
		t.Fatal(err)
	}
	for name, hdr := range map[string][]string{
		"no key":      {"X-API-KEY", ""},
		"bad key":     {"X-API-KEY", "e2b_" + strings.Repeat("0", 40)},
		"space key":   {"X-API-KEY", g.s.AdminKey},
		"bearer":      {"Authorization", "Bearer " + g.s.AdminKey},
		"revoked key": {"X-API-KEY", revoked},
	} {
		r := g.do("GET", "/v2/sandboxes", nil, hdr...)
		want(t, name, r, http.StatusUnauthorized, `"code":401`, `"message":`)
	}
	if _, r := g.list("/v2/sandboxes"); r.hdr.Get("Content-Type") != "application/json" {
		t.Fatalf("content type %q", r.hdr.Get("Content-Type"))
	}
	// The E2B CLI's form, and the header name in any case.
	want(t, "bearer e2b key", g.do("GET", "/v2/sandboxes", nil, "Authorization", "Bearer "+g.key), http.StatusOK)
	want(t, "x-api-key lower case", g.do("GET", "/sandboxes", nil, "x-api-key", g.key), http.StatusOK)

	// Unauthenticated and unknown routes.
	want(t, "health", g.do("GET", "/health", nil, "X-API-KEY", ""), http.StatusOK, "OK")
	want(t, "no route", g.do("GET", "/nowhere", nil), http.StatusNotFound, "no route")
	want(t, "logs of an unknown sandbox", g.do("GET", "/sandboxes/abc/logs", nil), http.StatusNotFound, "not found")
	want(t, "fork of an unknown sandbox", g.do("POST", "/sandboxes/abc/fork", nil), http.StatusNotFound, "not found")
	want(t, "fork needs a key too", g.do("POST", "/sandboxes/abc/fork", nil, "X-API-KEY", ""), http.StatusUnauthorized)
	want(t, "sandbox id without port", g.do("GET", "/health", nil, "E2b-Sandbox-Id", "abc"), http.StatusBadRequest, "E2b-Sandbox-Port")
	want(t, "bad port", g.do("GET", "/health", nil, "E2b-Sandbox-Id", "abc", "E2b-Sandbox-Port", "70000"), http.StatusBadRequest, "70000")

	// Create bodies refused before anything is made.
	for _, tc := range []struct {
		path, body string
		code       int
		contains   string
	}{
		{"/sandboxes", `{`, 400, "malformed JSON"},
		{"/v2/sandboxes", `{"timeout":0}`, 400, "timeout"},
		{"/v2/sandboxes", `{"timeout":-5}`, 400, "timeout"},
		{"/v2/sandboxes", `{"timeout":86401}`, 400, "cannot be greater than 24 hours"},
		{"/v2/sandboxes", `{"mcp":{"x":{}}}`, 400, "MCP"},
		{"/v2/sandboxes", `{"volumeMounts":[{"name":"v","path":"/v"}]}`, 400, "volume"},
		{"/v2/sandboxes", `{"autoResume":{"enabled":true}}`, 400, "autoPause"},
		{"/sandboxes", `{"metadata":{"space.e2b.auto-resume":"1"}}`, 400, "reserved"},
		{"/v2/sandboxes", `{"templateID":"nope"}`, 404, "nope"},
		{"/v2/sandboxes", `{"envVars":{"1BAD":"x"}}`, 400, "env"},
		{"/v2/sandboxes", `{"metadata":{"k":"` + strings.Repeat("v", 2<<20) + `"}}`, 413, "exceeds"},
	} {
		want(t, tc.path+" "+tc.body[:min(len(tc.body), 60)], g.do("POST", tc.path, tc.body), tc.code, tc.contains)
	}
	if left, err := g.s.Store.ListSandboxes(g.s.Context(), store.SandboxFilter{IncludeDeleted: true, IncludePool: true}); err != nil || len(left) != 0 {
		t.Fatalf("refused creates left sandboxes: %d %v", len(left), err)
	}

	// Unknown sandboxes are 404 everywhere (a valid id, a malformed one).
	for _, id := range []string{ids.Sandbox(), "NOT-an-id"} {
		for _, req := range [][3]string{
			{"GET", "/sandboxes/" + id, ""},
			{"DELETE", "/sandboxes/" + id, ""},
			{"POST", "/sandboxes/" + id + "/timeout", `{"timeout":30}`},
			{"POST", "/sandboxes/" + id + "/refreshes", `{"duration":30}`},
			{"POST", "/sandboxes/" + id + "/pause", ""},
			{"POST", "/sandboxes/" + id + "/resume", `{"timeout":30}`},
			{"POST", "/v2/sandboxes/" + id + "/connect", `{"timeout":30}`},
			{"GET", "/sandboxes/" + id + "/metrics", ""},
		} {
			want(t, req[0]+" "+req[1], g.do(req[0], req[1], req[2]), http.StatusNotFound, `"code":404`)
		}
	}
	want(t, "many metrics of unknown", g.do("GET", "/sandboxes/metrics?sandbox_ids=nosuch,,"+ids.Sandbox(), nil), http.StatusOK, `{"sandboxes":{}}`)

	// Bad list parameters.
	for _, q := range []string{"state=killed", "order=sideways", "limit=0", "limit=101", "limit=x", "nextToken=garbage!",
		"startedAfter=yesterday", "metadata=novalue"} {
		want(t, "list "+q, g.do("GET", "/v2/sandboxes?"+q, nil), http.StatusBadRequest)
	}
	want(t, "v1 list with a bad metadata filter", g.do("GET", "/sandboxes?metadata=%25zz", nil), http.StatusBadRequest)

	// Templates: space's tags and the builtin names not built yet.
	r := g.do("GET", "/templates", nil)
	want(t, "templates", r, http.StatusOK)
	var tmpls []struct {
		TemplateID  string   `json:"templateID"`
		BuildID     string   `json:"buildID"`
		Aliases     []string `json:"aliases"`
		BuildStatus string   `json:"buildStatus"`
	}
	r.json(t, &tmpls)
	if len(tmpls) != 2 || tmpls[0].TemplateID != "base" || tmpls[0].BuildID != g.s.Base || tmpls[0].BuildStatus != "ready" ||
		tmpls[1].TemplateID != "builtin-later" || tmpls[1].BuildID != "" {
		t.Fatalf("templates %+v", tmpls)
	}
	want(t, "alias base", g.do("GET", "/templates/aliases/base", nil), http.StatusOK, `"templateID":"base"`)
	want(t, "alias builtin", g.do("GET", "/templates/aliases/builtin-later", nil), http.StatusOK)
	want(t, "alias unknown", g.do("GET", "/templates/aliases/nope", nil), http.StatusNotFound, "nope")
}

// The lifecycle of E2B sandboxes: create (v1 and v2), get, list, timeouts, envd
// traffic, metrics, pause and resume/connect, kill.
func TestSandboxLifecycle(t *testing.T) {
	var failCreate atomic.Bool
	g := startGateway(t, spacetest.Options{FailCreate: func(string) error {
		if failCreate.Load() {
			return errors.New("no room at the inn")
		}
		return nil
	}})

	// v2 create answers once the sandbox runs, with what the SDK needs.
	a := g.create("/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 120,
		"metadata": map[string]string{"app": "demo", "user-id": "a&b=c"}, "envVars": map[string]string{"GREETING": "hello"}})
	if !regexp.MustCompile(`^[0-9a-f]{64}$`).MatchString(a.EnvdAccessToken) || a.TemplateID != "base" || a.Alias != "base" ||
		a.ClientID == "" || a.EnvdVersion != envdpb.Version || !strings.HasPrefix(a.Domain, "localhost:") || a.TrafficAccessToken != nil || !ids.ValidSandbox(a.SandboxID) {
		t.Fatalf("v2 create %+v", a)
	}
	row := g.row(a.SandboxID)
	if row.State != api.StateRunning || row.ExpireAction != "delete" || row.ExpiresAt == nil || !near(*row.ExpiresAt, 120*time.Second, 30*time.Second) {
		t.Fatalf("row after create: state %s, expires %v (%s)", row.State, row.ExpiresAt, row.ExpireAction)
	}
	d := g.get(a.SandboxID)
	if d.State != "running" || d.Metadata["app"] != "demo" || d.EnvdAccessToken != a.EnvdAccessToken || d.Lifecycle.OnTimeout != "kill" ||
		d.Lifecycle.AutoResume || !near(d.EndAt, 120*time.Second, 30*time.Second) || d.CPUCount < 1 || d.MemoryMB < 1 || d.Domain != a.Domain {
		t.Fatalf("get %+v", d)
	}

	// v1 create with autoPause and autoResume, no timeout: upstream's legacy 15 s.
	b := g.create("/sandboxes", map[string]any{"autoPause": true, "autoResume": map[string]bool{"enabled": true},
		"metadata": map[string]string{"app": "other"}})
	db := g.get(b.SandboxID)
	if db.Lifecycle.OnTimeout != "pause" || !db.Lifecycle.AutoResume || !near(db.EndAt, 15*time.Second, 10*time.Second) {
		t.Fatalf("v1 autoPause sandbox %+v", db)
	}
	if _, hidden := db.Metadata["space.e2b.auto-resume"]; hidden || db.Metadata["app"] != "other" {
		t.Fatalf("metadata shown %v", db.Metadata)
	}
	if g.row(b.SandboxID).ExpireAction != "suspend" {
		t.Fatal("autoPause did not make the expiry a suspend")
	}
	// Timeout: set (may shorten), refresh (only extends); bad bodies.
	want(t, "set timeout", g.do("POST", "/sandboxes/"+b.SandboxID+"/timeout", `{"timeout":600}`), http.StatusNoContent)
	if d := g.get(b.SandboxID); !near(d.EndAt, 600*time.Second, 30*time.Second) {
		t.Fatalf("endAt after set timeout %v", d.EndAt)
	}
	want(t, "refresh", g.do("POST", "/sandboxes/"+b.SandboxID+"/refreshes", `{"duration":1200}`), http.StatusNoContent)
	want(t, "shorter refresh", g.do("POST", "/sandboxes/"+b.SandboxID+"/refreshes", `{"duration":30}`), http.StatusNoContent)
	if d := g.get(b.SandboxID); !near(d.EndAt, 1200*time.Second, 30*time.Second) {
		t.Fatalf("endAt after refreshes %v", d.EndAt)
	}
	want(t, "shorter timeout", g.do("POST", "/sandboxes/"+b.SandboxID+"/timeout", `{"timeout":900}`), http.StatusNoContent)
	if d := g.get(b.SandboxID); !near(d.EndAt, 900*time.Second, 30*time.Second) {
		t.Fatalf("endAt after shortening %v", d.EndAt)
	}
	want(t, "timeout missing", g.do("POST", "/sandboxes/"+b.SandboxID+"/timeout", `{}`), http.StatusBadRequest, "required")
	want(t, "timeout negative", g.do("POST", "/sandboxes/"+b.SandboxID+"/timeout", `{"timeout":-1}`), http.StatusBadRequest)
	want(t, "timeout too long", g.do("POST", "/sandboxes/"+b.SandboxID+"/timeout", `{"timeout":100000}`), http.StatusBadRequest, "24 hours")
	want(t, "refresh too long", g.do("POST", "/sandboxes/"+b.SandboxID+"/refreshes", `{"duration":100000}`), http.StatusBadRequest)

	// Listing: v1 (running only), v2 (filters, order, paging).
	if got, _ := g.list("/sandboxes"); !slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values([]string{a.SandboxID, b.SandboxID}))) {
		t.Fatalf("v1 list %v", got)
	}
	md := url.Values{url.QueryEscape("user-id"): {url.QueryEscape("a&b=c")}, "app": {"demo"}}.Encode()
	if got, _ := g.list("/sandboxes?metadata=" + url.QueryEscape(md)); !slices.Equal(got, []string{a.SandboxID}) {
		t.Fatalf("v1 list by metadata %v", got)
	}
	got, r := g.list("/v2/sandboxes?state=running&order=asc")
	if !slices.Equal(got, []string{a.SandboxID, b.SandboxID}) || r.hdr.Get("X-Total-Running") != "2" || r.hdr.Get("X-Next-Token") != "" {
		t.Fatalf("v2 list asc %v %v", got, r.hdr)
	}
	var pages []string
	next := ""
	for i := 0; i < 5; i++ {
		q := "/v2/sandboxes?limit=1"
		if next != "" {
			q += "&nextToken=" + url.QueryEscape(next)
		}
		got, r := g.list(q)
		pages = append(pages, got...)
		if next = r.hdr.Get("X-Next-Token"); next == "" {
			break
		}
	}
	if !slices.Equal(pages, []string{b.SandboxID, a.SandboxID}) {
		t.Fatalf("pages newest first %v", pages)
	}
	after := url.QueryEscape(g.row(b.SandboxID).CreatedAt.Format(time.RFC3339Nano))
	if got, _ := g.list("/v2/sandboxes?startedAfter=" + after); !slices.Equal(got, []string{b.SandboxID}) {
		t.Fatalf("started after %v", got)
	}
	if got, _ := g.list("/v2/sandboxes?template=base&state=paused"); len(got) != 0 {
		t.Fatalf("paused listed %v", got)
	}
	if got, _ := g.list("/v2/sandboxes?template=other"); len(got) != 0 {
		t.Fatalf("other template listed %v", got)
	}
	// Another tenant sees none of them.
	other := g.s.NewKey("other", false, service.KeyE2B)
	if r := g.do("GET", "/v2/sandboxes", nil, "X-API-KEY", other); r.code != 200 || strings.TrimSpace(string(r.body)) != "[]" {
		t.Fatalf("other tenant's list %s", r)
	}
	want(t, "other tenant's get", g.do("GET", "/sandboxes/"+a.SandboxID, nil, "X-API-KEY", other), http.StatusNotFound)
	want(t, "other tenant's kill", g.do("DELETE", "/sandboxes/"+a.SandboxID, nil, "X-API-KEY", other), http.StatusNotFound)

	// envd through the gateway: every path, health included, needs the sandbox's own
	// access token; without it the answer is the same whether the sandbox exists or not.
	want(t, "envd health", g.envd("GET", a.SandboxID, "/health", nil, "X-API-KEY", "", "X-Access-Token", a.EnvdAccessToken), http.StatusNoContent)
	want(t, "envd health without the token", g.envd("GET", a.SandboxID, "/health", nil, "X-API-KEY", ""), http.StatusUnauthorized, "access token")
	hostHealth := g.do("GET", "/health", nil, "Host", fmt.Sprintf("%d-%s.sandboxes.example", envdpb.Port, a.SandboxID), "X-API-KEY", "",
		"X-Access-Token", a.EnvdAccessToken)
	want(t, "envd health by host", hostHealth, http.StatusNoContent)

	var mp bytes.Buffer
	mw := multipart.NewWriter(&mp)
	fw, _ := mw.CreateFormFile("file", "data/hello.txt")
	_, _ = fw.Write([]byte("hello from the test\n"))
	_ = mw.Close()
	upload := func(token string) reply {
		return g.envd("POST", a.SandboxID, "/files?path=data/hello.txt", mp.Bytes(), "Content-Type", mw.FormDataContentType(), "X-Access-Token", token)
	}
	want(t, "upload without token", upload(""), http.StatusUnauthorized, "missing signature")
	want(t, "upload with another sandbox's token", upload(b.EnvdAccessToken), http.StatusUnauthorized)
	r = upload(a.EnvdAccessToken)
	want(t, "upload", r, http.StatusOK, `"name":"hello.txt"`, `"type":"file"`)
	var written []struct{ Path string }
	r.json(t, &written)
	if len(written) != 1 || !strings.HasSuffix(written[0].Path, "/data/hello.txt") {
		t.Fatalf("upload answer %s", r)
	}
	r = g.envd("GET", a.SandboxID, "/files?path=data/hello.txt", nil, "X-Access-Token", a.EnvdAccessToken)
	want(t, "download", r, http.StatusOK)
	if string(r.body) != "hello from the test\n" {
		t.Fatalf("downloaded %q", r.body)
	}
	// By host name, and by a signed URL without the token.
	r = g.do("GET", "/files?path=data/hello.txt", nil, "Host", fmt.Sprintf("%d-%s.sandboxes.example", envdpb.Port, a.SandboxID),
		"X-Access-Token", a.EnvdAccessToken, "X-API-KEY", "")
	want(t, "download by host", r, http.StatusOK, "hello from the test")
	soon := time.Now().Add(time.Minute).Unix()
	want(t, "signed download", g.envd("GET", a.SandboxID, signedURL("data/hello.txt", a.EnvdAccessToken, soon), nil), http.StatusOK, "hello from the test")
	want(t, "download signed for another sandbox", g.envd("GET", a.SandboxID, signedURL("data/hello.txt", b.EnvdAccessToken, soon), nil),
		http.StatusUnauthorized)
	// A signed URL without an expiration would never expire; one expiring beyond the
	// operator's maximum (1 h by default) lives too long: both refused.
	want(t, "signed URL without expiration", g.envd("GET", a.SandboxID, signedURL("data/hello.txt", a.EnvdAccessToken, 0), nil),
		http.StatusUnauthorized)
	late := time.Now().Add(2 * time.Hour).Unix()
	want(t, "signed URL beyond the maximum lifetime", g.envd("GET", a.SandboxID, signedURL("data/hello.txt", a.EnvdAccessToken, late), nil),
		http.StatusUnauthorized)
	want(t, "download of a missing file", g.envd("GET", a.SandboxID, "/files?path=data/nope.txt", nil, "X-Access-Token", a.EnvdAccessToken),
		http.StatusNotFound)
	want(t, "envd path that is not envd's", g.envd("GET", a.SandboxID, "/v1/files", nil, "X-Access-Token", a.EnvdAccessToken),
		http.StatusNotFound, "no envd route")

	// Connect RPCs, as the SDKs make them.
	httpc := &http.Client{Transport: envdTransport{id: a.SandboxID, token: a.EnvdAccessToken}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fs := filesystempbconnect.NewFilesystemClient(httpc, g.url)
	st, err := fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "data/hello.txt"}))
	if err != nil || st.Msg.GetEntry().GetSize() != int64(len("hello from the test\n")) || st.Msg.GetEntry().GetName() != "hello.txt" {
		t.Fatalf("stat %v %v", st, err)
	}
	_, err = fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "data/nope"}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("stat of a missing file: %v", err)
	}
	noToken := filesystempbconnect.NewFilesystemClient(&http.Client{Transport: envdTransport{id: a.SandboxID}}, g.url)
	if _, err := noToken.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "data/hello.txt"})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("stat without token: %v", err)
	}
	proc := processpbconnect.NewProcessClient(httpc, g.url)
	stream, err := proc.Start(ctx, connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{
		Cmd: "/bin/sh", Args: []string{"-c", `echo "$GREETING $(cat data/hello.txt)"; exit 3`}}}))
	if err != nil {
		t.Fatal(err)
	}
	var stdout bytes.Buffer
	var end *process.ProcessEvent_EndEvent
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		stdout.Write(ev.GetData().GetStdout())
		if e := ev.GetEnd(); e != nil {
			end = e
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("process stream: %v", err)
	}
	_ = stream.Close()
	if end == nil || end.GetExitCode() != 3 || stdout.String() != "hello hello from the test\n" {
		t.Fatalf("process: end %v, stdout %q", end, stdout.String())
	}

	// Other ports are public, as E2B's are by default (the sandbox id is the capability):
	// a closed port of a running sandbox says so; an unknown sandbox is not found.
	otherPort := g.do("GET", "/", nil, "E2b-Sandbox-Id", a.SandboxID, "E2b-Sandbox-Port", "8080")
	want(t, "other port", otherPort, http.StatusBadGateway, "port is not open")
	want(t, "other port by host", g.do("GET", "/", nil, "Host", "8080-"+a.SandboxID+".sandboxes.example"), http.StatusBadGateway, "port is not open")
	unknown := ids.Sandbox()
	want(t, "other port of an unknown sandbox", g.do("GET", "/", nil, "E2b-Sandbox-Id", unknown, "E2b-Sandbox-Port", "8080"), http.StatusBadGateway, "was not found")
	want(t, "unknown sandbox", g.envd("GET", unknown, "/health", nil, "X-Access-Token", a.EnvdAccessToken), http.StatusUnauthorized)
	want(t, "malformed sandbox id", g.do("GET", "/health", nil, "E2b-Sandbox-Id", "../x", "E2b-Sandbox-Port", "49983"), http.StatusUnauthorized)

	want(t, "logs", g.do("GET", "/sandboxes/"+a.SandboxID+"/logs", nil), http.StatusNotImplemented, "not supported")

	// Metrics: one sample of a running sandbox, none outside the range asked for.
	r = g.do("GET", "/sandboxes/"+a.SandboxID+"/metrics", nil)
	var samples []struct {
		CPUCount int   `json:"cpuCount"`
		MemTotal int64 `json:"memTotal"`
		TS       int64 `json:"timestampUnix"`
	}
	r.json(t, &samples)
	if r.code != 200 || len(samples) != 1 || samples[0].CPUCount < 1 || samples[0].MemTotal <= 0 || samples[0].TS <= 0 {
		t.Fatalf("metrics %s", r)
	}
	future := strconv.FormatInt(time.Now().Add(time.Hour).Unix(), 10)
	want(t, "metrics from the future", g.do("GET", "/sandboxes/"+a.SandboxID+"/metrics?start="+future, nil), http.StatusOK, "[]")
	want(t, "metrics bad start", g.do("GET", "/sandboxes/"+a.SandboxID+"/metrics?end=soon", nil), http.StatusBadRequest, "unix seconds")
	r = g.do("GET", "/sandboxes/metrics?sandbox_ids="+a.SandboxID+","+ids.Sandbox(), nil)
	var many struct {
		Sandboxes map[string]json.RawMessage `json:"sandboxes"`
	}
	r.json(t, &many)
	if _, ok := many.Sandboxes[a.SandboxID]; r.code != 200 || !ok || len(many.Sandboxes) != 1 {
		t.Fatalf("many metrics %s", r)
	}

	// Pause: a space suspend; the sandbox no longer expires, answers envd with 502,
	// is listed as paused, and cannot be paused again or have its timeout set.
	want(t, "pause", g.do("POST", "/sandboxes/"+a.SandboxID+"/pause", nil), http.StatusNoContent)
	row = g.row(a.SandboxID)
	if row.State != api.StateSuspended || row.DesiredState != api.StateSuspended || row.ExpiresAt != nil {
		t.Fatalf("paused row: %s/%s expires %v", row.State, row.DesiredState, row.ExpiresAt)
	}
	if d := g.get(a.SandboxID); d.State != "paused" {
		t.Fatalf("paused get %+v", d)
	}
	want(t, "pause again", g.do("POST", "/sandboxes/"+a.SandboxID+"/pause", nil), http.StatusConflict, "already paused")
	want(t, "timeout of a paused sandbox", g.do("POST", "/sandboxes/"+a.SandboxID+"/timeout", `{"timeout":60}`), http.StatusNotFound)
	want(t, "refresh of a paused sandbox", g.do("POST", "/sandboxes/"+a.SandboxID+"/refreshes", `{}`), http.StatusNotFound)
	want(t, "envd of a paused sandbox", g.envd("GET", a.SandboxID, "/files?path=data/hello.txt", nil, "X-Access-Token", g.get(a.SandboxID).EnvdAccessToken),
		http.StatusBadGateway, "not found")
	// The pause replaced the access token: the one from before is refused; the
	// sandbox's details carry the current one.
	paused := g.get(a.SandboxID)
	if paused.EnvdAccessToken == a.EnvdAccessToken {
		t.Fatal("pause kept the envd access token")
	}
	want(t, "envd with the token from before the pause", g.envd("GET", a.SandboxID, "/health", nil, "X-Access-Token", a.EnvdAccessToken),
		http.StatusUnauthorized)
	want(t, "health of a paused sandbox", g.envd("GET", a.SandboxID, "/health", nil, "X-Access-Token", paused.EnvdAccessToken), http.StatusBadGateway,
		"not found")
	want(t, "other port of a paused sandbox (no autoResume: not woken)", g.do("GET", "/", nil, "E2b-Sandbox-Id", a.SandboxID, "E2b-Sandbox-Port", "8080"), http.StatusBadGateway,
		"was not found")
	// The history stays (no new sample while paused).
	want(t, "metrics of a paused sandbox", g.do("GET", "/sandboxes/"+a.SandboxID+"/metrics?start="+future, nil), http.StatusOK, "[]")
	if got, _ := g.list("/v2/sandboxes?state=paused"); !slices.Equal(got, []string{a.SandboxID}) {
		t.Fatalf("paused list %v", got)
	}
	if got, r := g.list("/v2/sandboxes"); len(got) != 2 || r.hdr.Get("X-Total-Running") != "1" {
		t.Fatalf("v2 default list %v %v", got, r.hdr)
	}
	if got, _ := g.list("/sandboxes"); !slices.Equal(got, []string{b.SandboxID}) {
		t.Fatalf("v1 list while paused %v", got)
	}

	// Legacy resume: 201 with a new token; 409 when it runs.
	r = g.do("POST", "/sandboxes/"+a.SandboxID+"/resume", `{"timeout":300,"autoPause":true}`)
	want(t, "resume", r, http.StatusCreated)
	var resumed created
	r.json(t, &resumed)
	if resumed.SandboxID != a.SandboxID || resumed.EnvdAccessToken == a.EnvdAccessToken || resumed.EnvdAccessToken == paused.EnvdAccessToken {
		t.Fatalf("resume %+v", resumed)
	}
	want(t, "envd with the token of the paused sandbox", g.envd("GET", a.SandboxID, "/health", nil, "X-Access-Token", paused.EnvdAccessToken),
		http.StatusUnauthorized)
	row = g.row(a.SandboxID)
	if row.State != api.StateRunning || row.ExpireAction != "suspend" || row.ExpiresAt == nil || !near(*row.ExpiresAt, 300*time.Second, 30*time.Second) {
		t.Fatalf("resumed row: %s %s %v", row.State, row.ExpireAction, row.ExpiresAt)
	}
	want(t, "resume a running sandbox", g.do("POST", "/sandboxes/"+a.SandboxID+"/resume", `{}`), http.StatusConflict, "already running")
	want(t, "files survive pause", g.envd("GET", a.SandboxID, "/files?path=data/hello.txt", nil, "X-Access-Token", resumed.EnvdAccessToken),
		http.StatusOK, "hello from the test")

	// Connect: 200 (timeout only grows, same token) while running, 201 with a new token
	// after a pause.
	want(t, "connect running", g.do("POST", "/v2/sandboxes/"+a.SandboxID+"/connect", `{"timeout":60}`), http.StatusOK, a.SandboxID,
		resumed.EnvdAccessToken)
	if row := g.row(a.SandboxID); !near(*row.ExpiresAt, 300*time.Second, 30*time.Second) {
		t.Fatalf("connect shortened the timeout: %v", row.ExpiresAt)
	}
	want(t, "connect bad timeout", g.do("POST", "/sandboxes/"+a.SandboxID+"/connect", `{"timeout":0}`), http.StatusBadRequest)
	want(t, "pause for connect", g.do("POST", "/sandboxes/"+a.SandboxID+"/pause", nil), http.StatusNoContent)
	r = g.do("POST", "/sandboxes/"+a.SandboxID+"/connect", `{"timeout":400}`)
	want(t, "connect paused", r, http.StatusCreated, a.SandboxID)
	var connected created
	r.json(t, &connected)
	if connected.EnvdAccessToken == resumed.EnvdAccessToken || connected.EnvdAccessToken != g.get(a.SandboxID).EnvdAccessToken {
		t.Fatalf("connect after a pause kept the token or answered another: %+v", connected)
	}
	want(t, "envd with the connected token", g.envd("GET", a.SandboxID, "/health", nil, "X-Access-Token", connected.EnvdAccessToken), http.StatusNoContent)
	if row := g.row(a.SandboxID); row.State != api.StateRunning || !near(*row.ExpiresAt, 400*time.Second, 30*time.Second) {
		t.Fatalf("after connect: %s %v", row.State, row.ExpiresAt)
	}

	// autoResume: an envd request with the current token wakes a paused sandbox; a
	// request without it wakes nothing and extends nothing.
	want(t, "pause the autoResume sandbox", g.do("POST", "/sandboxes/"+b.SandboxID+"/pause", nil), http.StatusNoContent)
	if row := g.row(b.SandboxID); row.State != api.StateSuspended {
		t.Fatalf("autoResume sandbox after pause: %s", row.State)
	}
	for name, tok := range map[string]string{"no token": "", "the token from before the pause": b.EnvdAccessToken, "a's token": connected.EnvdAccessToken} {
		want(t, "envd with "+name+" on a paused autoResume sandbox", g.envd("GET", b.SandboxID, "/health", nil, "X-Access-Token", tok),
			http.StatusUnauthorized)
	}
	if row := g.row(b.SandboxID); row.State != api.StateSuspended || row.DesiredState != api.StateSuspended || row.ExpiresAt != nil {
		t.Fatalf("unauthenticated envd requests woke or extended the sandbox: %s/%s %v", row.State, row.DesiredState, row.ExpiresAt)
	}
	bToken := g.get(b.SandboxID).EnvdAccessToken
	want(t, "envd wakes the autoResume sandbox", g.envd("GET", b.SandboxID, "/health", nil, "X-Access-Token", bToken), http.StatusNoContent)
	if row := g.row(b.SandboxID); row.State != api.StateRunning || row.ExpiresAt == nil || !near(*row.ExpiresAt, 15*time.Second, 15*time.Second) {
		t.Fatalf("auto-resumed: %s %v", row.State, row.ExpiresAt)
	}

	// revoke-tokens (space's API) replaces the envd access token too.
	if err := g.s.C.RevokeTokens(g.s.Context(), a.SandboxID); err != nil {
		t.Fatal(err)
	}
	want(t, "envd with a token revoked by revoke-tokens", g.envd("GET", a.SandboxID, "/health", nil, "X-Access-Token", connected.EnvdAccessToken),
		http.StatusUnauthorized)
	current := g.get(a.SandboxID).EnvdAccessToken
	if current == connected.EnvdAccessToken {
		t.Fatal("revoke-tokens kept the envd access token")
	}
	want(t, "envd with the token after revoke-tokens", g.envd("GET", a.SandboxID, "/health", nil, "X-Access-Token", current), http.StatusNoContent)
	connected.EnvdAccessToken = current

	// Kill: 204, then 404; the sandbox's envd is gone.
	want(t, "kill", g.do("DELETE", "/sandboxes/"+a.SandboxID, nil), http.StatusNoContent)
	want(t, "kill again", g.do("DELETE", "/sandboxes/"+a.SandboxID, nil), http.StatusNotFound)
	want(t, "get killed", g.do("GET", "/sandboxes/"+a.SandboxID, nil), http.StatusNotFound)
	want(t, "envd of a killed sandbox", g.envd("GET", a.SandboxID, "/health", nil, "X-Access-Token", connected.EnvdAccessToken), http.StatusBadGateway)
	want(t, "envd of a killed sandbox without its token", g.envd("GET", a.SandboxID, "/health", nil), http.StatusUnauthorized)
	if got, _ := g.list("/v2/sandboxes"); !slices.Equal(got, []string{b.SandboxID}) {
		t.Fatalf("list after kill %v", got)
	}

	// Timeouts end sandboxes: autoPause ones are paused (and can be connected to
	// again), the others killed.
	pausing := g.create("/v2/sandboxes", map[string]any{"timeout": 1, "autoPause": true})
	dying := g.create("/v2/sandboxes", map[string]any{"timeout": 1})
	g.s.Eventually(time.Minute, "the autoPause sandbox to be paused at its timeout", func() bool {
		return g.row(pausing.SandboxID).State == api.StateSuspended
	})
	if d := g.get(pausing.SandboxID); d.State != "paused" {
		t.Fatalf("timed out autoPause sandbox %+v", d)
	}
	g.s.Eventually(time.Minute, "the other sandbox to be killed at its timeout", func() bool {
		return g.do("GET", "/sandboxes/"+dying.SandboxID, nil).code == http.StatusNotFound
	})
	want(t, "connect after the timeout paused it", g.do("POST", "/sandboxes/"+pausing.SandboxID+"/connect", `{"timeout":300}`),
		http.StatusCreated, pausing.SandboxID)
	if row := g.row(pausing.SandboxID); row.State != api.StateRunning || !near(*row.ExpiresAt, 300*time.Second, 30*time.Second) {
		t.Fatalf("connected after timeout: %s %v", row.State, row.ExpiresAt)
	}
	want(t, "kill the connected one", g.do("DELETE", "/sandboxes/"+pausing.SandboxID, nil), http.StatusNoContent)

	// A create the node fails answers 500 and leaves no sandbox behind.
	failCreate.Store(true)
	r = g.do("POST", "/v2/sandboxes", `{"timeout":60,"metadata":{"doomed":"yes"}}`)
	want(t, "failed create", r, http.StatusInternalServerError, "failed to start", "no room at the inn")
	failCreate.Store(false)
	doomed, err := g.s.Store.ListSandboxes(g.s.Context(), store.SandboxFilter{Metadata: map[string]string{"doomed": "yes"}, IncludeDeleted: true})
	if err != nil || len(doomed) != 1 || doomed[0].DesiredState != api.StateDeleted {
		t.Fatalf("failed create left %+v %v", doomed, err)
	}
	if got, _ := g.list("/v2/sandboxes"); !slices.Equal(got, []string{b.SandboxID}) {
		t.Fatalf("failed sandbox listed %v", got)
	}
}
