package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
	"golang.org/x/term"

	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/bench"
	"github.com/spacedev/space/internal/cli"
	"github.com/spacedev/space/internal/controller"
	"github.com/spacedev/space/internal/dataplane"
	"github.com/spacedev/space/internal/e2b"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/pgmanaged"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/firecracker"
	"github.com/spacedev/space/internal/runtime/gvisor"
	"github.com/spacedev/space/internal/runtime/qemu"
	"github.com/spacedev/space/internal/server"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
	"github.com/spacedev/space/internal/token"
)

// serveConfig is everything space serve reads from flags and the environment.
type serveConfig struct {
	dataDir        string
	databaseURL    string
	listen         string
	roles          []string
	runtime        string
	advertiseURL   string
	nodeName       string
	tokenTTL       time.Duration
	defaultCPU     int
	defaultMemory  int
	maxCPU         int
	maxMemory      int
	defaultDisk    int
	maxDisk        int
	diskReserve    string
	pidsLimit      int
	mirror         string
	sources        template.Sources
	storeSize      int64
	journalBytes   int64
	readerStall    time.Duration
	retention      time.Duration
	logLevel       string
	runscPlatform  string
	runscPath      string
	runscUserNS    bool
	runscUIDBase   uint
	agentReadyWait time.Duration
	idleTimeout    time.Duration
	baseSnapshots  bool
	vmKernel       string
	qemuAccel      string
	fcBin          string
	jailerBin      string
	fcKernel       string
	fcUser         string
	e2bListen      string
	e2bDomain      string
	e2bSignedTTL   time.Duration
	metricsListen  string
	quota          store.Quota
	net            netConfig
	capacity       string
	dbMaxConns     int32
	dbWait         time.Duration
	shutdownGrace  time.Duration
	placement      string
	placeTimeout   time.Duration
	nodeTimeout    time.Duration
	registry       artifact.Config
	// registryGCGrace: how long an unreferenced release artifact stays in the registry.
	registryGCGrace time.Duration
	nodeTakeOver    bool
}

