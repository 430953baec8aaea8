package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// coldCreate measures POST /v1/sandboxes → exit event of a first `true` (the boot
// path), against `runsc run` of the same root filesystem running true.
func coldCreate(ctx context.Context, cfg *Config) ([]Result, error) {
	c := cfg.Client
	var xs []float64
	for i := 0; i < cfg.Runs; i++ {
		start := time.Now()
		sb, err := c.CreateAndWait(ctx, api.CreateSandboxRequest{Template: cfg.Template, FreshBoot: true, Metadata: map[string]string{"space-bench": "cold-create"}})
		if err != nil {
			return nil, err
		}
		code, err := c.Exec(ctx, sb.ID, api.CreateSessionRequest{Argv: []string{"true"}}, client.Output{})
		if err != nil {
			return nil, err
		}
		if code != 0 {
			return nil, fmt.Errorf("true exited %d", code)
		}
		xs = append(xs, ms(time.Since(start)))
		if err := deleteAndWait(ctx, c, sb.ID); err != nil {
			return nil, err
		}
	}
	rootfs, err := baseRootfs(ctx, cfg)
	if err != nil {
		return nil, err
	}
	bs, err := runscRun(ctx, rootfs, []string{"/bin/true"}, cfg.Runs)
	if err != nil {
		return nil, err
	}
	return []Result{result("cold-create", "POST /v1/sandboxes → exit of first `true`", "ms", xs, "runsc run true", bs)}, nil
}

func deleteAndWait(ctx context.Context, c *client.Client, id string) error {
	op, err := c.DeleteSandbox(ctx, id)
	if err != nil {
		return err
	}
	_, err = c.WaitOperation(ctx, op.ID)
	return err
}
