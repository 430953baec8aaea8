package bench

import (
	"context"
	"fmt"
	"os/exec"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/runtime/gvisor"
)

// execPath sets a command round trip of `true` beside the runtime's own, interleaved so
// both see the same load: runsc exec (the runtime alone) and the whole API path (POST
// /v1/sandboxes/{id}/exec through the Go client, frames encoding). API − runsc is what
// space adds over runsc's own exec. (Until 2026-12-06 it also timed the agent alone,
// over its unix socket; the agent now connects to the node, which is the only way to
// it.)
func execPath(ctx context.Context, cfg *Config) ([]Result, error) {
	sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{})
	if err != nil {
		return nil, err
	}
	defer done()
	var viaAPI, rs []float64
	for i := 0; i < cfg.Runs+1; i++ {
		start := time.Now()
		x, err := cfg.Client.Run(ctx, sb.ID, api.ExecRequest{Argv: []string{"true"}}, client.Output{})
		if err != nil || client.ExitCode(x) != 0 {
			return nil, fmt.Errorf("exec true: %+v %v", x, err)
		}
		a := ms(time.Since(start))
		start = time.Now()
		if out, err := exec.CommandContext(ctx, gvisor.DefaultRunscPath, "--root", runscRoot(cfg.DataDir), "exec", sb.ID, "/bin/true").CombinedOutput(); err != nil {
			return nil, fmt.Errorf("runsc exec: %v: %s", err, out)
		}
		r := ms(time.Since(start))
		if i == 0 {
			continue // warms the connections of both paths
		}
		viaAPI, rs = append(viaAPI, a), append(rs, r)
	}
	return []Result{
		result("exec-path", "API: POST …/exec (frames) → exit of `true`", "ms", viaAPI, "runsc exec true", rs),
	}, nil
}
