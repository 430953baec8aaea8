package e2b_test

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/e2b"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
)

// netGateway is a gateway with sandbox networking on, over a space whose node has a
// fake network manager.
func netGateway(t *testing.T) (*gateway, *spacetest.FakeNetwork) {
	t.Helper()
	fn := spacetest.NewFakeNetwork()
	s := spacetest.Start(t, spacetest.Options{Node: func(c *node.Config) { c.Network = fn }})
	g, err := e2b.New(s.Context(), e2b.Config{API: s.Service, Store: s.Store, Network: true, BuiltinTemplates: []string{"base"}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g)
	t.Cleanup(srv.Close)
	return &gateway{t: t, s: s, url: srv.URL, key: s.NewKey("default", false, service.KeyE2B)}, fn
}

// netDetail is the network part of E2B's SandboxDetail.
type netDetail struct {
	AllowInternetAccess *bool `json:"allowInternetAccess"`
	Network             *struct {
		AllowOut           []string                    `json:"allowOut"`
		DenyOut            []string                    `json:"denyOut"`
		Rules              map[string][]map[string]any `json:"rules"`
		EgressProxy        map[string]string           `json:"egressProxy"`
		AllowPublicTraffic bool                        `json:"allowPublicTraffic"`
		MaskRequestHost    string                      `json:"maskRequestHost"`
	} `json:"network"`
}

// TestE2BNetworkOptions: E2B's allowInternetAccess and network options become space
// policies (open by default, as E2B's), are shown back without secrets, and
// updateNetwork (PUT, replace-all) changes the running sandbox's policy.
func TestE2BNetworkOptions(t *testing.T) {
	g, fn := netGateway(t)

	// E2B's default: open egress.
	a := g.create("/v2/sandboxes", map[string]any{"templateID": "base"})
	if spec := fn.Spec(a.SandboxID); spec == nil || !spec.Egress || len(spec.DenyOut) != 0 {
		t.Fatalf("default E2B sandbox's policy: %+v", spec)
	}
	if a.TrafficAccessToken != nil {
		t.Fatalf("public sandbox got a traffic token")
	}
	var d netDetail
	g.do("GET", "/sandboxes/"+a.SandboxID, nil).json(t, &d)
	if d.AllowInternetAccess == nil || !*d.AllowInternetAccess || d.Network == nil || !d.Network.AllowPublicTraffic {
		t.Fatalf("detail of a default sandbox: %+v %+v", d.AllowInternetAccess, d.Network)
	}

	// No internet but an allowlist, header rules and a proxy.
	b := g.create("/v2/sandboxes", map[string]any{"templateID": "base", "allow_internet_access": false, "network": map[string]any{
		"allowOut":    []string{"api.example.com", "203.0.113.0/24"},
		"rules":       map[string]any{"api.example.com": []any{map[string]any{"transform": map[string]any{"headers": map[string]string{"Authorization": "Bearer sk-e2b"}}}}},
		"egressProxy": map[string]string{"address": "proxy.example.com:1080", "username": "u", "password": "pw-secret"},
	}})
	spec := fn.Spec(b.SandboxID)
	if spec == nil || !spec.Egress || len(spec.DenyOut) != 1 || spec.DenyOut[0] != "0.0.0.0/0" || len(spec.AllowOut) != 2 ||
		spec.EgressProxy.Password != "pw-secret" || spec.Rules["api.example.com"][0].Transform.Headers["Authorization"] != "Bearer sk-e2b" {
		t.Fatalf("policy of a no-internet sandbox: %+v", spec)
	}
	r := g.do("GET", "/sandboxes/"+b.SandboxID, nil)
	if strings.Contains(string(r.body), "pw-secret") || strings.Contains(string(r.body), "sk-e2b") {
		t.Fatalf("detail shows a secret: %s", r)
	}
	d = netDetail{}
	r.json(t, &d)
	if d.AllowInternetAccess == nil || *d.AllowInternetAccess || len(d.Network.AllowOut) != 2 || d.Network.EgressProxy["address"] != "proxy.example.com:1080" {
		t.Fatalf("detail of a no-internet sandbox: %s", r)
	}

	// updateNetwork replaces the whole policy: omitted fields are cleared.
	want(t, "update", g.do("PUT", "/sandboxes/"+b.SandboxID+"/network", map[string]any{"allowOut": []string{"pypi.org"}, "allow_internet_access": false}), http.StatusNoContent)
	spec = fn.Spec(b.SandboxID)
	if len(spec.AllowOut) != 1 || spec.AllowOut[0] != "pypi.org" || spec.EgressProxy != nil || spec.Rules != nil || len(spec.DenyOut) != 1 {
		t.Fatalf("after updateNetwork: %+v", spec)
	}
	want(t, "update to open", g.do("PUT", "/sandboxes/"+b.SandboxID+"/network", map[string]any{}), http.StatusNoContent)
	if spec = fn.Spec(b.SandboxID); len(spec.DenyOut) != 0 || len(spec.AllowOut) != 0 {
		t.Fatalf("after an empty update: %+v", spec)
	}
	// Bad input names the field; nothing changes.
	want(t, "bad CIDR", g.do("PUT", "/sandboxes/"+b.SandboxID+"/network", map[string]any{"denyOut": []string{"1.2.3.4/40"}}), http.StatusBadRequest, "network.deny_out[0]")
	want(t, "bad create", g.do("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "network": map[string]any{"allowOut": []string{"bad_name!"}}}), http.StatusBadRequest, "network.allow_out[0]")
	want(t, "https ports", g.do("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "network": map[string]any{"httpsPorts": []int{3000}}}), http.StatusBadRequest, "httpsPorts")
	want(t, "bad mask", g.do("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "network": map[string]any{"maskRequestHost": "a b"}}), http.StatusBadRequest, "maskRequestHost")
	want(t, "unknown sandbox", g.do("PUT", "/sandboxes/nosuchsandbox/network", map[string]any{}), http.StatusNotFound)
}

// TestE2BPrivateTraffic: allowPublicTraffic false gives the sandbox a traffic access
// token that port requests must carry; maskRequestHost is the Host its server sees.
func TestE2BPrivateTraffic(t *testing.T) {
	g, _ := netGateway(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "host=%s token=%q", r.Host, r.Header.Get("E2b-Traffic-Access-Token"))
	}), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)

	c := g.create("/v2/sandboxes", map[string]any{"templateID": "base", "network": map[string]any{
		"allowPublicTraffic": false, "maskRequestHost": "app.internal:${PORT}",
	}})
	if c.TrafficAccessToken == nil || *c.TrafficAccessToken == "" {
		t.Fatal("a private sandbox got no traffic access token")
	}
	host := port + "-" + c.SandboxID + ".sandboxes.example"
	want(t, "without the token", g.do("GET", "/", nil, "Host", host), http.StatusForbidden, "E2b-Traffic-Access-Token")
	want(t, "with a wrong token", g.do("GET", "/", nil, "Host", host, "E2b-Traffic-Access-Token", "nope"), http.StatusForbidden)
	r := g.do("GET", "/", nil, "Host", host, "E2b-Traffic-Access-Token", *c.TrafficAccessToken)
	want(t, "with the token", r, http.StatusOK, "host=app.internal:"+port, `token=""`)

	// A public sandbox needs no token; its server sees the name the client used.
	p := g.create("/v2/sandboxes", map[string]any{"templateID": "base"})
	r = g.do("GET", "/", nil, "Host", port+"-"+p.SandboxID+".sandboxes.example")
	want(t, "public", r, http.StatusOK, "host="+port+"-"+p.SandboxID)
}

// TestE2BNetworkOff: on a server without sandbox networking, E2B's defaults (and "no
// internet") give sandboxes without a network; egress rules are refused, as is
// updateNetwork.
func TestE2BNetworkOff(t *testing.T) {
	g := startGateway(t, spacetest.Options{})
	a := g.create("/v2/sandboxes", map[string]any{"templateID": "base", "allow_internet_access": true})
	sb, err := g.s.Store.GetSandbox(g.s.Context(), a.SandboxID)
	if err != nil || sb.Spec.Network != nil {
		t.Fatalf("sandbox on a server without networking: %+v %v", sb, err)
	}
	want(t, "allowOut", g.do("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "network": map[string]any{"allowOut": []string{"example.com"}}}), http.StatusBadRequest, "networking is off")
	want(t, "update", g.do("PUT", "/sandboxes/"+a.SandboxID+"/network", map[string]any{}), http.StatusBadRequest, "networking is off")
}
