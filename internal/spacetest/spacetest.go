// Package spacetest runs a whole space — store, service, control-plane API, data plane,
// controller and one node — inside a test process, on a real PostgreSQL (from
// internal/testenv) and the fake runtime and directory store (internal/runtime/fake).
// It needs no root: control-plane tests of every package use it. Packages that use it
// call testenv.Main from their TestMain.
package spacetest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/controller"
	"github.com/spacedev/space/internal/dataplane"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/runtime/fake"
	"github.com/spacedev/space/internal/server"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
	"github.com/spacedev/space/internal/token"
)

// Options configure a Space.
type Options struct {
	// NoNode runs no node (sandboxes stay pending).
	NoNode bool
	// NoController runs no controller (nothing is scheduled).
	NoController bool
	// BeforeCheckpoint is called as the fake runtime's Checkpoint starts.
	BeforeCheckpoint func(id string)
	// FailCreate makes the fake runtime fail Create for matching ids (fake.Config).
	FailCreate func(id string) error
	// DieAfterRestore makes the fake runtime kill a restored instance's agent for
	// matching ids.
	DieAfterRestore func(id string) bool
	// Service adjusts the service's config.
	Service func(*service.Config)
	// Controller adjusts the controller's config.
	Controller func(*controller.Config)
	// Node adjusts the node's config (e.g. a Builder, base snapshots).
	Node func(*node.Config)
	// NoBase starts without the base release (a Builder makes it on first use).
	NoBase bool
	// ParkRunning makes the fake runtime park warm-pool members running
	// (runtime.Caps.ParkRunning), as gVisor does.
	ParkRunning bool
	// HostCPU makes the fake runtime read instances' CPU time (runtime.CPUTimer), as
	// gVisor does from the sandbox's cgroup.
	HostCPU bool
	// MemoryOverheadMB is what the fake runtime's instances may hold beyond their
	// memory size (runtime.MemoryBounder, as gVisor's).
	MemoryOverheadMB int
	// ServiceDBConns runs the service (the API's requests) on a connection pool of its
	// own with this many connections (0: the store the other roles use).
	ServiceDBConns int32
}

// Space is a running in-process space.
type Space struct {
	T       testing.TB
	Store   *store.Store
	Service *service.Service
	Signer  *token.Signer
	Runtime *fake.Runtime
	Disk    *fake.Disk
	Node    *node.Node
	NodeID  string
	URL     string
	// AdminKey is an operator API key (home tenant "default"); C is a client using it.
	AdminKey string
	C        *client.Client
	// Base is the digest of the "base" release every Space has.
	Base    string
	DataDir string
	Log     *slog.Logger

	opts         Options
	serviceStore *store.Store // Options.ServiceDBConns
	agentPath    string
	ctx          context.Context
	cancel       context.CancelFunc
	wg           sync.WaitGroup
	nodeStop     context.CancelFunc
	nodeWG       sync.WaitGroup
	mux          *http.ServeMux
	dp           atomic.Pointer[http.ServeMux]
	srv          *httptest.Server
}

// BaseConfig is the config of the base release.
var BaseConfig = json.RawMessage(`{"user":"user","workdir":"/home/user","env":{"FROM_TEMPLATE":"yes"}}`)

