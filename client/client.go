// Package client is the Go client of space's HTTP API: control-plane calls with an API
// key, and data-plane attach streams (SSE) with attachment tokens, including resuming a
// stream from its last event id so no output is lost across disconnects.
package client

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spacedev/space/api"
)

// Client talks to one space API endpoint.
type Client struct {
	BaseURL string
	APIKey  string
	HTTP    *http.Client
}

// New returns a client for baseURL (e.g. "http://127.0.0.1:7700").
func New(baseURL, apiKey string) *Client {
	return &Client{BaseURL: strings.TrimRight(baseURL, "/"), APIKey: apiKey, HTTP: &http.Client{}}
}

// Error is an error answer from the API.
type Error struct {
	Status  int
	Code    string
	Message string
	// RetryAfter is the answer's Retry-After (0 without one): the server says the
	// refusal passes on its own, as a 409 for a transition in flight does.
	RetryAfter time.Duration
}

func (e *Error) Error() string { return fmt.Sprintf("%s (%d %s)", e.Message, e.Status, e.Code) }

// IsNotFound reports whether err is a 404 from the API.
func IsNotFound(err error) bool {
	e, ok := err.(*Error)
	return ok && e.Status == http.StatusNotFound
}

func decodeError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	out := &Error{Status: resp.StatusCode, Code: http.StatusText(resp.StatusCode), Message: strings.TrimSpace(string(b))}
	var e api.Error
	if json.Unmarshal(b, &e) == nil && e.Error.Message != "" {
		out.Code, out.Message = e.Error.Code, e.Error.Message
	}
	if n, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && n >= 0 {
		out.RetryAfter = max(time.Duration(n)*time.Second, readRetryFirst)
	}
	return out
}

// Retries of reads that failed transiently (the server or its database restarting).
const (
	readRetries    = 8
	readRetryFirst = 100 * time.Millisecond
	readRetryMax   = 3 * time.Second
)

// transient reports whether a failed request may succeed when repeated: the server
// was unreachable or answered 502, 503 or 504.
func transient(err error) bool {
	var e *Error
	if errors.As(err, &e) {
		return e.Status == http.StatusBadGateway || e.Status == http.StatusServiceUnavailable || e.Status == http.StatusGatewayTimeout
	}
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET)
}

// do sends a request with the API key and decodes a JSON answer into out. Reads (GET)
// that fail transiently are repeated with a growing delay while ctx allows; other
// writes than doKeyed's are not.
func (c *Client) do(ctx context.Context, method, path string, in, out any, hdr http.Header) error {
	if method != http.MethodGet {
		return c.doOnce(ctx, method, path, in, out, hdr)
	}
	return repeatTransient(ctx, func() error { return c.doOnce(ctx, method, path, in, out, hdr) })
}

// doKeyed is do for the writes the server makes safe to repeat with an Idempotency-Key
// (creates, lifecycle verbs, clones, snapshots, command sessions, template builds,
// deletes of sandboxes and snapshots): it sends key, a new random one when key is "",
// and repeats a request that failed transiently as do repeats reads. The server
// answers a repeat with the first request's answer and makes nothing twice, also when
// the first request took effect and only its answer was lost. A 409 with Retry-After
// (the sandbox is in a transition that another verb must wait for: an idle suspend, a
// pause) is sent again once that has passed, for up to BusyWait in all.
func (c *Client) doKeyed(ctx context.Context, method, path string, in, out any, key string) error {
	if key == "" {
		key = newKey()
	}
	hdr := http.Header{"Idempotency-Key": {key}}
	return repeatBusy(ctx, func() error {
		return repeatTransient(ctx, func() error { return c.doOnce(ctx, method, path, in, out, hdr) })
	})
}

// BusyWait bounds how long a keyed write waits for a transition in flight.
const BusyWait = time.Minute

// repeatBusy calls f again while it answers a 409 with Retry-After, after that delay,
// for up to BusyWait and while ctx allows.
func repeatBusy(ctx context.Context, f func() error) error {
	deadline := time.Now().Add(BusyWait)
	for {
		err := f()
		var e *Error
		if !errors.As(err, &e) || e.Status != http.StatusConflict || e.RetryAfter <= 0 ||
			time.Now().Add(e.RetryAfter).After(deadline) || ctx.Err() != nil {
			return err
		}
		sleepCtx(ctx, e.RetryAfter)
	}
}

// newKey returns a new random Idempotency-Key.
func newKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return "go-" + hex.EncodeToString(b[:])
}

// repeatTransient calls f again while it fails transiently, with a growing delay, at
// most readRetries times more and while ctx allows.
func repeatTransient(ctx context.Context, f func() error) error {
	delay := readRetryFirst
	for attempt := 0; ; attempt++ {
		err := f()
		if err == nil || attempt >= readRetries || !transient(err) || ctx.Err() != nil {
			return err
		}
		sleepCtx(ctx, delay)
		delay = min(delay*2, readRetryMax)
	}
}

