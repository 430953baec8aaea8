package artifact

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/docker/cli/cli/config"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"golang.org/x/sync/singleflight"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
)

// Defaults of Config.
const (
	DefaultChunkSize int64 = 32 << 20
	DefaultJobs            = 4
)

// maxChunkSize bounds Config.ChunkSize and what a pull accepts as one chunk's
// uncompressed size: a chunk is held in memory while it is compressed or verified.
const maxChunkSize int64 = 1 << 30

// Config says which registry to use and how.
type Config struct {
	// Registry is where artifacts live: host[:port]/prefix, e.g.
	// "registry.example.com/space" or "127.0.0.1:5000/space". Releases go to the
	// repository <prefix>/releases, snapshots to <prefix>/snapshots. A scheme may lead:
	// "https://" (the default) or "http://" (plain HTTP, see Insecure).
	Registry string
	// Username and Password authenticate with HTTP basic credentials (also used to
	// obtain bearer tokens from the registry's token service).
	Username, Password string
	// DockerConfig is the path of a Docker config.json to take credentials from (its
	// auths entry for the registry host, or its credential helper). At most one of
	// DockerConfig and Username may be set; with neither, access is anonymous.
	DockerConfig string
	// Insecure allows plain HTTP to a registry that is not on a loopback address. Without
	// it plain HTTP is used only with loopback registries; every other registry must
	// speak HTTPS with a certificate the host trusts.
	Insecure bool
	// ChunkSize is how many bytes of a stream go into one blob (default
	// DefaultChunkSize): the unit of resumption, deduplication and verification.
	ChunkSize int64
	// Jobs is how many blobs are transferred at once (default DefaultJobs). Each holds
	// up to ChunkSize bytes of memory, twice while it is compressed.
	Jobs int
	// Transport is the HTTP transport below authentication and retries (default: a
	// copy of remote.DefaultTransport).
	Transport http.RoundTripper
	// Logger receives progress at info level (default: discarded).
	Logger *slog.Logger
}

// Client pushes and pulls the artifacts of one store to and from one registry. Its
// methods are safe for concurrent use; concurrent pulls of the same artifact in one
// process share one download (run under the first caller's context: if that caller
// gives up, the others get its error and may try again).
type Client struct {
	st        *storage.Store
	log       *slog.Logger
	registry  string // as configured, for messages
	host      string
	releases  name.Repository
	snapshots name.Repository
	auth      authn.Authenticator
	base      http.RoundTripper
	allowHTTP bool // plain HTTP to any host (Insecure)
	chunk     int64
	jobs      int

	flight singleflight.Group
	// bases caches the blob descriptors of base streams already pushed, by identity.
	basesMu sync.Mutex
	bases   map[string]streamRecord
	// agents caches the agent binaries already pushed (their blobs and sha256), by
	// file (path, size, modification time): a binary is compressed once per process.
	agents map[agentFileKey]agentPushed
	// baseMake serializes choosing and making disk bases.
	baseMake sync.Mutex

	stats stats
}

