package console

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"testing"
)

func newHandler(t *testing.T, origins []string, err error) *Handler {
	t.Helper()
	h, e := New(Config{DataPlaneOrigins: func(context.Context) ([]string, error) { return origins, err }})
	if e != nil {
		t.Fatal(e)
	}
	return h
}

func get(t *testing.T, h http.Handler, method, path string, hdr map[string]string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(method, path, nil)
	for k, v := range hdr {
		r.Header.Set(k, v)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// TestSecurityHeaders checks the policy and headers on documents, assets and errors.
func TestSecurityHeaders(t *testing.T) {
	h := newHandler(t, []string{"http://node1:7700/", "https://node2.example:8443", "http://127.0.0.1:7700", "javascript:alert(1)", "http://x; script-src *"}, nil)
	for _, path := range []string{"/ui/", "/ui/index.html", "/ui/app.css", "/ui/js/main.js", "/ui/nope", "/ui/../etc/passwd"} {
		w := get(t, h, "GET", path, nil)
		hd := w.Header()
		csp := hd.Get("Content-Security-Policy")
		for _, want := range []string{"default-src 'none'", "script-src 'self'", "style-src 'self'", "frame-ancestors 'none'", "base-uri 'none'", "object-src 'none'"} {
			if !strings.Contains(csp, want) {
				t.Errorf("%s: CSP %q lacks %q", path, csp, want)
			}
		}
		for _, bad := range []string{"unsafe-inline", "unsafe-eval", "*", "javascript:", "script-src *"} {
			if strings.Contains(csp, bad) {
				t.Errorf("%s: CSP %q contains %q", path, csp, bad)
			}
		}
		for k, v := range map[string]string{"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"} {
			if got := hd.Get(k); got != v {
				t.Errorf("%s: %s = %q, want %q", path, k, got, v)
			}
		}
	}
	csp := get(t, h, "GET", "/ui/", nil).Header().Get("Content-Security-Policy")
	if !strings.Contains(csp, "connect-src 'self' http://node1:7700 https://node2.example:8443 http://127.0.0.1:7700") {
		t.Errorf("document CSP %q does not allow exactly the data planes", csp)
	}
	if strings.Contains(csp, "http://x") {
		t.Errorf("document CSP %q took an origin with a CSP separator", csp)
	}
	// A failing node list still serves the console (same-origin data plane only).
	h2 := newHandler(t, nil, errors.New("db down"))
	if w := get(t, h2, "GET", "/ui/", nil); w.Code != 200 || !strings.Contains(w.Header().Get("Content-Security-Policy"), "connect-src 'self'") {
		t.Errorf("with no node list: %d %q", w.Code, w.Header().Get("Content-Security-Policy"))
	}
}

func TestServing(t *testing.T) {
	h := newHandler(t, nil, nil)
	cases := []struct {
		method, path string
		code         int
		ctype        string
	}{
		{"GET", "/ui/", 200, "text/html; charset=utf-8"},
		{"HEAD", "/ui/", 200, "text/html; charset=utf-8"},
		{"GET", "/ui/js/main.js", 200, "text/javascript; charset=utf-8"},
		{"GET", "/ui/vendor/xterm-headless.mjs", 200, "text/javascript; charset=utf-8"},
		{"GET", "/ui/app.css", 200, "text/css; charset=utf-8"},
		{"GET", "/ui/favicon.svg", 200, "image/svg+xml"},
		{"GET", "/ui/missing.js", 404, ""},
		{"GET", "/ui/js/", 404, ""},
		{"GET", "/ui/../console.go", 404, ""},
		{"GET", "/other", 404, ""},
		{"POST", "/ui/", 405, ""},
		{"DELETE", "/ui/app.css", 405, ""},
	}
	for _, c := range cases {
		w := get(t, h, c.method, c.path, nil)
		if w.Code != c.code {
			t.Errorf("%s %s: %d, want %d", c.method, c.path, w.Code, c.code)
		}
		if c.ctype != "" && w.Header().Get("Content-Type") != c.ctype {
			t.Errorf("%s %s: Content-Type %q, want %q", c.method, c.path, w.Header().Get("Content-Type"), c.ctype)
		}
	}
	// Revalidation by ETag.
	w := get(t, h, "GET", "/ui/app.css", nil)
	etag := w.Header().Get("ETag")
	if etag == "" || w.Header().Get("Cache-Control") != "no-cache" {
		t.Fatalf("ETag %q, Cache-Control %q", etag, w.Header().Get("Cache-Control"))
	}
	if w := get(t, h, "GET", "/ui/app.css", map[string]string{"If-None-Match": etag}); w.Code != http.StatusNotModified {
		t.Errorf("If-None-Match: %d, want 304", w.Code)
	}
	if w := get(t, h, "POST", "/ui/", nil); w.Header().Get("Allow") != "GET, HEAD" {
		t.Errorf("405 without Allow")
	}
}

var (
	inlineScript = regexp.MustCompile(`(?is)<script\b[^>]*>\s*[^<\s]`)
	styleTag     = regexp.MustCompile(`(?i)<style\b`)
	styleAttr    = regexp.MustCompile(`(?i)\sstyle\s*=`)
	handlerAttr  = regexp.MustCompile(`(?i)\son[a-z]+\s*=`)
	jsURL        = regexp.MustCompile(`(?i)javascript:`)
	// Things in our JavaScript that a strict CSP forbids or that would turn API data
	// into markup.
	jsForbidden = regexp.MustCompile(`\beval\(|new Function\(|innerHTML|outerHTML|insertAdjacentHTML|document\.write|setAttribute\('style'|\.cssText|createElement\('style'\)`)
)

// TestNoInlineCode checks that the console's own files need nothing the CSP forbids:
// no inline scripts, styles, event-handler attributes or javascript: URLs in HTML; no
// eval, no markup built from strings, no style elements or attributes in JavaScript.
func TestNoInlineCode(t *testing.T) {
	n := 0
	err := fs.WalkDir(static, "static", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || strings.HasPrefix(p, "static/vendor/") {
			return err
		}
		b, err := fs.ReadFile(static, p)
		if err != nil {
			return err
		}
		s := string(b)
		switch {
		case strings.HasSuffix(p, ".html"):
			n++
			for name, re := range map[string]*regexp.Regexp{"inline script": inlineScript, "style element": styleTag,
				"style attribute": styleAttr, "event-handler attribute": handlerAttr, "javascript: URL": jsURL} {
				if loc := re.FindStringIndex(s); loc != nil {
					t.Errorf("%s: %s at byte %d: %q", p, name, loc[0], s[loc[0]:min(len(s), loc[1]+20)])
				}
			}
		case strings.HasSuffix(p, ".js"):
			n++
			for i, line := range strings.Split(s, "\n") {
				if strings.HasPrefix(strings.TrimSpace(line), "//") {
					continue
				}
				if m := jsForbidden.FindString(line); m != "" {
					t.Errorf("%s:%d: %q", p, i+1, m)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 5 {
		t.Fatalf("checked only %d files", n)
	}
}

// TestVendorManifest checks the vendored npm files against vendor/MANIFEST.json
// (written by scripts/build-console.sh) and the versions pinned in
// web/package-lock.json, so that a hand-edited or stale vendor file fails here;
// `scripts/build-console.sh --check` compares with a fresh npm ci.
func TestVendorManifest(t *testing.T) {
	var man struct {
		Files []struct {
			Package, Version, File, SHA256 string
		} `json:"files"`
	}
	b, err := fs.ReadFile(static, "static/vendor/MANIFEST.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &man); err != nil {
		t.Fatal(err)
	}
	lb, err := os.ReadFile("web/package-lock.json")
	if err != nil {
		t.Fatal(err)
	}
	var lock struct {
		Packages map[string]struct {
			Version string `json:"version"`
		} `json:"packages"`
	}
	if err := json.Unmarshal(lb, &lock); err != nil {
		t.Fatal(err)
	}
	if len(man.Files) == 0 {
		t.Fatal("the manifest lists no files")
	}
	listed := map[string]bool{"MANIFEST.json": true, "xterm-LICENSE.txt": true}
	for _, f := range man.Files {
		listed[f.File] = true
		if v := lock.Packages["node_modules/"+f.Package].Version; v != f.Version {
			t.Errorf("%s: manifest has %s@%s, the lockfile pins %q: run scripts/build-console.sh", f.File, f.Package, f.Version, v)
		}
		data, err := fs.ReadFile(static, "static/vendor/"+f.File)
		if err != nil {
			t.Errorf("%s: %v", f.File, err)
			continue
		}
		sum := sha256.Sum256(data)
		if got := hex.EncodeToString(sum[:]); got != f.SHA256 {
			t.Errorf("%s: sha256 %s, manifest says %s: run scripts/build-console.sh", f.File, got, f.SHA256)
		}
	}
	entries, err := fs.ReadDir(static, "static/vendor")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !listed[e.Name()] {
			t.Errorf("vendor/%s is not in the manifest", e.Name())
		}
	}
}

func TestOrigin(t *testing.T) {
	for in, want := range map[string]string{
		"http://a:1/x":       "http://a:1",
		"https://b.example/": "https://b.example",
		"ftp://c":            "",
		"http://u:p@d/":      "",
		"":                   "",
		"http://e f/":        "",
	} {
		if got := Origin(in); got != want {
			t.Errorf("Origin(%q) = %q, want %q", in, got, want)
		}
	}
}
