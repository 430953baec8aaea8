package e2b

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/store"
)

// The sandbox plane: envd requests of the SDKs, relayed to the sandbox's agent.

var (
	// hostRe matches E2B's sandbox host names, <port>-<sandbox id>.<domain>.
	hostRe = regexp.MustCompile(`^([0-9]{1,5})-([a-z0-9]+)\.`)
	// envdPathRe is the set of envd paths relayed to the agent; nothing else of the
	// agent's API is reachable this way.
	envdPathRe = regexp.MustCompile(`^/(health|files|envs|metrics|process\.Process/[A-Za-z]+|filesystem\.Filesystem/[A-Za-z]+)$`)
)

// route decides whether r is sandbox traffic and for which sandbox and port: by
// host name <port>-<id>.<domain>, else by the E2b-Sandbox-Id and E2b-Sandbox-Port
// headers (which must come together).
func route(r *http.Request) (id string, port int, ok bool, err error) {
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	if m := hostRe.FindStringSubmatch(strings.ToLower(host)); m != nil {
		port, _ = strconv.Atoi(m[1])
		return m[2], port, true, nil
	}
	hid, hport := r.Header.Get("E2b-Sandbox-Id"), r.Header.Get("E2b-Sandbox-Port")
	if hid == "" && hport == "" {
		return "", 0, false, nil
	}
	if hid == "" || hport == "" {
		return "", 0, false, errors.New("sandbox requests need both E2b-Sandbox-Id and E2b-Sandbox-Port")
	}
	port, err = strconv.Atoi(hport)
	if err != nil || port < 1 || port > 65535 {
		return "", 0, false, fmt.Errorf("invalid E2b-Sandbox-Port %q", hport)
	}
	return hid, port, true, nil
}

// notFound502 is E2B's answer for a sandbox that is unknown, paused or not reachable:
// the SDKs read a 502 as "the sandbox is not running" (isRunning() false, timeout
// errors). It is given only to requests whose access token was verified.
func notFound502(w http.ResponseWriter, id string) {
	writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "message": "The sandbox was not found", "code": http.StatusBadGateway})
}

// unauthorized is the one answer to an envd request whose access token (or signed URL)
// does not verify — whether the sandbox exists, is another tenant's or never existed.
func unauthorized(w http.ResponseWriter) {
	writeError(w, http.StatusUnauthorized, "unauthorized access, please provide a valid access token or method signing if supported")
}

// validSignature checks a signed /files URL: v1_ + base64(sha256(path:op:user:token:
// expiration)) without padding, expiring in the future but at most maxTTL from now. A
// URL without an expiration never would, and is refused.
func validSignature(r *http.Request, token string, now time.Time, maxTTL time.Duration) bool {
	q := r.URL.Query()
	sig, exp := q.Get("signature"), q.Get("signature_expiration")
	if sig == "" || exp == "" {
		return false
	}
	n, err := strconv.ParseInt(exp, 10, 64)
	if err != nil || strconv.FormatInt(n, 10) != exp || now.Unix() > n || time.Unix(n, 0).Sub(now) > maxTTL {
		return false
	}
	op := "write"
	if r.Method == http.MethodGet {
		op = "read"
	}
	sum := sha256.Sum256([]byte(q.Get("path") + ":" + op + ":" + q.Get("username") + ":" + token + ":" + exp))
	want := "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
	return subtle.ConstantTimeCompare([]byte(sig), []byte(want)) == 1
}

// authenticate checks an envd request's access token — the X-Access-Token header, or
// for /files a signed URL — against sandbox id, and returns the sandbox and the
// principal the request acts as (a member of the sandbox's tenant). It reads the
// sandbox's row only; it wakes nothing and changes nothing. A sandbox that does not
// exist is checked against a token nobody has, so it costs the same.
func (g *Gateway) authenticate(ctx context.Context, r *http.Request, id string) (*store.Sandbox, *service.Principal, bool) {
	sb, err := g.st.GetSandbox(ctx, id)
	if err != nil && !fault.Is(err, fault.NotFound) {
		g.log.Warn("envd authentication: load sandbox", "sandbox", id, "err", err)
	}
	tenant, epoch := "", int64(-1)
	if sb != nil && sb.PoolKey == "" {
		tenant, epoch = sb.Tenant, sb.AccessEpoch
	}
	token := g.accessTokenOf(tenant, id, epoch)
	got := r.Header.Get("X-Access-Token")
	var ok bool
	if got == "" && r.URL.Path == "/files" {
		ok = validSignature(r, token, time.Now(), g.cfg.MaxSignedURLTTL)
	} else {
		ok = subtle.ConstantTimeCompare([]byte(got), []byte(token)) == 1
	}
	if !ok || epoch < 0 {
		return nil, nil, false
	}
	return sb, &service.Principal{Tenant: sb.Tenant, Role: store.RoleMember}, true
}

