package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// poolPhases are the phases of a warm-pool create's timeline, in order (api.Operation
// Timeline; docs/lifecycle.md).
var poolPhases = []string{"claimed", "node", "recorded", "resumed", "agent", "identity", "reported", "done"}

// pool measures the warm-pool fast path alone: create → exit of a first
// `python3 -c pass`, against a boot measured in the same run, and where the time goes:
// each phase of the create operation's timeline (the step from the phase before), and
// what the client sees (POST answered, operation seen done, the command's round trip).
func pool(ctx context.Context, cfg *Config) ([]Result, error) {
	var boot []float64
	for i := 0; i < cfg.Runs; i++ {
		d, sb, err := createToPass(ctx, cfg, api.CreateSandboxRequest{FreshBoot: true})
		if sb != nil {
			if derr := deleteAndWait(ctx, cfg.Client, sb.ID); err == nil && derr != nil {
				err = derr
			}
		}
		if err != nil {
			return nil, fmt.Errorf("boot: %w", err)
		}
		boot = append(boot, d)
	}
	if _, err := cfg.Client.SetPool(ctx, api.SetPoolRequest{Template: cfg.Template, Size: cfg.Runs}); err != nil {
		return nil, fmt.Errorf("set pool (needs an admin key): %w", err)
	}
	defer cfg.Client.SetPool(context.WithoutCancel(ctx), api.SetPoolRequest{Template: cfg.Template, Size: 0})
	var total, posted, seen, lag, exec, again []float64
	steps := map[string][]float64{}
	for len(total) < cfg.Runs {
		if err := waitPoolFull(ctx, cfg); err != nil {
			return nil, err
		}
		start := time.Now()
		sb, err := cfg.Client.CreateSandbox(ctx, api.CreateSandboxRequest{Template: cfg.Template,
			Metadata: map[string]string{"space-bench": "pool"}}, "")
		if err != nil {
			return nil, err
		}
		tPost := time.Since(start)
		op, err := cfg.Client.WaitOperation(ctx, sb.Operation.ID)
		seenAt := time.Now()
		tSeen := seenAt.Sub(start)
		if err == nil && op.State != api.OpSucceeded {
			err = fmt.Errorf("create failed: %s", op.Error)
		}
		var code int
		if err == nil {
			code, err = cfg.Client.Exec(ctx, sb.ID, api.CreateSessionRequest{Argv: []string{"python3", "-c", "pass"}}, client.Output{})
			if err == nil && code != 0 {
				err = fmt.Errorf("python3 -c pass: exit %d", code)
			}
		}
		tExit := time.Since(start)
		// The same command again: what the first one would cost with nothing left
		// cold (the floor of the last step).
		var tAgain time.Duration
		if err == nil {
			t0 := time.Now()
			code, err = cfg.Client.Exec(ctx, sb.ID, api.CreateSessionRequest{Argv: []string{"python3", "-c", "pass"}}, client.Output{})
			tAgain = time.Since(t0)
			if err == nil && code != 0 {
				err = fmt.Errorf("python3 -c pass: exit %d", code)
			}
		}
		if derr := deleteAndWait(ctx, cfg.Client, sb.ID); err == nil && derr != nil {
			err = derr
		}
		if err != nil {
			return nil, err
		}
		if sb.StartPath != "pool" {
			// The pool ran dry between the check and the create: not a pool sample.
			continue
		}
		total = append(total, ms(tExit))
		posted = append(posted, ms(tPost))
		seen = append(seen, ms(tSeen-tPost))
		if op.DoneAt != nil {
			lag = append(lag, ms(seenAt.Sub(*op.DoneAt))) // same host: the bench runs on the server's
		}
		exec = append(exec, ms(tExit-tSeen))
		again = append(again, ms(tAgain))
		for i := 1; i < len(op.Timeline); i++ {
			e := op.Timeline[i]
			steps[e.Phase] = append(steps[e.Phase], e.Ms-op.Timeline[i-1].Ms)
		}
	}
	out := []Result{result("pool", "pool: create → `python3 -c pass` exit", "ms", total, "boot", boot)}
	for _, ph := range poolPhases {
		if xs := steps[ph]; len(xs) > 0 {
			out = append(out, result("pool", "pool timeline: → "+ph, "ms", xs, "", nil))
		}
	}
	return append(out,
		result("pool", "pool client: POST /v1/sandboxes answered", "ms", posted, "", nil),
		result("pool", "pool client: then operation seen done", "ms", seen, "", nil),
		result("pool", "pool client: done_at → seen done (the wait's answer)", "ms", lag, "", nil),
		result("pool", "pool client: then `python3 -c pass` round trip", "ms", exec, "", nil),
		result("pool", "pool client: a second `python3 -c pass` (the floor)", "ms", again, "", nil),
	), nil
}
