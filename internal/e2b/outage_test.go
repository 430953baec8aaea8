package e2b_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/e2b"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
)

// errAway is the store's error for a database that stays away longer than its wait
// (store.dbUnavailable): the driver's words, which name the socket path, are private.
var errAway = fault.Later(fault.Redacted(fault.Unavailable, "database unavailable, retry shortly",
	errors.New("failed to connect to `user=space database=space`: dial unix /srv/secret/.s.PGSQL.5432: connect: no such file or directory")), time.Second)

// awayPlatform is a space whose relays meet the database away while reach is set.
type awayPlatform struct {
	e2b.Platform
	reach *atomic.Bool
}

func (a awayPlatform) Reach(ctx context.Context, p *service.Principal, id string, noWake bool) (*agentclient.Client, error) {
	if a.reach.Load() {
		return nil, errAway
	}
	return a.Platform.Reach(ctx, p, id, noWake)
}

// awayStore is a store whose sandbox reads meet the database away while get is set.
type awayStore struct {
	e2b.Store
	get *atomic.Bool
}

func (a awayStore) GetSandbox(ctx context.Context, id string) (*store.Sandbox, error) {
	if a.get.Load() {
		return nil, errAway
	}
	return a.Store.GetSandbox(ctx, id)
}

// TestRelaysAnswer503WhileTheDatabaseIsAway: an envd request whose relay cannot find
// the sandbox's agent because the database is away, and a request for a sandbox's port
// that cannot read the sandbox, are answered 503 with Retry-After: 1 (clients retry),
// in the gateway's words. Until 2026-12-07 the envd request got a 502 "The sandbox is
// not reachable: " followed by the driver's message (the database's socket path), and
// the port request a 502 "The sandbox was not found", which tells a client the
// sandbox is gone.
func TestRelaysAnswer503WhileTheDatabaseIsAway(t *testing.T) {
	var reach, get atomic.Bool
	g := startGatewayOver(t, spacetest.Options{}, func(c *e2b.Config) {
		c.API = awayPlatform{c.API, &reach}
		c.Store = awayStore{c.Store, &get}
	})
	a := g.create("/v2/sandboxes", map[string]any{"templateID": "base"})
	check := func(what string, r reply) {
		t.Helper()
		if r.code != http.StatusServiceUnavailable || r.hdr.Get("Retry-After") != "1" || !strings.Contains(string(r.body), "database unavailable") {
			t.Errorf("%s while the database is away: %s (Retry-After %q), want 503 with Retry-After: 1", what, r, r.hdr.Get("Retry-After"))
		}
		if strings.Contains(string(r.body), "/srv/secret") {
			t.Errorf("%s while the database is away names the socket path: %s", what, r)
		}
	}
	reach.Store(true)
	check("envd file read", g.envd("GET", a.SandboxID, "/files?path=/etc/hostname", nil, "X-Access-Token", a.EnvdAccessToken))
	reach.Store(false)
	get.Store(true)
	check("port request", g.do("GET", "/", nil, "Host", fmt.Sprintf("8080-%s.sandboxes.example", a.SandboxID)))
	get.Store(false)
	want(t, "envd file read once the database is back", g.envd("GET", a.SandboxID, "/files?path=/etc/hostname", nil, "X-Access-Token", a.EnvdAccessToken), http.StatusOK)
}

// heldPlatform is a space whose creates and relays wait, while hold is set, until their
// request ends (as a create waits for its sandbox to run) and tell when they wait.
type heldPlatform struct {
	e2b.Platform
	hold    *atomic.Bool
	waiting chan string
}