// rawBody is a request body sent as it is, with its content type (in is JSON
// otherwise).
type rawBody struct {
	data        []byte
	contentType string
}

func (c *Client) doOnce(ctx context.Context, method, path string, in, out any, hdr http.Header) error {
	var body io.Reader
	ctype := "application/json"
	if raw, ok := in.(rawBody); ok {
		body, ctype = bytes.NewReader(raw.data), raw.contentType
	} else if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.BaseURL+path, body)
	if err != nil {
		return err
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	if in != nil {
		req.Header.Set("Content-Type", ctype)
	}
	if c.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.APIKey)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		return decodeError(resp)
	}
	if out != nil {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	return nil
}

// CreateSandbox requests a sandbox. With idempotencyKey "" the client picks a key of
// its own for this call (see doKeyed); a caller that may send the request again itself,
// after a restart say, passes the same key each time.
func (c *Client) CreateSandbox(ctx context.Context, req api.CreateSandboxRequest, idempotencyKey string) (*api.Sandbox, error) {
	var sb api.Sandbox
	return &sb, c.doKeyed(ctx, http.MethodPost, "/v1/sandboxes", req, &sb, idempotencyKey)
}

// GetSandbox returns a sandbox.
func (c *Client) GetSandbox(ctx context.Context, id string) (*api.Sandbox, error) {
	var sb api.Sandbox
	return &sb, c.do(ctx, http.MethodGet, "/v1/sandboxes/"+url.PathEscape(id), nil, &sb, nil)
}

// ListOptions filters ListSandboxes.
type ListOptions struct {
	States   []string
	Metadata map[string]string
	// Tenant narrows an operator's list to one tenant.
	Tenant string
}

// ListSandboxes lists sandboxes.
func (c *Client) ListSandboxes(ctx context.Context, o ListOptions) ([]api.Sandbox, error) {
	q := url.Values{}
	if len(o.States) > 0 {
		q.Set("state", strings.Join(o.States, ","))
	}
	for k, v := range o.Metadata {
		q.Add("metadata", k+"="+v)
	}
	if o.Tenant != "" {
		q.Set("tenant", o.Tenant)
	}
	var out api.SandboxList
	path := "/v1/sandboxes"
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	err := c.do(ctx, http.MethodGet, path, nil, &out, nil)
	return out.Sandboxes, err
}

// DeleteSandbox requests deletion and returns the operation. It is sent again on a
// transient failure under an Idempotency-Key of its own (doKeyed): a repeat whose first
// attempt took effect gets that attempt's operation, not a 404.
func (c *Client) DeleteSandbox(ctx context.Context, id string) (*api.Operation, error) {
	var op api.Operation
	return &op, c.doKeyed(ctx, http.MethodDelete, "/v1/sandboxes/"+url.PathEscape(id), nil, &op, "")
}

// GetOperation returns an operation.
func (c *Client) GetOperation(ctx context.Context, id string) (*api.Operation, error) {
	var op api.Operation
	return &op, c.do(ctx, http.MethodGet, "/v1/operations/"+url.PathEscape(id), nil, &op, nil)
}

