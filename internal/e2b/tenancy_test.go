package e2b

import (
	"bytes"
	"context"
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/spacedev/space/internal/guest/envdpb"
	filesystem "github.com/spacedev/space/internal/guest/envdpb/filesystem"
	process "github.com/spacedev/space/internal/guest/envdpb/process"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
)

// gatewayRoutes are the control-plane routes the package registers with h(…) (in
// control.go and the files it delegates to), read from the source so that a new route
// cannot escape the matrix.
func gatewayRoutes(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) != 2 {
				return true
			}
			if id, ok := call.Fun.(*ast.Ident); !ok || id.Name != "h" {
				return true
			}
			lit, ok := call.Args[0].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				t.Errorf("%s: a route pattern that is not a string literal: this test cannot check it", name)
				return true
			}
			p, _ := strconv.Unquote(lit.Value)
			out = append(out, p)
			return true
		})
	}
	if len(out) < 20 {
		t.Fatalf("found %d routes: is the scan broken?", len(out))
	}
	return out
}

// envdRoutes are the envd requests the gateway relays: the plain paths its path
// pattern admits, and every RPC of envd's Connect services (from their descriptors).
func envdRoutes(t *testing.T) []string {
	t.Helper()
	plain := map[string][]string{"health": {"GET"}, "files": {"GET", "POST"}, "envs": {"GET"}, "metrics": {"GET"}}
	alt := regexp.MustCompile(`\(([^()]*)\)`).FindStringSubmatch(envdPathRe.String())
	var out []string
	for _, a := range strings.Split(alt[1], "|") {
		if strings.Contains(a, "/") {
			continue // the RPC services, below
		}
		methods, ok := plain[a]
		if !ok {
			t.Errorf("envd path /%s has no tenancy case", a)
		}
		for _, m := range methods {
			out = append(out, m+" /"+a)
		}
	}
	for _, fd := range []protoreflect.FileDescriptor{process.File_process_process_proto, filesystem.File_filesystem_filesystem_proto} {
		svcs := fd.Services()
		for i := range svcs.Len() {
			ms := svcs.Get(i).Methods()
			for j := range ms.Len() {
				out = append(out, "POST /"+string(svcs.Get(i).FullName())+"/"+string(ms.Get(j).Name()))
			}
		}
	}
	if len(out) < 20 {
		t.Fatalf("only %d envd routes", len(out))
	}
	return out
}

type tenancyGW struct {
	t          *testing.T
	s          *spacetest.Space
	url        string
	aKey, bKey string
}

type resp struct {
	code int
	body string
}