func (h heldPlatform) Create(ctx context.Context, p *service.Principal, req api.CreateSandboxRequest, idem *service.Idempotency) (*service.Created, error) {
	if h.hold.Load() {
		h.waiting <- "create"
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return h.Platform.Create(ctx, p, req, idem)
}

func (h heldPlatform) Sandbox(ctx context.Context, p *service.Principal, id string) (*store.Sandbox, error) {
	if h.hold.Load() {
		h.waiting <- "sandbox"
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return h.Platform.Sandbox(ctx, p, id)
}

func (h heldPlatform) Reach(ctx context.Context, p *service.Principal, id string, noWake bool) (*agentclient.Client, error) {
	if h.hold.Load() {
		h.waiting <- "envd"
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return h.Platform.Reach(ctx, p, id, noWake)
}

// TestRequestsInFlightAtShutdownAnswer503: requests that wait when the gateway stops
// (a restart of space serve) are answered 503 with Retry-After: 1: an E2B create, an
// envd request to a running sandbox and one to a paused sandbox. Until 2026-12-07
// their context's end was taken for their client's going away and nothing was written:
// an empty 200, which the E2B SDK took for a created sandbox without an id ("Cannot
// read properties of undefined (reading 'envdVersion')"), an empty file, or a Connect
// answer without a content type; the paused sandbox's was a 502 "The sandbox was not
// found".
func TestRequestsInFlightAtShutdownAnswer503(t *testing.T) {
	var hold atomic.Bool
	waiting := make(chan string, 3)
	var gw *e2b.Gateway
	g := startGatewayOver(t, spacetest.Options{}, func(c *e2b.Config) {
		c.API = heldPlatform{c.API, &hold, waiting}
		var err error
		if gw, err = e2b.New(context.Background(), *c); err != nil {
			t.Fatal(err)
		}
	})
	a := g.create("/v2/sandboxes", map[string]any{"templateID": "base"})
	b := g.create("/v2/sandboxes", map[string]any{"templateID": "base"})
	want(t, "pause", g.do("POST", "/sandboxes/"+b.SandboxID+"/pause", nil), http.StatusNoContent)
	bToken := g.get(b.SandboxID).EnvdAccessToken // a pause rotates it
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- gw.Serve(ctx, ln, rest.Drain{}) }()
	base := "http://" + ln.Addr().String()
	hold.Store(true)
	type answer struct {
		what string
		r    reply
	}
	const sent = 3
	answers := make(chan answer, sent)
	send := func(what, method, path string, body string, hdr ...string) {
		req, _ := http.NewRequest(method, base+path, strings.NewReader(body))
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			answers <- answer{what, reply{code: -1, body: []byte(err.Error())}}
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		answers <- answer{what, reply{code: resp.StatusCode, hdr: resp.Header, body: b}}
	}
	go send("E2B create", "POST", "/sandboxes", `{"templateID":"base"}`, "X-API-KEY", g.key, "Content-Type", "application/json")
	go send("envd file read", "GET", "/files?path=/etc/hostname", "", "E2b-Sandbox-Id", a.SandboxID,
		"E2b-Sandbox-Port", fmt.Sprint(envdpb.Port), "X-Access-Token", a.EnvdAccessToken)
	go send("envd file read (paused)", "GET", "/files?path=/etc/hostname", "", "E2b-Sandbox-Id", b.SandboxID,
		"E2b-Sandbox-Port", fmt.Sprint(envdpb.Port), "X-Access-Token", bToken)
	var held []string
	for range sent {
		select {
		case w := <-waiting:
			held = append(held, w)
		case got := <-answers:
			t.Fatalf("%s answered before the shutdown: %s (held: %v)", got.what, got.r, held)
		case <-time.After(10 * time.Second):
			t.Fatalf("held %v; want %d requests held", held, sent)
		}
	}
	stop()
	for range sent {
		got := <-answers
		if got.r.code != http.StatusServiceUnavailable || got.r.hdr.Get("Retry-After") != "1" || !strings.Contains(string(got.r.body), "restarting") {
			t.Errorf("%s in flight at shutdown: %s, want 503 with Retry-After: 1", got.what, got.r)
		}
	}
	if err := <-served; err != nil {
		t.Fatal(err)
	}
}
