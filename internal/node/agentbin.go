package node

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// installAgent copies the agent binary to <data-dir>/agents/<sha256>/space-agent and
// returns that path and the hash. Sandboxes run the agent from this content-addressed
// copy: a restored snapshot finds the very binary it was taken with (runtimes reopen
// it by path), even after space is upgraded with a new agent. Copies are kept; they are
// small and old snapshots may still need them.
func installAgent(dataDir, src string) (string, string, error) {
	f, err := os.Open(src)
	if err != nil {
		return "", "", fmt.Errorf("agent binary: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", "", fmt.Errorf("hash agent binary: %w", err)
	}
	sum := hex.EncodeToString(h.Sum(nil))
	dir := filepath.Join(dataDir, "agents", sum[:16])
	dst := filepath.Join(dir, "space-agent")
	if _, err := os.Stat(dst); err == nil {
		return dst, sum[:16], nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", "", err
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return "", "", err
	}
	tmp, err := os.CreateTemp(dir, ".space-agent-*")
	if err != nil {
		return "", "", err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, f); err != nil {
		tmp.Close()
		return "", "", err
	}
	if err := tmp.Chmod(0o755); err != nil {
		tmp.Close()
		return "", "", err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return "", "", err
	}
	if err := tmp.Close(); err != nil {
		return "", "", err
	}
	return dst, sum[:16], os.Rename(tmp.Name(), dst)
}
