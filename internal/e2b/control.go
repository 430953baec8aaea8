package e2b

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/store"
)

// E2B control-plane constants.
const (
	// clientID is E2B's deprecated constant that the Python SDK still requires.
	clientID = "6532622b"
	// defaultTimeout is the v2 (and SDK) default sandbox timeout; v1 creates that
	// omit it get upstream's legacy 15 s.
	defaultTimeout   = 300
	legacyTimeout    = 15
	defaultTemplate  = "base"
	maxListLimit     = 100
	maxJSONBodyBytes = 1 << 20
	// createAllowance is added to the timeout while a sandbox is being created (the
	// clock starts once it runs).
	createAllowance = 10 * time.Minute
	// autoResumeKey marks, in the sandbox's metadata, a sandbox created with E2B's
	// autoResume; its value is the timeout (seconds) a resumed sandbox gets. Keys
	// under metadataPrefix are hidden from E2B clients.
	metadataPrefix = "space.e2b."
	autoResumeKey  = metadataPrefix + "auto-resume"
)

// apiHandler is a control-plane handler of an authenticated caller.
type apiHandler func(w http.ResponseWriter, r *http.Request, p *service.Principal) error

func (g *Gateway) routes() http.Handler {
	mux := http.NewServeMux()
	h := func(pattern string, fn apiHandler) { mux.Handle(pattern, g.authed(fn)) }
	h("POST /sandboxes", g.create(false))
	h("POST /v2/sandboxes", g.create(true))
	h("GET /sandboxes", g.list(false))
	h("GET /v2/sandboxes", g.list(true))
	h("GET /sandboxes/metrics", g.manyMetrics)
	h("GET /sandboxes/{id}", g.get)
	h("DELETE /sandboxes/{id}", g.kill)
	h("POST /sandboxes/{id}/timeout", g.setTimeout)
	h("POST /sandboxes/{id}/refreshes", g.refresh)
	h("POST /sandboxes/{id}/pause", g.pause)
	h("POST /sandboxes/{id}/resume", g.resume)
	h("POST /sandboxes/{id}/connect", g.connect())
	h("POST /v2/sandboxes/{id}/connect", g.connect())
	h("GET /sandboxes/{id}/metrics", g.metrics)
	h("PUT /sandboxes/{id}/network", g.updateNetwork)
	h("GET /templates", g.templates)
	h("GET /templates/aliases/{alias}", g.templateAlias)
	g.snapshotRoutes(h) // snapshots.go
	// Not implemented: 501, after the sandbox named (if any) is found like everywhere
	// else, so that another tenant's sandbox answers 404 here too.
	h("GET /sandboxes/{id}/logs", g.notImplemented)
	h("GET /v2/sandboxes/{id}/logs", g.notImplemented)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "OK")
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path))
	})
	return mux
}

func (g *Gateway) notImplemented(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	if id := r.PathValue("id"); id != "" {
		if _, err := g.live(r.Context(), p, id); err != nil {
			return err
		}
	}
	writeError(w, http.StatusNotImplemented, fmt.Sprintf("%s %s is not supported by space's E2B-compatible API (see docs/e2b.md)", r.Method, r.URL.Path))
	return nil
}

// authed authenticates an E2B API key (X-API-KEY, or Authorization: Bearer as the
// E2B CLI sends it).
func (g *Gateway) authed(h apiHandler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("X-API-Key")
		if key == "" {
			key, _ = strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		}
		p, err := g.api.Authenticate(r.Context(), key, service.KeyE2B)
		if err == nil {
			err = g.api.Allow(r.Context(), p) // the tenant's request rate
		}
		if err != nil {
			g.fail(w, r, err)
			return
		}
		if err := h(w, r, p); err != nil {
			g.fail(w, r, err)
		}
	})
}

// writeError writes E2B's error body: {"code": <status>, "message": …}. The JS SDK
// decides 404/409 handling by body.code, the Python SDK needs both fields.
func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]any{"code": status, "message": msg})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
}