// serveSandbox relays one envd request to the sandbox's agent, after authentication.
func (g *Gateway) serveSandbox(w http.ResponseWriter, r *http.Request, id string, port int) {
	ctx := r.Context()
	if port != envdpb.Port {
		// space forwards no sandbox ports but envd's: the same answer for every
		// sandbox, running, paused, another tenant's or none.
		writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "port": port, "code": http.StatusBadGateway,
			"message": fmt.Sprintf("port %d is not reachable: space forwards only envd's port (%d) of a sandbox", port, envdpb.Port)})
		return
	}
	if r.URL.RawPath != "" || !envdPathRe.MatchString(r.URL.Path) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no envd route for %s %s", r.Method, r.URL.Path))
		return
	}
	if !ids.ValidSandbox(id) {
		unauthorized(w)
		return
	}
	sb, p, ok := g.authenticate(ctx, r, id)
	if !ok {
		unauthorized(w)
		return
	}
	if err := g.api.Allow(ctx, p); err != nil {
		g.fail(w, r, err)
		return
	}
	sb, err := g.runningSandbox(ctx, p, sb.ID)
	if err != nil {
		if fault.Is(err, fault.QuotaExceeded) {
			g.fail(w, r, err) // an autoResume over the tenant's quota: say why
			return
		}
		if ctx.Err() == nil {
			g.log.Debug("envd request for a sandbox that is not running", "sandbox", id, "err", err)
		}
		notFound502(w, id)
		return
	}
	// What the agent needs of the SDK's headers, under names the proxies leave alone;
	// the access token stays here.
	if a := r.Header.Get("Authorization"); a != "" {
		r.Header.Set(envdpb.AuthHeader, a)
	} else {
		r.Header.Del(envdpb.AuthHeader)
	}
	ae := r.Header.Get("Accept-Encoding")
	if ae == "" {
		ae = "identity"
	}
	r.Header.Set(envdpb.AcceptEncodingHeader, ae)
	r.Header.Set(envdpb.TunnelHeader, "1")
	r.Header.Del(envdpb.StatusHeader)
	r.Header.Del("X-Access-Token")
	q := r.URL.Query()
	q.Del("signature")
	q.Del("signature_expiration")
	// The agent answers as soon as it has read the request, while the relay may still
	// be finishing its read of the body: without full duplex, Go's HTTP/1 server
	// would close the body when the answer starts and the relay would cut the stream.
	_ = http.NewResponseController(w).EnableFullDuplex()
	uw := &untunnel{ResponseWriter: w}
	t, err := g.api.Running(ctx, p, sb.ID, true)
	if err == nil {
		err = g.api.Agent(t).Relay(uw, r, envdpb.Prefix+r.URL.Path, q)
	}
	if err != nil {
		if uw.wrote {
			g.log.Debug("envd relay ended", "sandbox", id, "err", err)
			return
		}
		if ctx.Err() != nil {
			return
		}
		g.log.Warn("envd relay failed", "sandbox", id, "path", r.URL.Path, "err", err)
		writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "message": "The sandbox is not reachable: " + err.Error(),
			"code": http.StatusBadGateway})
	}
}

// runningSandbox returns the sandbox once it runs: one being started or resumed is
// waited for; a paused one is resumed only when it was created with autoResume. The
// caller has authenticated the request.
func (g *Gateway) runningSandbox(ctx context.Context, p *service.Principal, id string) (*store.Sandbox, error) {
	sb, err := g.live(ctx, p, id)
	if err != nil {
		return nil, err
	}
	if sb.State == api.StateRunning && sb.DesiredState == api.StateRunning {
		return sb, nil
	}
	if sb.State == api.StateFailed {
		return nil, fault.New(fault.Conflict, "sandbox %s failed", id)
	}
	if paused(sb) {
		secs, err := strconv.Atoi(sb.Metadata[autoResumeKey])
		if err != nil || secs <= 0 {
			return nil, fault.New(fault.Conflict, "sandbox %s is paused", id)
		}
		g.log.Info("auto-resuming sandbox for an envd request", "sandbox", id)
		return g.wake(ctx, p, sb, secs, "")
	}
	woken, err := g.api.Awake(ctx, p, sb, false) // starting or resuming: wait
	if err != nil {
		return nil, err
	}
	if woken.State != api.StateRunning {
		return nil, fault.New(fault.Conflict, "sandbox %s is %s", id, woken.State)
	}
	return woken, nil
}

// untunnel restores the status the agent tunneled in envdpb.StatusHeader.
type untunnel struct {
	http.ResponseWriter
	wrote bool
}

func (u *untunnel) WriteHeader(code int) {
	if u.wrote {
		return
	}
	u.wrote = true
	if s := u.Header().Get(envdpb.StatusHeader); s != "" {
		u.Header().Del(envdpb.StatusHeader)
		if n, err := strconv.Atoi(s); err == nil && n >= 200 && n <= 599 {
			code = n
		}
	}
	u.ResponseWriter.WriteHeader(code)
}

func (u *untunnel) Write(b []byte) (int, error) {
	if !u.wrote {
		u.WriteHeader(http.StatusOK)
	}
	return u.ResponseWriter.Write(b)
}

func (u *untunnel) Flush() {
	if !u.wrote {
		u.WriteHeader(http.StatusOK)
	}
	_ = http.NewResponseController(u.ResponseWriter).Flush()
}

func (u *untunnel) Unwrap() http.ResponseWriter { return u.ResponseWriter }