// Start runs a space for the test and stops it when the test ends.
func Start(t testing.TB, opts Options) *Space {
	t.Helper()
	dbURL := testenv.Postgres(t)
	_, agentPath := testenv.Binaries(t)
	log := slog.New(slog.DiscardHandler)
	if os.Getenv("SPACE_TEST_VERBOSE") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Space{T: t, opts: opts, ctx: ctx, cancel: cancel, Log: log, DataDir: t.TempDir(), agentPath: agentPath}
	t.Cleanup(s.stop)
	st, err := store.Open(ctx, store.Config{URL: dbURL, Logger: log})
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	s.Store = st
	key, err := st.SigningKey(ctx, "attach-v1")
	if err != nil {
		t.Fatal(err)
	}
	if s.Signer, err = token.NewSigner(key); err != nil {
		t.Fatal(err)
	}
	if s.Runtime, err = fake.New(fake.Config{Dir: s.DataDir + "/fake", AgentPath: agentPath, FailCreate: opts.FailCreate, DieAfterRestore: opts.DieAfterRestore, BeforeCheckpoint: opts.BeforeCheckpoint, ParkRunning: opts.ParkRunning, CPUTime: opts.HostCPU, MemoryOverheadMB: opts.MemoryOverheadMB}); err != nil {
		t.Fatal(err)
	}
	if s.Disk, err = fake.NewDisk(s.DataDir + "/store"); err != nil {
		t.Fatal(err)
	}
	s.AdminKey = s.NewKey("default", true, service.KeySpace)
	cfg := service.Config{Store: st, Signer: s.Signer, Logger: log, NodeClient: &http.Client{}}
	if opts.ServiceDBConns > 0 {
		own, err := store.Open(ctx, store.Config{URL: dbURL, Logger: log, MaxConns: opts.ServiceDBConns})
		if err != nil {
			t.Fatalf("open the service's store: %v", err)
		}
		s.serviceStore, cfg.Store = own, own
	}
	if opts.Service != nil {
		opts.Service(&cfg)
	}
	s.Service = service.New(cfg)
	s.go_(s.Service.Run)
	s.mux = http.NewServeMux()
	a := server.NewAPI(server.Config{Service: s.Service, Logger: log, Registry: prometheus.NewRegistry()})
	s.mux.Handle("/", a.Handler())
	s.mux.Handle("/v1/dp/", http.HandlerFunc(s.routeNode))
	s.mux.Handle("/internal/", http.HandlerFunc(s.routeNode))
	s.srv = httptest.NewServer(s.mux)
	s.URL = s.srv.URL
	s.C = client.New(s.URL, s.AdminKey)
	if !opts.NoController {
		ccfg := controller.Config{Store: st, Logger: log, Resync: time.Second}
		if opts.Controller != nil {
			opts.Controller(&ccfg)
		}
		ctl := controller.New(ccfg)
		s.go_(ctl.Run)
	}
	s.NodeID = ids.Node()
	if opts.NoBase {
		if err := st.RegisterNode(ctx, &store.Node{ID: s.NodeID, Name: "node-" + s.NodeID[:6], Runtime: "fake", DataPlaneURL: s.URL}); err != nil {
			t.Fatal(err)
		}
	} else {
		s.Base = s.AddRelease("base", "latest", BaseConfig, map[string]string{"etc/os-release": "ID=fake\n"})
	}
	if opts.NoNode {
		// The node row AddRelease registered is no node anybody runs.
		if _, err := st.MarkDeadNodes(ctx, time.Now().Add(time.Hour)); err != nil {
			t.Fatal(err)
		}
	} else {
		s.StartNode()
	}
	return s
}

// go_ runs fn until the space stops.
func (s *Space) go_(fn func(context.Context) error) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := fn(s.ctx); err != nil && s.ctx.Err() == nil {
			s.T.Errorf("spacetest: %v", err)
		}
	}()
}

// AddRelease puts a release with files on the node's disk and in the database, tagged
// name:tag, and returns its digest.
func (s *Space) AddRelease(name, tag string, config json.RawMessage, files map[string]string) string {
	s.T.Helper()
	h := sha256.New()
	h.Write([]byte(name + tag + string(config)))
	for k, v := range files {
		h.Write([]byte(k + "\x00" + v))
	}
	digest := "sha256:" + hex.EncodeToString(h.Sum(nil))
	rel, err := s.Disk.AddRelease(name, digest, config, files)
	if err != nil {
		s.T.Fatal(err)
	}
	// The node's row must exist for node_releases: register it first (not again: that
	// would fence a running node).
	if _, err := s.Store.GetNode(s.ctx, s.NodeID); err != nil {
		if err := s.Store.RegisterNode(s.ctx, &store.Node{ID: s.NodeID, Name: "node-" + s.NodeID[:6], Runtime: "fake", DataPlaneURL: s.URL}); err != nil {
			s.T.Fatal(err)
		}
	}
	if err := s.Store.PutRelease(s.ctx, &store.Release{Digest: rel.Digest, Name: name, Config: config}, tag, s.NodeID); err != nil {
		s.T.Fatal(err)
	}
	return digest
}

// StartNode runs the node (again, after StopNode: as a restart would).
func (s *Space) StartNode() {
	s.T.Helper()
	cfg := node.Config{
		ID: s.NodeID, Name: "node-" + s.NodeID[:6], DataDir: s.DataDir, AdvertiseURL: s.URL,
		Store: s.Store, Runtime: s.Runtime, Storage: s.Disk, AgentPath: s.agentPath, Logger: s.Log,
		Resync: time.Second, Heartbeat: 500 * time.Millisecond, AgentReadyTimeout: 20 * time.Second,
		ShutdownGrace: 5 * time.Second, NoBaseSnapshots: true, DefaultCPU: 1, DefaultMemoryMB: 512,
		Signer: s.Signer,
	}
	if s.opts.Node != nil {
		s.opts.Node(&cfg)
	}
	n, err := node.New(cfg)
	if err != nil {
		s.T.Fatal(err)
	}
	s.Node = n
	dp := dataplane.New(dataplane.Config{Store: s.Store, Signer: s.Signer, Logger: s.Log, Node: n, NodeID: s.NodeID})
	mux := http.NewServeMux()
	dp.Register(mux)
	n.RegisterRoutes(mux)
	s.dp.Store(mux)
	ctx, cancel := context.WithCancel(s.ctx)
	s.nodeStop = cancel
	run := func(fn func(context.Context) error) {
		s.nodeWG.Add(1)
		go func() {
			defer s.nodeWG.Done()
			if err := fn(ctx); err != nil && ctx.Err() == nil {
				s.T.Errorf("spacetest node: %v", err)
			}
		}()
	}
	run(n.Run)
	run(dp.Run)
}

