package artifact_test

import (
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/spacedev/space/internal/testenv"
)

// registry is a CNCF distribution registry (Debian's docker-registry) that a test
// started on 127.0.0.1, with its storage in a temporary directory.
type registry struct {
	addr    string // host:port
	storage string // its filesystem storage root
}

// startRegistry runs Debian's docker-registry for the test (testenv.StartRegistry).
func startRegistry(t *testing.T) *registry {
	t.Helper()
	r := testenv.StartRegistry(t)
	return &registry{addr: r.Addr, storage: r.Storage}
}

func freeAddr(t *testing.T) string { return testenv.FreeAddr(t) }

// blobPath returns the file in the registry's storage that holds a blob.
func (r *registry) blobPath(digest string) string {
	hex := strings.TrimPrefix(digest, "sha256:")
	return filepath.Join(r.storage, "docker/registry/v2/blobs/sha256", hex[:2], hex, "data")
}

// proxy is a reverse proxy in front of a registry that counts requests and can act on
// them: the tests' window on what the client asks of the registry.
type proxy struct {
	srv *httptest.Server
	mu  sync.Mutex
	// counts by "METHOD kind", kind one of manifest, blob, upload, other.
	counts map[string]int
	// onDone, if set, is called after each response is sent.
	onDone func(method, kind string, status int)
	// auth, if set, is required as the basic credentials "user:password".
	auth string

	blobUploads atomic.Int64 // completed blob uploads (PUT .../blobs/uploads/...)
	inflight    atomic.Int64 // requests being served
}

func newProxy(t *testing.T, target string) *proxy {
	t.Helper()
	u, _ := url.Parse("http://" + target)
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ErrorLog = log.New(io.Discard, "", 0) // interrupted requests are what some tests do
	p := &proxy{counts: map[string]int{}}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		p.inflight.Add(1)
		defer p.inflight.Add(-1)
		kind := requestKind(req.URL.Path)
		if p.auth != "" {
			user, pass, ok := req.BasicAuth()
			if !ok || user+":"+pass != p.auth {
				w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
				w.WriteHeader(http.StatusUnauthorized)
				return
			}
		}
		p.mu.Lock()
		p.counts[req.Method+" "+kind]++
		p.mu.Unlock()
		rec := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		rp.ServeHTTP(rec, req)
		if req.Method == http.MethodPut && kind == "upload" && rec.status == http.StatusCreated {
			p.blobUploads.Add(1)
		}
		p.mu.Lock()
		f := p.onDone
		p.mu.Unlock()
		if f != nil {
			f(req.Method, kind, rec.status)
		}
	}))
	t.Cleanup(p.srv.Close)
	return p
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (s *statusWriter) WriteHeader(code int) {
	s.status = code
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func requestKind(path string) string {
	switch {
	case strings.Contains(path, "/blobs/uploads"):
		return "upload"
	case strings.Contains(path, "/blobs/"):
		return "blob"
	case strings.Contains(path, "/manifests/"):
		return "manifest"
	}
	return "other"
}

// addr returns the proxy's host:port.
func (p *proxy) addr() string { return strings.TrimPrefix(p.srv.URL, "http://") }

// count returns how many requests of method and kind it saw.
func (p *proxy) count(method, kind string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.counts[method+" "+kind]
}

// total returns how many requests it saw.
func (p *proxy) total() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.counts {
		n += c
	}
	return n
}

// quiesce waits until no request is being served: after a client gives up, requests
// it had in flight may still complete at the registry, and count.
func (p *proxy) quiesce(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for p.inflight.Load() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests still in flight after 30 s", p.inflight.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (p *proxy) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.counts = map[string]int{}
	p.blobUploads.Store(0)
}

func (p *proxy) setOnDone(f func(method, kind string, status int)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.onDone = f
}

var _ = context.Background

func statBlocks(fi os.FileInfo) int64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Blocks
	}
	return 0
}
