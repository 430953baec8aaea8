package e2b_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacedev/space/internal/e2b"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
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