// New checks cfg and returns a client for the store st. It does not contact the
// registry. st may be nil for a client that only lists, deletes and checks (the
// controller's garbage collection): such a client must not push or pull.
func New(cfg Config, st *storage.Store) (*Client, error) {
	reg := strings.TrimSpace(cfg.Registry)
	if reg == "" {
		return nil, fault.New(fault.Invalid, "artifact: no registry given (host[:port]/prefix)")
	}
	plain := false
	switch {
	case strings.HasPrefix(reg, "http://"):
		plain = true
		reg = strings.TrimPrefix(reg, "http://")
	case strings.HasPrefix(reg, "https://"):
		reg = strings.TrimPrefix(reg, "https://")
	case strings.Contains(reg, "://"):
		return nil, fault.New(fault.Invalid, "artifact: registry %q: only http:// and https:// are supported", cfg.Registry)
	}
	reg = strings.TrimSuffix(reg, "/")
	host, prefix, _ := strings.Cut(reg, "/")
	if host == "" {
		return nil, fault.New(fault.Invalid, "artifact: registry %q has no host", cfg.Registry)
	}
	if plain && !cfg.Insecure && !isLoopback(host) {
		return nil, fault.New(fault.Invalid, "artifact: registry %q: plain HTTP is only allowed to a loopback address unless insecure is set", cfg.Registry)
	}
	var opts []name.Option
	if plain {
		opts = append(opts, name.Insecure)
	}
	repo := func(leaf string) (name.Repository, error) {
		path := leaf
		if prefix != "" {
			path = prefix + "/" + leaf
		}
		r, err := name.NewRepository(host+"/"+path, append(opts, name.StrictValidation)...)
		if err != nil {
			return name.Repository{}, fault.New(fault.Invalid, "artifact: registry %q: %v", cfg.Registry, err)
		}
		return r, nil
	}
	releases, err := repo("releases")
	if err != nil {
		return nil, err
	}
	snapshots, err := repo("snapshots")
	if err != nil {
		return nil, err
	}
	auth, err := credentials(cfg, releases.Registry)
	if err != nil {
		return nil, err
	}
	chunk := cfg.ChunkSize
	if chunk == 0 {
		chunk = DefaultChunkSize
	}
	if chunk < 4096 || chunk > maxChunkSize {
		return nil, fault.New(fault.Invalid, "artifact: chunk size %d is not between 4 KiB and 1 GiB", chunk)
	}
	jobs := cfg.Jobs
	if jobs == 0 {
		jobs = DefaultJobs
	}
	if jobs < 1 || jobs > 64 {
		return nil, fault.New(fault.Invalid, "artifact: jobs %d is not between 1 and 64", jobs)
	}
	base := cfg.Transport
	if base == nil {
		base = remote.DefaultTransport.(*http.Transport).Clone()
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Client{
		st: st, log: log, registry: strings.TrimSpace(cfg.Registry), host: host,
		releases: releases, snapshots: snapshots, auth: auth, base: base,
		allowHTTP: cfg.Insecure, chunk: chunk, jobs: jobs,
		bases: map[string]streamRecord{}, agents: map[agentFileKey]agentPushed{},
	}, nil
}

// Registry returns the registry as configured.
func (c *Client) Registry() string { return c.registry }

// Check asks the registry for a tag that does not exist: it succeeds if the registry is
// reachable and accepts the credentials for reading, and otherwise fails as a push or
// pull would (fault.Unavailable, fault.Unauthorized…). For start-up and health checks.
func (c *Client) Check(ctx context.Context) error {
	o := c.newOp(ctx)
	p, err := o.puller()
	if err != nil {
		return err
	}
	ref := c.releases.Tag("space-check")
	if _, err := p.Head(ctx, ref); err != nil {
		if err := c.fail(ctx, "check", err); !fault.Is(err, fault.NotFound) {
			return err
		}
	}
	return nil
}

// credentials returns the authenticator cfg asks for.
func credentials(cfg Config, reg name.Registry) (authn.Authenticator, error) {
	switch {
	case cfg.DockerConfig != "" && (cfg.Username != "" || cfg.Password != ""):
		return nil, fault.New(fault.Invalid, "artifact: give either a username and password or a Docker config file, not both")
	case cfg.Password != "" && cfg.Username == "":
		return nil, fault.New(fault.Invalid, "artifact: a password without a username")
	case cfg.Username != "":
		return authn.FromConfig(authn.AuthConfig{Username: cfg.Username, Password: cfg.Password}), nil
	case cfg.DockerConfig != "":
		f, err := os.Open(cfg.DockerConfig)
		if err != nil {
			return nil, fault.New(fault.Invalid, "artifact: Docker config: %v", err)
		}
		defer f.Close()
		cf, err := config.LoadFromReader(f)
		if err != nil {
			return nil, fault.New(fault.Invalid, "artifact: Docker config %s: %v", cfg.DockerConfig, err)
		}
		ac, err := cf.GetAuthConfig(reg.RegistryStr())
		if err != nil {
			return nil, fault.New(fault.Invalid, "artifact: Docker config %s: %v", cfg.DockerConfig, err)
		}
		if ac.Username == "" && ac.Password == "" && ac.Auth == "" && ac.IdentityToken == "" && ac.RegistryToken == "" {
			return nil, fault.New(fault.Invalid, "artifact: Docker config %s has no credentials for %s", cfg.DockerConfig, reg.RegistryStr())
		}
		return authn.FromConfig(authn.AuthConfig{
			Username: ac.Username, Password: ac.Password, Auth: ac.Auth,
			IdentityToken: ac.IdentityToken, RegistryToken: ac.RegistryToken,
		}), nil
	}
	return authn.Anonymous, nil
}

// isLoopback reports whether host (with an optional port) is a loopback address or
// "localhost".
func isLoopback(host string) bool {
	h := host
	if hh, _, err := net.SplitHostPort(host); err == nil {
		h = hh
	}
	h = strings.Trim(h, "[]")
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// op is one push or pull: its own transport (counting what it uploads) and remote
// options. Pushers and pullers are made per operation: a long-lived go-containerregistry
// pusher remembers blobs as uploaded, which a registry's garbage collection may since
// have removed.
type op struct {
	c          *Client
	uploaded   atomic.Int64
	downloaded atomic.Int64 // blob bytes, including what nested pulls (a snapshot's release) fetched
	opts       []remote.Option
}

func (c *Client) newOp(ctx context.Context) *op {
	o := &op{c: c}
	t := &guardTransport{c: c, next: c.base, uploaded: &o.uploaded}
	o.opts = []remote.Option{
		remote.WithContext(ctx),
		remote.WithTransport(t),
		remote.WithAuth(c.auth),
		remote.WithUserAgent("space"),
		remote.WithJobs(c.jobs),
		remote.WithRetryBackoff(remote.Backoff{Duration: 500 * time.Millisecond, Factor: 2, Jitter: 0.1, Steps: 3}),
	}
	return o
}

func (o *op) pusher() (*remote.Pusher, error) { return remote.NewPusher(o.opts...) }
func (o *op) puller() (*remote.Puller, error) { return remote.NewPuller(o.opts...) }

// guardTransport refuses plain HTTP to hosts other than loopback ones (unless Insecure)
// — go-containerregistry itself falls back to HTTP for private addresses — and counts
// the blob bytes uploaded through it.
type guardTransport struct {
	c        *Client
	next     http.RoundTripper
	uploaded *atomic.Int64
}

func (t *guardTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme == "http" && !t.c.allowHTTP && !isLoopback(req.URL.Host) {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, fmt.Errorf("%w: plain HTTP to %s refused (use HTTPS, or set insecure for this registry)", errPlainHTTP, req.URL.Host)
	}
	if req.Body != nil && (req.Method == http.MethodPatch || req.Method == http.MethodPut) && strings.Contains(req.URL.Path, "/blobs/uploads/") {
		req.Body = &countingBody{ReadCloser: req.Body, n: t.uploaded, total: &t.c.stats.bytesUp}
	}
	return t.next.RoundTrip(req)
}

var errPlainHTTP = errors.New("insecure transport")

type countingBody struct {
	io.ReadCloser
	n, total *atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	b.total.Add(int64(n))
	return n, err
}

// Stats are a client's cumulative transfer counters.
type Stats struct {
	BytesUploaded, BytesDownloaded int64
	BlobsDownloaded                int64
	Pushes, Pulls                  int64 // artifacts pushed and pulled (not found in the store)
}

type stats struct {
	bytesUp, bytesDown, blobsDown, pushes, pulls atomic.Int64
}

// Stats returns the client's counters since New.
func (c *Client) Stats() Stats {
	return Stats{
		BytesUploaded: c.stats.bytesUp.Load(), BytesDownloaded: c.stats.bytesDown.Load(),
		BlobsDownloaded: c.stats.blobsDown.Load(), Pushes: c.stats.pushes.Load(), Pulls: c.stats.pulls.Load(),
	}
}

// fail gives a registry error its fault kind and names the registry.
func (c *Client) fail(ctx context.Context, what string, err error) error {
	if err == nil {
		return nil
	}
	if ctxErr := ctx.Err(); ctxErr != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return fmt.Errorf("%s: %w", what, ctxErr)
	}
	var fe *fault.Error
	if errors.As(err, &fe) {
		return fmt.Errorf("%s: %w", what, err)
	}
	var terr *transport.Error
	if errors.As(err, &terr) {
		switch {
		case terr.StatusCode == http.StatusUnauthorized:
			return fault.New(fault.Unauthorized, "%s: registry %s refused the credentials: %v", what, c.registry, terr)
		case terr.StatusCode == http.StatusForbidden:
			return fault.New(fault.Forbidden, "%s: registry %s forbids it: %v", what, c.registry, terr)
		case terr.StatusCode == http.StatusNotFound || hasCode(terr, transport.ManifestUnknownErrorCode, transport.BlobUnknownErrorCode, transport.NameUnknownErrorCode):
			return fault.New(fault.NotFound, "%s: not in registry %s: %v", what, c.registry, terr)
		case terr.StatusCode == http.StatusMethodNotAllowed || hasCode(terr, transport.UnsupportedErrorCode):
			return fault.New(fault.Unavailable, "%s: registry %s does not support it (for deletes, enable them in the registry's configuration): %v", what, c.registry, terr)
		case terr.StatusCode == http.StatusTooManyRequests:
			return fault.New(fault.TooManyRequests, "%s: registry %s: %v", what, c.registry, terr)
		case terr.StatusCode >= 500:
			return fault.New(fault.Unavailable, "%s: registry %s is unavailable: %v", what, c.registry, terr)
		}
		return fault.New(fault.BadGateway, "%s: registry %s: %v", what, c.registry, terr)
	}
	if errors.Is(err, errPlainHTTP) {
		return fault.New(fault.Forbidden, "%s: registry %s: %v", what, c.registry, err)
	}
	if unreachable(err) {
		return fault.New(fault.Unavailable, "%s: registry %s is unreachable: %v", what, c.registry, err)
	}
	return fmt.Errorf("%s: registry %s: %w", what, c.registry, err)
}

func hasCode(terr *transport.Error, codes ...transport.ErrorCode) bool {
	for _, d := range terr.Errors {
		for _, c := range codes {
			if d.Code == c {
				return true
			}
		}
	}
	return false
}

// unreachable reports whether err is a failure to reach or keep talking to a server.
func unreachable(err error) bool {
	var netErr net.Error
	var opErr *net.OpError
	var dnsErr *net.DNSError
	var urlErr *url.Error
	return errors.As(err, &opErr) || errors.As(err, &dnsErr) || errors.As(err, &netErr) ||
		errors.As(err, &urlErr) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.EPIPE)
}
