package e2b

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/fault"
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
	check := func(method, path, user, sig string, exp int64, hdr string) (int, string) {
		q := url.Values{"path": {path}}
		if sig != "" {
			q.Set("signature", sig)
		}
		if user != "" {
			q.Set("username", user)
		}
		if exp != 0 {
			q.Set("signature_expiration", strconv.FormatInt(exp, 10))
		}
		r := httptest.NewRequest(method, "/files?"+q.Encode(), nil)
		if hdr != "" {
			r.Header.Set("X-Access-Token", hdr)
		}
		return checkFiles(r, "tok", now, time.Hour)
	}
	soon, late := now.Unix()+60, now.Unix()+3601
	if st, msg := check("GET", "/a b.txt", "", sign("/a b.txt", "read", "", "tok", soon), soon, ""); st != 0 {
		t.Errorf("valid read signature refused: %d %s", st, msg)
	}
	if st, msg := check("POST", "x", "root", sign("x", "write", "root", "tok", soon), soon, ""); st != 0 {
		t.Errorf("valid write signature refused: %d %s", st, msg)
	}
	if st, _ := check("GET", "x", "", "", 0, "tok"); st != 0 {
		t.Error("access token header refused")
	}
	for _, c := range []struct {
		name              string
		method, user, sig string
		exp               int64
		hdr               string
		wantSt            int
		wantMsg           string
	}{
		{"read signature used to write", "POST", "", sign("x", "read", "", "tok", soon), soon, "", 401, "invalid signature"},
		{"other user", "GET", "root", sign("x", "read", "", "tok", soon), soon, "", 401, "invalid signature"},
		{"other token", "GET", "", sign("x", "read", "", "other", soon), soon, "", 401, "invalid signature"},
		{"expired", "GET", "", sign("x", "read", "", "tok", now.Unix()-1), now.Unix() - 1, "", 401, "signature is already expired"},
		{"forged and expired", "GET", "", "v1_forged", now.Unix() - 1, "", 401, "invalid signature"},
		{"no signature", "GET", "", "", soon, "", 401, "missing signature query parameter"},
		{"no expiration: would never end", "GET", "", sign("x", "read", "", "tok", 0), 0, "", 401, msgNoExpiration},
		{"beyond the maximum lifetime", "GET", "", sign("x", "read", "", "tok", late), late, "", 401, "signature_expiration is more than 1h0m0s away (this server's limit for signed URLs)"},
		{"wrong header", "GET", "", sign("x", "read", "", "tok", soon), soon, "nope", 401, "access token present in header but does not match"},
	} {
		if st, msg := check(c.method, "x", c.user, c.sig, c.exp, c.hdr); st != c.wantSt || msg != c.wantMsg {
			t.Errorf("%s: %d %q, want %d %q", c.name, st, msg, c.wantSt, c.wantMsg)
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
		"api.example.com":      "example.com",
		"api.example.com:8443": "example.com:8443",
		"127.0.0.1:3000":       "localhost:3000",
		"127.0.0.2":            "localhost",
		"localhost:3000":       "localhost:3000",
		"[::1]:3000":           "localhost:3000",
		"0.0.0.0:3000":         "localhost:3000",
		"10.1.2.3:3000":        "10-1-2-3.ip.invalid:3000",
		"[fd00::1]:3000":       "fd00--1.ip.invalid:3000",
		"e2b.internal:3000":    "e2b.internal:3000",
		"":                     "localhost",
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = host
		got := g.domain(r)
		if got != want {
			t.Errorf("%s: %q, want %q", host, got, want)
		}
		// What the SDKs build from it must be a valid URL with that host.
		// (WHATWG URL parsers, Node's among them, reject a host whose last label is
		// a number.)
		u, err := url.Parse("https://8000-abc123." + got + "/")
		if err != nil || !strings.HasPrefix(u.Hostname(), "8000-abc123.") {
			t.Errorf("%s: URL from %q: %v %v", host, got, u, err)
			continue
		}
		labels := strings.Split(u.Hostname(), ".")
		if _, err := strconv.Atoi(labels[len(labels)-1]); err == nil {
			t.Errorf("%s: %q ends in a number", host, u.Hostname())
		}
	}
	g.cfg.Domain = "sandboxes.example.com"
	if got := g.domain(httptest.NewRequest("GET", "/", nil)); got != "sandboxes.example.com" {
		t.Errorf("configured domain: %q", got)
	}
}

// TestFailRetryAfter: the E2B API's errors carry Retry-After as the native API's do: a
// conflict that passes on its own (a transition in flight) and too many requests.
func TestFailRetryAfter(t *testing.T) {
	g := &Gateway{log: slog.New(slog.DiscardHandler)}
	for _, tc := range []struct {
		err    error
		status int
		after  string
	}{
		{fault.Later(fault.New(fault.Conflict, "sandbox x is suspending; wait for that to finish"), 1500*time.Millisecond), 409, "2"},
		{fault.New(fault.TooManyRequests, "slow down"), 429, "1"},
		{fault.New(fault.Conflict, "sandbox x is stopped"), 409, ""},
	} {
		w := httptest.NewRecorder()
		g.fail(w, httptest.NewRequest("POST", "/sandboxes/x/pause", nil), tc.err)
		var body struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil || w.Code != tc.status || body.Code != tc.status {
			t.Errorf("%v: %d %s", tc.err, w.Code, w.Body)
		}
		if got := w.Header().Get("Retry-After"); got != tc.after {
			t.Errorf("%v: Retry-After %q, want %q", tc.err, got, tc.after)
		}
	}
}
