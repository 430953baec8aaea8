package controller

import (
	"context"
	"fmt"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/crash"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/lifecycle"
	"github.com/spacedev/space/internal/store"
)

// idle suspends sandboxes that had no activity for their idle timeout. A sandbox whose
// suspend failed runs on with its desired state suspended (a program held a socket
// gVisor cannot save, or the store had no room for the snapshot): it is asked again
// once it has been idle for its timeout since that request, which recorded activity.
func (c *Controller) idle(ctx context.Context) {
	list, err := c.st.IdleSandboxes(ctx, time.Now(), 100)
	if err != nil {
		c.log.Warn("list idle sandboxes", "err", err)
		return
	}
	suspend, _ := lifecycle.VerbOf(api.OpSuspend)
	for _, sb := range list {
		reason := fmt.Sprintf("idle for %s (no API request, attached stream or process output since %s)",
			sb.IdleTimeout, sb.LastActivityAt.UTC().Format(time.RFC3339))
		if sb.DesiredState == api.StateSuspended {
			reason += "; asking again, the last suspend failed"
		}
		if err := c.request(ctx, sb.ID, api.StateSuspended, api.OpSuspend, reason, func(cur *store.Sandbox) bool {
			// Check also holds a sandbox whose last request is not settled; a drain
			// handles a sandbox whose move failed.
			return cur.State == api.StateRunning && cur.LastActivityAt.Equal(sb.LastActivityAt) && cur.MoveFrom == "" &&
				(cur.DesiredState == api.StateRunning || cur.DesiredState == api.StateSuspended) &&
				lifecycle.Check(cur.Lifecycle(), suspend) == nil
		}); err != nil {
			c.log.Warn("idle suspend", "sandbox", sb.ID, "err", err)
			continue
		}
		c.log.Info("suspending idle sandbox", "sandbox", sb.ID, "idle_timeout", sb.IdleTimeout)
	}
}

// request records intent for a sandbox if ok(current) still holds.
func (c *Controller) request(ctx context.Context, id, desired, kind, reason string, ok func(*store.Sandbox) bool) error {
	op := &store.Operation{ID: ids.Operation(), Kind: kind, Message: reason}
	return c.st.InTx(ctx, func(tx *store.Tx) error {
		cur, err := tx.GetSandboxForUpdate(ctx, id)
		if err != nil {
			return err
		}
		if cur.DeletedAt != nil || !ok(cur) {
			return nil
		}
		if err := tx.SetDesiredState(ctx, cur, desired, reason, op); err != nil {
			return err
		}
		if desired == api.StateDeleted {
			// On a dead node nothing would act on it: deleted at once.
			_, err = tx.DeleteIfNodeDead(ctx, cur)
		}
		return err
	})
}

// pools keeps every warm pool at its size with members of the template's current
// release, and drains members whose pool is gone or whose tag moved.
func (c *Controller) pools(ctx context.Context) {
	pools, err := c.st.ListPools(ctx)
	if err != nil {
		c.log.Warn("list pools", "err", err)
		return
	}
	for _, p := range pools {
		c.pool(ctx, p)
	}
	orphans, err := c.st.OrphanPoolMembers(ctx)
	if err != nil {
		return
	}
	for _, sb := range orphans {
		c.drain(ctx, sb, "its pool was removed")
	}
}

func (c *Controller) drain(ctx context.Context, sb *store.Sandbox, why string) {
	err := c.request(ctx, sb.ID, api.StateDeleted, api.OpDelete, "pool member drained: "+why, func(cur *store.Sandbox) bool {
		return cur.PoolKey != "" && cur.DesiredState != api.StateDeleted
	})
	if err != nil {
		c.log.Warn("drain pool member", "sandbox", sb.ID, "err", err)
	}
}

func (c *Controller) pool(ctx context.Context, p store.Pool) {
	ref, err := api.ParseTemplateRef(p.Template)
	if err != nil {
		return
	}
	digest, err := c.st.ResolvePoolTag(ctx, p) // the pool's tenant's tag, else a shared one
	if err != nil {
		return
	}
	members, err := c.st.PoolMembers(ctx, p.Key())
	if err != nil {
		c.log.Warn("list pool members", "pool", p.Key(), "err", err)
		return
	}
	var live []*store.Sandbox
	recentFailure := false
	for _, m := range members {
		switch {
		case m.TemplateDigest != "" && digest != "" && m.TemplateDigest != digest:
			c.drain(ctx, m, "the template's tag moved to "+digest)
		case m.State == api.StateFailed || m.State == api.StateStopped:
			// A failed member, or one that lost its memory (stopped), is of no use.
			if time.Since(m.UpdatedAt) < 30*time.Second {
				recentFailure = true
			}
			c.drain(ctx, m, "it "+m.State+": "+m.Error)
		default:
			live = append(live, m)
		}
	}
	for len(live) > p.Size {
		c.drain(ctx, live[len(live)-1], "the pool shrank")
		live = live[:len(live)-1]
	}
	if recentFailure || len(live) >= p.Size {
		return
	}
	for i := len(live); i < p.Size; i++ {
		sb := &store.Sandbox{
			ID: ids.Sandbox(), Tenant: "", TemplateRef: ref.String(), TemplateDigest: digest,
			Spec:         store.SandboxSpec{CPU: p.CPU, MemoryMB: p.MemoryMB},
			DesiredState: api.StatePaused, State: api.StatePending, PoolKey: p.Key(), IdleTimeout: -1,
		}
		op := &store.Operation{ID: ids.Operation(), Kind: api.OpCreate, Message: "warm pool member for " + p.Key()}
		if err := c.st.InTx(ctx, func(tx *store.Tx) error { return tx.CreateSandbox(ctx, sb, op) }); err != nil {
			c.log.Warn("create pool member", "pool", p.Key(), "err", err)
			return
		}
		crash.Point("pool.member-recorded")
	}
	c.log.Info("refilling warm pool", "pool", p.Key(), "have", len(live), "want", p.Size)
}
