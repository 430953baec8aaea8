package bench

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// createToPass measures create → exit of `python3 -c pass`.
func createToPass(ctx context.Context, cfg *Config, req api.CreateSandboxRequest) (float64, *api.Sandbox, error) {
	req.Template = cfg.Template
	req.Metadata = map[string]string{"space-bench": "start-paths"}
	start := time.Now()
	sb, err := cfg.Client.CreateAndWait(ctx, req)
	if err != nil {
		return 0, nil, err
	}
	code, err := cfg.Client.Exec(ctx, sb.ID, api.CreateSessionRequest{Argv: []string{"python3", "-c", "pass"}}, client.Output{})
	if err != nil || code != 0 {
		return 0, sb, fmt.Errorf("python3 -c pass: %d %v", code, err)
	}
	return ms(time.Since(start)), sb, nil
}

// startPaths measures create → first `python3 -c pass` exit for each start path: boot,
// base snapshot and warm pool, with snapshot and pool as ratios to boot.
func startPaths(ctx context.Context, cfg *Config) ([]Result, error) {
	var created []string
	defer func() {
		for _, id := range created {
			_ = deleteAndWait(context.WithoutCancel(ctx), cfg.Client, id)
		}
	}()
	// autoBooted counts the snapshot-path creates the node booted instead (it measured
	// its base snapshot restores slower than its boots: internal/node/startpath.go).
	var autoBooted, snapTries int
	measure := func(req api.CreateSandboxRequest, want string) ([]float64, error) {
		var xs []float64
		for i := 0; len(xs) < cfg.Runs; i++ {
			if want == "snapshot" && i >= 4*cfg.Runs {
				break // the node keeps booting: report the restores it did
			}
			d, sb, err := createToPass(ctx, cfg, req)
			if sb != nil {
				created = append(created, sb.ID)
			}
			if err != nil {
				return nil, err
			}
			got, _ := cfg.Client.GetSandbox(ctx, sb.ID)
			if want == "snapshot" {
				snapTries++
			}
			switch {
			case got == nil || got.StartPath == want:
				xs = append(xs, d)
			case want == "snapshot" && got.StartPath == "boot":
				autoBooted++
			default:
				return nil, fmt.Errorf("expected start path %s, got %s (is the base snapshot built? is a pool set?)", want, got.StartPath)
			}
			// Delete as we go so the host's load stays the same across runs.
			if err := deleteAndWait(ctx, cfg.Client, sb.ID); err != nil {
				return nil, err
			}
			created = created[:len(created)-1]
		}
		return xs, nil
	}
	boot, err := measure(api.CreateSandboxRequest{FreshBoot: true}, "boot")
	if err != nil {
		return nil, fmt.Errorf("boot: %w", err)
	}
	// The base snapshot is built in the background after the first boot.
	if err := waitFor(ctx, 2*time.Minute, func() bool {
		d, sb, err := createToPass(ctx, cfg, api.CreateSandboxRequest{})
		_ = d
		if sb != nil {
			created = append(created, sb.ID)
		}
		return err == nil && sb.StartPath == "snapshot"
	}); err != nil {
		return nil, fmt.Errorf("the base snapshot never became available: %w", err)
	}
	snap, err := measure(api.CreateSandboxRequest{}, "snapshot")
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	// A pool as large as the run count, so that every create claims a member.
	if _, err := cfg.Client.SetPool(ctx, api.SetPoolRequest{Template: cfg.Template, Size: cfg.Runs}); err != nil {
		return nil, fmt.Errorf("set pool (needs an admin key): %w", err)
	}
	defer cfg.Client.SetPool(context.WithoutCancel(ctx), api.SetPoolRequest{Template: cfg.Template, Size: 0})
	var pool []float64
	for len(pool) < cfg.Runs {
		if err := waitPoolFull(ctx, cfg); err != nil {
			return nil, err
		}
		xs, err := measure(api.CreateSandboxRequest{}, "pool")
		if err != nil {
			return nil, fmt.Errorf("pool: %w", err)
		}
		pool = append(pool, xs...)
	}
	snapRow := result("start", "snapshot: create → `python3 -c pass` exit", "ms", snap, "boot", boot)
	if autoBooted > 0 {
		snapRow.Note = fmt.Sprintf("auto booted %d of %d creates: the node measured its base snapshot restores slower than its boots", autoBooted, snapTries)
	}
	return []Result{
		result("start", "boot: create → `python3 -c pass` exit", "ms", boot, "", nil),
		snapRow,
		result("start", "pool: create → `python3 -c pass` exit", "ms", pool, "boot", boot),
	}, nil
}

// waitPoolFull waits until the pool has all its members parked: a claim is measured
// while no refill (a create, its restore and warm command) competes with it for the
// node's CPUs.
func waitPoolFull(ctx context.Context, cfg *Config) error {
	if err := waitFor(ctx, 3*time.Minute, func() bool {
		ps, err := cfg.Client.ListPools(ctx)
		return err == nil && len(ps) > 0 && ps[0].Size > 0 && ps[0].Ready >= ps[0].Size
	}); err != nil {
		return fmt.Errorf("the pool did not fill: %w", err)
	}
	return nil
}