// StopNode stops the node as a SIGTERM of its process would (sandboxes keep running).
func (s *Space) StopNode() {
	if s.nodeStop == nil {
		return
	}
	s.nodeStop()
	s.nodeWG.Wait()
	s.nodeStop = nil
	s.dp.Store(nil)
}

// routeNode serves the data plane of the node running now (503 while none runs).
func (s *Space) routeNode(w http.ResponseWriter, r *http.Request) {
	mux := s.dp.Load()
	if mux == nil {
		http.Error(w, `{"error":{"code":"unavailable","message":"node is down"}}`, http.StatusServiceUnavailable)
		return
	}
	mux.ServeHTTP(w, r)
}

func (s *Space) stop() {
	s.StopNode()
	s.cancel()
	s.wg.Wait()
	if s.srv != nil {
		s.srv.Close()
	}
	// Kill every agent the fake runtime still runs.
	if insts, err := s.Runtime.List(context.Background()); err == nil {
		for _, in := range insts {
			_ = s.Runtime.Destroy(context.Background(), in.ID)
		}
	}
	s.Store.Close()
	if s.serviceStore != nil {
		s.serviceStore.Close()
	}
}

// NewKey creates an API key of kind (service.KeySpace or KeyE2B) in tenant (created
// when missing) and returns its secret: an operator key when operator is true, else a
// member key.
func (s *Space) NewKey(tenant string, operator bool, kind string) string {
	s.T.Helper()
	role := store.RoleMember
	if operator {
		role = store.RoleOperator
	}
	_, secret := s.NewKeyRole(tenant, role, kind)
	return secret
}

// NewKeyRole creates an API key of a role (store.RoleOperator, RoleAdmin, RoleMember)
// and kind in tenant (created when missing) and returns its id and secret.
func (s *Space) NewKeyRole(tenant, role, kind string) (id, secret string) {
	s.T.Helper()
	secret, prefix, err := store.NewKeySecret(kind)
	if err != nil {
		s.T.Fatal(err)
	}
	if err := s.Store.EnsureTenant(s.ctx, tenant); err != nil {
		s.T.Fatal(err)
	}
	k := &store.APIKey{ID: ids.APIKey(), Name: "test", Prefix: prefix, Kind: kind, Tenant: tenant, Role: role}
	if err := s.Store.CreateAPIKey(s.ctx, k, secret); err != nil {
		s.T.Fatal(err)
	}
	return k.ID, secret
}

// Create creates a sandbox (base template unless req names one) and waits until its
// create operation is done; it fails the test unless the sandbox runs.
func (s *Space) Create(req api.CreateSandboxRequest) api.Sandbox {
	s.T.Helper()
	ctx, cancel := context.WithTimeout(s.ctx, time.Minute)
	defer cancel()
	sb, err := s.C.CreateSandbox(ctx, req, "")
	if err != nil {
		s.T.Fatalf("create sandbox: %v", err)
	}
	s.WaitOp(sb.Operation.ID, api.OpSucceeded)
	got, err := s.C.GetSandbox(ctx, sb.ID)
	if err != nil {
		s.T.Fatal(err)
	}
	return *got
}

// WaitOp waits for an operation to end and fails the test unless it ended in state.
func (s *Space) WaitOp(id, state string) *api.Operation {
	s.T.Helper()
	ctx, cancel := context.WithTimeout(s.ctx, time.Minute)
	defer cancel()
	op, err := s.C.WaitOperation(ctx, id)
	if err != nil {
		s.T.Fatalf("wait for operation %s: %v", id, err)
	}
	if op.State != state {
		s.T.Fatalf("operation %s (%s) ended %s (%s: %s), want %s", id, op.Kind, op.State, op.Message, op.Error, state)
	}
	return op
}

// Eventually waits until cond holds (polling), failing the test after timeout.
func (s *Space) Eventually(timeout time.Duration, what string, cond func() bool) {
	s.T.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			s.T.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Request sends an API request with the operator key (a JSON body unless hdr says
// otherwise; hdr is name, value, … and may name another Authorization) and returns the
// status, the body and the response's headers. It fails the test if the request cannot
// be sent.
func (s *Space) Request(method, path, body string, hdr ...string) (int, string, http.Header) {
	s.T.Helper()
	req, err := http.NewRequest(method, s.URL+path, strings.NewReader(body))
	if err != nil {
		s.T.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+s.AdminKey)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.T.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header
}

// Handler is what the space serves at URL (its API and its node's data plane), for
// a test that serves it itself (e.g. through rest.Serve, to stop it).
func (s *Space) Handler() http.Handler { return s.mux }

// AgentPath is the space-agent binary the fake runtime runs.
func (s *Space) AgentPath() string { return s.agentPath }

// Context is the space's context (ends when the test does).
func (s *Space) Context() context.Context { return s.ctx }
