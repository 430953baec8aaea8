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
// errors).
func notFound502(w http.ResponseWriter, id string) {
	writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "message": "The sandbox was not found", "code": http.StatusBadGateway})
}

// envd's answers to /files requests whose credentials do not hold (all 401, as envd
// gives them).
const (
	msgMissingSignature = "missing signature query parameter"
	msgInvalidSignature = "invalid signature"
	msgExpiredSignature = "signature is already expired"
	msgTokenMismatch    = "access token present in header but does not match"
	msgUnauthorized     = "unauthorized access, please provide a valid access token or method signing if supported"
)

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

// checkFiles applies envd's rules for /files: an X-Access-Token header must be the
// token; without it the signature must match, then must not be expired. It returns
// the status and envd's message of a refusal, or 0.
func checkFiles(r *http.Request, token string, now time.Time) (int, string) {
	if got := r.Header.Get("X-Access-Token"); got != "" {
		if subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
			return http.StatusUnauthorized, msgTokenMismatch
		}
		return 0, ""
	}
	q := r.URL.Query()
	if !q.Has("signature") {
		return http.StatusUnauthorized, msgMissingSignature
	}
	var exp int64
	if s := q.Get("signature_expiration"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return http.StatusBadRequest, "invalid signature_expiration " + strconv.Quote(s)
		}
		exp = n
	}
	if !signatureMatches(r, token) {
		return http.StatusUnauthorized, msgInvalidSignature
	}
	if q.Get("signature_expiration") != "" && exp < now.Unix() {
		return http.StatusUnauthorized, msgExpiredSignature
	}
	return 0, ""
}

// authorize checks envd's access rules: the access token on everything but GET
// /health and /files; /files takes the token or a valid signature (checkFiles). It
// returns the status and message of a refusal, or 0.
func (g *Gateway) authorize(r *http.Request, id string) (int, string) {
	token := g.accessToken(id)
	switch {
	case r.URL.Path == "/health" && r.Method == http.MethodGet:
		return 0, ""
	case r.URL.Path == "/files" && (r.Method == http.MethodGet || r.Method == http.MethodPost):
		return checkFiles(r, token, time.Now())
	}
	if subtle.ConstantTimeCompare([]byte(r.Header.Get("X-Access-Token")), []byte(token)) != 1 {
		return http.StatusUnauthorized, msgUnauthorized
	}
	return 0, ""
}

// serveUnroutedFiles serves a /files request that names no sandbox: a signed
// uploadUrl()/downloadUrl() link behind a single E2B_SANDBOX_URL (the SDKs put no
// sandbox id in those links). The sandbox is the one whose access token verifies the
// signature (or equals the X-Access-Token header): every sandbox that is not deleted
// is a candidate, each compared in constant time. Nothing found is envd's 401.
func (g *Gateway) serveUnroutedFiles(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	header := r.Header.Get("X-Access-Token")
	if header == "" && !q.Has("signature") {
		writeError(w, http.StatusUnauthorized, msgMissingSignature)
		return
	}
	if s := q.Get("signature_expiration"); s != "" {
		if _, err := strconv.ParseInt(s, 10, 64); err != nil {
			writeError(w, http.StatusBadRequest, "invalid signature_expiration "+strconv.Quote(s))
			return
		}
	}
	list, err := g.st.ListSandboxes(r.Context(), store.SandboxFilter{})
	if err != nil {
		g.fail(w, r, err)
		return
	}
	for _, sb := range list {
		token := g.accessToken(sb.ID)
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

// serveSandbox relays one envd request to the sandbox's agent.
func (g *Gateway) serveSandbox(w http.ResponseWriter, r *http.Request, id string, port int) {
	ctx := r.Context()
	if !ids.ValidSandbox(id) {
		notFound502(w, id)
		return
	}
	if port != envdpb.Port {
		g.servePort(w, r, id, port)
		return
	}
	if r.URL.RawPath != "" || !envdPathRe.MatchString(r.URL.Path) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no envd route for %s %s", r.Method, r.URL.Path))
		return
	}
	if status, msg := g.authorize(r, id); status != 0 {
		writeError(w, status, msg)
		return
	}
	sb, err := g.runningSandbox(ctx, id)
	if err != nil {
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
	t, err := g.api.Running(ctx, g.envdCaller, sb.ID, true)
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
// waited for; a paused one is resumed only when it was created with autoResume.
func (g *Gateway) runningSandbox(ctx context.Context, id string) (*store.Sandbox, error) {
	sb, err := g.live(ctx, g.envdCaller, id)
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
		return g.wake(ctx, g.envdCaller, sb, secs, "")
	}
	woken, err := g.api.Awake(ctx, g.envdCaller, sb, false) // starting or resuming: wait
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
