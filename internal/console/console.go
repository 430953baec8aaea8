// Package console owns space's web console: the static files of a single-page
// application (plain HTML, CSS and JavaScript modules, plus vendored npm files copied by
// scripts/build-console.sh) embedded in the binary, and the handler that serves them
// under /ui/ with a strict Content-Security-Policy and the usual security headers.
//
// The console holds no state and no credentials on the server: the browser keeps the
// API key in sessionStorage and sends it as a bearer header to the same API every
// other client uses. No cookies are involved, so there is nothing to forge across
// sites (no CSRF), and the handler itself needs no authentication: the files are
// public, the data is not.
package console

import (
	"bytes"
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"io/fs"
	"log/slog"
	"mime"
	"net/http"
	"net/url"
	"path"
	"slices"
	"strings"
	"time"
)

// static holds the console's files: the application (static/*.html, *.css, js/) and the
// vendored npm files (static/vendor/, see scripts/build-console.sh).
//
//go:embed static
var static embed.FS

// Prefix is the URL path the console is served under.
const Prefix = "/ui/"

// Config configures the console handler.
type Config struct {
	Logger *slog.Logger
	// DataPlaneOrigins returns the origins (scheme://host:port) of the nodes' data
	// planes. The browser connects to them for attach streams, stdin and resizes, so
	// the page's connect-src must name them. It is called for HTML documents only.
	DataPlaneOrigins func(ctx context.Context) ([]string, error)
}

// file is one embedded file, ready to serve.
type file struct {
	name  string
	data  []byte
	ctype string
	etag  string
}

// Handler serves the console. Mount it at Prefix ("/ui/"); other paths are 404.
type Handler struct {
	cfg   Config
	log   *slog.Logger
	files map[string]*file // by path below Prefix; "" is index.html
}

// New returns the console handler.
func New(cfg Config) (*Handler, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	h := &Handler{cfg: cfg, log: cfg.Logger, files: map[string]*file{}}
	sub, err := fs.Sub(static, "static")
	if err != nil {
		return nil, err
	}
	err = fs.WalkDir(sub, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := fs.ReadFile(sub, p)
		if err != nil {
			return err
		}
		sum := sha256.Sum256(data)
		h.files[p] = &file{name: p, data: data, ctype: contentType(p), etag: `"` + hex.EncodeToString(sum[:12]) + `"`}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("console: read embedded files: %w", err)
	}
	if h.files["index.html"] == nil {
		return nil, fmt.Errorf("console: index.html is not embedded")
	}
	h.files[""] = h.files["index.html"]
	return h, nil
}

// contentType names the type of a console file. Module scripts must be served with a
// JavaScript type or browsers refuse them, whatever the system's mime tables say.
func contentType(p string) string {
	switch path.Ext(p) {
	case ".html":
		return "text/html; charset=utf-8"
	case ".js", ".mjs":
		return "text/javascript; charset=utf-8"
	case ".css":
		return "text/css; charset=utf-8"
	case ".svg":
		return "image/svg+xml"
	case ".png":
		return "image/png"
	case ".json", ".map":
		return "application/json"
	case ".txt", "":
		return "text/plain; charset=utf-8"
	}
	if t := mime.TypeByExtension(path.Ext(p)); t != "" {
		return t
	}
	return "application/octet-stream"
}

// basePolicy is the Content-Security-Policy of every response: nothing but the
// console's own files may load, no inline script or style (the HTML has none; styles
// set from JavaScript go through the CSSOM, which the policy allows), no eval, no
// plugins, no framing, forms post nowhere. connect-src gains the data-plane origins on
// HTML documents.
const basePolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; font-src 'self'; " +
	"manifest-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'; object-src 'none'"

// setSecurityHeaders sets the headers every console response carries.
func setSecurityHeaders(hd http.Header, csp string) {
	hd.Set("Content-Security-Policy", csp)
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("X-Frame-Options", "DENY")
	hd.Set("Referrer-Policy", "no-referrer")
	hd.Set("Cross-Origin-Opener-Policy", "same-origin")
	hd.Set("Cross-Origin-Resource-Policy", "same-origin")
	hd.Set("Permissions-Policy", "camera=(), microphone=(), geolocation=(), usb=(), payment=()")
}

// policy returns the CSP for a response: HTML documents may connect to the API (same
// origin) and the data planes.
func (h *Handler) policy(ctx context.Context, html bool) string {
	if !html {
		return basePolicy + "; connect-src 'self'"
	}
	src := []string{"'self'"}
	if h.cfg.DataPlaneOrigins != nil {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		origins, err := h.cfg.DataPlaneOrigins(ctx)
		if err != nil {
			// The console still works against a data plane on this origin.
			h.log.Warn("console: list data-plane origins", "err", err)
		}
		for _, o := range origins {
			if o = Origin(o); o != "" && !slices.Contains(src, o) {
				src = append(src, o)
			}
		}
	}
	return basePolicy + "; connect-src " + strings.Join(src, " ")
}

// Origin returns scheme://host[:port] of an http(s) URL, or "" when u is not one (or
// holds characters that could break out of a CSP source expression).
func Origin(u string) string {
	p, err := url.Parse(u)
	if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" || p.User != nil {
		return ""
	}
	if strings.ContainsAny(p.Host, " ;,'\"\t\r\n") {
		return ""
	}
	return p.Scheme + "://" + p.Host
}

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rel, ok := strings.CutPrefix(r.URL.Path, Prefix)
	f := h.files[rel]
	html := f != nil && strings.HasPrefix(f.ctype, "text/html")
	setSecurityHeaders(w.Header(), h.policy(r.Context(), html))
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	if !ok || f == nil {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	hd := w.Header()
	hd.Set("Content-Type", f.ctype)
	hd.Set("ETag", f.etag)
	// Revalidate every time: the files change with the binary, and a 304 is cheap.
	hd.Set("Cache-Control", "no-cache")
	http.ServeContent(w, r, f.name, time.Time{}, bytes.NewReader(f.data))
}

// Files lists the embedded files (paths below Prefix), for tests and tooling.
func (h *Handler) Files() []string {
	var out []string
	for p := range h.files {
		if p != "" {
			out = append(out, p)
		}
	}
	slices.Sort(out)
	return out
}