// fail writes err with the status space's one mapping gives it; internal errors are
// logged and not shown.
func (g *Gateway) fail(w http.ResponseWriter, r *http.Request, err error) {
	if rest.ShuttingDown(r) {
		err = rest.ErrShuttingDown
	}
	status := rest.StatusOf(err)
	msg := fault.Message(err)
	if fault.KindOf(err) == fault.Internal {
		if r.Context().Err() != nil {
			return // the client is gone
		}
		g.log.Error("E2B request failed", "method", r.Method, "path", r.URL.Path, "err", err)
		msg = "internal error"
	}
	rest.SetRetryAfter(w, err)
	writeError(w, status, msg)
}

// decodeBody decodes an optional JSON body leniently (unknown fields are ignored:
// newer SDKs send fields this server does not know yet).
func decodeBody(r *http.Request, v any) error {
	b, err := io.ReadAll(io.LimitReader(r.Body, maxJSONBodyBytes+1))
	if err != nil {
		return fault.New(fault.Invalid, "read body: %v", err)
	}
	if len(b) > maxJSONBodyBytes {
		return fault.New(fault.TooLarge, "request body exceeds %d bytes", maxJSONBodyBytes)
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fault.New(fault.Invalid, "malformed JSON body: %v", err)
	}
	return nil
}

// timeout returns the E2B timeout in seconds a request gave, or def when it gave none,
// validated by checkTimeout.
func (g *Gateway) timeout(given *int, def int) (int, error) {
	if given != nil {
		def = *given
	}
	return def, g.checkTimeout(def)
}

// checkTimeout validates an E2B timeout in seconds.
func (g *Gateway) checkTimeout(secs int) error {
	if secs <= 0 {
		return fault.New(fault.Invalid, "timeout must be a positive number of seconds")
	}
	if time.Duration(secs)*time.Second > g.cfg.MaxTimeout {
		return fault.New(fault.Invalid, "Timeout cannot be greater than %s", humanHours(g.cfg.MaxTimeout))
	}
	return nil
}

func humanHours(d time.Duration) string {
	if d%time.Hour == 0 {
		return fmt.Sprintf("%d hours", int(d/time.Hour))
	}
	return d.String()
}

// live loads a sandbox the caller may see that is not deleted (404 otherwise).
func (g *Gateway) live(ctx context.Context, p *service.Principal, id string) (*store.Sandbox, error) {
	sb, err := g.api.Sandbox(ctx, p, id)
	if err != nil {
		return nil, err
	}
	if sb.DeletedAt != nil || sb.DesiredState == api.StateDeleted {
		return nil, fault.New(fault.NotFound, "sandbox %q not found", id)
	}
	return sb, nil
}

// paused reports whether a sandbox is (or is becoming) paused in E2B's terms: space
// paused, suspended or stopped.
func paused(sb *store.Sandbox) bool {
	switch sb.DesiredState {
	case api.StatePaused, api.StateSuspended, api.StateStopped:
		return true
	}
	return sb.State == api.StateFailed
}

func e2bState(sb *store.Sandbox) string {
	if paused(sb) {
		return "paused"
	}
	return "running"
}

// templateNames returns E2B's templateID and alias for a space template reference
// ("base:latest" is "base").
func templateNames(ref string) (id, alias string) {
	id = strings.TrimSuffix(ref, ":latest")
	if i := strings.IndexAny(id, ":@"); i >= 0 {
		return id, id[:i]
	}
	return id, id
}

// endAt is when the sandbox's timeout ends; for a paused one, when it was paused.
func endAt(sb *store.Sandbox) time.Time {
	if paused(sb) {
		if sb.StatusChangedAt != nil {
			return *sb.StatusChangedAt
		}
		return sb.UpdatedAt
	}
	if sb.ExpiresAt != nil {
		return *sb.ExpiresAt
	}
	if sb.IdleTimeout > 0 {
		return sb.LastActivityAt.Add(sb.IdleTimeout)
	}
	return sb.CreatedAt.AddDate(100, 0, 0) // no timeout
}

// userMetadata is the sandbox's metadata without the gateway's own keys.
func userMetadata(sb *store.Sandbox) map[string]string {
	out := map[string]string{}
	for k, v := range sb.Metadata {
		if !strings.HasPrefix(k, metadataPrefix) {
			out[k] = v
		}
	}
	return out
}