func serveCmd(env *cli.Env) *cobra.Command {
	c := &serveConfig{quota: service.DefaultQuota()}
	var roles string
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the space server (api, controller and node roles)",
		Long: `Run the space server. By default one process runs every role:

  api         the HTTP API (control plane) on --listen
  controller  the control loops: scheduling, TTLs, dead nodes (leader-elected)
  node        this host's agent: runs sandboxes, serves their data plane

Without --database-url, space creates and runs a private PostgreSQL cluster in
<data-dir>/postgres (unix socket only) with the machine's initdb/postgres binaries.
With --database-url, every api, controller and node process of a fleet shares that
database.

On first start space creates the operator's API key and writes it to
<data-dir>/admin.key (mode 0600), where the CLI finds it; when standard output is a
terminal it is also shown there once. It never goes to the log.

Tenants are created with "space tenant create"; --quota-* set the quotas of tenants
that have none of their own (-1: unlimited).

Under systemd the listening sockets may be passed by socket activation, each named
after its flag (FileDescriptorName=listen, e2b-listen, metrics-listen): they are used
instead of binding the flags' addresses, and outlive restarts, so no connection is
refused while space serve restarts (docs/operations.md, "Running under systemd").
PostgreSQL away (a restart, a failover) is waited for up to --database-wait before a
request is answered 503.

On SIGTERM or SIGINT space serve stops taking connections and gives the requests in
flight up to --shutdown-grace to finish (a create, a file upload, an E2B command's
stream); streams that space's clients resume by themselves (attach, exec, the event
feed) end at once and reconnect. Requests still in flight after the grace are
answered 503, or their streams end; then the roles stop. A second signal ends the
grace at once. Sandboxes keep running across the restart.`,
		Example: `  sudo space serve
  space serve --data-dir /srv/space --listen 0.0.0.0:7700 --advertise-url http://node1:7700
  space serve --roles node --database-url postgres://space@db/space --listen 0.0.0.0:7701`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c.dataDir = env.DataDir
			c.roles = strings.Split(roles, ",")
			for q, v := range c.quota {
				if v < store.Unlimited || v == 0 && (q == store.QuotaRate || q == store.QuotaBurst) {
					return fmt.Errorf("--quota-%s %d: want -1 (unlimited) or a positive number", strings.ReplaceAll(q, "_", "-"), v)
				}
			}
			for _, r := range c.roles {
				if !slices.Contains([]string{"api", "controller", "node"}, r) {
					return fmt.Errorf("--roles: unknown role %q (roles are api, controller, node)", r)
				}
			}
			return serve(cmd.Context(), c)
		},
	}
	f := cmd.Flags()
	f.StringVar(&c.databaseURL, "database-url", os.Getenv("SPACE_DATABASE_URL"), "PostgreSQL URL (env SPACE_DATABASE_URL); empty runs a private cluster in <data-dir>/postgres")
	f.Int32Var(&c.dbMaxConns, "database-max-conns", 0, "size of this process's PostgreSQL connection pool (0: the URL's pool_max_conns, at least 16); the process opens up to 7 more connections of its own, by role (docs/operations.md, \"Connection budget\")")
	f.DurationVar(&c.dbWait, "database-wait", store.DefaultWait, "how long a request waits for PostgreSQL to come back (a restart, a failover) before it answers 503; 0 answers at once")
	f.DurationVar(&c.shutdownGrace, "shutdown-grace", DefaultShutdownGrace, "on SIGTERM or SIGINT, how long requests in flight may go on before they are answered 503 or their streams end (a second signal ends it at once)")
	f.StringVar(&c.listen, "listen", envOr("SPACE_LISTEN", "127.0.0.1:7700"), "HTTP listen address of the API and data plane (env SPACE_LISTEN)")
	f.StringVar(&roles, "roles", "api,controller,node", "roles to run: any of api, controller, node")
	f.StringVar(&c.runtime, "runtime", envOr("SPACE_RUNTIME", "auto"), "sandbox runtime: auto (firecracker, else qemu with hardware KVM, else gvisor), gvisor, qemu or firecracker (env SPACE_RUNTIME)")
	f.StringVar(&c.vmKernel, "vm-kernel", "", "guest kernel for VM runtimes (default: the newest Debian cloud kernel in /boot); QEMU boots a compressed kernel built with CONFIG_PVH through its PVH entry, from the vmlinux it extracts into <data-dir>/cache/qemu-kernel")
	f.StringVar(&c.fcBin, "firecracker-bin", os.Getenv("SPACE_FIRECRACKER_BIN"), "firecracker binary (env SPACE_FIRECRACKER_BIN; default: firecracker on PATH)")
	f.StringVar(&c.jailerBin, "jailer-bin", os.Getenv("SPACE_JAILER_BIN"), "jailer binary (env SPACE_JAILER_BIN; default: jailer beside firecracker, else on PATH)")
	f.StringVar(&c.fcKernel, "firecracker-kernel", os.Getenv("SPACE_FIRECRACKER_KERNEL"), "guest kernel for Firecracker: a vmlinux, or a vmlinuz whose vmlinux space extracts (env SPACE_FIRECRACKER_KERNEL)")
	f.StringVar(&c.fcUser, "firecracker-user", "", "unprivileged user the jailer runs Firecracker as (empty: run without the jailer, for development only)")
	f.StringVar(&c.qemuAccel, "qemu-accel", "auto", "qemu accelerator: auto (kvm when the CPU has vmx/svm and /dev/kvm works, else tcg), kvm or tcg")
	f.StringVar(&c.advertiseURL, "advertise-url", "", "URL clients use to reach this node's data plane (default: http://<listen>)")
	f.StringVar(&c.nodeName, "node-name", "", "this node's name (default: the host name)")
	f.DurationVar(&c.tokenTTL, "token-ttl", service.DefaultTokenTTL, "default lifetime of attachment tokens")
	f.IntVar(&c.defaultCPU, "default-cpu", service.DefaultCPU, "vCPUs of a sandbox that asks for none")
	f.IntVar(&c.defaultMemory, "default-memory", service.DefaultMemoryMB, "memory (MiB) of a sandbox that asks for none")
	f.IntVar(&c.maxCPU, "max-cpu", service.DefaultMaxCPU, "largest cpu a sandbox may ask for")
	f.IntVar(&c.maxMemory, "max-memory", service.DefaultMaxMemoryMB, "largest memory (MiB) a sandbox may ask for")
	f.IntVar(&c.defaultDisk, "default-disk", service.DefaultDiskMB, "disk limit (MiB) of a sandbox that asks for none")
	f.IntVar(&c.maxDisk, "max-disk", service.DefaultMaxDiskMB, "largest disk limit (MiB) a sandbox may ask for")
	f.StringVar(&c.diskReserve, "disk-reserve", "10%", "free disk the node keeps: creates, wakes and snapshots that would go below it are refused (507); a percentage or a fraction")
	f.IntVar(&c.pidsLimit, "pids-limit", 0, "host tasks each sandbox may have (0: the runtime's default: gVisor 6 per task inside plus 256, with one task inside per MiB of memory, 256 to 2048, so 12544 from 2 GiB; QEMU 64 VMM threads)")
	f.StringVar(&c.mirror, "debian-mirror", "", "Debian mirror URL for template builds (default: debootstrap's own)")
	f.Var(&c.sources, "template-sources", "template sources this node may read: comma-separated registry:HOST[/PREFIX] and dir:/ABS/PATH (default: only Debian suites and existing templates)")
	f.Int64Var(&c.storeSize, "store-size", storage.DefaultImageSize, "size in bytes of the sparse btrfs image made when the data dir is not on btrfs")
	f.Int64Var(&c.journalBytes, "journal-bytes", wire.DefaultJournalBytes, "per-process output journal size in bytes")
	f.DurationVar(&c.readerStall, "output-reader-stall", time.Second, "how long a process's output waits for a following reader that is a whole journal behind and takes nothing, before dropping what it has not read (0: never wait: readers that fall behind get gaps)")
	f.DurationVar(&c.retention, "output-retention", wire.DefaultRetention, "how long an exited process's output stays readable")
	f.StringVar(&c.logLevel, "log-level", envOr("SPACE_LOG_LEVEL", "info"), "log level: debug, info, warn, error")
	f.StringVar(&c.runscPath, "runsc", os.Getenv("SPACE_RUNSC"), "runsc binary (env SPACE_RUNSC; default "+gvisor.DefaultRunscPath+", built by scripts/setup.sh; Debian's /usr/bin/runsc needs --runsc-platform ptrace)")
	f.StringVar(&c.runscPlatform, "runsc-platform", gvisor.DefaultPlatform, "gVisor platform: systrap, ptrace (the only one of Debian's runsc) or kvm")
	f.BoolVar(&c.runscUserNS, "runsc-userns", true, "run gVisor sandboxes in a user namespace: their processes run as unprivileged host uids, not root (needs id-mapped mounts: Linux 6.3+)")
	f.UintVar(&c.runscUIDBase, "runsc-uid-base", uint(gvisor.DefaultUIDBase), "first host uid/gid of the gVisor sandboxes' user namespace (65536 ids; must be used by nothing else on the host)")
	f.DurationVar(&c.agentReadyWait, "agent-timeout", node.DefaultAgentReadyTimeout, "how long a new sandbox's agent may take to answer")
	f.DurationVar(&c.idleTimeout, "idle-timeout", service.DefaultIdleTimeout, "suspend sandboxes after this long without activity (per-sandbox idle_timeout overrides)")
	f.BoolVar(&c.baseSnapshots, "base-snapshots", true, "restore new sandboxes from a snapshot of their booted template instead of booting")
	f.StringVar(&c.e2bListen, "e2b-listen", envOr("SPACE_E2B_LISTEN", "127.0.0.1:3000"), "listen address of the E2B-compatible API, for E2B SDKs (env SPACE_E2B_LISTEN; empty disables; like --listen and --metrics-listen, an address that cannot be bound stops serve)")
	f.StringVar(&c.e2bDomain, "e2b-domain", "", "sandbox domain returned to E2B SDKs (<port>-<id>.<domain> hosts; default: from the request's host)")
	f.DurationVar(&c.e2bSignedTTL, "e2b-signed-url-max-ttl", e2b.DefaultMaxSignedURLTTL, "longest lifetime of a signed E2B file URL (its signature_expiration at most this far ahead; URLs without one are refused)")
	f.StringVar(&c.metricsListen, "metrics-listen", os.Getenv("SPACE_METRICS_LISTEN"), "serve GET /metrics without authentication on this address, for Prometheus, and Go's profiles at /debug/pprof/ (env SPACE_METRICS_LISTEN; on --listen, /metrics needs an operator key and there are no profiles)")
	for _, q := range []struct {
		name, help string
	}{
		{store.QuotaRunning, "sandboxes a tenant may hold in memory (running or paused)"},
		{store.QuotaVCPUs, "vCPUs of a tenant's running and paused sandboxes"},
		{store.QuotaMemoryMB, "memory (MiB) of a tenant's running and paused sandboxes"},
		{store.QuotaDiskMB, "disk (MiB) of a tenant's sandboxes and snapshots (estimated: docs/operations.md)"},
		{store.QuotaOperations, "unfinished operations of a tenant"},
		{store.QuotaRate, "API requests per second of a tenant, per api process"},
		{store.QuotaBurst, "request bursts of a tenant (token bucket size)"},
	} {
		f.Var(quotaFlag{c.quota, q.name}, "quota-"+strings.ReplaceAll(q.name, "_", "-"), "default quota: "+q.help+"; -1 unlimited")
	}
	f.StringVar(&c.capacity, "capacity", "", "what this node offers its sandboxes: comma-separated cpu=N (vCPUs in total), memory=MiB, disk=MiB; omitted keys keep their default, 0 is unbounded (default: vCPUs unbounded, memory 2 × (host memory − max(1 GiB, 10 %)), disk the store's size minus --disk-reserve; docs/operations.md)")
	f.StringVar(&c.placement, "placement", string(controller.Spread), "controller: placement policy among the nodes a sandbox fits on: spread (most room left first) or pack (fullest first); nodes holding the sandbox's template release come first either way")
	f.DurationVar(&c.placeTimeout, "place-timeout", controller.DefaultPlaceTimeout, "controller: how long a sandbox that fits on no node (runtime, capacity, cordons) stays pending before its create fails with the reason")
	f.DurationVar(&c.nodeTimeout, "node-timeout", controller.DefaultNodeTimeout, "controller: how long a node may miss heartbeats before it is marked dead and fenced (its running sandboxes are lost)")
	f.StringVar(&c.net.mode, "network", envOr("SPACE_NETWORK", "auto"), "sandbox networking: auto (on when running as root), on (fail if it cannot start) or off (env SPACE_NETWORK)")
	f.StringVar(&c.net.uplink, "egress-interface", "", "interface sandbox egress leaves by (default: the default route's)")
	f.StringVar(&c.net.allow, "network-allow", "", "comma-separated CIDRs sandboxes may be allowed to reach although they are private, link-local or otherwise always denied (e.g. an internal package mirror)")
	f.StringVar(&c.net.pool, "network-pool", "", "IPv4 network sandbox addresses come from, a /30 each (default "+network.DefaultPool.String()+"; must not overlap the host's networks)")
	f.StringVar(&c.net.dnsUpstreams, "dns-upstream", "", "comma-separated DNS servers (ip or ip:port) the sandboxes' resolver asks (default: the host's /etc/resolv.conf)")
	f.StringVar(&c.net.defaultEgress, "default-egress", "none", "network of sandboxes created without a network policy: none (no network), closed (a network namespace with egress off, changeable later) or open (egress to anything not always denied)")
	f.StringVar(&c.net.netnsDir, "netns-dir", "", "where sandbox network namespaces are pinned (default /run/netns, where `ip netns` finds them)")
	f.StringVar(&c.net.hostNetns, "network-host-netns", "", "network namespace that plays the host for sandbox networking (tests: a fake internet); default: space's own")
	_ = f.MarkHidden("network-host-netns")
	f.StringVar(&c.registry.Registry, "registry", os.Getenv("SPACE_REGISTRY"), "node, controller: OCI registry (host[:port]/prefix) that template releases and snapshots are shared through, so every node can start and wake them, and whose unreferenced releases the controller deletes (env SPACE_REGISTRY; empty: artifacts stay on this node; docs/operations.md, \"Registry\")")
	f.StringVar(&c.registry.Username, "registry-username", os.Getenv("SPACE_REGISTRY_USERNAME"), "node, controller: registry user name (env SPACE_REGISTRY_USERNAME); the password is read from SPACE_REGISTRY_PASSWORD only, to keep it out of ps")
	f.StringVar(&c.registry.DockerConfig, "registry-docker-config", os.Getenv("SPACE_REGISTRY_DOCKER_CONFIG"), "node, controller: Docker config.json whose auths entry or credential helper has the registry's credentials (env SPACE_REGISTRY_DOCKER_CONFIG)")
	f.BoolVar(&c.registry.Insecure, "registry-insecure", false, "node, controller: allow plain HTTP to a registry that is not on a loopback address")
	f.DurationVar(&c.registryGCGrace, "registry-gc-grace", controller.DefaultGCGrace, "controller, node: how long a template release artifact stays in the registry after nothing references it and after its push before the leader deletes it, and a release nothing uses stays in a node's store before the node removes it (it can pull it again); longer than the longest push or pull (docs/operations.md, \"Garbage collection\")")
	f.BoolVar(&c.nodeTakeOver, "node-takeover", false, "node: register even though another installation (host, data directory, store) registered this node id — only when the data directory was moved and its old copy runs nowhere (docs/operations.md, \"Copied node ids\")")
	return cmd
}

