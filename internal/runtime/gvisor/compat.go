package gvisor

import (
	_ "embed"
	"fmt"
	"os"
	"path/filepath"
)

//go:generate ./compat/gen.sh

// statxCompat is an LD_PRELOAD shim (source: compat/statx.c) for runsc releases whose
// statx(2) rejects AT_NO_AUTOMOUNT, which GNU coreutils 9 always passes: without it `ls`
// fails with "Invalid argument" in sandboxes. The runtime bind-mounts it read-only at
// CompatPreload and reports that path in Info().Caps.Preload; the node puts it in
// LD_PRELOAD of every process the agent starts.
//
//go:embed compat/statx-compat.so
var statxCompat []byte

// CompatPreload is where the shim appears inside sandboxes.
const CompatPreload = "/.space/statx-compat.so"

// writeCompat installs the shim under the runtime's root directory and returns its path.
func writeCompat(rootDir string) (string, error) {
	dir := filepath.Join(rootDir, "compat")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("gvisor: compat dir: %w", err)
	}
	p := filepath.Join(dir, "statx-compat.so")
	if b, err := os.ReadFile(p); err == nil && string(b) == string(statxCompat) {
		return p, nil
	}
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, statxCompat, 0o644); err != nil {
		return "", fmt.Errorf("gvisor: write compat shim: %w", err)
	}
	return p, os.Rename(tmp, p)
}
