package service

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/store"
)

// targetCacheTTL bounds how long the one-request exec reuses what it learnt of a
// running sandbox (tenant, node, data-plane URL, node token) without reading the
// database. Every change of the sandbox (ChannelSandboxes), of its token epoch
// (ChannelTokens) and every reconnect of the listener drops the entry at once; the TTL
// only bounds the damage of a notification PostgreSQL never delivered. It must stay
// well below nodeTokenTTL: the cached node token must outlive the entry.
const targetCacheTTL = 10 * time.Second

// maxExecStdin bounds the stdin an exec request carries in its body.
const maxExecStdin = 1 << 20

// fastPath is the state of the one-request exec: the targets of running sandboxes
// (valid while the service's listener is connected) and the open exec streams, which
// are cut like attach streams when the sandbox's tokens or the caller's API key are
// revoked.
type fastPath struct {
	mu   sync.Mutex
	live bool // the listener is connected: notifications invalidate the cache
	// seq counts invalidations: a target read before one is not remembered after it
	// (the notification of a change may arrive between the read and remember).
	seq     uint64
	targets map[string]cachedTarget
	streams map[*Execution]struct{}
	// keys caches authenticated API keys by the hash of their secret, under the same
	// rules: dropped at their revocation (ChannelKeys), all at a reconnect, a tenant's
	// deletion or after targetCacheTTL; keySeq counts the notifications that drop keys.
	keys   map[string]cachedKey
	keySeq uint64
}

type cachedKey struct {
	p    Principal
	kind string
	at   time.Time
}

type cachedTarget struct {
	t      *Target
	tenant string
	at     time.Time
}

func newFastPath() *fastPath {
	return &fastPath{targets: map[string]cachedTarget{}, streams: map[*Execution]struct{}{}, keys: map[string]cachedKey{}}
}

// notify handles one notification of the service's listener (see Service.Run).
func (f *fastPath) notify(channel, payload string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if channel != store.ChannelKeys {
		f.seq++
	} else {
		f.dropKeysLocked(payload)
	}
	switch {
	case payload == "":
		// (Re)connected: anything may have changed while no one listened. A key revoked
		// meanwhile is not told of: the service checks the keys of the open streams
		// (recheckStreams), and cuts those that lost their key.
		f.live = true
		clear(f.targets)
	case channel == store.ChannelKeys:
		for x := range f.streams {
			if x.key == payload {
				x.cancel()
			}
		}
	case channel == store.ChannelTokens:
		delete(f.targets, payload)
		for x := range f.streams {
			if x.sandbox == payload {
				x.cancel()
			}
		}
	default: // ChannelSandboxes
		delete(f.targets, payload)
	}
}

// streamKeys returns the open streams by the key that authorized them.
func (f *fastPath) streamKeys() map[string][]*Execution {
	f.mu.Lock()
	defer f.mu.Unlock()
	byKey := map[string][]*Execution{}
	for x := range f.streams {
		byKey[x.key] = append(byKey[x.key], x)
	}
	return byKey
}

// recheckStreams cuts the open exec streams whose API key was revoked or deleted (all
// of them when the database cannot tell), after the listener (re)connected: a
// revocation notified while it did not listen is not seen otherwise. A stream cut so
// ends as a revocation's does (the client re-attaches through a session, checked
// afresh); the others go on. Cutting every stream instead made the first command
// after a restart fail with a 500 when the listener connected while it started.
func (s *Service) recheckStreams(ctx context.Context) {
	byKey := s.fast.streamKeys()
	if len(byKey) == 0 {
		return
	}
	keys := slices.Collect(maps.Keys(byKey))
	revoked, err := s.st.RevokedKeys(ctx, keys)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("check the keys of open exec streams; cutting them", "err", err)
		}
		revoked = keys
	}
	for _, k := range revoked {
		for _, x := range byKey[k] {
			x.cancel()
		}
	}
}

// stop marks the listener gone: the cache is not used until it reconnects.
func (f *fastPath) stop() {
	f.mu.Lock()
	f.seq++
	f.keySeq++
	f.live = false
	clear(f.targets)
	clear(f.keys)
	f.mu.Unlock()
}

// key returns the cached principal of the key of kind whose secret hashes to hash
// (nil if none), and the count to hand to rememberKey.
func (f *fastPath) key(hash, kind string) (*Principal, uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k, ok := f.keys[hash]
	if !ok || !f.live || k.kind != kind || time.Since(k.at) > targetCacheTTL {
		return nil, f.keySeq
	}
	p := k.p
	return &p, f.keySeq
}

// rememberKey caches p unless a key notification came after seq.
func (f *fastPath) rememberKey(hash, kind string, p Principal, seq uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.live && f.keySeq == seq {
		if len(f.keys) >= maxCachedKeys {
			clear(f.keys)
		}
		f.keys[hash] = cachedKey{p: p, kind: kind, at: time.Now()}
	}
}

// dropKeys forgets the cached key id ("" = every key).
func (f *fastPath) dropKeys(id string) {
	f.mu.Lock()
	f.dropKeysLocked(id)
	f.mu.Unlock()
}

