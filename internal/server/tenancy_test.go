package server_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
)

// The tenants of the tenancy tests, and a name no tenant has.
const (
	tenantA       = "tenant-aa"
	tenantB       = "tenant-bb"
	tenantMissing = "tenant-zz"
)

// tenancy is a space with two tenants, a and b, each with an admin and a member key,
// and resources of a's to probe with b's credentials.
type tenancy struct {
	t *testing.T
	s *spacetest.Space
	// Keys (secrets) and a's member key id.
	aAdmin, aMember, bAdmin, bMember string
	aMemberID                        string
	// a's resources.
	sandbox, op, build, template, digest string
	snapshot                             string // a's named snapshot's id
	pid                                  int
	aToken                               string
	// b's attachment token (for b's own sandbox).
	bToken string
}

func startTenancy(t *testing.T) *tenancy {
	t.Helper()
	s := spacetest.Start(t, spacetest.Options{})
	c := ctx(t)
	e := &tenancy{t: t, s: s}
	for _, name := range []string{tenantA, tenantB} {
		if _, err := s.C.CreateTenant(c, name); err != nil {
			t.Fatal(err)
		}
	}
	_, e.aAdmin = s.NewKeyRole(tenantA, store.RoleAdmin, "space")
	e.aMemberID, e.aMember = s.NewKeyRole(tenantA, store.RoleMember, "space")
	_, e.bAdmin = s.NewKeyRole(tenantB, store.RoleAdmin, "space")
	_, e.bMember = s.NewKeyRole(tenantB, store.RoleMember, "space")

	// a's template, sandbox, process and build; a pool of a's template.
	e.template = "atpl"
	rel, err := s.Disk.AddRelease("atpl", "sha256:"+strings.Repeat("a", 64), spacetest.BaseConfig, map[string]string{"etc/os-release": "ID=a\n"})
	if err != nil {
		t.Fatal(err)
	}
	e.digest = rel.Digest
	if err := s.Store.PutRelease(c, &store.Release{Digest: rel.Digest, Name: "atpl", Config: spacetest.BaseConfig, Tenant: tenantA}, "latest", s.NodeID); err != nil {
		t.Fatal(err)
	}
	ca := client.New(s.URL, e.aMember)
	sb := e.create(ca, "atpl")
	if sb.TemplateDigest != e.digest || sb.Tenant != tenantA {
		t.Fatalf("a's sandbox of a's template: %+v", sb)
	}
	e.sandbox, e.op = sb.ID, sb.Operation.ID
	// (Taken before the session: on the fake runtime a checkpoint restarts the agent.)
	sn, err := ca.CreateSnapshotAndWait(c, sb.ID, api.CreateSnapshotRequest{Name: "asnap"})
	if err != nil {
		t.Fatal(err)
	}
	e.snapshot = sn.ID
	sess, err := ca.CreateSession(c, sb.ID, api.CreateSessionRequest{Command: "sleep 600", Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	e.pid, e.aToken = sess.PID, sess.Token
	if _, err := ca.WriteFile(c, sb.ID, "x", strings.NewReader("x"), client.FileOptions{}); err != nil {
		t.Fatal(err)
	}
	build := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild, Tenant: tenantA, State: api.OpSucceeded,
		Params: map[string]any{"template": "atpl:v2"}}
	if err := s.Store.CreateOperation(c, build); err != nil {
		t.Fatal(err)
	}
	e.build = build.ID
	if _, err := client.New(s.URL, e.aAdmin).SetPool(c, api.SetPoolRequest{Template: "atpl", Size: 1}); err != nil {
		t.Fatal(err)
	}
	// b's own sandbox and session: b's attachment token.
	cb := client.New(s.URL, e.bMember)
	bsb := e.create(cb, "base")
	bsess, err := cb.CreateSession(c, bsb.ID, api.CreateSessionRequest{Command: "sleep 600", Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	e.bToken = bsess.Token
	return e
}

// create creates a sandbox with c and waits until it runs.
func (e *tenancy) create(c *client.Client, template string) *api.Sandbox {
	e.t.Helper()
	sb, err := c.CreateSandbox(ctx(e.t), api.CreateSandboxRequest{Template: template}, "")
	if err != nil {
		e.t.Fatal(err)
	}
	op, err := c.WaitOperation(ctx(e.t), sb.Operation.ID)
	if err != nil || op.State != api.OpSucceeded {
		e.t.Fatalf("create from %s: %+v %v", template, op, err)
	}
	return sb
}

type answer struct {
	code int
	body string
}

// do sends a request with credential cred (an API key or an attachment token).
func (e *tenancy) do(method, path, cred, body string) answer {
	e.t.Helper()
	c, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(c, method, e.s.URL+path, strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	if cred != "" {
		req.Header.Set("Authorization", "Bearer "+cred)
	}
	if body != "" && strings.HasPrefix(body, "{") {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		return answer{resp.StatusCode, "(stream)"}
	}
	b, _ := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, strings.TrimSpace(string(b))}
}

// routeCase says how to exercise one route of the OpenAPI document: the query and body
// it needs to reach its tenant check.
type routeCase struct {
	query, body string
}

// pathCases are the extras of routes with path parameters (missing: none needed).
var pathCases = map[string]routeCase{
	"GET /v1/sandboxes/{id}/files":                      {query: "?path=x"},
	"PUT /v1/sandboxes/{id}/files":                      {query: "?path=x", body: "data"},
	"DELETE /v1/sandboxes/{id}/files":                   {query: "?path=x"},
	"GET /v1/sandboxes/{id}/files/stat":                 {query: "?path=x"},
	"GET /v1/sandboxes/{id}/files/list":                 {query: "?path=."},
	"GET /v1/sandboxes/{id}/files/watch":                {query: "?path=x"},
	"POST /v1/sandboxes/{id}/files/mkdir":               {body: `{"path":"x"}`},
	"POST /v1/sandboxes/{id}/files/move":                {body: `{"from":"x","to":"y"}`},
	"POST /v1/sandboxes/{id}/sessions":                  {body: `{"command":"true"}`},
	"POST /v1/sandboxes/{id}/exec":                      {body: `{"command":"true"}`},
	"GET /v1/operations/{id}/wait":                      {query: "?timeout=1s"},
	"PUT /v1/tenants/{name}/quota":                      {body: `{"running_sandboxes":1}`},
	"POST /v1/dp/sandboxes/{id}/processes/{pid}/stdin":  {body: "x"},
	"POST /v1/dp/sandboxes/{id}/processes/{pid}/signal": {body: `{"signal":"TERM"}`},
	"POST /v1/dp/sandboxes/{id}/processes/{pid}/resize": {body: `{"rows":10,"cols":10}`},
}

// TestTenancyMatrix is generated from the route table (the OpenAPI document, which
// api/openapi_test.go keeps equal to the routes internal/server and internal/dataplane
// register): for every route, tenant b's credentials — its admin key, its member key,
// and on the data plane its attachment token — on tenant a's resource get exactly the
// answer a missing resource gets, and that answer is a 404. Routes without a path
// parameter have a case each in TestTenancyListings; a new route that is in neither
// fails here.
func TestTenancyMatrix(t *testing.T) {
	e := startTenancy(t)
	doc := map[string]any{}
	if err := json.Unmarshal(api.OpenAPI, &doc); err != nil {
		t.Fatal(err)
	}
	paths := doc["paths"].(map[string]any)
	var routes []string
	for path, item := range paths {
		for method := range item.(map[string]any) {
			switch method {
			case "get", "put", "post", "delete", "patch":
				routes = append(routes, strings.ToUpper(method)+" "+path)
			}
		}
	}
	sort.Strings(routes)
	missing := map[string]string{
		e.sandbox: ids.Sandbox(), e.op: ids.Operation(), e.aMemberID: ids.APIKey(), e.template: "nosuchtpl", tenantA: tenantMissing,
		e.snapshot: ids.Snapshot(),
	}
	n := 0
	for _, route := range routes {
		method, path, _ := strings.Cut(route, " ")
		if !strings.Contains(path, "{") {
			if !slices.Contains(listingRoutes, route) {
				t.Errorf("%s: no tenancy case (a route without a path parameter needs one in TestTenancyListings)", route)
			}
			continue
		}
		if strings.HasPrefix(path, "/v1/nodes/{name}") {
			// Nodes are the operator's, not a tenant's: every other key is refused,
			// whether the node exists or not.
			for name, cred := range map[string]string{"admin key": e.bAdmin, "member key": e.bMember} {
				for _, node := range []string{e.s.NodeID, "nosuchnode"} {
					if got := e.do(method, strings.ReplaceAll(path, "{name}", node), cred, ""); got.code != http.StatusForbidden {
						t.Errorf("%s with b's %s on node %s: %d %s, want 403", route, name, node, got.code, got.body)
					}
					n++
				}
			}
			continue
		}
		target, other, creds, ok := e.resolve(method, path, missing)
		if !ok {
			t.Errorf("%s: no tenancy case for its path parameters (add its resource to tenancy.resolve)", route)
			continue
		}
		rc := pathCases[route]
		for name, cred := range creds {
			got := e.do(method, target+rc.query, cred, rc.body)
			want := e.do(method, other+rc.query, cred, rc.body)
			for from, to := range missing {
				got.body = strings.ReplaceAll(got.body, from, to)
			}
			if got.code != http.StatusNotFound || got != want {
				t.Errorf("%s with b's %s: a's resource answers %d %s; a missing one %d %s (want the same 404)",
					route, name, got.code, got.body, want.code, want.body)
			}
			n++
		}
		// The resource is real: a's own member gets something else than a 404 from
		// the routes that only read (streams are left alone).
		if method == http.MethodGet && !strings.HasSuffix(path, "/events") && !strings.HasSuffix(path, "/watch") &&
			!strings.HasSuffix(path, "/attach") && !strings.HasPrefix(path, "/internal/") {
			cred := e.aMember
			if strings.HasPrefix(path, "/v1/dp/") {
				cred = e.aToken
			}
			if got := e.do(method, target+rc.query, cred, ""); got.code == http.StatusNotFound {
				t.Errorf("%s: a's own key gets %d %s: the matrix probes nothing real", route, got.code, got.body)
			}
		}
	}
	if n < 60 {
		t.Fatalf("only %d probes: is the route table read?", n)
	}
}

// resolve fills a route's path parameters with a's resource (target) and with a
// missing one of the same kind (other), and names the credentials of b to try.
func (e *tenancy) resolve(method, path string, missing map[string]string) (target, other string, creds map[string]string, ok bool) {
	keys := map[string]string{"admin key": e.bAdmin, "member key": e.bMember}
	var params map[string]string
	switch {
	case strings.HasPrefix(path, "/v1/sandboxes/{id}"):
		params = map[string]string{"{id}": e.sandbox, "{pid}": itoa(e.pid), "{port}": "8080", "{path}": "index.html"}
	case strings.HasPrefix(path, "/v1/operations/{id}"):
		params = map[string]string{"{id}": e.op}
	case strings.HasPrefix(path, "/v1/apikeys/{id}"):
		params = map[string]string{"{id}": e.aMemberID}
	case strings.HasPrefix(path, "/v1/templates/{ref}"):
		ref := e.template
		if method == http.MethodDelete {
			ref += ":latest"
		}
		params = map[string]string{"{ref}": ref}
	case strings.HasPrefix(path, "/v1/snapshots/{ref}"):
		params = map[string]string{"{ref}": e.snapshot}
	case strings.HasPrefix(path, "/v1/tenants/{name}"):
		params = map[string]string{"{name}": tenantA}
	case strings.HasPrefix(path, "/v1/dp/sandboxes/{id}"):
		params = map[string]string{"{id}": e.sandbox, "{pid}": itoa(e.pid)}
		keys = map[string]string{"attachment token": e.bToken}
	case strings.HasPrefix(path, "/internal/v1/sandboxes/{id}/agent/"):
		params = map[string]string{"{id}": e.sandbox, "{path}": "v1/health"}
		keys = map[string]string{"attachment token": e.bToken}
	default:
		return "", "", nil, false
	}
	target, other = path, path
	for p, v := range params {
		if !strings.Contains(path, p) {
			continue
		}
		target = strings.ReplaceAll(target, p, url.PathEscape(v))
		m, ok := missing[v]
		if !ok {
			m = v // a pid or agent path: the same under the missing sandbox
		}
		if p == "{ref}" && strings.HasSuffix(v, ":latest") {
			m = missing[e.template] + ":latest"
		}
		other = strings.ReplaceAll(other, p, url.PathEscape(m))
	}
	if strings.Contains(target, "{") {
		return "", "", nil, false
	}
	return target, other, keys, true
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// listingRoutes are the routes without a path parameter; TestTenancyListings has a
// case for each.
var listingRoutes = []string{
	"GET /healthz", "GET /metrics", "GET /v1/openapi.json",
	"POST /v1/sandboxes", "GET /v1/sandboxes",
	"GET /v1/pools", "PUT /v1/pools",
	"POST /v1/apikeys", "GET /v1/apikeys",
	"GET /v1/nodes", "GET /v1/tenants", "POST /v1/tenants",
	"GET /v1/whoami", "GET /v1/events", "GET /v1/operations", "GET /v1/bench",
	"GET /v1/templates", "POST /v1/templates", "GET /v1/snapshots",
}

// TestTenancyListings covers the routes without a path parameter: what they list or
// accept never shows or reaches tenant a's resources to tenant b, naming a's tenant or
// template answers like a missing one, and operator-only routes refuse tenants' keys.
func TestTenancyListings(t *testing.T) {
	e := startTenancy(t)
	covered := map[string]bool{}
	same := func(route, cred, method, aPath, missingPath, aBody, missingBody string, replace ...string) {
		t.Helper()
		covered[route] = true
		got := e.do(method, aPath, cred, aBody)
		want := e.do(method, missingPath, cred, missingBody)
		for i := 0; i+1 < len(replace); i += 2 {
			got.body = strings.ReplaceAll(got.body, replace[i], replace[i+1])
		}
		if got.code != http.StatusNotFound || got != want {
			t.Errorf("%s: a's answers %d %s, a missing one %d %s (want the same 404)", route, got.code, got.body, want.code, want.body)
		}
	}
	hidden := func(route, cred, path string, secrets ...string) {
		t.Helper()
		covered[route] = true
		got := e.do("GET", path, cred, "")
		if got.code != http.StatusOK {
			t.Errorf("%s: %d %s", route, got.code, got.body)
		}
		for _, s := range secrets {
			if strings.Contains(got.body, s) {
				t.Errorf("%s: b sees a's %q: %s", route, s, got.body)
			}
		}
	}
	refused := func(route, cred, method, path, body string, code int) {
		t.Helper()
		covered[route] = true
		if got := e.do(method, path, cred, body); got.code != code {
			t.Errorf("%s with a tenant's key: %d %s, want %d", route, got.code, got.body, code)
		}
	}
	for _, cred := range []string{e.bAdmin, e.bMember} {
		// Public routes carry no tenant's data.
		for _, r := range []string{"GET /healthz", "GET /v1/openapi.json"} {
			covered[r] = true
			if got := e.do("GET", strings.TrimPrefix(r, "GET "), "", ""); got.code != http.StatusOK || strings.Contains(got.body, e.sandbox) {
				t.Errorf("%s: %d", r, got.code)
			}
		}
		same("POST /v1/sandboxes", cred, "POST", "/v1/sandboxes", "/v1/sandboxes", `{"template":"atpl"}`, `{"template":"nosuchtpl"}`, "atpl", "nosuchtpl")
		same("POST /v1/sandboxes", cred, "POST", "/v1/sandboxes", "/v1/sandboxes", `{"template":"atpl@`+e.digest+`"}`,
			`{"template":"atpl@sha256:`+strings.Repeat("f", 64)+`"}`, e.digest, "sha256:"+strings.Repeat("f", 64))
		hidden("GET /v1/sandboxes", cred, "/v1/sandboxes?state=running,paused,suspended,stopped,deleted,pending,creating", e.sandbox)
		same("GET /v1/sandboxes", cred, "GET", "/v1/sandboxes?tenant="+tenantA, "/v1/sandboxes?tenant="+tenantMissing, "", "", tenantA, tenantMissing)
		hidden("GET /v1/pools", cred, "/v1/pools", "atpl")
		same("GET /v1/pools", cred, "GET", "/v1/pools?tenant="+tenantA, "/v1/pools?tenant="+tenantMissing, "", "", tenantA, tenantMissing)
		same("PUT /v1/pools", cred, "PUT", "/v1/pools", "/v1/pools", `{"template":"base","size":1,"tenant":"`+tenantA+`"}`,
			`{"template":"base","size":1,"tenant":"`+tenantMissing+`"}`, tenantA, tenantMissing)
		same("POST /v1/apikeys", cred, "POST", "/v1/apikeys", "/v1/apikeys", `{"name":"x","tenant":"`+tenantA+`"}`, `{"name":"x","tenant":"`+tenantMissing+`"}`,
			tenantA, tenantMissing)
		same("GET /v1/apikeys", cred, "GET", "/v1/apikeys?tenant="+tenantA, "/v1/apikeys?tenant="+tenantMissing, "", "", tenantA, tenantMissing)
		refused("GET /v1/nodes", cred, "GET", "/v1/nodes", "", http.StatusForbidden)
		refused("GET /v1/tenants", cred, "GET", "/v1/tenants", "", http.StatusForbidden)
		refused("POST /v1/tenants", cred, "POST", "/v1/tenants", `{"name":"tenant-cc"}`, http.StatusForbidden)
		refused("GET /metrics", cred, "GET", "/metrics", "", http.StatusForbidden)
		hidden("GET /v1/operations", cred, "/v1/operations?kind=template_build", e.build, "atpl")
		same("GET /v1/operations", cred, "GET", "/v1/operations?kind=template_build&tenant="+tenantA, "/v1/operations?kind=template_build&tenant="+tenantMissing,
			"", "", tenantA, tenantMissing)
		hidden("GET /v1/snapshots", cred, "/v1/snapshots", e.snapshot, "asnap", e.sandbox)
		hidden("GET /v1/templates", cred, "/v1/templates", "atpl", e.digest)
		same("GET /v1/templates", cred, "GET", "/v1/templates?tenant="+tenantA, "/v1/templates?tenant="+tenantMissing, "", "", tenantA, tenantMissing)
		same("POST /v1/templates", cred, "POST", "/v1/templates", "/v1/templates", `{"name":"x","from":{"template":"atpl"}}`,
			`{"name":"x","from":{"template":"nosuchtpl"}}`, "atpl", "nosuchtpl")
		// The bench results are the host's figures, the same for every key.
		covered["GET /v1/bench"] = true
		if got, op := e.do("GET", "/v1/bench", cred, ""), e.do("GET", "/v1/bench", e.aMember, ""); got != op {
			t.Errorf("bench answers differ by tenant: %v %v", got, op)
		}
		covered["GET /v1/whoami"] = true
		var who api.WhoAmI
		if got := e.do("GET", "/v1/whoami", cred, ""); json.Unmarshal([]byte(got.body), &who) != nil || who.Tenant != tenantB {
			t.Errorf("whoami: %s", got.body)
		}
	}
	// Operators see every tenant and narrow by tenant.
	op := e.s.C
	if list, err := op.ListSandboxes(ctx(t), client.ListOptions{}); err != nil || !slices.ContainsFunc(list, func(sb api.Sandbox) bool { return sb.ID == e.sandbox }) {
		t.Errorf("operator list: %v", err)
	}
	if got := e.do("GET", "/v1/sandboxes?tenant="+tenantB, e.s.AdminKey, ""); got.code != 200 || strings.Contains(got.body, e.sandbox) ||
		!strings.Contains(got.body, `"tenant":"`+tenantB+`"`) {
		t.Errorf("operator list of b: %s", got.body)
	}
	if got := e.do("GET", "/v1/templates?tenant="+tenantA, e.s.AdminKey, ""); !strings.Contains(got.body, `"tenant":"`+tenantA+`","name":"atpl"`) {
		t.Errorf("operator templates of a: %s", got.body)
	}
	if got := e.do("GET", "/metrics", e.s.AdminKey, ""); got.code != 200 || !strings.Contains(got.body, "space_sandboxes") {
		t.Errorf("operator metrics: %d", got.code)
	}

	// Events: b's stream never carries a's changes (checked by waiting for b's own
	// change after a's).
	covered["GET /v1/events"] = true
	c, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(c, "GET", e.s.URL+"/v1/events", nil)
	req.Header.Set("Authorization", "Bearer "+e.bMember)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	lines := make(chan string, 1000)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	waitLine := func(whats ...string) {
		deadline := time.After(time.Minute)
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatal("b's event stream ended")
				}
				if strings.Contains(l, e.sandbox) {
					t.Fatalf("b's event stream carried a's sandbox: %s", l)
				}
				for _, what := range whats {
					if strings.Contains(l, what) {
						return
					}
				}
			case <-deadline:
				t.Fatalf("none of %q on b's event stream", whats)
			}
		}
	}
	waitLine("event: ready", "event: resync")
	if _, err := client.New(e.s.URL, e.aMember).Lifecycle(ctx(t), e.sandbox, api.OpPause); err != nil {
		t.Fatal(err)
	}
	bsb, err := client.New(e.s.URL, e.bMember).CreateSandbox(ctx(t), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	waitLine(bsb.ID)

	for _, r := range listingRoutes {
		if !covered[r] {
			t.Errorf("%s: listed but not checked", r)
		}
	}
}
