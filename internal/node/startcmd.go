package node

import (
	"context"
	"fmt"
	"time"

	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// runTemplateStart starts the template's start command (as its user, in its workdir)
// and waits for its ready check, after a boot. Restored sandboxes do not run it: the
// process is part of their snapshot.
func (n *Node) runTemplateStart(ctx context.Context, sb *store.Sandbox) error {
	if sb.TemplateDigest == "" {
		return nil
	}
	rel, err := n.st.GetRelease(ctx, sb.TemplateDigest)
	if err != nil {
		return nil // releases built before configs were recorded have none
	}
	cfg, err := template.ParseConfig(rel.Config)
	if err != nil {
		return fmt.Errorf("template config: %w", err)
	}
	if len(cfg.Start) > 0 {
		spec := wire.ProcessSpec{Argv: cfg.Start, User: cfg.User, Cwd: cfg.Workdir, Tag: "template-start"}
		p, err := n.agent(sb.ID).StartProcess(ctx, spec)
		if err != nil {
			return fmt.Errorf("start command: %w", err)
		}
		n.log.Info("template start command running", "sandbox", sb.ID, "pid", p.PID)
	}
	if cfg.Ready == nil {
		return nil
	}
	timeout := time.Duration(cfg.Ready.Timeout)
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	argv := cfg.Ready.Command.Argv
	if cfg.Ready.Command.Shell != "" {
		argv = []string{"/bin/sh", "-c", cfg.Ready.Command.Shell}
	}
	deadline := time.Now().Add(timeout)
	for {
		code, err := n.runCheck(ctx, sb.ID, wire.ProcessSpec{Argv: argv, User: cfg.User, Cwd: cfg.Workdir, TimeoutMs: 10000})
		if err == nil && code == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("ready check %q did not succeed within %s (last: exit %d, %v)", argv, timeout, code, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// runCheck runs a short command through the agent and returns its exit code.
func (n *Node) runCheck(ctx context.Context, id string, spec wire.ProcessSpec) (int, error) {
	c := n.agent(id)
	p, err := c.StartProcess(ctx, spec)
	if err != nil {
		return -1, err
	}
	for {
		if p, err = c.GetProcess(ctx, p.PID); err != nil {
			return -1, err
		}
		if p.State == wire.StateExited {
			if p.ExitCode == nil {
				return -1, fmt.Errorf("killed by %s", p.Signal)
			}
			return *p.ExitCode, nil
		}
		select {
		case <-ctx.Done():
			return -1, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
