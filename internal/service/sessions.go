package service

import (
	"context"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/token"
)

var (
	allRights  = []string{api.RightRead, api.RightStdin, api.RightResize, api.RightSignal}
	userNameRe = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`)
)

// maxPTY bounds terminal rows and columns.
const maxPTY = 1000

// ValidUser reports whether u is a valid user name (empty is valid: the default).
func ValidUser(u string) error {
	if u != "" && !userNameRe.MatchString(u) {
		return invalid("user %q is not a valid user name", u)
	}
	return nil
}

// ValidPTY checks terminal dimensions.
func ValidPTY(rows, cols int) error {
	if rows < 1 || rows > maxPTY || cols < 1 || cols > maxPTY {
		return invalid("pty rows and cols must be between 1 and %d", maxPTY)
	}
	return nil
}

// Target is how to reach a running sandbox's agent: through its node's internal agent
// proxy, with a short node token.
type Target struct {
	Sandbox *store.Sandbox
	Node    *store.Node
	// Base is the URL of the node's agent proxy for the sandbox; agent paths follow it.
	Base  string
	Token string
}

// target returns how to reach the agent of sb, which must be running.
func (s *Service) target(ctx context.Context, sb *store.Sandbox) (*Target, error) {
	if sb.DeletedAt != nil || sb.DesiredState == api.StateDeleted {
		return nil, notFound(sb.ID)
	}
	if sb.State == api.StateFailed {
		return nil, fault.New(fault.Conflict, "sandbox %s failed (%s); it must be running", sb.ID, sb.Error)
	}
	if sb.NodeID == "" {
		return nil, fault.New(fault.Conflict, "sandbox %s is %s; it must be running", sb.ID, sb.State)
	}
	node, err := s.st.GetNode(ctx, sb.NodeID)
	if err != nil {
		return nil, err
	}
	if err := deadNode(sb, node); err != nil {
		return nil, err
	}
	if sb.State != api.StateRunning {
		return nil, fault.New(fault.Conflict, "sandbox %s is %s; it must be running", sb.ID, sb.State)
	}
	tok, _, err := s.cfg.Signer.Mint(token.Claims{Sandbox: sb.ID, Rights: []string{token.RightNode}, Epoch: sb.TokenEpoch}, nodeTokenTTL)
	if err != nil {
		return nil, err
	}
	return &Target{Sandbox: sb, Node: node, Base: node.DataPlaneURL + "/internal/v1/sandboxes/" + sb.ID + "/agent", Token: tok}, nil
}

// Running loads a sandbox p may see, wakes it unless noWake, and returns how to reach
// its agent.
func (s *Service) Running(ctx context.Context, p *Principal, id string, noWake bool) (*Target, error) {
	sb, err := s.Sandbox(ctx, p, id)
	if err != nil {
		return nil, err
	}
	if sb, err = s.Awake(ctx, p, sb, noWake); err != nil {
		return nil, err
	}
	return s.target(ctx, sb)
}

// relay returns a client for the agent of a running sandbox through its node's agent
// proxy (Agent).
func (s *Service) relay(t *Target) *agentclient.Client {
	return agentclient.NewVia(t.Base, s.cfg.NodeClient.Transport, func() (string, error) { return t.Token, nil })
}

// CreateSession creates a command session: a new gated process (or, with req.PID, an
// existing one) and a token to attach to it on the sandbox's node.
//
// key is the request's Idempotency-Key ("" for none). For a new process the agent keeps
// it with the process (hashed with the caller's API key, apart from exec keys), and a
// repeat gets a session for that process instead of a second one (wire.ProcessSpec.Key):
// a new session id and token, the same pid and process_uid. A re-attach (req.PID)
// makes nothing, so it is safe to repeat without a key.
func (s *Service) CreateSession(ctx context.Context, p *Principal, id string, req api.CreateSessionRequest, noWake bool, key string) (api.CommandSession, error) {
	rights := req.Rights
	if len(rights) == 0 {
		rights = allRights
	}
	for _, rt := range rights {
		if !slices.Contains(allRights, rt) {
			return api.CommandSession{}, invalid("unknown right %q; rights are read, stdin, resize, signal", rt)
		}
	}
	ttl := s.cfg.TokenTTL
	if req.TokenTTL != "" {
		d, err := time.ParseDuration(req.TokenTTL)
		if err != nil || d < time.Second || d > s.cfg.MaxTokenTTL {
			return api.CommandSession{}, invalid("token_ttl must be a duration between 1s and %s", s.cfg.MaxTokenTTL)
		}
		ttl = d
	}
	var spec *wire.ProcessSpec
	if req.PID != 0 {
		if len(req.Argv) > 0 || req.Command != "" || req.PTY != nil || req.Stdin || len(req.Env) > 0 || req.Cwd != "" || req.User != "" || req.Timeout != "" {
			return api.CommandSession{}, invalid("pid re-attaches to an existing process; do not combine it with command fields")
		}
		if req.PID < 0 {
			return api.CommandSession{}, invalid("pid must be positive")
		}
	} else {
		if req.ProcessUID != "" {
			return api.CommandSession{}, invalid("process_uid goes with pid")
		}
		var err error
		if spec, err = ProcessSpec(&req); err != nil {
			return api.CommandSession{}, err
		}
	}
	if err := checkKey(key); err != nil {
		return api.CommandSession{}, err
	}
	if spec != nil && key != "" {
		spec.Key = processKey(p, "session", key)
	}
	t, err := s.Running(ctx, p, id, noWake)
	if err != nil {
		return api.CommandSession{}, err
	}
	agent, err := s.Agent(ctx, t)
	if err != nil {
		return api.CommandSession{}, err
	}
	var info wire.ProcessInfo
	if spec == nil {
		info, err = agent.Proc(req.PID, req.ProcessUID).Info(ctx)
	} else {
		info, err = agent.StartProcess(ctx, *spec)
	}
	if err != nil {
		return api.CommandSession{}, err
	}
	sid := ids.Session()
	// The token names the key that minted it: revoking the key ends it (and cuts its
	// streams) within a second, whatever its expiry.
	tok, claims, err := s.cfg.Signer.Mint(token.Claims{Sandbox: t.Sandbox.ID, PID: info.PID, Proc: info.UID, Session: sid,
		Rights: rights, Epoch: t.Sandbox.TokenEpoch, Key: p.KeyID}, ttl)
	if err != nil {
		return api.CommandSession{}, err
	}
	return api.CommandSession{
		SessionID:  sid,
		SandboxID:  t.Sandbox.ID,
		PID:        info.PID,
		ProcessUID: info.UID,
		AttachURL:  fmt.Sprintf("%s/v1/dp/sandboxes/%s/processes/%d/attach", t.Node.DataPlaneURL, t.Sandbox.ID, info.PID),
		Token:      tok,
		ExpiresAt:  claims.ExpiresAt(),
		Rights:     rights,
	}, nil
}

// ProcessSpec validates a new-command session request and turns it into an agent
// spec. The process is gated: it starts when the session is first attached.
func ProcessSpec(req *api.CreateSessionRequest) (*wire.ProcessSpec, error) {
	spec := &wire.ProcessSpec{Env: req.Env, Cwd: req.Cwd, User: req.User, Stdin: req.Stdin, Gated: true}
	switch {
	case len(req.Argv) > 0 && req.Command != "":
		return nil, invalid("give either argv or command, not both")
	case len(req.Argv) > 0:
		spec.Argv = req.Argv
	case req.Command != "":
		spec.Argv = []string{"/bin/bash", "-c", req.Command}
	default:
		return nil, invalid("a session needs argv, command or pid")
	}
	if len(spec.Argv[0]) == 0 {
		return nil, invalid("argv[0] is empty")
	}
	if err := ValidateMap("env", req.Env, true); err != nil {
		return nil, err
	}
	for i, arg := range spec.Argv {
		if strings.ContainsRune(arg, 0) {
			return nil, invalid("argv[%d] contains NUL", i)
		}
	}
	if err := checkText("cwd", spec.Cwd, false); err != nil {
		return nil, err
	}
	if spec.User == "" {
		spec.User = "root"
	}
	if err := ValidUser(spec.User); err != nil {
		return nil, err
	}
	if spec.Cwd != "" && spec.Cwd[0] != '/' {
		return nil, invalid("cwd must be an absolute path")
	}
	if req.Timeout != "" {
		d, err := time.ParseDuration(req.Timeout)
		if err != nil || d <= 0 {
			return nil, invalid("timeout must be a positive duration, like \"30s\"")
		}
		spec.TimeoutMs = d.Milliseconds()
	}
	if req.PTY != nil {
		if err := ValidPTY(req.PTY.Rows, req.PTY.Cols); err != nil {
			return nil, err
		}
		spec.PTY = &wire.Size{Rows: uint16(req.PTY.Rows), Cols: uint16(req.PTY.Cols)}
	}
	return spec, nil
}

// processFromWire converts an agent process record to its API form.
func processFromWire(p wire.ProcessInfo) api.Process {
	return api.Process{PID: p.PID, Argv: p.Argv, Cwd: p.Cwd, User: p.User, State: p.State, ExitCode: p.ExitCode,
		Signal: p.Signal, Error: p.Error, TimedOut: p.TimedOut, PTY: p.PTY, Stdin: p.Stdin, StartedAt: p.StartedAt, EndedAt: p.EndedAt}
}

// Processes lists a sandbox's processes (running and recently exited).
func (s *Service) Processes(ctx context.Context, p *Principal, id string, noWake bool) ([]api.Process, error) {
	t, err := s.Running(ctx, p, id, noWake)
	if err != nil {
		return nil, err
	}
	agent, err := s.Agent(ctx, t)
	if err != nil {
		return nil, err
	}
	list, err := agent.ListProcesses(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]api.Process, 0, len(list))
	for _, pi := range list {
		out = append(out, processFromWire(pi))
	}
	return out, nil
}

// Process describes one process of a sandbox.
func (s *Service) Process(ctx context.Context, p *Principal, id, pid string, noWake bool) (api.Process, error) {
	n, err := strconv.Atoi(pid)
	if err != nil || n <= 0 {
		return api.Process{}, invalid("pid must be a positive integer")
	}
	t, err := s.Running(ctx, p, id, noWake)
	if err != nil {
		return api.Process{}, err
	}
	agent, err := s.Agent(ctx, t)
	if err != nil {
		return api.Process{}, err
	}
	pi, err := agent.GetProcess(ctx, n)
	if err != nil {
		return api.Process{}, err
	}
	return processFromWire(pi), nil
}

// NodeTransport is the transport the service reaches nodes with (for relays that
// stream through a node's internal agent proxy verbatim).
func (s *Service) NodeTransport() http.RoundTripper {
	if s.cfg.NodeClient.Transport != nil {
		return s.cfg.NodeClient.Transport
	}
	return http.DefaultTransport
}
