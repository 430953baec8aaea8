package node

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"time"

	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/store"
)

// agentJSON makes one JSON call to a sandbox's agent, ready or not.
func (n *Node) agentJSON(ctx context.Context, id, method, path string, in, out any) error {
	n.mu.Lock()
	t := n.transportLocked(id)
	n.mu.Unlock()
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://agent"+path, body)
	if err != nil {
		return err
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := t.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("agent %s %s: %s: %s", method, path, resp.Status, bytes.TrimSpace(b))
	}
	if out != nil {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	return nil
}

// waitAgent polls the agent's health endpoint until it answers or the timeout passes.
func (n *Node) waitAgent(ctx context.Context, id string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	delay := 2 * time.Millisecond
	var last error
	for {
		var h wire.Health
		cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
		last = n.agentJSON(cctx, id, http.MethodGet, "/v1/health", nil, &h)
		ccancel()
		if last == nil {
			return nil
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("agent did not answer within %s: %v", timeout, last)
		case <-t.C:
		}
		if delay < 100*time.Millisecond {
			delay *= 2
		}
	}
}

// identity returns a new identity for the sandbox: fresh entropy, the host's clock and
// its environment (the template's defaults overlaid by the sandbox's own).
func (n *Node) identity(sb *store.Sandbox) wire.Identity {
	env := map[string]string{}
	if sb.TemplateDigest != "" {
		if rel, err := n.disk.Release(sb.TemplateDigest); err == nil {
			maps.Copy(env, rel.Config.Env)
		}
	}
	maps.Copy(env, sb.Spec.Env)
	// A runtime may need a compatibility library preloaded into every process.
	if p := n.info.Details["preload"]; p != "" {
		if cur := env["LD_PRELOAD"]; cur != "" {
			p += ":" + cur
		}
		env["LD_PRELOAD"] = p
	}
	return wire.Identity{
		Generation: time.Now().UnixNano(),
		Seed:       randomSeed(),
		UnixNano:   time.Now().UnixNano(),
		Env:        env,
		Hostname:   "sandbox-" + sb.ID[:8],
	}
}

// setIdentity gives a running agent the sandbox's identity.
func (n *Node) setIdentity(ctx context.Context, sb *store.Sandbox) error {
	id := n.identity(sb)
	if err := n.agentJSON(ctx, sb.ID, http.MethodPost, "/v1/identity", id, nil); err != nil {
		return err
	}
	if sb.ClaimedAt != nil {
		return n.st.SetIdentityGeneration(context.WithoutCancel(ctx), sb.ID, id.Generation)
	}
	return nil
}