func waitFor(ctx context.Context, d time.Duration, cond func() bool) error {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s", d)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return nil
}

// holdMemory starts a process in the sandbox that holds mib MiB of memory with a
// non-zero byte in every page (a checkpoint saves each of them) and waits until it
// does: resident, and every page written. Resident alone is not enough: the slice
// read that precedes the writes faults every page in, so a checkpoint taken then saved
// zero pages only (the 1 GiB wakes measured until 2026-12-03 restored 5 MB).
func holdMemory(ctx context.Context, c *client.Client, id string, mib int) error {
	hold := fmt.Sprintf("rm -f /tmp/space-bench-held; python3 -c \"import time; b = bytearray(%d << 20); "+
		"b[::4096] = b'x' * len(b[::4096]); open('/tmp/space-bench-held', 'w').close(); time.sleep(10**9)\" &", mib)
	if code, err := c.Exec(ctx, id, api.CreateSessionRequest{Command: hold}, client.Output{}); err != nil || code != 0 {
		return fmt.Errorf("touch memory: %d %v", code, err)
	}
	if err := waitFor(ctx, time.Minute, func() bool {
		var out strings.Builder
		_, err := c.Exec(ctx, id, api.CreateSessionRequest{
			Command: "test -e /tmp/space-bench-held && ps -C python3 -o rss= | sort -n | tail -1"}, client.Output{Stdout: &out})
		kb, _ := strconv.Atoi(strings.TrimSpace(out.String()))
		return err == nil && kb >= mib*1024*9/10
	}); err != nil {
		return fmt.Errorf("the sandbox does not hold %d MiB: %w", mib, err)
	}
	return nil
}

// suspendWake measures suspend and wake of sandboxes holding 256 MiB and 1 GiB of
// touched memory.
func suspendWake(ctx context.Context, cfg *Config) ([]Result, error) {
	var out []Result
	for _, mib := range []int{256, 1024} {
		sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{MemoryMB: mib + 768})
		if err != nil {
			return nil, err
		}
		if err := holdMemory(ctx, cfg.Client, sb.ID, mib); err != nil {
			done()
			return nil, err
		}
		runs := cfg.Runs
		var sus, wake []float64
		// Where the time goes: each phase of the operations' timelines (the step from
		// the phase before), in the order first seen.
		steps := map[string][]float64{}
		var order []string
		phases := func(verb string, op *api.Operation) {
			for i := 1; op != nil && i < len(op.Timeline); i++ {
				k := verb + " → " + op.Timeline[i].Phase
				if _, ok := steps[k]; !ok {
					order = append(order, k)
				}
				steps[k] = append(steps[k], op.Timeline[i].Ms-op.Timeline[i-1].Ms)
			}
		}
		for i := 0; i < runs; i++ {
			start := time.Now()
			op, err := cfg.Client.LifecycleAndWait(ctx, sb.ID, "suspend")
			if err != nil {
				done()
				return nil, err
			}
			sus = append(sus, ms(time.Since(start)))
			phases("suspend", op)
			start = time.Now()
			if op, err = cfg.Client.LifecycleAndWait(ctx, sb.ID, "wake"); err != nil {
				done()
				return nil, err
			}
			wake = append(wake, ms(time.Since(start)))
			phases("wake", op)
		}
		done()
		out = append(out,
			result("suspend", fmt.Sprintf("suspend, %d MiB touched", mib), "ms", sus, "", nil),
			result("suspend", fmt.Sprintf("wake from suspend, %d MiB touched", mib), "ms", wake, "", nil))
		for _, k := range order {
			out = append(out, result("suspend", fmt.Sprintf("%d MiB timeline: %s", mib, k), "ms", steps[k], "", nil))
		}
	}
	return out, nil
}

// clones measures cloning 1 and 10 sandboxes from a running one, and the disk bytes
// each clone uses of its own right after.
func clones(ctx context.Context, cfg *Config) ([]Result, error) {
	src, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{})
	if err != nil {
		return nil, err
	}
	defer done()
	var out []Result
	for _, n := range []int{1, 10} {
		runs := cfg.Runs
		if n > 1 {
			runs = max(1, cfg.Runs/4)
		}
		var xs, bytes []float64
		for i := 0; i < runs; i++ {
			start := time.Now()
			list, err := cfg.Client.Clone(ctx, src.ID, api.CloneRequest{Count: n})
			if err != nil {
				return nil, err
			}
			for _, c := range list {
				op, err := cfg.Client.WaitOperation(ctx, c.Operation.ID)
				if err != nil || op.State != api.OpSucceeded {
					return nil, fmt.Errorf("clone: %+v %v", op, err)
				}
			}
			xs = append(xs, ms(time.Since(start)))
			for _, c := range list {
				if got, err := cfg.Client.GetSandbox(ctx, c.ID); err == nil {
					bytes = append(bytes, float64(got.DiskBytes)/1024)
				}
				_ = deleteAndWait(ctx, cfg.Client, c.ID)
			}
		}
		out = append(out,
			result("clone", fmt.Sprintf("clone %d (request → all running)", n), "ms", xs, "", nil),
			result("clone", fmt.Sprintf("disk each clone adds (of %d)", n), "KiB", bytes, "", nil))
	}
	return out, nil
}
