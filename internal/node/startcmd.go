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
	cfg, err := n.templateConfig(ctx, sb)
	if err != nil {
		return err
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

// templateConfig is the recorded config of the sandbox's template release (the zero
// config for a sandbox without one, or a release built before configs were recorded).
func (n *Node) templateConfig(ctx context.Context, sb *store.Sandbox) (template.Config, error) {
	if sb.TemplateDigest == "" {
		return template.Config{}, nil
	}
	rel, err := n.st.GetRelease(ctx, sb.TemplateDigest)
	if err != nil {
		return template.Config{}, nil
	}
	cfg, err := template.ParseConfig(rel.Config)
	if err != nil {
		return template.Config{}, fmt.Errorf("template config: %w", err)
	}
	return cfg, nil
}

// warmTimeout bounds a warm-pool member's warm command.
const warmTimeout = 30 * time.Second

// warmMember runs the template's warm command in a warm-pool member before it is
// parked (template.Config.Warm): a member restored from a base snapshot starts with an
// empty page cache, and its owner's first command would pay for filling it. A warm
// command that fails or times out is logged and the member is parked anyway: the
// owner's command then costs what it would have without it.
func (n *Node) warmMember(ctx context.Context, sb *store.Sandbox) {
	cfg, err := n.templateConfig(ctx, sb)
	if err != nil || cfg.Warm == nil {
		return
	}
	began := time.Now()
	wctx, cancel := context.WithTimeout(ctx, warmTimeout)
	defer cancel()
	code, err := n.runCheck(wctx, sb.ID, wire.ProcessSpec{Argv: cfg.Warm.Args(), User: cfg.User, Cwd: cfg.Workdir,
		TimeoutMs: warmTimeout.Milliseconds(), Tag: "template-warm"})
	if err != nil || code != 0 {
		n.log.Warn("warm command of a pool member failed; parking it anyway", "sandbox", sb.ID, "exit", code, "err", err)
		return
	}
	n.marks.mark(sb.ID, "warmed")
	n.log.Debug("pool member warmed", "sandbox", sb.ID, "took", time.Since(began).Round(time.Millisecond))
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
