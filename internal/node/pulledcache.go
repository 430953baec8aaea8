package node

import (
	"context"
	"os"
	"path/filepath"
	"time"
)

// Pulled snapshots (artifact.Client's cache in <store>/pulled/<digest>) are copies of
// registry artifacts a node pulled to start a sandbox from: a moved sandbox's suspend
// snapshot or checkpoint, or a named snapshot whose node is dead. A sandbox made from
// one has its own O(1) copies of the disk and checkpoint, so the cache only saves a
// download when the same snapshot starts another sandbox here.
//
//   - A moved sandbox's snapshot serves that sandbox only: it is dropped as soon as the
//     sandbox's own disk and checkpoint are made (dropPulled, from materialize).
//   - A named snapshot may start several sandboxes here: it stays until it was pulled
//     more than Config.ReleaseCacheGrace ago and no create is using the cache
//     (evictPulled at each resync; creates from a pulled snapshot hold pulledUse).

// dropPulled removes one pulled snapshot from the cache (failures are logged: the
// next eviction pass takes it).
func (n *Node) dropPulled(ctx context.Context, digest string) {
	if n.cfg.Artifacts == nil || digest == "" {
		return
	}
	n.pulledUse.Lock()
	defer n.pulledUse.Unlock()
	if err := n.cfg.Artifacts.DeleteCachedSnapshot(context.WithoutCancel(ctx), digest); err != nil {
		n.log.Warn("drop pulled snapshot", "digest", digest, "err", err)
	}
}

// evictPulled removes the pulled snapshots that were pulled more than the grace period
// ago, unless a create from one is running (it then waits for the next resync).
func (n *Node) evictPulled(ctx context.Context) {
	if n.cfg.Artifacts == nil {
		return
	}
	snaps, err := n.cfg.Artifacts.CachedSnapshots()
	if err != nil || len(snaps) == 0 {
		return
	}
	if !n.pulledUse.TryLock() {
		return
	}
	defer n.pulledUse.Unlock()
	for _, s := range snaps {
		if ctx.Err() != nil {
			return
		}
		fi, err := os.Stat(filepath.Dir(s.Checkpoint))
		if err != nil || time.Since(fi.ModTime()) < n.cfg.ReleaseCacheGrace {
			continue
		}
		if err := n.cfg.Artifacts.DeleteCachedSnapshot(ctx, s.Digest); err != nil {
			n.log.Warn("evict pulled snapshot", "digest", s.Digest, "err", err)
			continue
		}
		n.log.Info("evicted pulled snapshot from this node's store (it is in the registry)", "digest", s.Digest, "snapshot", s.ID)
	}
}
