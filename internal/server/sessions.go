package server

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/token"
)

var (
	allRights  = []string{api.RightRead, api.RightStdin, api.RightResize, api.RightSignal}
	userNameRe = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`)
)

// nodeToken mints a short token that lets this API call a node's internal endpoints for
// one sandbox.
func (a *API) nodeToken(sb *store.Sandbox) (string, error) {
	tok, _, err := a.cfg.Signer.Mint(token.Claims{Sandbox: sb.ID, Rights: []string{token.RightNode}, Epoch: sb.TokenEpoch}, time.Minute)
	return tok, err
}

// runningOn returns the node of a running sandbox, or a 409 explaining its state.
func (a *API) runningOn(ctx context.Context, sb *store.Sandbox) (*store.Node, error) {
	if sb.DeletedAt != nil || sb.DesiredState == api.StateDeleted {
		return nil, fault.New(fault.NotFound, "sandbox %q not found", sb.ID)
	}
	if sb.State != api.StateRunning || sb.NodeID == "" {
		return nil, fault.New(fault.Conflict, "sandbox %s is %s; it must be running", sb.ID, sb.State)
	}
	return a.st.GetNode(ctx, sb.NodeID)
}

// agentCall sends one JSON request to the sandbox's agent through its node's internal
// proxy and decodes the JSON answer into out.
func (a *API) agentCall(ctx context.Context, sb *store.Sandbox, method, path string, in, out any) error {
	node, err := a.runningOn(ctx, sb)
	if err != nil {
		return err
	}
	tok, err := a.nodeToken(sb)
	if err != nil {
		return err
	}
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, node.DataPlaneURL+"/internal/v1/sandboxes/"+sb.ID+"/agent"+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := a.cfg.NodeClient.Do(req)
	if err != nil {
		return fault.New(fault.Unavailable, "node %s unreachable: %v", node.Name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		return agentError(resp)
	}
	if out == nil {
		return nil
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(out); err != nil {
		return fmt.Errorf("decode agent answer: %w", err)
	}
	return nil
}

// agentError turns an error answer relayed from an agent (or node) into a fault.
func agentError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	msg := string(b)
	var we wire.Error
	var ae api.Error
	if json.Unmarshal(b, &we) == nil && we.Message != "" {
		msg = we.Message
	} else if json.Unmarshal(b, &ae) == nil && ae.Error.Message != "" {
		msg = ae.Error.Message
	}
	k := fault.Internal
	switch resp.StatusCode {
	case http.StatusBadRequest:
		k = fault.Invalid
	case http.StatusNotFound:
		k = fault.NotFound
	case http.StatusConflict:
		k = fault.Conflict
	case http.StatusUnauthorized:
		k = fault.Unauthorized
	case http.StatusForbidden:
		k = fault.Forbidden
	case http.StatusRequestEntityTooLarge:
		k = fault.TooLarge
	case http.StatusInsufficientStorage:
		k = fault.InsufficientStorage
	case http.StatusServiceUnavailable, http.StatusBadGateway:
		k = fault.Unavailable
	}
	return &fault.Error{Kind: k, Msg: msg}
}

func (a *API) createSession(w http.ResponseWriter, r *http.Request) error {
	var req api.CreateSessionRequest
	if err := decodeJSON(w, r, &req); err != nil {
		return err
	}
	sb, err := a.sandboxFor(r, r.PathValue("id"))
	if err != nil {
		return err
	}
	if sb, err = a.awake(r, sb); err != nil {
		return err
	}
	node, err := a.runningOn(r.Context(), sb)
	if err != nil {
		return err
	}
	rights := req.Rights
	if len(rights) == 0 {
		rights = allRights
	}
	for _, rt := range rights {
		if !slices.Contains(allRights, rt) {
			return invalid("unknown right %q; rights are read, stdin, resize, signal", rt)
		}
	}
	ttl := a.cfg.TokenTTL
	if req.TokenTTL != "" {
		d, err := time.ParseDuration(req.TokenTTL)
		if err != nil || d < time.Second || d > a.cfg.MaxTokenTTL {
			return invalid("token_ttl must be a duration between 1s and %s", a.cfg.MaxTokenTTL)
		}
		ttl = d
	}
	var info wire.ProcessInfo
	if req.PID != 0 {
		if len(req.Argv) > 0 || req.Command != "" || req.PTY != nil || req.Stdin || len(req.Env) > 0 || req.Cwd != "" || req.User != "" || req.Timeout != "" {
			return invalid("pid re-attaches to an existing process; do not combine it with command fields")
		}
		if req.PID < 0 {
			return invalid("pid must be positive")
		}
		if err := a.agentCall(r.Context(), sb, http.MethodGet, "/v1/processes/"+strconv.Itoa(req.PID), nil, &info); err != nil {
			return err
		}
	} else {
		spec, err := processSpec(&req)
		if err != nil {
			return err
		}
		if err := a.agentCall(r.Context(), sb, http.MethodPost, "/v1/processes", spec, &info); err != nil {
			return err
		}
	}
	sid := ids.Session()
	tok, claims, err := a.cfg.Signer.Mint(token.Claims{Sandbox: sb.ID, PID: info.PID, Session: sid, Rights: rights, Epoch: sb.TokenEpoch}, ttl)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, api.CommandSession{
		SessionID: sid,
		SandboxID: sb.ID,
		PID:       info.PID,
		AttachURL: fmt.Sprintf("%s/v1/dp/sandboxes/%s/processes/%d/attach", node.DataPlaneURL, sb.ID, info.PID),
		Token:     tok,
		ExpiresAt: claims.ExpiresAt(),
		Rights:    rights,
	})
	return nil
}

// processSpec validates a new-command session request and turns it into an agent spec.
// The process is gated: it starts when the session is first attached.
func processSpec(req *api.CreateSessionRequest) (*wire.ProcessSpec, error) {
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
	if err := validateMap("env", req.Env, envKeyRe); err != nil {
		return nil, err
	}
	if spec.User == "" {
		spec.User = "root"
	}
	if !userNameRe.MatchString(spec.User) {
		return nil, invalid("user %q is not a valid user name", spec.User)
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
		if req.PTY.Rows < 1 || req.PTY.Rows > 1000 || req.PTY.Cols < 1 || req.PTY.Cols > 1000 {
			return nil, invalid("pty rows and cols must be between 1 and 1000")
		}
		spec.PTY = &wire.Size{Rows: uint16(req.PTY.Rows), Cols: uint16(req.PTY.Cols)}
	}
	return spec, nil
}

// processFromWire converts an agent process record to its API form.
func processFromWire(p wire.ProcessInfo) api.Process {
	return api.Process{PID: p.PID, Argv: p.Argv, Cwd: p.Cwd, User: p.User, State: p.State, ExitCode: p.ExitCode,
		Signal: p.Signal, PTY: p.PTY, Stdin: p.Stdin, StartedAt: p.StartedAt, EndedAt: p.EndedAt}
}

func (a *API) listProcesses(w http.ResponseWriter, r *http.Request) error {
	sb, err := a.sandboxFor(r, r.PathValue("id"))
	if err != nil {
		return err
	}
	if sb, err = a.awake(r, sb); err != nil {
		return err
	}
	var list []wire.ProcessInfo
	if err := a.agentCall(r.Context(), sb, http.MethodGet, "/v1/processes", nil, &list); err != nil {
		return err
	}
	out := make([]api.Process, 0, len(list))
	for _, p := range list {
		out = append(out, processFromWire(p))
	}
	writeJSON(w, http.StatusOK, map[string]any{"processes": out})
	return nil
}

func (a *API) getProcess(w http.ResponseWriter, r *http.Request) error {
	pid, err := strconv.Atoi(r.PathValue("pid"))
	if err != nil || pid <= 0 {
		return invalid("pid must be a positive integer")
	}
	sb, err := a.sandboxFor(r, r.PathValue("id"))
	if err != nil {
		return err
	}
	if sb, err = a.awake(r, sb); err != nil {
		return err
	}
	var p wire.ProcessInfo
	if err := a.agentCall(r.Context(), sb, http.MethodGet, "/v1/processes/"+strconv.Itoa(pid), nil, &p); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, processFromWire(p))
	return nil
}
