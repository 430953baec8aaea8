package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/runtime"
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

// checkpointAgent returns the agent binary a restore of the checkpoint in dir needs
// from the host (runtime.AgentMapper; "" for a runtime whose checkpoints hold their
// agent): a push sends it along, so that a node running another space build restores
// the snapshot with the binary it was taken with instead of its own, which the
// restored agent cannot run on. Unknown, it is "" and the push goes without it.
func (n *Node) checkpointAgent(ctx context.Context, dir string) string {
	m, ok := n.rt.(runtime.AgentMapper)
	if !ok {
		return ""
	}
	p, err := m.RestoreAgent(dir, n.cfg.AgentPath)
	if err != nil {
		n.log.WarnContext(ctx, "the checkpoint's agent binary is unknown; it is pushed without it", "checkpoint", dir, "err", err)
		return ""
	}
	return p
}

// installPulledAgent puts the agent binary a pulled snapshot carries among this node's
// agents (installAgent), where a restore of its checkpoint finds it by its
// content-addressed name.
func (n *Node) installPulledAgent(snap artifact.Snapshot) error {
	if snap.Agent == "" {
		return nil
	}
	p, hash, err := installAgent(n.cfg.DataDir, snap.Agent)
	if err != nil {
		return fmt.Errorf("install the agent binary its snapshot carries: %w", err)
	}
	if !strings.HasPrefix(snap.AgentSHA256, hash) {
		return fmt.Errorf("installed agent %s does not hash to its snapshot's %s", p, snap.AgentSHA256)
	}
	return nil
}