// domain is the sandbox domain returned to SDKs (see Config.Domain). SDKs build
// <port>-<sandbox id>.<domain> host names from it, so it must make a valid URL host
// (an IP address does not: "8000-id.127.0.0.1" ends in a number, which URL parsers
// reject). Derived from the request's Host, keeping its port (host-routed requests
// come back to this listener):
//   - "api.<domain>" gives <domain>;
//   - localhost or a loopback address gives "localhost" (RFC 6761: every name under
//     localhost is the loopback interface; browsers and curl resolve them so);
//   - another IP address gives "<a-b-c-d>.ip.invalid": valid, never resolvable (the
//     reserved .invalid name), so an SDK fails plainly instead of sending traffic to
//     a name someone else resolves. Serving remote clients host-routed traffic needs
//     Config.Domain and a wildcard DNS name (docs/e2b.md);
//   - any other name is used as it is.
func (g *Gateway) domain(r *http.Request) string {
	if g.cfg.Domain != "" {
		return g.cfg.Domain
	}
	host, port := r.Host, ""
	if h, p, err := net.SplitHostPort(host); err == nil {
		host, port = h, p
	}
	host = strings.ToLower(strings.Trim(host, "[]"))
	switch ip := net.ParseIP(host); {
	case host == "" || host == "localhost" || (ip != nil && (ip.IsLoopback() || ip.IsUnspecified())):
		host = "localhost"
	case ip != nil:
		host = strings.NewReplacer(".", "-", ":", "-").Replace(ip.String()) + ".ip.invalid"
	default:
		if rest, ok := strings.CutPrefix(host, "api."); ok && rest != "" {
			host = rest
		}
	}
	if port != "" {
		return net.JoinHostPort(host, port)
	}
	return host
}

// sandboxJSON is E2B's Sandbox (create, connect, resume answers).
type sandboxJSON struct {
	TemplateID         string  `json:"templateID"`
	SandboxID          string  `json:"sandboxID"`
	Alias              string  `json:"alias,omitempty"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             string  `json:"domain"`
}

func (g *Gateway) sandboxJSON(r *http.Request, sb *store.Sandbox) sandboxJSON {
	id, alias := templateNames(sb.TemplateRef)
	return sandboxJSON{TemplateID: id, SandboxID: sb.ID, Alias: alias, ClientID: clientID, EnvdVersion: envdpb.Version,
		EnvdAccessToken: g.accessToken(sb), TrafficAccessToken: g.trafficTokenOf(sb), Domain: g.domain(r)}
}

type lifecycleJSON struct {
	OnTimeout  string `json:"onTimeout"`
	AutoResume bool   `json:"autoResume"`
}

type volumeMount struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// listedSandbox is E2B's ListedSandbox; sandboxDetail (GET /sandboxes/{id}) adds to it.
type listedSandbox struct {
	TemplateID   string            `json:"templateID"`
	Alias        string            `json:"alias,omitempty"`
	SandboxID    string            `json:"sandboxID"`
	ClientID     string            `json:"clientID"`
	StartedAt    time.Time         `json:"startedAt"`
	EndAt        time.Time         `json:"endAt"`
	CPUCount     int               `json:"cpuCount"`
	MemoryMB     int               `json:"memoryMB"`
	DiskSizeMB   int               `json:"diskSizeMB"`
	Metadata     map[string]string `json:"metadata"`
	State        string            `json:"state"`
	EnvdVersion  string            `json:"envdVersion"`
	VolumeMounts []volumeMount     `json:"volumeMounts"`
}

type sandboxDetail struct {
	listedSandbox
	EnvdAccessToken     string          `json:"envdAccessToken"`
	Domain              string          `json:"domain"`
	AllowInternetAccess bool            `json:"allowInternetAccess"`
	Network             *e2bNetworkInfo `json:"network,omitempty"`
	Lifecycle           lifecycleJSON   `json:"lifecycle"`
}

func listed(sb *store.Sandbox) listedSandbox {
	id, alias := templateNames(sb.TemplateRef)
	return listedSandbox{TemplateID: id, Alias: alias, SandboxID: sb.ID, ClientID: clientID, StartedAt: sb.CreatedAt,
		EndAt: endAt(sb), CPUCount: sb.Spec.CPU, MemoryMB: sb.Spec.MemoryMB, DiskSizeMB: sb.Spec.DiskMB,
		Metadata: userMetadata(sb), State: e2bState(sb), EnvdVersion: envdpb.Version, VolumeMounts: []volumeMount{}}
}

func (g *Gateway) detail(r *http.Request, sb *store.Sandbox) sandboxDetail {
	lc := lifecycleJSON{OnTimeout: "kill", AutoResume: sb.Metadata[autoResumeKey] != ""}
	if sb.ExpireAction == "suspend" || sb.ExpireAction == "stop" {
		lc.OnTimeout = "pause"
	}
	return sandboxDetail{listedSandbox: listed(sb), EnvdAccessToken: g.accessToken(sb), Domain: g.domain(r),
		AllowInternetAccess: allowInternet(sb), Network: networkInfo(sb), Lifecycle: lc}
}

// newSandbox is E2B's NewSandbox (v1) and NewSandboxV2 body.
type newSandbox struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int              `json:"timeout"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	Secure              *bool             `json:"secure"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	AutoPause           bool              `json:"autoPause"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory"`
	AutoResume          *struct {
		Enabled bool `json:"enabled"`
	} `json:"autoResume"`
	MCP          json.RawMessage   `json:"mcp"`
	VolumeMounts []json.RawMessage `json:"volumeMounts"`
	Network      *e2bNetwork       `json:"network"`
}

