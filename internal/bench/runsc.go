package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/runtime/gvisor"
)

// baseRootfs returns the host path of the template's root filesystem in the local
// server's store.
func baseRootfs(ctx context.Context, cfg *Config) (string, error) {
	list, err := cfg.Client.ListTemplates(ctx)
	if err != nil {
		return "", err
	}
	name := strings.SplitN(cfg.Template, ":", 2)[0]
	for _, t := range list {
		for _, tag := range t.Tags {
			if t.Name == name && tag == "latest" {
				dir := filepath.Join(cfg.DataDir, "store", "templates", strings.TrimPrefix(t.Digest, "sha256:"), "rootfs")
				if _, err := os.Stat(dir); err != nil {
					return "", fmt.Errorf("template %s is not in the local store %s (run bench on the server's host as root): %w", cfg.Template, cfg.DataDir, err)
				}
				return dir, nil
			}
		}
	}
	return "", fmt.Errorf("template %s:latest has no release yet (create one sandbox first)", name)
}

// runscBundle writes an OCI bundle that runs argv on rootfs (read-only) with no network.
func runscBundle(ctx context.Context, rootfs string, argv []string) (dir string, err error) {
	dir, err = os.MkdirTemp("", "space-bench-")
	if err != nil {
		return "", err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(dir)
		}
	}()
	cmd := exec.CommandContext(ctx, gvisor.DefaultRunscPath, "spec", "--bundle", dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("runsc spec: %v: %s", err, out)
	}
	p := filepath.Join(dir, "config.json")
	b, err := os.ReadFile(p)
	if err != nil {
		return "", err
	}
	var spec map[string]any
	if err := json.Unmarshal(b, &spec); err != nil {
		return "", err
	}
	spec["root"] = map[string]any{"path": rootfs, "readonly": true}
	proc := spec["process"].(map[string]any)
	proc["args"] = argv
	proc["terminal"] = false
	if b, err = json.Marshal(spec); err != nil {
		return "", err
	}
	return dir, os.WriteFile(p, b, 0o644)
}

// runscRun times `runsc run` of argv on rootfs, a fresh container each time.
func runscRun(ctx context.Context, rootfs string, argv []string, runs int) ([]float64, error) {
	bundle, err := runscBundle(ctx, rootfs, argv)
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(bundle)
	root := filepath.Join(bundle, "state")
	// runsc pins an empty network namespace for its gofers in its root dir (a mount).
	defer gvisor.UnpinNullNetNS(root)
	var xs []float64
	for i := 0; i < runs; i++ {
		id := "bench" + ids.Secret(10)
		start := time.Now()
		cmd := exec.CommandContext(ctx, gvisor.DefaultRunscPath, "--root", root, "--network=none", "run", "-bundle", bundle, id)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("runsc run: %v: %s", err, out)
		}
		xs = append(xs, ms(time.Since(start)))
		_ = exec.Command(gvisor.DefaultRunscPath, "--root", root, "delete", "-force", id).Run()
	}
	return xs, nil
}
