package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"

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
	dst, err := placeAgent(dataDir, sum, func(w io.Writer) error {
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return err
		}
		_, err := io.Copy(w, f)
		return err
	})
	return dst, sum[:16], err
}

// placeAgent returns where the agent binary of sha256 sum (hex) is kept,
// <data-dir>/agents/<sum[:16]>/space-agent, first writing it there with write when it
// is not: into a new file beside it, synced and renamed into place only once write
// succeeded (write checks what it writes), so the name never holds anything else.
func placeAgent(dataDir, sum string, write func(w io.Writer) error) (string, error) {
	dir := filepath.Join(dataDir, "agents", sum[:16])
	dst := filepath.Join(dir, "space-agent")
	if _, err := os.Stat(dst); err == nil {
		return dst, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.CreateTemp(dir, ".space-agent-*")
	if err != nil {
		return "", err
	}
	defer os.Remove(tmp.Name())
	err = write(tmp)
	if err == nil {
		err = tmp.Chmod(0o755)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", err
	}
	return dst, os.Rename(tmp.Name(), dst)
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

// installPulledAgent makes sure this node has the agent binary a pulled snapshot
// carries among its agents (placeAgent), where a restore of its checkpoint finds it by
// its content-addressed name: a node that has it downloads nothing (the usual case: the
// two nodes run the same space build).
func (n *Node) installPulledAgent(ctx context.Context, snap artifact.Snapshot) error {
	if snap.AgentSHA256 == "" {
		return nil
	}
	_, err := placeAgent(n.cfg.DataDir, snap.AgentSHA256, func(w io.Writer) error {
		return n.cfg.Artifacts.PullAgent(ctx, snap, w)
	})
	if err != nil {
		return fmt.Errorf("install the agent binary its snapshot carries: %w", err)
	}
	return nil
}