func newLogger(level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l})), nil
}

func (c *serveConfig) has(role string) bool { return slices.Contains(c.roles, role) }

func serve(ctx context.Context, c *serveConfig) error {
	log, err := newLogger(c.logLevel)
	if err != nil {
		return err
	}
	dataDir, err := filepath.Abs(c.dataDir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dataDir, 0o711); err != nil {
		return fmt.Errorf("data dir: %w", err)
	}
	log.Info("starting space", "version", version, "data_dir", dataDir, "roles", strings.Join(c.roles, ","))
	// space gives what it creates the modes it means (private files and directories are
	// made 0600 and 0700 explicitly). An inherited stricter umask (a unit's UMask=0077)
	// made the directories runsc shares with a sandbox's unprivileged host uid
	// unreadable to it: every sandbox start failed with "cannot read client sync file".
	if old := unix.Umask(0o022); old != 0o022 {
		log.Info("umask set for the files space creates", "inherited", fmt.Sprintf("%04o", old), "now", "0022")
	}

	// Every listener is bound before anything starts: one that cannot bind stops serve.
	lns, err := c.bindListeners()
	if err != nil {
		return err
	}
	defer lns.close()
	ln := lns.main

	dbURL := c.databaseURL
	var pg *pgmanaged.Server
	if dbURL == "" {
		pg, err = pgmanaged.Start(ctx, pgmanaged.Config{Dir: filepath.Join(dataDir, "postgres"), Logger: log.With("component", "postgres")})
		if err != nil {
			return fmt.Errorf("start embedded PostgreSQL: %w", err)
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			if err := pg.Stop(sctx); err != nil {
				log.Error("stop embedded PostgreSQL", "err", err)
			} else {
				log.Info("embedded PostgreSQL stopped")
			}
		}()
		dbURL = pg.URL()
		log.Info("embedded PostgreSQL running", "dir", filepath.Join(dataDir, "postgres"))
	}
	st, err := store.Open(ctx, store.Config{URL: dbURL, Logger: log, MaxConns: c.dbMaxConns, Wait: orNoWait(c.dbWait)})
	if err != nil {
		return err
	}
	defer st.Close()

	key, err := st.SigningKey(ctx, "attach-v1")
	if err != nil {
		return err
	}
	signer, err := token.NewSigner(key)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	opMetrics := node.NewOperationMetrics(reg)

	// Every role and every HTTP server runs in this group: the first that fails stops
	// the others, and serve returns once all have ended. A stop (ctx: SIGTERM, SIGINT)
	// or a failure first drains the HTTP servers (rest.Serve): they take no new
	// connection, and the requests in flight get --shutdown-grace to finish. The roles
	// (and the embedded PostgreSQL) run on until the servers are done, because those
	// requests need them; then they stop.
	rolesCtx, stopRoles := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRoles()
	g, gctx := errgroup.WithContext(rolesCtx)
	stopping, beginStop := context.WithCancel(ctx)
	defer beginStop()
	context.AfterFunc(gctx, beginStop) // a failed role stops the servers too
	drain := rest.Drain{Grace: c.shutdownGrace, Hurry: secondSignal(stopping, rolesCtx, log), Log: log}
	var serving sync.WaitGroup
	serveHTTP := func(name string, serve func(stop context.Context) error) {
		serving.Add(1)
		g.Go(func() error {
			defer serving.Done()
			if err := serve(stopping); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}
	if pg != nil {
		// The embedded PostgreSQL is restarted when it dies; space reconnects by itself.
		g.Go(func() error { return pg.Supervise(gctx) })
	}
	run := func(name string, fn func(context.Context) error) {
		g.Go(func() error {
			if err := fn(gctx); err != nil && gctx.Err() == nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}

	mux := http.NewServeMux()
	var health *node.Node // this process's node, if it runs one
	var metrics http.Handler = promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	var svc *service.Service
	if c.has("api") {
		if err := bootstrapAdminKey(ctx, st, dataDir, os.Stdout, log); err != nil {
			return err
		}
		netCfg, err := c.net.serviceNetwork()
		if err != nil {
			return err
		}
		svc = service.New(service.Config{
			Store: st, Signer: signer, Logger: log.With("component", "api"), Network: netCfg,
			TokenTTL: c.tokenTTL, DefaultCPU: c.defaultCPU, DefaultMemoryMB: c.defaultMemory,
			MaxCPU: c.maxCPU, MaxMemoryMB: c.maxMemory, BuiltinTemplates: template.Builtins(),
			DefaultDiskMB: c.defaultDisk, MaxDiskMB: c.maxDisk,
			IdleTimeout: c.idleTimeout, DefaultQuota: c.quota,
		})
		a := server.NewAPI(server.Config{Service: svc, Logger: log.With("component", "api"), Registry: reg,
			BenchFile: bench.LastPath(dataDir)})
		metrics = a.MetricsHandler()
		run("api", svc.Run)
		mux.Handle("/", a.Handler())
		if lns.e2b != nil {
			gw, err := e2b.New(ctx, e2b.Config{API: svc, Store: st, Logger: log.With("component", "e2b"),
				Domain: c.e2bDomain, Network: c.net.enabled(), BuiltinTemplates: template.Builtins(), MaxSignedURLTTL: c.e2bSignedTTL})
			if err != nil {
				return err
			}
			serveHTTP("e2b", func(stop context.Context) error { return gw.Serve(stop, lns.e2b, drain) })
		}
	}
	if c.has("controller") {
		policy, err := controller.ParsePolicy(c.placement)
		if err != nil {
			return fmt.Errorf("--placement: %w", err)
		}
		var reg controller.Registry
		if c.registry.Registry != "" {
			rc := c.registry
			rc.Password = os.Getenv("SPACE_REGISTRY_PASSWORD")
			rc.Logger = log.With("component", "artifact")
			ac, err := artifact.New(rc, nil) // lists and deletes only
			if err != nil {
				return fmt.Errorf("--registry: %w", err)
			}
			reg = ac
		}
		ctl := controller.New(controller.Config{Store: st, Logger: log.With("component", "controller"),
			Placement: policy, PlaceTimeout: c.placeTimeout, NodeTimeout: c.nodeTimeout,
			Registry: reg, GCGrace: c.registryGCGrace})
		run("controller", ctl.Run)
	}
	if c.has("node") {
		n, dp, netMgr, err := newNode(ctx, c, dataDir, st, signer, ln, log, opMetrics)
		if err != nil {
			return err
		}
		n.RegisterMetrics(reg)
		health = n
		if svc != nil {
			// One process: exec reaches this node's agents directly, a pool claim on it
			// is handed to it directly, and its completed operations wake their waiters.
			svc.SetLocalNode(n)
			n.OnOperationDone(svc.OperationChanged)
		}
		dpMux := http.NewServeMux()
		dp.Register(dpMux)
		n.RegisterRoutes(dpMux)
		mux.Handle("/v1/dp/", dataplane.CORS(dpMux))
		mux.Handle("/internal/", dpMux)
		mux.Handle("GET /healthz", nodeHealthz(n))
		if !c.has("api") {
			// The api's /metrics needs an operator key on --listen; so does a node's.
			mux.Handle("GET /metrics", operatorOnly(st, log.With("component", "node"), metrics))
		}
		run("node", func(ctx context.Context) error {
			err := n.Run(ctx)
			if netMgr != nil {
				// After the node's in-flight work: resolvers and proxies stop, the
				// namespaces and rules stay for the next start.
				netMgr.Close()
			}
			return err
		})
		run("data plane", dp.Run)
	}

	if mln := lns.metrics; mln != nil {
		mmux := http.NewServeMux()
		mmux.Handle("GET /metrics", metrics)
		if health != nil {
			mmux.Handle("GET /healthz", nodeHealthz(health))
		}
		mmux.HandleFunc("GET /debug/pprof/{name...}", server.DebugPprof) // Go profiles, this address only
		msrv := &http.Server{Handler: mmux, ReadHeaderTimeout: 10 * time.Second, MaxHeaderBytes: 16 << 10,
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
		serveHTTP("metrics http", func(stop context.Context) error { return rest.Serve(stop, msrv, mln, drain) })
		log.Info("metrics serving (no authentication)", "listen", mln.Addr().String())
	}
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
	serveHTTP("http", func(stop context.Context) error { return rest.Serve(stop, srv, ln, drain) })
	g.Go(func() error {
		<-stopping.Done()
		log.Info("shutting down")
		serving.Wait()
		stopRoles() // after the requests that needed them
		return nil
	})
	log.Info("space is serving", "listen", ln.Addr().String())
	if c.has("api") {
		log.Info("web console", "url", "http://"+ln.Addr().String()+"/ui/")
	}
	runErr := g.Wait()
	if runErr != nil {
		log.Error("fatal", "err", runErr)
	}
	log.Info("space stopped (sandboxes keep running)")
	return runErr
}

// DefaultShutdownGrace is --shutdown-grace's default: long enough for a create from a
// warm pool or a short command, short enough that a restart under systemd (whose
// TimeoutStopSec defaults to 90 s) is quick.
const DefaultShutdownGrace = 10 * time.Second

// secondSignal returns a context that ends when a second SIGTERM or SIGINT arrives
// after the stop began (stopping), to end the requests' grace at once; it gives up
// (and ends) when the roles have stopped (done).
func secondSignal(stopping, done context.Context, log *slog.Logger) context.Context {
	hurry, hurryNow := context.WithCancel(context.Background())
	go func() {
		defer hurryNow()
		select {
		case <-stopping.Done():
		case <-done.Done():
			return
		}
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
		defer signal.Stop(sig)
		select {
		case s := <-sig:
			log.Warn("stopping: second signal; requests in flight are ended now", "signal", s.String())
		case <-done.Done():
		}
	}()
	return hurry
}

// bootstrapAdminKey creates the first operator key (home tenant "default") and writes
// it to <data-dir>/admin.key (mode 0600). The secret is shown on out only when out is
// a terminal, and never logged: a redirected serve log stays free of it.
func bootstrapAdminKey(ctx context.Context, st *store.Store, dataDir string, out *os.File, log *slog.Logger) error {
	n, err := st.CountOperatorKeys(ctx)
	if err != nil {
		return err
	}
	if n > 0 {
		return nil
	}
	secret, prefix, err := store.NewKeySecret("space")
	if err != nil {
		return err
	}
	path := filepath.Join(dataDir, "admin.key")
	if err := os.WriteFile(path+".tmp", []byte(secret+"\n"), 0o600); err != nil {
		return fmt.Errorf("write admin key: %w", err)
	}
	k := &store.APIKey{ID: ids.APIKey(), Name: "admin", Prefix: prefix, Kind: "space", Tenant: "default", Role: store.RoleOperator}
	if err := st.CreateAPIKey(ctx, k, secret); err != nil {
		os.Remove(path + ".tmp")
		return err
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		return err
	}
	if out != nil && term.IsTerminal(int(out.Fd())) {
		fmt.Fprintf(out, "\nCreated the operator API key (shown once here; saved to %s):\n\n    %s\n\n", path, secret)
	}
	log.Info("created the operator API key (its secret is in the file only)", "id", k.ID, "file", path)
	return nil
}

// quotaFlag sets one default quota.
type quotaFlag struct {
	q    store.Quota
	name string
}

func (f quotaFlag) String() string {
	if f.q == nil {
		return ""
	}
	return strconv.FormatInt(f.q[f.name], 10)
}

func (f quotaFlag) Set(v string) error {
	n, err := strconv.ParseInt(v, 10, 64)
	if v == "unlimited" {
		n, err = store.Unlimited, nil
	}
	if err != nil {
		return fmt.Errorf("want a number or -1 (unlimited)")
	}
	f.q[f.name] = n
	return nil
}

func (f quotaFlag) Type() string { return "int" }

// agentBinary finds space-agent beside the space executable.
func agentBinary() (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	exe, _ = filepath.EvalSymlinks(exe)
	p := filepath.Join(filepath.Dir(exe), "space-agent")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("space-agent not found beside %s: build both with `go build -o DIR ./cmd/...`", exe)
	}
	return p, nil
}

func newNode(ctx context.Context, c *serveConfig, dataDir string, st *store.Store, signer *token.Signer, ln net.Listener,
	log *slog.Logger, metrics *node.OperationMetrics) (*node.Node, *dataplane.DataPlane, *network.Manager, error) {
	agent, err := agentBinary()
	if err != nil {
		return nil, nil, nil, err
	}
	var (
		disk       node.Disk
		rt         runtime.Runtime
		why        string
		builder    node.TemplateBuilder
		storeBytes int64
		reserve    float64
		artifacts  *artifact.Client
	)
	if c.runtime == "fake" {
		if rt, disk, err = testRuntime(dataDir, agent, log); err != nil {
			return nil, nil, nil, err
		}
		why = "requested with --runtime fake (a test build)"
	} else {
		reserve, err = storage.ParseDiskReserve(c.diskReserve)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("--disk-reserve: %w", err)
		}
		store, err := storage.Open(ctx, storage.Config{DataDir: dataDir, ImageSizeBytes: c.storeSize, DiskReserve: reserve,
			Logger: log.With("component", "storage")})
		if err != nil {
			return nil, nil, nil, fmt.Errorf("open btrfs store: %w", err)
		}
		if rt, why, err = selectRuntime(c, dataDir, log); err != nil {
			return nil, nil, nil, err
		}
		disk = store
		if fss, err := store.Space(); err == nil && len(fss) > 0 {
			storeBytes = fss[0].TotalBytes // the btrfs volume's own size
		}
		builder = &template.Builder{Store: store, Logger: log.With("component", "template"), Mirror: c.mirror,
			CacheDir: filepath.Join(dataDir, "cache", "debootstrap"), Sources: c.sources}
		if c.registry.Registry != "" {
			rc := c.registry
			rc.Password = os.Getenv("SPACE_REGISTRY_PASSWORD")
			rc.Logger = log.With("component", "artifact")
			if artifacts, err = artifact.New(rc, store); err != nil {
				return nil, nil, nil, fmt.Errorf("--registry: %w", err)
			}
			if err := artifacts.Check(ctx); err != nil {
				// Not fatal: the registry may come up after the node; what needs it fails
				// with this error meanwhile.
				log.Warn("registry not reachable yet", "registry", artifacts.Registry(), "err", err)
			}
		}
	}
	log.Info("runtime selected", "reason", why)
	capacity, err := node.ParseCapacity(c.capacity, node.DefaultCapacity(node.HostMemoryMB(), storeBytes, reserve))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("--capacity: %w", err)
	}
	netMgr, err := c.net.startNetwork(ctx, dataDir, log)
	if err != nil {
		return nil, nil, nil, err
	}
	var nm node.NetworkManager
	if netMgr != nil {
		nm = netMgr
	}
	id, err := node.LoadOrCreateID(dataDir)
	if err != nil {
		return nil, nil, nil, err
	}
	storeRoot := ""
	if sr, ok := disk.(interface{ Root() string }); ok {
		storeRoot = sr.Root()
	}
	name := c.nodeName
	if name == "" {
		if name, err = os.Hostname(); err != nil {
			return nil, nil, nil, err
		}
	}
	adv := c.advertiseURL
	if adv == "" {
		host, port, _ := net.SplitHostPort(ln.Addr().String())
		if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
			host = "127.0.0.1"
		}
		adv = "http://" + net.JoinHostPort(host, port)
	}
	n, err := node.New(node.Config{
		ID: id, Name: name, DataDir: dataDir, AdvertiseURL: strings.TrimRight(adv, "/"),
		Store: st, Runtime: rt, Storage: disk,
		Builder:   builder,
		AgentPath: agent,
		AgentEnv: map[string]string{
			"SPACE_AGENT_JOURNAL_BYTES": strconv.FormatInt(c.journalBytes, 10),
			"SPACE_AGENT_RETENTION":     c.retention.String(),
			"SPACE_AGENT_READER_STALL":  c.readerStall.String(),
		},
		Logger:            log.With("component", "node"),
		Metrics:           metrics,
		PidsLimit:         c.pidsLimit,
		AgentReadyTimeout: c.agentReadyWait,
		NoBaseSnapshots:   !c.baseSnapshots,
		RuntimeReason:     why,
		Network:           nm,
		Signer:            signer,
		DefaultCPU:        c.defaultCPU,
		DefaultMemoryMB:   c.defaultMemory,
		Capacity:          capacity,
		Artifacts:         artifacts,
		ReleaseCacheGrace: c.registryGCGrace,
		Fingerprint:       node.Fingerprint(dataDir, storeFingerprintID(storeRoot)),
		TakeOver:          c.nodeTakeOver,
	})
	if err != nil {
		if netMgr != nil {
			netMgr.Close()
		}
		return nil, nil, nil, err
	}
	dp := dataplane.New(dataplane.Config{Store: st, Signer: signer, Logger: log.With("component", "dataplane"), Node: n, NodeID: id})
	return n, dp, netMgr, nil
}

// selectRuntime picks the sandbox runtime and logs why: --runtime auto prefers
// firecracker (binaries and hardware KVM), then qemu with hardware KVM, then gVisor.
func selectRuntime(c *serveConfig, dataDir string, log *slog.Logger) (runtime.Runtime, string, error) {
	// Runtime state lives on tmpfs (it does not survive a reboot, and neither do the
	// sandboxes); one directory per data dir so that several servers on one host never
	// see each other's sandboxes.
	sum := sha256.Sum256([]byte(dataDir))
	suffix := hex.EncodeToString(sum[:6])
	newGVisor := func() (runtime.Runtime, error) {
		if c.runscUIDBase == 0 || c.runscUIDBase > math.MaxUint32 {
			return nil, fmt.Errorf("--runsc-uid-base %d: want 1…%d", c.runscUIDBase, uint32(math.MaxUint32))
		}
		// The sandboxes' user namespace reaches its id-mapped views in the root dir:
		// /run/space must be searchable (not listable) by others.
		if err := os.MkdirAll("/run/space", 0o711); err != nil {
			return nil, err
		}
		if c.runscUserNS {
			if err := os.Chmod("/run/space", 0o711); err != nil {
				return nil, err
			}
		}
		return gvisor.New(gvisor.Config{
			RunscPath: c.runscPath,
			RootDir:   filepath.Join("/run/space", "runsc-"+suffix),
			Platform:  c.runscPlatform,
			UIDBase:   uint32(c.runscUIDBase),
			NoUserNS:  !c.runscUserNS,
			Logger:    log.With("component", "gvisor"),
		})
	}
	newQEMU := func() (*qemu.Runtime, error) {
		return qemu.New(qemu.Config{
			RootDir:    filepath.Join("/run/space", "qemu-"+suffix),
			KernelPath: c.vmKernel,
			// On disk, not tmpfs: the extracted vmlinux (53 MB for Debian's cloud kernel)
			// is page cache every VM maps and the host can reclaim.
			KernelCacheDir: filepath.Join(dataDir, "cache", "qemu-kernel"),
			Accel:          c.qemuAccel,
			Logger:         log.With("component", "qemu"),
		})
	}
	switch c.runtime {
	case "gvisor":
		rt, err := newGVisor()
		return rt, "requested with --runtime gvisor", err
	case "qemu":
		rt, err := newQEMU()
		if err != nil {
			return nil, "", err
		}
		info, _ := rt.Info(context.Background())
		return rt, fmt.Sprintf("requested with --runtime qemu (accel %s: %s)", info.Details["accel"], info.Details["accel_reason"]), nil
	case "firecracker":
		rt, err := newFirecracker(c, dataDir, log)
		if err != nil {
			return nil, "", fmt.Errorf("--runtime firecracker: %w", err)
		}
		return rt, "requested with --runtime firecracker", nil
	case "auto":
	default:
		return nil, "", fmt.Errorf("--runtime must be auto, gvisor, qemu or firecracker")
	}
	var why []string
	if fc, err := newFirecracker(c, dataDir, log); err == nil {
		return fc, "auto: firecracker (binaries and hardware KVM present)", nil
	} else {
		why = append(why, "firecracker: "+err.Error())
	}
	// Probe before building: a runtime that is not chosen must leave nothing on the host.
	if accel, reason, err := qemu.DetectAccel(c.qemuAccel); err != nil {
		why = append(why, "qemu: "+err.Error())
	} else if accel != qemu.AccelKVM {
		why = append(why, "qemu: no hardware KVM ("+reason+"), and TCG is too slow to be the default")
	} else if q, err := newQEMU(); err != nil {
		why = append(why, "qemu: "+err.Error())
	} else {
		return q, "auto: qemu with hardware KVM (" + strings.Join(why, "; ") + ")", nil
	}
	rt, err := newGVisor()
	return rt, "auto: gVisor (" + strings.Join(why, "; ") + ")", err
}

// newFirecracker builds the firecracker runtime if the host can run it: hardware KVM,
// the binaries and a kernel.
func newFirecracker(c *serveConfig, dataDir string, log *slog.Logger) (runtime.Runtime, error) {
	if err := firecracker.CheckKVM(); err != nil {
		return nil, err
	}
	cfg := firecracker.Config{
		FirecrackerPath: c.fcBin, JailerPath: c.jailerBin, KernelPath: c.fcKernel,
		RootDir: filepath.Join(dataDir, "firecracker"), NoJailer: c.fcUser == "",
		Logger: log.With("component", "firecracker"),
	}
	if c.fcUser != "" {
		u, err := user.Lookup(c.fcUser)
		if err != nil {
			return nil, fmt.Errorf("--firecracker-user: %w", err)
		}
		cfg.UID, _ = strconv.Atoi(u.Uid)
		cfg.GID, _ = strconv.Atoi(u.Gid)
	}
	return firecracker.New(cfg)
}

// orNoWait is the store's Wait for --database-wait d: the flag's 0 (or less) is the
// store's "do not wait" (its 0 is its default).
func orNoWait(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}
