package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/storage"
)

// templatePullRuns bounds the repetitions of the template-pull scenario: each pull
// moves the whole template through the registry.
const templatePullRuns = 5

// templatePull measures the first start of a template on a node that does not hold
// its release, against a node that does: the release pulled from the registry into an
// empty btrfs store (what such a node adds before its create), side by side with a
// create → exit of a first `true` on the server, which holds it. The server must push
// to the registry (space serve --registry); without --registry the scenario is skipped.
func templatePull(ctx context.Context, cfg *Config) ([]Result, error) {
	if cfg.Registry == "" {
		if cfg.Progress != nil {
			fmt.Fprintln(cfg.Progress, "bench: template-pull skipped: give --registry (the server's)")
		}
		return nil, nil
	}
	c := cfg.Client
	runs := min(cfg.Runs, templatePullRuns)
	var creates []float64
	digest := ""
	for i := 0; i <= runs; i++ { // the first create makes sure the release exists and is pushed
		start := time.Now()
		sb, err := c.CreateAndWait(ctx, api.CreateSandboxRequest{Template: cfg.Template, Metadata: map[string]string{"space-bench": "template-pull"}})
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
		if i > 0 {
			creates = append(creates, ms(time.Since(start)))
		}
		digest = sb.TemplateDigest
		if err := deleteAndWait(ctx, c, sb.ID); err != nil {
			return nil, err
		}
	}
	pulls, mb, err := pullIntoEmptyStore(ctx, cfg, digest, runs)
	if err != nil {
		return nil, err
	}
	r := result("template-pull", "first start without the release: pull "+cfg.Template+" from the registry into an empty store", "ms",
		pulls, "create → exit of first `true` on a node holding it", creates)
	r.Note = fmt.Sprintf("release %s, %d MB of files; a node without it starts its first sandbox after the pull plus a create", digest, mb)
	return []Result{r}, nil
}

// pullIntoEmptyStore pulls the release runs times into a fresh loop-mounted btrfs
// store (emptied between runs) and returns each pull's duration.
func pullIntoEmptyStore(ctx context.Context, cfg *Config, digest string, runs int) (_ []float64, mb int64, err error) {
	dir, err := os.MkdirTemp("", "space-bench-pull-")
	if err != nil {
		return nil, 0, err
	}
	defer os.RemoveAll(dir)
	st, err := storage.Open(ctx, storage.Config{DataDir: dir, ImageSizeBytes: 16 << 30, DisableQuotas: true})
	if err != nil {
		return nil, 0, fmt.Errorf("an empty store to pull into (needs root): %w", err)
	}
	defer func() { err = errors.Join(err, st.Unmount(context.WithoutCancel(ctx))) }()
	ac, err := artifact.New(artifact.Config{Registry: cfg.Registry, Username: os.Getenv("SPACE_REGISTRY_USERNAME"),
		Password: os.Getenv("SPACE_REGISTRY_PASSWORD"), DockerConfig: os.Getenv("SPACE_REGISTRY_DOCKER_CONFIG"),
		Insecure: cfg.RegistryInsecure}, st)
	if err != nil {
		return nil, 0, err
	}
	var xs []float64
	for range runs {
		start := time.Now()
		rel, err := ac.PullRelease(ctx, digest)
		if err != nil {
			return nil, 0, fmt.Errorf("pull %s (does the server push to %s? space serve --registry): %w", digest, cfg.Registry, err)
		}
		xs = append(xs, ms(time.Since(start)))
		mb = rel.SizeBytes >> 20
		if err := st.DeleteRelease(ctx, digest); err != nil {
			return nil, 0, err
		}
	}
	return xs, mb, nil
}