// create handles POST /sandboxes (v1) and POST /v2/sandboxes: the sandbox is created
// and the answer comes once it runs (E2B's create is synchronous).
func (g *Gateway) create(v2 bool) apiHandler {
	return func(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
		var body newSandbox
		if err := decodeBody(r, &body); err != nil {
			return err
		}
		def := defaultTimeout
		if !v2 {
			def = legacyTimeout
		}
		timeout, err := g.timeout(body.Timeout, def)
		if err != nil {
			return err
		}
		if len(body.MCP) > 0 && string(body.MCP) != "null" {
			return fault.New(fault.Invalid, "MCP gateways are not supported by space")
		}
		if len(body.VolumeMounts) > 0 {
			return fault.New(fault.Invalid, "volume mounts are not supported by space")
		}
		autoResume := body.AutoResume != nil && body.AutoResume.Enabled
		if autoResume && !body.AutoPause {
			return fault.New(fault.Invalid, "autoResume can only be enabled together with autoPause")
		}
		// autoPauseMemory false: pause keeps the disk only (a space stop).
		keepMemory := body.AutoPauseMemory == nil || *body.AutoPauseMemory
		if autoResume && !keepMemory {
			return fault.New(fault.Invalid, "autoResume cannot be enabled when autoPauseMemory is false: a sandbox paused without its memory is resumed explicitly (connect)")
		}
		for k := range body.Metadata {
			if strings.HasPrefix(k, metadataPrefix) {
				return fault.New(fault.Invalid, "metadata keys starting with %q are reserved", metadataPrefix)
			}
		}
		md := body.Metadata
		if autoResume {
			md = make(map[string]string, len(body.Metadata)+1)
			for k, v := range body.Metadata {
				md[k] = v
			}
			md[autoResumeKey] = strconv.Itoa(timeout)
		}
		if md, err = inboundMetadata(body.Network, md); err != nil {
			return err
		}
		netSpec, err := g.egressPolicy(body.AllowInternetAccess, body.Network)
		if err != nil {
			return err
		}
		tmpl := body.TemplateID
		if tmpl == "" {
			tmpl = defaultTemplate
		}
		action := "delete"
		if body.AutoPause {
			action = "suspend"
			if !keepMemory {
				action = "stop"
			}
		}
		ctx := r.Context()
		// A snapshot's id is a template id on E2B (snapshots.go).
		var snapshot string
		if sn, err := g.snapshotFor(ctx, p, tmpl); err != nil {
			return err
		} else if sn != nil {
			tmpl, snapshot = "", sn.ID
		}
		created, err := g.api.Create(ctx, p, api.CreateSandboxRequest{
			Template: tmpl, Snapshot: snapshot, Env: body.EnvVars, Metadata: md,
			// The expiry is set again once the sandbox runs; meanwhile the TTL leaves
			// time to start and still covers a client that gives up waiting.
			TTL:         (time.Duration(timeout)*time.Second + createAllowance).String(),
			IdleTimeout: "0", // E2B's timeout is the only clock
			Network:     netSpec,
		}, nil)
		if err != nil {
			return err
		}
		sb, op := created.Sandbox, created.Op
		exp := time.Now().Add(time.Duration(timeout)*time.Second + createAllowance)
		if err := g.api.SetExpiry(ctx, p, sb.ID, &exp, action); err != nil {
			return err
		}
		op, err = g.api.WaitDone(ctx, p, op.ID)
		if err != nil {
			return err
		}
		if op.State == api.OpFailed {
			g.log.Warn("E2B create failed", "sandbox", sb.ID, "err", op.Error)
			if _, err := g.api.Delete(context.WithoutCancel(ctx), p, sb.ID); err != nil && !fault.Is(err, fault.NotFound) {
				g.log.Warn("delete failed sandbox", "sandbox", sb.ID, "err", err)
			}
			writeError(w, http.StatusInternalServerError, "sandbox failed to start: "+op.Error)
			return nil
		}
		if sb, err = g.live(ctx, p, sb.ID); err != nil {
			return err
		}
		exp = time.Now().Add(time.Duration(timeout) * time.Second)
		if err := g.api.SetExpiry(ctx, p, sb.ID, &exp, action); err != nil {
			return err
		}
		g.log.Info("E2B sandbox created", "sandbox", sb.ID, "template", sb.TemplateRef, "timeout", timeout, "on_timeout", action)
		writeJSON(w, http.StatusCreated, g.sandboxJSON(r, sb))
		return nil
	}
}

