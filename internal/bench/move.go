package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/spacedev/space/api"
)

// move measures moving sandboxes between nodes through the registry (a fleet of at
// least two alive nodes started with --registry; otherwise it reports why it did not
// run): a wake on the sandbox's own node (suspend, then wake) against its downtime when
// `space node drain` moves it, running, to another node (checkpoint, push, pull,
// restore), and the drain's wall time per sandbox. Each run creates a sandbox with a
// process that holds 64 MiB, drains the node it landed on, and uncordons it again.
func move(ctx context.Context, cfg *Config) ([]Result, error) {
	c := cfg.Client
	nodes, err := c.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	shared := 0
	for _, n := range nodes {
		info, _ := n.RuntimeInfo.(map[string]any)
		if r, _ := info["registry"].(bool); r && n.State == "alive" && !n.Cordoned {
			shared++
		}
	}
	if shared < 2 {
		return []Result{{Scenario: "move", Metric: "moves between nodes", Unit: "ms",
			Note: fmt.Sprintf("skipped: needs two alive, uncordoned nodes sharing a registry (found %d)", shared)}}, nil
	}
	var same, down, wall []float64
	for i := 0; i < cfg.Runs; i++ {
		sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{Metadata: map[string]string{"space-bench": "move"}})
		if err != nil {
			return nil, err
		}
		if err := holdMemory(ctx, c, sb.ID, 64); err != nil {
			done()
			return nil, err
		}
		if _, err := c.LifecycleAndWait(ctx, sb.ID, api.OpSuspend); err != nil {
			done()
			return nil, err
		}
		start := time.Now()
		if op, err := c.LifecycleAndWait(ctx, sb.ID, api.OpWake); err != nil || op.State != api.OpSucceeded {
			done()
			return nil, fmt.Errorf("wake: %+v %v", op, err)
		}
		same = append(same, ms(time.Since(start)))

		cur, err := c.GetSandbox(ctx, sb.ID)
		if err != nil {
			done()
			return nil, err
		}
		from := cur.Node
		start = time.Now()
		op, err := c.DrainNode(ctx, from)
		if err == nil {
			op, err = c.WaitOperation(ctx, op.ID)
		}
		took := time.Since(start)
		if _, uerr := c.CordonNode(context.WithoutCancel(ctx), from, false); uerr != nil && err == nil {
			err = uerr
		}
		if err != nil || op.State != api.OpSucceeded {
			done()
			return nil, fmt.Errorf("drain %s: %+v %v", from, op, err)
		}
		moved, err := c.GetSandbox(ctx, sb.ID)
		if err != nil || moved.Node == from || moved.MoveDowntimeMs <= 0 {
			done()
			return nil, fmt.Errorf("the sandbox did not move: %+v %v", moved, err)
		}
		down = append(down, float64(moved.MoveDowntimeMs))
		wall = append(wall, ms(took)/float64(max(len(op.Moves), 1)))
		done()
	}
	return []Result{
		result("move", "wake on the same node (suspend → wake), 64 MiB touched", "ms", same, "", nil),
		result("move", "drain: downtime of a running sandbox moved to another node", "ms", down, "", nil),
		result("move", "drain: request → done, per sandbox moved", "ms", wall, "", nil),
	}, nil
}
