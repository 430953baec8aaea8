package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/runtime"
)

// installAgent copies the agent binary to <data-dir>/agents/<sha256>/space-agent and
// returns that path and the hash. Sandboxes run the agent from this content-addressed
// copy: a restored snapshot finds the very binary it was taken with (runtimes reopen
// it by path), even after space is upgraded with a new agent. Copies are kept; they are
// kept while anything on the node may need them (pruneAgents).
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
// succeeded (write checks what it writes), so the name never holds anything else. A
// binary already there has its directory's time set to now: pruneAgents keeps what was
// placed or asked for within agentGrace.
func placeAgent(dataDir, sum string, write func(w io.Writer) error) (string, error) {
	dir := filepath.Join(dataDir, "agents", sum[:16])
	dst := filepath.Join(dir, "space-agent")
	if _, err := os.Stat(dst); err == nil {
		now := time.Now()
		return dst, os.Chtimes(dir, now, now)
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
	n.agentsMu.Lock()
	defer n.agentsMu.Unlock()
	_, err := placeAgent(n.cfg.DataDir, snap.AgentSHA256, func(w io.Writer) error {
		return n.cfg.Artifacts.PullAgent(ctx, snap, w)
	})
	if err != nil {
		return fmt.Errorf("install the agent binary its snapshot carries: %w", err)
	}
	return nil
}

// Agent binaries are pruned (pruneAgents) every agentPrunePeriod, starting when the
// node starts; one placed or asked for within agentGrace is kept even while nothing on
// the node names it yet (a pulled snapshot's restore follows its placement).
const (
	agentPrunePeriod = time.Hour
	agentGrace       = time.Hour
)

// pruneAgents removes the agent binaries under <data-dir>/agents/ that nothing on this
// node can need any more (agentsInUse): each space build adds one when a node of it
// starts, and each pulled snapshot of another build adds its own. Removing one that a
// checkpoint needs would cost that sandbox its memory at its next restore (it boots
// from its disk instead), so when the node cannot tell what its checkpoints need it
// keeps them all this time. Unfinished placements older than agentGrace go too.
func (n *Node) pruneAgents(ctx context.Context) {
	n.agentsMu.Lock()
	defer n.agentsMu.Unlock()
	root := filepath.Join(n.cfg.DataDir, "agents")
	keep, err := n.agentsInUse(ctx, root)
	if err != nil {
		n.log.WarnContext(ctx, "agent binaries are all kept this time: what the checkpoints need is unknown", "err", err)
		return
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		n.log.WarnContext(ctx, "list agent binaries", "err", err)
		return
	}
	recent := func(path string) bool {
		fi, err := os.Lstat(path)
		return err != nil || time.Since(fi.ModTime()) < agentGrace
	}
	for _, e := range ents {
		dir := filepath.Join(root, e.Name())
		if !e.IsDir() || recent(dir) {
			continue
		}
		if !keep[e.Name()] {
			if err := os.RemoveAll(dir); err != nil {
				n.log.WarnContext(ctx, "remove an agent binary", "dir", dir, "err", err)
				continue
			}
			n.log.InfoContext(ctx, "removed an agent binary nothing on this node needs", "dir", dir)
			continue
		}
		tmps, _ := filepath.Glob(filepath.Join(dir, ".space-agent-*"))
		for _, t := range tmps {
			if !recent(t) {
				_ = os.Remove(t)
			}
		}
	}
}

// agentsInUse returns the names (hash prefixes) of the agent binaries under root that
// this node may still run: its own, the ones its runtime's instances run (a checkpoint
// of one records it), and, for each checkpoint on the node, the one its restore would
// mount (runtime.AgentMapper): sandboxes' suspend checkpoints and clone batches, base
// snapshots, named snapshots, and the cache of pulled snapshots. A runtime whose
// checkpoints hold their agent needs only the node's own.
func (n *Node) agentsInUse(ctx context.Context, root string) (map[string]bool, error) {
	keep := map[string]bool{n.agentHash: true}
	m, ok := n.rt.(runtime.AgentMapper)
	if !ok {
		return keep, nil
	}
	add := func(p string) {
		if filepath.Dir(filepath.Dir(p)) == root {
			keep[filepath.Base(filepath.Dir(p))] = true
		}
	}
	running, err := m.InstanceAgents()
	if err != nil {
		return nil, fmt.Errorf("the agents of the runtime's instances: %w", err)
	}
	for _, p := range running {
		add(p)
	}
	dirs, err := n.checkpointDirs()
	if err != nil {
		return nil, err
	}
	for _, d := range dirs {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		p, err := m.RestoreAgent(d, n.cfg.AgentPath)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			continue // no checkpoint there
		case err != nil:
			return nil, fmt.Errorf("checkpoint %s: %w", d, err)
		}
		add(p)
	}
	return keep, nil
}

// checkpointDirs lists the directories on this node's store where a checkpoint may be
// (most hold none): each sandbox's suspend checkpoint and clone batches, each release's
// base snapshots, each named snapshot, and each pulled snapshot in the cache. Checkpoints
// being written into tmp/ are of running instances (InstanceAgents covers them).
func (n *Node) checkpointDirs() ([]string, error) {
	var dirs []string
	ids, err := n.disk.ListSandboxes()
	if err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", err)
	}
	for _, id := range ids {
		cp, err := n.disk.CheckpointDir(id)
		if err != nil {
			return nil, err
		}
		dir, err := n.disk.SandboxDir(id)
		if err != nil {
			return nil, err
		}
		batches, _ := filepath.Glob(filepath.Join(dir, "clones", "*", "checkpoint"))
		dirs = append(append(dirs, cp), batches...)
	}
	rels, err := n.disk.ListReleases()
	if err != nil {
		return nil, fmt.Errorf("list releases: %w", err)
	}
	for _, r := range rels {
		dir, keys, err := n.baseSnapshots(r.Digest)
		if err != nil {
			return nil, err
		}
		for _, key := range keys {
			dirs = append(dirs, filepath.Join(dir, key, "checkpoint"))
		}
	}
	named, err := n.disk.ListSnapshotDirs()
	if err != nil {
		return nil, fmt.Errorf("list named snapshots: %w", err)
	}
	for _, id := range named {
		dir, err := n.disk.SnapshotDir(id)
		if err != nil {
			return nil, err
		}
		dirs = append(dirs, filepath.Join(dir, "checkpoint"))
	}
	if n.cfg.Artifacts != nil {
		cached, err := n.cfg.Artifacts.CachedSnapshots()
		if err != nil {
			return nil, fmt.Errorf("list pulled snapshots: %w", err)
		}
		for _, s := range cached {
			dirs = append(dirs, s.Checkpoint)
		}
	}
	return dirs, nil
}
