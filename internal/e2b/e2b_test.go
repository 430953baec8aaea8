package e2b

import (
	"crypto/sha256"
	"encoding/base64"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/store"
)

func TestRoute(t *testing.T) {
	for _, tc := range []struct {
		host    string
		hdr     map[string]string
		id      string
		port    int
		sandbox bool
		err     bool
	}{
		{host: "127.0.0.1:3000"},
		{host: "api.example.com"},
		{host: "localhost:3000", hdr: map[string]string{"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "49983"}, id: "abc", port: 49983, sandbox: true},
		{host: "sandbox.example.com", hdr: map[string]string{"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "49999"}, id: "abc", port: 49999, sandbox: true},
		{host: "49983-abc123.example.com", id: "abc123", port: 49983, sandbox: true},
		{host: "3000-abc123.example.com:443", id: "abc123", port: 3000, sandbox: true},
		{host: "localhost", hdr: map[string]string{"E2b-Sandbox-Id": "abc"}, err: true},
		{host: "localhost", hdr: map[string]string{"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "x"}, err: true},
	} {
		r := httptest.NewRequest("GET", "/health", nil)
		r.Host = tc.host
		for k, v := range tc.hdr {
			r.Header.Set(k, v)
		}
		id, port, sandbox, err := route(r)
		if (err != nil) != tc.err || id != tc.id || port != tc.port || sandbox != tc.sandbox {
			t.Errorf("%s %v: got %q %d %v %v", tc.host, tc.hdr, id, port, sandbox, err)
		}
	}
}

// TestMetadataQuery decodes the filter as the JS SDK builds it: keys and values
// percent-encoded, joined with URLSearchParams (encoding again), sent as one query
// parameter (encoded once more).
func TestMetadataQuery(t *testing.T) {
	want := map[string]string{"user id": "a&b=c", "plain": "v"}
	inner := url.Values{}
	for k, v := range want {
		inner.Set(url.QueryEscape(k), url.QueryEscape(v))
	}
	q := url.Values{"metadata": {inner.Encode()}}
	r := httptest.NewRequest("GET", "/v2/sandboxes?"+q.Encode(), nil)
	got, err := parseMetadataQuery(r.URL.Query().Get("metadata"))
	if err != nil || !maps.Equal(got, want) {
		t.Fatalf("got %v %v, want %v", got, err, want)
	}
	if _, err := parseMetadataQuery("novalue"); err == nil {
		t.Error("a pair without = was accepted")
	}
	if states, err := parseStates([]string{"running,paused"}, nil); err != nil || len(states) != 2 {
		t.Errorf("states: %v %v", states, err)
	}
	if _, err := parseStates([]string{"killed"}, nil); err == nil {
		t.Error("unknown state accepted")
	}
}

// sign computes a /files URL signature the way the SDKs do.
func sign(path, op, user, token string, exp int64) string {
	raw := path + ":" + op + ":" + user + ":" + token
	if exp != 0 {
		raw += ":" + strconv.FormatInt(exp, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

func TestSignature(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	check := func(method, path, user, sig string, exp int64) bool {
		q := url.Values{"path": {path}, "signature": {sig}}
		if user != "" {
			q.Set("username", user)
		}
		if exp != 0 {
			q.Set("signature_expiration", strconv.FormatInt(exp, 10))
		}
		return validSignature(httptest.NewRequest(method, "/files?"+q.Encode(), nil), "tok", now, time.Hour)
	}
	soon := now.Unix() + 60
	if !check("GET", "/a b.txt", "", sign("/a b.txt", "read", "", "tok", soon), soon) {
		t.Error("valid read signature refused")
	}
	if !check("POST", "x", "root", sign("x", "write", "root", "tok", soon), soon) {
		t.Error("valid write signature refused")
	}
	late := now.Unix() + 3601
	for name, ok := range map[string]bool{
		"read signature used to write":   check("POST", "x", "", sign("x", "read", "", "tok", soon), soon),
		"other user":                     check("GET", "x", "root", sign("x", "read", "", "tok", soon), soon),
		"other token":                    check("GET", "x", "", sign("x", "read", "", "other", soon), soon),
		"expired":                        check("GET", "x", "", sign("x", "read", "", "tok", now.Unix()-1), now.Unix()-1),
		"no expiration: would never end": check("GET", "x", "", sign("x", "read", "", "tok", 0), 0),
		"beyond the maximum lifetime":    check("GET", "x", "", sign("x", "read", "", "tok", late), late),
		"no signature":                   check("GET", "x", "", "", soon),
	} {
		if ok {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestCursor(t *testing.T) {
	sb := &store.Sandbox{ID: "abc", CreatedAt: time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)}
	ts, id, err := parseCursor(cursor(sb))
	if err != nil || id != "abc" || !ts.Equal(sb.CreatedAt) {
		t.Fatalf("round trip: %v %q %v", ts, id, err)
	}
	if _, _, err := parseCursor("garbage!"); err == nil {
		t.Error("garbage cursor accepted")
	}
}

func TestTemplateNames(t *testing.T) {
	for ref, want := range map[string][2]string{
		"base:latest":          {"base", "base"},
		"base":                 {"base", "base"},
		"py:3.12":              {"py:3.12", "py"},
		"py@sha256:0123456789": {"py@sha256:0123456789", "py"},
	} {
		if id, alias := templateNames(ref); id != want[0] || alias != want[1] {
			t.Errorf("%s: %q %q, want %v", ref, id, alias, want)
		}
	}
}

func TestUntunnel(t *testing.T) {
	rec := httptest.NewRecorder()
	u := &untunnel{ResponseWriter: rec}
	u.Header().Set(envdpb.StatusHeader, "404")
	u.WriteHeader(http.StatusOK)
	_, _ = u.Write([]byte(`{"code":"not_found"}`))
	u.Flush()
	if rec.Code != 404 || rec.Header().Get(envdpb.StatusHeader) != "" {
		t.Errorf("status %d, headers %v", rec.Code, rec.Header())
	}
	rec = httptest.NewRecorder()
	u = &untunnel{ResponseWriter: rec}
	_, _ = u.Write([]byte("x"))
	if rec.Code != 200 {
		t.Errorf("plain status %d", rec.Code)
	}
}

func TestDomain(t *testing.T) {
	g := &Gateway{}
	for host, want := range map[string]string{
		"api.example.com":   "example.com",
		"127.0.0.1:3000":    "127.0.0.1",
		"localhost:3000":    "localhost",
		"[::1]:3000":        "::1",
		"e2b.internal:3000": "e2b.internal",
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = host
		if got := g.domain(r); got != want {
			t.Errorf("%s: %q, want %q", host, got, want)
		}
	}
	g.cfg.Domain = "sandboxes.example.com"
	if got := g.domain(httptest.NewRequest("GET", "/", nil)); got != "sandboxes.example.com" {
		t.Errorf("configured domain: %q", got)
	}
}