func (g *tenancyGW) do(method, path string, body string, hdr ...string) resp {
	g.t.Helper()
	c, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(c, method, g.url+path, strings.NewReader(body))
	if err != nil {
		g.t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	r, err := http.DefaultClient.Do(req)
	if err != nil {
		g.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer r.Body.Close()
	b, _ := io.ReadAll(r.Body)
	return resp{r.StatusCode, string(bytes.TrimSpace(b))}
}

func (g *tenancyGW) create(key, body string) (id, token string) {
	g.t.Helper()
	r := g.do("POST", "/v2/sandboxes", body, "X-API-KEY", key)
	var c struct {
		SandboxID       string `json:"sandboxID"`
		EnvdAccessToken string `json:"envdAccessToken"`
	}
	if r.code != http.StatusCreated || json.Unmarshal([]byte(r.body), &c) != nil {
		g.t.Fatalf("create: %d %s", r.code, r.body)
	}
	return c.SandboxID, c.EnvdAccessToken
}

// gatewayBodies are the bodies routes need to reach their tenant check.
var gatewayBodies = map[string]string{
	"POST /sandboxes/{id}/timeout":    `{"timeout":30}`,
	"POST /sandboxes/{id}/refreshes":  `{"duration":30}`,
	"POST /sandboxes/{id}/resume":     `{"timeout":30}`,
	"POST /sandboxes/{id}/connect":    `{"timeout":30}`,
	"POST /v2/sandboxes/{id}/connect": `{"timeout":30}`,
}

// TestTenancyMatrix: for every route of the E2B API (read from control.go) and every
// envd request (the gateway's path pattern and envd's service descriptors), tenant
// b's credentials — its E2B key, its sandbox's access token — on tenant a's sandbox
// (running, or paused with autoResume) get exactly the answer of a sandbox that does
// not exist, and nothing of a's is woken, extended or changed.
func TestTenancyMatrix(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	gw, err := New(s.Context(), Config{API: s.Service, Store: s.Store, BuiltinTemplates: []string{"base"}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(gw)
	t.Cleanup(srv.Close)
	g := &tenancyGW{t: t, s: s, url: srv.URL}
	_, g.aKey = s.NewKeyRole("tenant-aa", store.RoleMember, service.KeyE2B)
	_, g.bKey = s.NewKeyRole("tenant-bb", store.RoleMember, service.KeyE2B)
	rel, err := s.Disk.AddRelease("atpl", "sha256:"+strings.Repeat("a", 64), spacetest.BaseConfig, map[string]string{"etc/os-release": "ID=a\n"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Store.PutRelease(s.Context(), &store.Release{Digest: rel.Digest, Name: "atpl", Config: spacetest.BaseConfig, Tenant: "tenant-aa"}, "latest", s.NodeID); err != nil {
		t.Fatal(err)
	}
	running, runTok := g.create(g.aKey, `{"templateID":"atpl","timeout":600}`)
	pausedID, _ := g.create(g.aKey, `{"timeout":600,"autoPause":true,"autoResume":{"enabled":true}}`)
	if r := g.do("POST", "/sandboxes/"+pausedID+"/pause", "", "X-API-KEY", g.aKey); r.code != http.StatusNoContent {
		t.Fatalf("pause: %d %s", r.code, r.body)
	}
	_, bTok := g.create(g.bKey, `{"timeout":600}`)
	before := map[string]*store.Sandbox{}
	for _, id := range []string{running, pausedID} {
		before[id], _ = s.Store.GetSandbox(s.Context(), id)
	}

	// A snapshot of a's.
	snap := g.do("POST", "/sandboxes/"+running+"/snapshots", `{"name":"asnap"}`, "X-API-KEY", g.aKey)
	if snap.code != http.StatusCreated && snap.code != http.StatusOK || !strings.Contains(snap.body, `"asnap"`) {
		t.Fatalf("a's snapshot: %v", snap)
	}

	// The control plane, by b's E2B key.
	for _, route := range gatewayRoutes(t) {
		method, path, _ := strings.Cut(route, " ")
		if !strings.Contains(path, "{") {
			if !slices.Contains([]string{"POST /sandboxes", "POST /v2/sandboxes", "GET /sandboxes", "GET /v2/sandboxes",
				"GET /sandboxes/metrics", "GET /templates", "GET /snapshots"}, route) {
				t.Errorf("%s: no tenancy case", route)
			}
			continue
		}
		var targets [][2]string // a's value, a missing one
		switch {
		case strings.Contains(path, "{id}"):
			targets = [][2]string{{running, ids.Sandbox()}, {pausedID, ids.Sandbox()}}
		case strings.Contains(path, "{alias}"):
			targets = [][2]string{{"atpl", "nosuchtpl"}}
		case strings.Contains(path, "{templateID}"):
			targets = [][2]string{{"asnap", "nosuchsnap"}, {"atpl", "nosuchtpl"}}
		default:
			t.Errorf("%s: no tenancy case for its path parameter", route)
			continue
		}
		for _, tg := range targets {
			param := path[strings.Index(path, "{") : strings.Index(path, "}")+1]
			got := g.do(method, strings.Replace(path, param, tg[0], 1), gatewayBodies[route], "X-API-KEY", g.bKey)
			want := g.do(method, strings.Replace(path, param, tg[1], 1), gatewayBodies[route], "X-API-KEY", g.bKey)
			got.body = strings.ReplaceAll(got.body, tg[0], tg[1])
			if got.code != http.StatusNotFound || got != want {
				t.Errorf("%s on a's %s: %d %s; on a missing one %d %s (want the same 404)", route, tg[0], got.code, got.body, want.code, want.body)
			}
		}
	}
	// Routes without a path parameter: a's template and sandboxes are missing to b.
	for _, path := range []string{"/sandboxes", "/v2/sandboxes"} {
		got := g.do("POST", path, `{"templateID":"atpl"}`, "X-API-KEY", g.bKey)
		want := g.do("POST", path, `{"templateID":"nosuchtpl"}`, "X-API-KEY", g.bKey)
		if got.code != http.StatusNotFound || strings.ReplaceAll(got.body, "atpl", "nosuchtpl") != want.body {
			t.Errorf("create from a's template: %v, from a missing one %v", got, want)
		}
		if r := g.do("GET", path, "", "X-API-KEY", g.bKey); r.code != 200 || strings.Contains(r.body, running) || strings.Contains(r.body, pausedID) {
			t.Errorf("b's list %s: %v", path, r)
		}
	}
	if r := g.do("GET", "/v2/sandboxes?state=paused", "", "X-API-KEY", g.bKey); r.body != "[]" {
		t.Errorf("b's paused list: %v", r)
	}
	if r := g.do("GET", "/sandboxes/metrics?sandbox_ids="+running+","+pausedID, "", "X-API-KEY", g.bKey); r.body != `{"sandboxes":{}}` {
		t.Errorf("b's metrics of a's sandboxes: %v", r)
	}
	if r := g.do("GET", "/templates", "", "X-API-KEY", g.bKey); r.code != 200 || strings.Contains(r.body, "atpl") {
		t.Errorf("b's templates: %v", r)
	}
	if r := g.do("GET", "/snapshots", "", "X-API-KEY", g.bKey); r.code != 200 || strings.Contains(r.body, "asnap") || strings.Contains(r.body, running) {
		t.Errorf("b's snapshots: %v", r)
	}
	if r := g.do("GET", "/snapshots", "", "X-API-KEY", g.aKey); r.code != 200 || !strings.Contains(r.body, "asnap") {
		t.Errorf("a's snapshots: %v", r)
	}

	// envd, by b's sandbox's access token, by a's token on the wrong sandbox, and
	// without a token.
	creds := map[string]string{"b's access token": bTok, "no token": ""}
	for _, route := range envdRoutes(t) {
		method, path, _ := strings.Cut(route, " ")
		for _, target := range []string{running, pausedID} {
			missing := ids.Sandbox()
			for name, tok := range creds {
				q := ""
				if path == "/files" {
					q = "?path=x"
				}
				get := func(id string) resp {
					return g.do(method, path+q, "{}", "E2b-Sandbox-Id", id, "E2b-Sandbox-Port", strconv.Itoa(envdpb.Port), "X-Access-Token", tok)
				}
				got, want := get(target), get(missing)
				got.body = strings.ReplaceAll(got.body, target, missing)
				if got.code != http.StatusUnauthorized || got != want {
					t.Errorf("envd %s on a's sandbox with %s: %d %s; on a missing one %d %s (want the same 401)",
						route, name, got.code, got.body, want.code, want.body)
				}
			}
		}
	}
	// Other ports are public traffic, as E2B's are by default: the sandbox id is their
	// capability, and no key or token of another tenant adds anything. What they never
	// do is wake a paused sandbox that did not ask for autoResume.
	missing := ids.Sandbox()
	// Signed URLs made with b's token do not open a's files.
	exp := time.Now().Add(time.Minute).Unix()
	for _, tok := range []string{bTok} {
		q := "?path=x&signature_expiration=" + strconv.FormatInt(exp, 10) + "&signature=" + url.QueryEscape(sign("x", "read", "", tok, exp))
		got := g.do("GET", "/files"+q, "", "E2b-Sandbox-Id", running, "E2b-Sandbox-Port", strconv.Itoa(envdpb.Port))
		want := g.do("GET", "/files"+q, "", "E2b-Sandbox-Id", missing, "E2b-Sandbox-Port", strconv.Itoa(envdpb.Port))
		if got.code != http.StatusUnauthorized || got != want {
			t.Errorf("signed URL of b's on a's sandbox: %v, on a missing one %v", got, want)
		}
	}

	// Nothing of a's was woken, extended or changed by any of it.
	for id, was := range before {
		now, err := s.Store.GetSandbox(s.Context(), id)
		if err != nil || now.State != was.State || now.DesiredState != was.DesiredState || now.Generation != was.Generation ||
			!equalTime(now.ExpiresAt, was.ExpiresAt) || now.AccessEpoch != was.AccessEpoch || now.TokenEpoch != was.TokenEpoch {
			t.Errorf("sandbox %s changed under b's requests: %+v -> %+v (%v)", id, was, now, err)
		}
	}
	// a's own token still works (the probes were not refused for a broken gateway).
	if r := g.do("GET", "/health", "", "E2b-Sandbox-Id", running, "E2b-Sandbox-Port", strconv.Itoa(envdpb.Port), "X-Access-Token", runTok); r.code != http.StatusNoContent {
		t.Errorf("a's own envd health: %v", r)
	}
}

func equalTime(a, b *time.Time) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(*b)
}
