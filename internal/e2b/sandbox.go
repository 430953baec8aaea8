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
	"github.com/spacedev/space/internal/rest"
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
// later reports whether err says when to try again (the database is restarting): such
// a request is answered 503 with Retry-After, which clients retry, never a 502 that
// says the sandbox is gone or unreachable.
func later(err error) bool { return fault.RetryAfterOf(err) > 0 }

func notFound502(w http.ResponseWriter, id string) {
	writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "message": "The sandbox was not found", "code": http.StatusBadGateway})
}

// envd's answers to requests whose credentials do not hold (401, as envd words them).
// Which one a request gets depends only on the request and on whether its credentials
// verify — never on whether the sandbox exists, runs or is another tenant's.
const (
	msgMissingSignature = "missing signature query parameter"
	msgInvalidSignature = "invalid signature"
	msgExpiredSignature = "signature is already expired"
	msgTokenMismatch    = "access token present in header but does not match"
	msgUnauthorized     = "unauthorized access, please provide a valid access token or method signing if supported"
	// space refuses what envd accepts here: a signed URL that never expires.
	msgNoExpiration = "signature_expiration is required: signed URLs must expire (the SDKs' useSignatureExpiration option)"
)

// unauthorized is envd's answer to a request without a valid access token.
func unauthorized(w http.ResponseWriter) { writeError(w, http.StatusUnauthorized, msgUnauthorized) }

// fileSignature is the signature of a /files request under token: v1_ +
// base64(sha256(path:op:user:token[:expiration])) without padding, op being read (GET)
// or write (POST). ok is false when the request cannot be signed (another method).
func fileSignature(r *http.Request, token string) (sig string, ok bool) {
	op := ""
	switch r.Method {
	case http.MethodGet:
		op = "read"
	case http.MethodPost:
		op = "write"
	default:
		return "", false
	}
	q := r.URL.Query()
	raw := q.Get("path") + ":" + op + ":" + q.Get("username") + ":" + token
	if exp := q.Get("signature_expiration"); exp != "" {
		raw += ":" + exp
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:]), true
}

// signatureMatches compares the request's signature with token's in constant time.
func signatureMatches(r *http.Request, token string) bool {
	want, ok := fileSignature(r, token)
	got := r.URL.Query().Get("signature")
	return ok && got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}

// checkSignedForm checks what a signed /files URL must carry whatever sandbox it is
// for: a signature, and an expiration that is a canonical integer if it is given. It
// returns the status and message of a refusal, or 0, and the expiration (-1: none).
// A URL without an expiration is refused only once its signature has matched (space's
// rule: signed URLs must expire), so that a forged one is told it is invalid first.
func checkSignedForm(r *http.Request) (int, string, int64) {
	q := r.URL.Query()
	if !q.Has("signature") {
		return http.StatusUnauthorized, msgMissingSignature, 0
	}
	s := q.Get("signature_expiration")
	if s == "" {
		return 0, "", -1
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || strconv.FormatInt(n, 10) != s {
		return http.StatusBadRequest, "invalid signature_expiration " + strconv.Quote(s), 0
	}
	return 0, "", n
}

// checkFiles applies envd's rules for /files: an X-Access-Token header must be the
// token; without it the signature must match, must not be expired, and (space's rule)
// must expire within maxTTL. It returns the status and envd's message of a refusal, or
// 0.
func checkFiles(r *http.Request, token string, now time.Time, maxTTL time.Duration) (int, string) {
	if got := r.Header.Get("X-Access-Token"); got != "" {
		if subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
			return http.StatusUnauthorized, msgTokenMismatch
		}
		return 0, ""
	}
	status, msg, exp := checkSignedForm(r)
	if status != 0 {
		return status, msg
	}
	if !signatureMatches(r, token) {
		return http.StatusUnauthorized, msgInvalidSignature
	}
	if exp < 0 {
		return http.StatusUnauthorized, msgNoExpiration
	}
	if exp < now.Unix() {
		return http.StatusUnauthorized, msgExpiredSignature
	}
	if time.Unix(exp, 0).Sub(now) > maxTTL {
		return http.StatusUnauthorized, fmt.Sprintf("signature_expiration is more than %s away (this server's limit for signed URLs)", maxTTL)
	}
	return 0, ""
}