func (f *fastPath) dropKeysLocked(id string) {
	f.keySeq++
	for h, k := range f.keys {
		if id == "" || k.p.KeyID == id {
			delete(f.keys, h)
		}
	}
}

// maxCachedKeys bounds the key cache (a flood of distinct valid keys cannot grow it).
const maxCachedKeys = 4096

// lookup returns the cached target of sandbox id for p (nil if none), and the
// invalidation count to hand to remember after reading the target afresh.
func (f *fastPath) lookup(p *Principal, id string) (*Target, uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, ok := f.targets[id]
	if !ok || !f.live {
		return nil, f.seq
	}
	if time.Since(c.at) > targetCacheTTL {
		delete(f.targets, id)
		return nil, f.seq
	}
	if !p.Visible(c.tenant) {
		return nil, f.seq // the slow path answers exactly like a missing sandbox
	}
	return c.t, f.seq
}

// remember caches t unless an invalidation came after seq (lookup's count, taken
// before t was read).
func (f *fastPath) remember(t *Target, seq uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.live && f.seq == seq {
		f.targets[t.Sandbox.ID] = cachedTarget{t: t, tenant: t.Sandbox.Tenant, at: time.Now()}
	}
}

func (f *fastPath) forget(id string) {
	f.mu.Lock()
	delete(f.targets, id)
	f.mu.Unlock()
}

// LocalNode is the node that runs in the same process as the api role (space serve
// with both roles, the default). The one-request exec talks to its agents directly
// instead of through the node's HTTP agent proxy, and a warm-pool claim, a lifecycle
// request (suspend, wake, pause, resume, delete) or a clone on it is handed to it at
// once (Kick) rather than through a PostgreSQL notification: the notification still
// comes, and the node's worker coalesces the two.
type LocalNode interface {
	ID() string
	Agent(ctx context.Context, sandboxID string) (*agentclient.Client, error)
	Touch(sandboxID string)
	Kick(sandboxID string)
}

// SetLocalNode names the node running in this process (see LocalNode).
func (s *Service) SetLocalNode(n LocalNode) { s.local.Store(&n) }

// OperationChanged wakes the waiters of operation id (GET /v1/operations/{id}/wait)
// at once; the in-process node calls it when it completes an operation, ahead of the
// PostgreSQL notification that says the same.
func (s *Service) OperationChanged(id string) { s.ops.notify(id) }

// kickLocal hands a sandbox the api just changed (committed) to the in-process node
// when the sandbox is on it.
func (s *Service) kickLocal(sb *store.Sandbox) {
	if l := s.local.Load(); l != nil && sb != nil && sb.NodeID != "" && sb.NodeID == (*l).ID() {
		(*l).Kick(sb.ID)
	}
}

// Agent returns a client for t's agent: the in-process node's own when t is on it
// (one process, space serve's default: no HTTP hop to itself, and a request that meets
// this process's stop still reaches the agent: its own listener is closed by then, and
// a connection to the socket that systemd holds would wait for the next process),
// else through the node's agent proxy.
func (s *Service) Agent(ctx context.Context, t *Target) (*agentclient.Client, error) {
	if l := s.local.Load(); l != nil && t.Node != nil && t.Node.ID == (*l).ID() {
		a, err := (*l).Agent(ctx, t.Sandbox.ID)
		if err != nil {
			return nil, err
		}
		(*l).Touch(t.Sandbox.ID) // as the agent proxy does for each request
		return a, nil
	}
	return s.relay(t), nil
}

// Reach returns a client for the agent of running sandbox id, for relays (the E2B
// envd routes, commands.run among them). Like Exec it reads the database only when it
// must: a sandbox reached in the last seconds on this process's node is reached again
// without a query (the node itself checks that it still runs there); otherwise
// Running (waking it unless noWake) and the target is remembered.
func (s *Service) Reach(ctx context.Context, p *Principal, id string, noWake bool) (*agentclient.Client, error) {
	if t, _ := s.fast.lookup(p, id); t != nil && s.onLocalNode(t) {
		if a, err := s.Agent(ctx, t); err == nil {
			s.touch(id)
			return a, nil
		}
		s.fast.forget(id)
	}
	_, seq := s.fast.lookup(p, id)
	t, err := s.Running(ctx, p, id, noWake)
	if err != nil {
		return nil, err
	}
	a, err := s.Agent(ctx, t)
	if err != nil {
		return nil, err
	}
	s.fast.remember(t, seq)
	return a, nil
}

// onLocalNode reports whether t is on the node running in this process.
func (s *Service) onLocalNode(t *Target) bool {
	l := s.local.Load()
	return l != nil && t.Node != nil && t.Node.ID == (*l).ID()
}

// Execution is a command started by Exec: its process and its output stream from
// offset 0. Close ends the stream (not the process).
type Execution struct {
	PID int
	UID string
	// Out is the process's output (stdout, stderr, gaps, heartbeats, then the exit).
	Out *agentclient.OutputStream
	// Ctx ends when the stream was cut (revoked tokens or key) or closed.
	Ctx     context.Context
	sandbox string
	key     string
	cancel  context.CancelFunc
	untrack func()
}