// SandboxOperations lists a sandbox's operations, newest first.
func (c *Client) SandboxOperations(ctx context.Context, sandboxID string) ([]api.Operation, error) {
	var out struct {
		Operations []api.Operation `json:"operations"`
	}
	err := c.do(ctx, http.MethodGet, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/operations", nil, &out, nil)
	return out.Operations, err
}

// WaitOperation long-polls until the operation is done or ctx ends.
func (c *Client) WaitOperation(ctx context.Context, id string) (*api.Operation, error) {
	for {
		var op api.Operation
		err := c.do(ctx, http.MethodGet, "/v1/operations/"+url.PathEscape(id)+"/wait?timeout=30s", nil, &op, nil)
		if err != nil {
			return nil, err
		}
		if op.Done() {
			return &op, nil
		}
		if ctx.Err() != nil {
			return &op, ctx.Err()
		}
	}
}

// CreateAndWait creates a sandbox and waits until its create operation is done. A
// failed create is returned as an error together with the sandbox.
func (c *Client) CreateAndWait(ctx context.Context, req api.CreateSandboxRequest) (*api.Sandbox, error) {
	sb, err := c.CreateSandbox(ctx, req, "")
	if err != nil {
		return nil, err
	}
	op, err := c.WaitOperation(ctx, sb.Operation.ID)
	if err != nil {
		return sb, err
	}
	if op.State == api.OpFailed {
		return sb, fmt.Errorf("create sandbox %s failed: %s", sb.ID, op.Error)
	}
	return c.GetSandbox(ctx, sb.ID)
}

// CreateSession creates a command session. It sends a key of its own and repeats a
// request that failed transiently (doKeyed): a command's process is started once.
func (c *Client) CreateSession(ctx context.Context, sandboxID string, req api.CreateSessionRequest) (*api.CommandSession, error) {
	var s api.CommandSession
	return &s, c.doKeyed(ctx, http.MethodPost, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/sessions", req, &s, "")
}

// BuildTemplate queues a build of a template spec (YAML, or JSON with contentType
// "application/json"; docs/templates.md) and returns its operation. It sends a key of
// its own and repeats a request that failed transiently (doKeyed): one build is queued.
func (c *Client) BuildTemplate(ctx context.Context, spec []byte, contentType string) (*api.Operation, error) {
	var op api.Operation
	return &op, c.doKeyed(ctx, http.MethodPost, "/v1/templates", rawBody{spec, contentType}, &op, "")
}

// ListProcesses lists a sandbox's processes.
func (c *Client) ListProcesses(ctx context.Context, sandboxID string) ([]api.Process, error) {
	var out struct {
		Processes []api.Process `json:"processes"`
	}
	err := c.do(ctx, http.MethodGet, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/processes", nil, &out, nil)
	return out.Processes, err
}

// GetProcess returns one process.
func (c *Client) GetProcess(ctx context.Context, sandboxID string, pid int) (*api.Process, error) {
	var p api.Process
	return &p, c.do(ctx, http.MethodGet, fmt.Sprintf("/v1/sandboxes/%s/processes/%d", url.PathEscape(sandboxID), pid), nil, &p, nil)
}

// RevokeTokens revokes every attachment token of a sandbox.
func (c *Client) RevokeTokens(ctx context.Context, sandboxID string) error {
	return c.do(ctx, http.MethodPost, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/revoke-tokens", nil, nil, nil)
}

// CreateAPIKey creates an API key (admin only).
func (c *Client) CreateAPIKey(ctx context.Context, req api.CreateAPIKeyRequest) (*api.APIKey, error) {
	var k api.APIKey
	return &k, c.do(ctx, http.MethodPost, "/v1/apikeys", req, &k, nil)
}

// ListAPIKeys lists the API keys the caller may see (admins: their tenant's;
// operators: every tenant's).
func (c *Client) ListAPIKeys(ctx context.Context) ([]api.APIKey, error) {
	return c.ListAPIKeysOf(ctx, "")
}

// ListAPIKeysOf lists the API keys of one tenant ("" = all the caller may see).
func (c *Client) ListAPIKeysOf(ctx context.Context, tenant string) ([]api.APIKey, error) {
	var out struct {
		Keys []api.APIKey `json:"api_keys"`
	}
	err := c.do(ctx, http.MethodGet, "/v1/apikeys"+tenantQuery(tenant), nil, &out, nil)
	return out.Keys, err
}

func tenantQuery(tenant string) string {
	if tenant == "" {
		return ""
	}
	return "?tenant=" + url.QueryEscape(tenant)
}

// CreateTenant creates a tenant (operators only).
func (c *Client) CreateTenant(ctx context.Context, name string) (*api.Tenant, error) {
	var t api.Tenant
	return &t, c.do(ctx, http.MethodPost, "/v1/tenants", api.CreateTenantRequest{Name: name}, &t, nil)
}

// ListTenants lists tenants with their quotas and usage (operators only).
func (c *Client) ListTenants(ctx context.Context) ([]api.Tenant, error) {
	var out struct {
		Tenants []api.Tenant `json:"tenants"`
	}
	err := c.do(ctx, http.MethodGet, "/v1/tenants", nil, &out, nil)
	return out.Tenants, err
}

// GetTenant describes a tenant: its quotas and usage.
func (c *Client) GetTenant(ctx context.Context, name string) (*api.Tenant, error) {
	var t api.Tenant
	return &t, c.do(ctx, http.MethodGet, "/v1/tenants/"+url.PathEscape(name), nil, &t, nil)
}

// DeleteTenant removes a tenant with its keys and pools (operators only).
func (c *Client) DeleteTenant(ctx context.Context, name string) (*api.Tenant, error) {
	var t api.Tenant
	return &t, c.do(ctx, http.MethodDelete, "/v1/tenants/"+url.PathEscape(name), nil, &t, nil)
}

// SetQuota sets or resets a tenant's quotas (operators only).
func (c *Client) SetQuota(ctx context.Context, name string, req api.SetQuotaRequest) (*api.Tenant, error) {
	var t api.Tenant
	return &t, c.do(ctx, http.MethodPut, "/v1/tenants/"+url.PathEscape(name)+"/quota", req, &t, nil)
}

// RevokeAPIKey revokes a key by its id (key_…).
func (c *Client) RevokeAPIKey(ctx context.Context, id string) (*api.APIKey, error) {
	var k api.APIKey
	return &k, c.do(ctx, http.MethodDelete, "/v1/apikeys/"+url.PathEscape(id), nil, &k, nil)
}

// ListNodes lists nodes.
func (c *Client) ListNodes(ctx context.Context) ([]api.Node, error) {
	var out struct {
		Nodes []api.Node `json:"nodes"`
	}
	err := c.do(ctx, http.MethodGet, "/v1/nodes", nil, &out, nil)
	return out.Nodes, err
}

// CordonNode cordons (on) or uncordons a node by name or id: a cordoned node gets no
// new placements.
func (c *Client) CordonNode(ctx context.Context, name string, on bool) (*api.Node, error) {
	verb := "/cordon"
	if !on {
		verb = "/uncordon"
	}
	var n api.Node
	return &n, c.do(ctx, http.MethodPost, "/v1/nodes/"+url.PathEscape(name)+verb, nil, &n, nil)
}

// DrainNode cordons a node and moves its running sandboxes to other nodes; it returns
// the node_drain operation (WaitOperation waits for it).
func (c *Client) DrainNode(ctx context.Context, name string) (*api.Operation, error) {
	var op api.Operation
	return &op, c.do(ctx, http.MethodPost, "/v1/nodes/"+url.PathEscape(name)+"/drain", nil, &op, nil)
}

// RemoveNode removes a dead node, or a cordoned one that holds no sandbox, freeing its
// name.
func (c *Client) RemoveNode(ctx context.Context, name string) (*api.RemovedNode, error) {
	var rm api.RemovedNode
	return &rm, c.do(ctx, http.MethodDelete, "/v1/nodes/"+url.PathEscape(name), nil, &rm, nil)
}

// ListTemplates lists template releases.
func (c *Client) ListTemplates(ctx context.Context) ([]api.Template, error) {
	var out struct {
		Templates []api.Template `json:"templates"`
	}
	err := c.do(ctx, http.MethodGet, "/v1/templates", nil, &out, nil)
	return out.Templates, err
}

// Health checks /healthz.
func (c *Client) Health(ctx context.Context) error {
	return c.do(ctx, http.MethodGet, "/healthz", nil, nil, nil)
}

// backoff returns the wait before reconnect attempt n.
func backoff(n int) time.Duration {
	d := 50 * time.Millisecond << min(n, 5)
	return min(d, time.Second)
}

// Lifecycle requests a lifecycle verb (pause, resume, suspend, restore, stop, start,
// wake) and returns its operation. A request that failed transiently is sent again
// under the same Idempotency-Key (doKeyed), so the verb is asked for once.
func (c *Client) Lifecycle(ctx context.Context, sandboxID, verb string) (*api.Operation, error) {
	var op api.Operation
	return &op, c.doKeyed(ctx, http.MethodPost, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/"+url.PathEscape(verb), nil, &op, "")
}

// LifecycleAndWait requests a verb and waits for its operation; a failed operation is
// an error.
func (c *Client) LifecycleAndWait(ctx context.Context, sandboxID, verb string) (*api.Operation, error) {
	op, err := c.Lifecycle(ctx, sandboxID, verb)
	if err != nil {
		return nil, err
	}
	if op, err = c.WaitOperation(ctx, op.ID); err != nil {
		return op, err
	}
	if op.State == api.OpFailed {
		return op, fmt.Errorf("%s %s failed: %s", verb, sandboxID, op.Error)
	}
	return op, nil
}

// Clone makes count clones of a sandbox (sent again on a transient failure under the
// same Idempotency-Key, so they are made once: doKeyed).
func (c *Client) Clone(ctx context.Context, sandboxID string, req api.CloneRequest) ([]api.Sandbox, error) {
	var out api.CloneResponse
	err := c.doKeyed(ctx, http.MethodPost, "/v1/sandboxes/"+url.PathEscape(sandboxID)+"/clone", req, &out, "")
	return out.Sandboxes, err
}

// SetPool sets a warm pool's size (0 removes it).
func (c *Client) SetPool(ctx context.Context, req api.SetPoolRequest) (*api.Pool, error) {
	var p api.Pool
	return &p, c.do(ctx, http.MethodPut, "/v1/pools", req, &p, nil)
}

// ListPools lists warm pools.
func (c *Client) ListPools(ctx context.Context) ([]api.Pool, error) {
	var out struct {
		Pools []api.Pool `json:"pools"`
	}
	err := c.do(ctx, http.MethodGet, "/v1/pools", nil, &out, nil)
	return out.Pools, err
}
