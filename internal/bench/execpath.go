package bench

import (
	"context"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime/gvisor"
)

// execPath breaks a command round trip of `true` down by layer, interleaved so every
// layer sees the same load: runsc exec (the runtime alone), the agent alone (one
// POST /v1/exec over its unix socket, on a kept-alive connection, as the node calls it),
// and the whole API path (POST /v1/sandboxes/{id}/exec through the Go client, frames
// encoding). API − agent is what space serve adds (key, cache, relay, HTTP);
// agent − runsc is what the agent's call costs against runsc's own exec.
func execPath(ctx context.Context, cfg *Config) ([]Result, error) {
	sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{})
	if err != nil {
		return nil, err
	}
	defer done()
	sock := filepath.Join(cfg.DataDir, "runtime", sb.ID, "run", wire.AgentSocketName)
	agent := agentclient.New(agentclient.DialUnix(sock))
	defer agent.CloseIdleConnections()
	var viaAPI, direct, rs []float64
	for i := 0; i < cfg.Runs+1; i++ {
		start := time.Now()
		x, err := cfg.Client.Run(ctx, sb.ID, api.ExecRequest{Argv: []string{"true"}}, client.Output{})
		if err != nil || client.ExitCode(x) != 0 {
			return nil, fmt.Errorf("exec true: %+v %v", x, err)
		}
		a := ms(time.Since(start))
		start = time.Now()
		ax, err := agent.Exec(ctx, wire.ProcessSpec{Argv: []string{"true"}}, nil)
		if err != nil {
			return nil, fmt.Errorf("agent exec (socket %s; run the bench on the server's host as root): %w", sock, err)
		}
		for {
			f, err := ax.Out.Next()
			if err == io.EOF || err == nil && f.Type == wire.FrameExit {
				break
			}
			if err != nil {
				ax.Out.Close()
				return nil, fmt.Errorf("agent exec: %w", err)
			}
		}
		ax.Out.Close()
		d := ms(time.Since(start))
		start = time.Now()
		if out, err := exec.CommandContext(ctx, gvisor.DefaultRunscPath, "--root", runscRoot(cfg.DataDir), "exec", sb.ID, "/bin/true").CombinedOutput(); err != nil {
			return nil, fmt.Errorf("runsc exec: %v: %s", err, out)
		}
		r := ms(time.Since(start))
		if i == 0 {
			continue // warms the connections of both paths
		}
		viaAPI, direct, rs = append(viaAPI, a), append(direct, d), append(rs, r)
	}
	return []Result{
		result("exec-path", "agent alone: POST /v1/exec on its socket → exit of `true`", "ms", direct, "runsc exec true", rs),
		result("exec-path", "API: POST …/exec (frames) → exit of `true`", "ms", viaAPI, "runsc exec true", rs),
	}, nil
}