// Close ends the output stream.
func (x *Execution) Close() {
	x.cancel()
	if x.Out != nil {
		_ = x.Out.Close()
	}
	x.untrack()
}

// ExecSpec validates an exec request and turns it into a gated agent spec and the
// stdin bytes to send (nil: stdin is /dev/null).
func ExecSpec(req *api.ExecRequest) (*wire.ProcessSpec, []byte, error) {
	var stdin []byte
	switch {
	case req.Stdin != nil && req.StdinBase64 != "":
		return nil, nil, invalid("give either stdin or stdin_base64, not both")
	case req.Stdin != nil:
		stdin = []byte(*req.Stdin)
	case req.StdinBase64 != "":
		b, err := base64.StdEncoding.DecodeString(req.StdinBase64)
		if err != nil {
			return nil, nil, invalid("stdin_base64 is not valid base64")
		}
		stdin = b
	}
	if len(stdin) > maxExecStdin {
		return nil, nil, invalid("stdin is larger than %d bytes; use a session and its stdin endpoint", maxExecStdin)
	}
	spec, err := ProcessSpec(&api.CreateSessionRequest{Argv: req.Argv, Command: req.Command, Env: req.Env, Cwd: req.Cwd,
		User: req.User, Timeout: req.Timeout, Stdin: stdin != nil})
	if err != nil {
		return nil, nil, err
	}
	return spec, stdin, nil
}

// Exec starts a command in a running sandbox (waking it unless noWake) and returns its
// output stream, connected before the process starts so no byte is missed.
//
// The path reads the database only when it must: a sandbox it reached in the last
// seconds is reached again through the node it learnt (see targetCacheTTL) without a
// query; if that attempt fails before a process exists, the usual path (sandbox row,
// wake, node row) is taken once.
//
// key is the request's Idempotency-Key ("" for none): the agent keeps it with the
// process (hashed with the caller's API key), and a repeat gets that process's output
// from offset 0 instead of a second run (wire.ProcessSpec.Key). Without one the call
// gets a key of its own, so that its own second attempt below starts nothing twice
// when the first one's answer was lost after the agent started the process.
func (s *Service) Exec(ctx context.Context, p *Principal, id string, req api.ExecRequest, noWake bool, key string) (*Execution, error) {
	spec, stdin, err := ExecSpec(&req)
	if err != nil {
		return nil, err
	}
	if spec.Key, err = execKey(p, key); err != nil {
		return nil, err
	}
	t, seq := s.fast.lookup(p, id)
	if t != nil {
		x, err := s.startExec(ctx, p, t, *spec, stdin)
		if err == nil {
			s.touch(id)
			return x, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		s.fast.forget(id)
		_, seq = s.fast.lookup(p, id)
	}
	t, err = s.Running(ctx, p, id, noWake)
	if err != nil {
		return nil, err
	}
	x, err := s.startExec(ctx, p, t, *spec, stdin)
	if err != nil {
		return nil, err
	}
	s.fast.remember(t, seq)
	return x, nil
}

// execKey returns the key an exec's process is kept under in its agent: the caller's
// Idempotency-Key (processKey), or a random one.
func execKey(p *Principal, key string) (string, error) {
	if key == "" {
		var b [16]byte
		_, _ = rand.Read(b[:]) // never fails (crypto/rand)
		return "call:" + hex.EncodeToString(b[:]), nil
	}
	if err := checkKey(key); err != nil {
		return "", err
	}
	return processKey(p, "api", key), nil
}

// processKey returns the key a process started with the caller's (checked)
// Idempotency-Key is kept under in its agent (wire.ProcessSpec.Key): the key with its
// API key's id, hashed (the sandbox sees neither), behind kind, so that an exec's keys
// and a session's never name each other's processes.
func processKey(p *Principal, kind, key string) string {
	h := sha256.Sum256([]byte(p.KeyID + "\x00" + key))
	return kind + ":" + hex.EncodeToString(h[:16])
}

// startExec starts the process and connects to its output in one agent call (see
// agentclient.Exec), tracked so that a revocation cuts the stream.
func (s *Service) startExec(ctx context.Context, p *Principal, t *Target, spec wire.ProcessSpec, stdin []byte) (*Execution, error) {
	agent, err := s.Agent(ctx, t)
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithCancel(ctx)
	x := &Execution{Ctx: sctx, sandbox: t.Sandbox.ID, key: p.KeyID, cancel: cancel}
	s.fast.mu.Lock()
	s.fast.streams[x] = struct{}{}
	s.fast.mu.Unlock()
	x.untrack = func() {
		s.fast.mu.Lock()
		delete(s.fast.streams, x)
		s.fast.mu.Unlock()
	}
	ax, err := agent.Exec(sctx, spec, stdin)
	if err != nil {
		x.Close()
		return nil, err
	}
	x.PID, x.UID, x.Out = ax.PID, ax.UID, ax.Out
	return x, nil
}