// authenticate checks an envd request's access token — the X-Access-Token header, or
// for GET and POST /files a signed URL — against sandbox id, and returns the sandbox and
// the principal the request acts as (a member of the sandbox's tenant), or the status
// and message of a refusal, or the error that kept it from checking (the database is
// away). It reads the sandbox's row only; it wakes nothing and
// changes nothing. A sandbox that does not exist (or a warm-pool member) is checked
// against a token nobody has, so it costs the same and answers the same.
func (g *Gateway) authenticate(ctx context.Context, r *http.Request, id string) (*store.Sandbox, *service.Principal, int, string, error) {
	sb, err := g.st.GetSandbox(ctx, id)
	if err != nil && !fault.Is(err, fault.NotFound) {
		// The token cannot be checked (the database is away): a 503 the SDK retries,
		// never envd's 401 for a token that does not match (until 2026-12-07), which
		// tells the SDK the sandbox's credentials are wrong for good.
		g.log.Warn("envd authentication: load sandbox", "sandbox", id, "err", err)
		return nil, nil, 0, "", err
	}
	tenant, epoch := "", int64(-1)
	if sb != nil && sb.PoolKey == "" {
		tenant, epoch = sb.Tenant, sb.AccessEpoch
	}
	token := g.accessTokenOf(tenant, id, epoch)
	status, msg := 0, ""
	if r.URL.Path == "/files" && (r.Method == http.MethodGet || r.Method == http.MethodPost) {
		status, msg = checkFiles(r, token, time.Now(), g.cfg.MaxSignedURLTTL)
	} else if subtle.ConstantTimeCompare([]byte(r.Header.Get("X-Access-Token")), []byte(token)) != 1 {
		status, msg = http.StatusUnauthorized, msgUnauthorized
	}
	if status == 0 && epoch < 0 {
		status, msg = http.StatusUnauthorized, msgUnauthorized // unreachable: nobody has that token
	}
	if status != 0 {
		return nil, nil, status, msg, nil
	}
	return sb, &service.Principal{Tenant: sb.Tenant, Role: store.RoleMember}, 0, "", nil
}

// serveUnroutedFiles serves a /files request that names no sandbox: a signed
// uploadUrl()/downloadUrl() link behind a single E2B_SANDBOX_URL (the SDKs put no
// sandbox id in those links). The sandbox is the one whose access token verifies the
// signature (or equals the X-Access-Token header): every sandbox that is not deleted
// is a candidate, each compared in constant time. Nothing found is envd's 401.
func (g *Gateway) serveUnroutedFiles(w http.ResponseWriter, r *http.Request) {
	header := r.Header.Get("X-Access-Token")
	if header == "" {
		if status, msg, _ := checkSignedForm(r); status != 0 {
			writeError(w, status, msg)
			return
		}
	}
	list, err := g.st.ListSandboxes(r.Context(), store.SandboxFilter{})
	if err != nil {
		g.fail(w, r, err)
		return
	}
	for _, sb := range list {
		token := g.accessToken(sb)
		match := false
		if header != "" {
			match = subtle.ConstantTimeCompare([]byte(header), []byte(token)) == 1
		} else {
			match = signatureMatches(r, token)
		}
		if match {
			g.serveSandbox(w, r, sb.ID, envdpb.Port)
			return
		}
	}
	if header != "" {
		writeError(w, http.StatusUnauthorized, msgTokenMismatch)
		return
	}
	writeError(w, http.StatusUnauthorized, msgInvalidSignature)
}

// serveSandbox relays one envd request to the sandbox's agent, after authentication.
func (g *Gateway) serveSandbox(w http.ResponseWriter, r *http.Request, id string, port int) {
	ctx := r.Context()
	if port != envdpb.Port {
		g.servePort(w, r, id, port)
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
	sb, p, status, msg, err := g.authenticate(ctx, r, id)
	if err != nil {
		g.fail(w, r, err)
		return
	}
	if status != 0 {
		writeError(w, status, msg)
		return
	}
	if err := g.api.Allow(ctx, p); err != nil {
		g.fail(w, r, err)
		return
	}
	// The row authenticate read says whether the sandbox runs; only one that does not
	// is waited for (or resumed) with a fresh read.
	if sb.State != api.StateRunning || sb.DesiredState != api.StateRunning || sb.DeletedAt != nil {
		sb, err = g.runningSandbox(ctx, p, sb.ID)
	}
	if err != nil {
		// An autoResume over the tenant's quota says why; the database away, or this
		// process stopping, says to retry (never that the sandbox is gone).
		if fault.Is(err, fault.QuotaExceeded) || later(err) || rest.ShuttingDown(r) {
			g.fail(w, r, err)
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
	// commands.run (process.Process/Start) is one agent call that starts the process
	// and streams its output; Reach finds the agent without a query when it can.
	agent, err := g.api.Reach(ctx, p, sb.ID, true)
	if err == nil {
		err = agent.Relay(uw, r, envdpb.Prefix+r.URL.Path, q, g.log)
	}
	if err != nil {
		if uw.wrote {
			g.log.Debug("envd relay ended", "sandbox", id, "err", err)
			return
		}
		if ctx.Err() != nil {
			if rest.ShuttingDown(r) {
				g.fail(w, r, err) // says to retry
			}
			return
		}
		if later(err) {
			g.fail(w, r, err)
			return
		}
		g.log.Warn("envd relay failed", "sandbox", id, "path", r.URL.Path, "err", err)
		writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "message": "The sandbox is not reachable: " + fault.Message(err),
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
		// A sandbox paused without its memory is resumed explicitly only (E2B's rule).
		if err != nil || secs <= 0 || sb.DesiredState == api.StateStopped {
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