func (g *Gateway) get(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	sb, err := g.live(r.Context(), p, r.PathValue("id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, g.detail(r, sb))
	return nil
}

func (g *Gateway) kill(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	// A sandbox already being deleted is gone for E2B (kill answers 404).
	sb, err := g.live(r.Context(), p, r.PathValue("id"))
	if err != nil {
		return err
	}
	if _, err := g.api.Delete(r.Context(), p, sb.ID); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// running loads a sandbox that is running in E2B's terms (404 for paused ones, as
// upstream: they are not "live" sandboxes there).
func (g *Gateway) running(ctx context.Context, p *service.Principal, id string) (*store.Sandbox, error) {
	sb, err := g.live(ctx, p, id)
	if err != nil {
		return nil, err
	}
	if paused(sb) {
		return nil, fault.New(fault.NotFound, "sandbox %q is paused", id)
	}
	return sb, nil
}

func (g *Gateway) setTimeout(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	var body struct {
		Timeout *int `json:"timeout"`
	}
	if err := decodeBody(r, &body); err != nil {
		return err
	}
	if body.Timeout == nil {
		return fault.New(fault.Invalid, "timeout is required")
	}
	if *body.Timeout < 0 {
		return fault.New(fault.Invalid, "timeout must not be negative")
	}
	if err := g.checkTimeout(max(*body.Timeout, 1)); err != nil {
		return err
	}
	sb, err := g.running(r.Context(), p, r.PathValue("id"))
	if err != nil {
		return err
	}
	exp := time.Now().Add(time.Duration(*body.Timeout) * time.Second)
	if err := g.api.SetExpiry(r.Context(), p, sb.ID, &exp, ""); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// refresh handles the legacy keep-alive: the timeout is extended to now+duration
// (never shortened).
func (g *Gateway) refresh(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	var body struct {
		Duration *int `json:"duration"`
	}
	if err := decodeBody(r, &body); err != nil {
		return err
	}
	secs, err := g.timeout(body.Duration, legacyTimeout)
	if err != nil {
		return err
	}
	sb, err := g.running(r.Context(), p, r.PathValue("id"))
	if err != nil {
		return err
	}
	if err := g.extend(r.Context(), p, sb, secs); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// extend moves a running sandbox's expiry to now+secs unless it is later already.
func (g *Gateway) extend(ctx context.Context, p *service.Principal, sb *store.Sandbox, secs int) error {
	exp := time.Now().Add(time.Duration(secs) * time.Second)
	if sb.ExpiresAt != nil && sb.ExpiresAt.After(exp) {
		return nil
	}
	return g.api.SetExpiry(ctx, p, sb.ID, &exp, "")
}

// pause handles POST /sandboxes/{id}/pause: a space suspend, waited for; with
// {"memory": false} (the SDK's keepMemory: false) a space stop: the disk is kept, the
// memory dropped, and a resume boots. A paused sandbox does not expire.
func (g *Gateway) pause(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	var body struct {
		Memory *bool `json:"memory"`
	}
	if err := decodeBody(r, &body); err != nil {
		return err
	}
	verb := api.OpSuspend
	if body.Memory != nil && !*body.Memory {
		verb = api.OpStop
	}
	ctx := r.Context()
	sb, err := g.live(ctx, p, r.PathValue("id"))
	if err != nil {
		return err
	}
	if sb, err = g.settle(ctx, p, sb); err != nil {
		return err
	}
	if paused(sb) {
		return fault.New(fault.Conflict, "sandbox %s is already paused", sb.ID)
	}
	// An explicit pause replaces the sandbox's envd access token (connect returns the
	// new one).
	op, err := g.api.RequestVerb(ctx, p, sb.ID, verb, "paused through the E2B API")
	if err != nil {
		return err
	}
	if err := g.api.SetExpiry(ctx, p, sb.ID, nil, ""); err != nil {
		return err
	}
	if op, err = g.api.WaitDone(ctx, p, op.ID); err != nil {
		return err
	}
	if op.State == api.OpFailed {
		return fmt.Errorf("pause %s: %s", sb.ID, op.Error)
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// settleTimeout bounds how long a request waits for a transition in flight (a pause
// the timeout started, a resume) before acting on the sandbox.
const settleTimeout = 2 * time.Minute

// settle waits until the node has acted on the sandbox's latest intent, so that a
// pause or resume does not collide with one in flight.
func (g *Gateway) settle(ctx context.Context, p *service.Principal, sb *store.Sandbox) (*store.Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for sb.ObservedGeneration < sb.Generation {
		select {
		case <-ctx.Done():
			return nil, fault.New(fault.Unavailable, "sandbox %s is still %s; try again", sb.ID, sb.State)
		case <-t.C:
		}
		var err error
		if sb, err = g.live(ctx, p, sb.ID); err != nil {
			return nil, err
		}
	}
	return sb, nil
}

// wake resumes a paused sandbox (or waits for one being started) and gives it a new
// timeout.
func (g *Gateway) wake(ctx context.Context, p *service.Principal, sb *store.Sandbox, secs int, action string) (*store.Sandbox, error) {
	sb, err := g.settle(ctx, p, sb)
	if err != nil {
		return nil, err
	}
	// The old expiry may have passed (an auto-pause): move it first, or the
	// controller would pause the sandbox again as soon as it runs.
	exp := time.Now().Add(time.Duration(secs)*time.Second + createAllowance)
	if err := g.api.SetExpiry(ctx, p, sb.ID, &exp, action); err != nil {
		return nil, err
	}
	woken, err := g.api.Awake(ctx, p, sb, false)
	if err != nil {
		return nil, err
	}
	if woken.State != api.StateRunning {
		if woken.Error != "" {
			return nil, fmt.Errorf("resume %s: %s", sb.ID, woken.Error)
		}
		return nil, fault.New(fault.Unavailable, "sandbox %s is %s; try again", sb.ID, woken.State)
	}
	exp = time.Now().Add(time.Duration(secs) * time.Second)
	if err := g.api.SetExpiry(ctx, p, woken.ID, &exp, action); err != nil {
		return nil, err
	}
	return woken, nil
}

// connect handles POST /sandboxes/{id}/connect and POST /v2/sandboxes/{id}/connect
// (timeout optional, 300 s): 200 when the sandbox was running (its timeout only
// grows), 201 when it was resumed.
func (g *Gateway) connect() apiHandler {
	return func(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
		var body struct {
			Timeout *int `json:"timeout"`
		}
		if err := decodeBody(r, &body); err != nil {
			return err
		}
		secs, err := g.timeout(body.Timeout, defaultTimeout)
		if err != nil {
			return err
		}
		ctx := r.Context()
		sb, err := g.live(ctx, p, r.PathValue("id"))
		if err != nil {
			return err
		}
		if !paused(sb) && sb.State == api.StateRunning {
			if err := g.extend(ctx, p, sb, secs); err != nil {
				return err
			}
			writeJSON(w, http.StatusOK, g.sandboxJSON(r, sb))
			return nil
		}
		status := http.StatusOK // starting: waited for, not resumed
		if paused(sb) {
			status = http.StatusCreated
		}
		if sb, err = g.wake(ctx, p, sb, secs, ""); err != nil {
			return err
		}
		if status == http.StatusCreated {
			// An explicit resume replaces the envd access token; the answer carries it.
			if sb, err = g.api.RotateAccess(ctx, p, sb.ID); err != nil {
				return err
			}
		}
		writeJSON(w, status, g.sandboxJSON(r, sb))
		return nil
	}
}

// resume handles the legacy POST /sandboxes/{id}/resume (409 when running).
func (g *Gateway) resume(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	var body struct {
		Timeout   *int  `json:"timeout"`
		AutoPause *bool `json:"autoPause"`
	}
	if err := decodeBody(r, &body); err != nil {
		return err
	}
	secs, err := g.timeout(body.Timeout, legacyTimeout)
	if err != nil {
		return err
	}
	ctx := r.Context()
	sb, err := g.live(ctx, p, r.PathValue("id"))
	if err != nil {
		return err
	}
	if !paused(sb) {
		return fault.New(fault.Conflict, "sandbox %s is already running", sb.ID)
	}
	action := ""
	if body.AutoPause != nil {
		action = "delete"
		if *body.AutoPause {
			action = "suspend"
		}
	}
	if sb, err = g.wake(ctx, p, sb, secs, action); err != nil {
		return err
	}
	// An explicit resume replaces the envd access token; the answer carries it.
	if sb, err = g.api.RotateAccess(ctx, p, sb.ID); err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, g.sandboxJSON(r, sb))
	return nil
}

// templateJSON is E2B's Template (GET /templates).
type templateJSON struct {
	TemplateID  string    `json:"templateID"`
	BuildID     string    `json:"buildID"`
	CPUCount    int       `json:"cpuCount"`
	MemoryMB    int       `json:"memoryMB"`
	DiskSizeMB  int       `json:"diskSizeMB"`
	Public      bool      `json:"public"`
	Aliases     []string  `json:"aliases"`
	Names       []string  `json:"names"`
	CreatedAt   time.Time `json:"createdAt"`
	UpdatedAt   time.Time `json:"updatedAt"`
	CreatedBy   *string   `json:"createdBy"`
	SpawnCount  int       `json:"spawnCount"`
	BuildCount  int       `json:"buildCount"`
	BuildStatus string    `json:"buildStatus"`
	EnvdVersion string    `json:"envdVersion"`
}

// templates lists the template tags the caller's tenant may use (its own and the
// shared ones) as E2B templates (name:tag; ":latest" dropped), plus builtin templates
// not built yet.
func (g *Gateway) templates(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	rels, err := g.api.Templates(r.Context(), p, "")
	if err != nil {
		return err
	}
	out := []templateJSON{}
	seen := map[string]bool{}
	// Builds of a template: its releases (every build that succeeded made one).
	builds := map[string]int{}
	for _, rel := range rels {
		builds[rel.Name]++
	}
	add := func(id, name, build, status string, created time.Time) {
		if seen[id] {
			return
		}
		seen[id] = true
		out = append(out, templateJSON{TemplateID: id, BuildID: build, Public: true, Aliases: []string{id}, Names: []string{id},
			CreatedAt: created, UpdatedAt: created, BuildCount: builds[name], BuildStatus: status, EnvdVersion: envdpb.Version})
	}
	for _, rel := range rels {
		for _, tag := range rel.Tags {
			id, _ := templateNames(rel.Name + ":" + tag)
			add(id, rel.Name, rel.Digest, "ready", rel.CreatedAt)
		}
	}
	// A builtin template not built yet is built on first use: nothing is ready.
	for _, name := range g.cfg.BuiltinTemplates {
		add(name, name, "", "waiting", time.Time{})
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// templateAlias handles GET /templates/aliases/{alias} (the SDK's existence check):
// another tenant's template answers like a missing one.
func (g *Gateway) templateAlias(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	alias := r.PathValue("alias")
	rels, err := g.api.Templates(r.Context(), p, "")
	if err != nil {
		return err
	}
	found := slices.Contains(g.cfg.BuiltinTemplates, alias)
	for _, rel := range rels {
		for _, tag := range rel.Tags {
			id, _ := templateNames(rel.Name + ":" + tag)
			found = found || id == alias
		}
	}
	if !found {
		return fault.New(fault.NotFound, "template alias %q not found", alias)
	}
	writeJSON(w, http.StatusOK, map[string]any{"templateID": alias, "public": true})
	return nil
}
