package node

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/fake"
	"github.com/spacedev/space/internal/store"
)

// mapperRuntime is a runtime whose checkpoints name their agent in a file "agent"
// (gVisor's record it in their metadata) and whose instances run the agents in running.
type mapperRuntime struct {
	runtime.Runtime
	running []string
}

func (m mapperRuntime) RestoreAgent(dir, own string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, "agent"))
	return string(b), err
}

func (m mapperRuntime) InstanceAgents() ([]string, error) { return m.running, nil }

// diskWithRelease is a fake store under data holding one release.
func diskWithRelease(t *testing.T, data, digest string) *fake.Disk {
	t.Helper()
	disk, err := fake.NewDisk(filepath.Join(data, "store"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := disk.AddRelease("base", digest, nil, map[string]string{"etc/hostname": "x"}); err != nil {
		t.Fatal(err)
	}
	return disk
}

// TestPruneAgents: the node removes the agent binaries nothing on it needs, and keeps
// its own, the ones its instances run, the ones its checkpoints (suspended sandboxes,
// clone batches, base snapshots, named snapshots) would restore with, and any placed or
// asked for within agentGrace; when it cannot read what a checkpoint needs, it removes
// nothing.
func TestPruneAgents(t *testing.T) {
	data := t.TempDir()
	const digest = "sha256:" + "ab12ab12ab12ab12ab12ab12ab12ab12ab12ab12ab12ab12ab12ab12ab12ab12"
	disk := diskWithRelease(t, data, digest)
	old := time.Now().Add(-2 * agentGrace)
	agents := map[string]string{} // role -> path
	for i, role := range []string{"own", "running", "suspended", "clone", "base", "named", "recent", "stale", "stale2"} {
		sum := fmt.Sprintf("%016x", i+1) + strings.Repeat("0", 48)
		p, err := placeAgent(data, sum, func(w io.Writer) error { _, err := io.WriteString(w, role); return err })
		if err != nil {
			t.Fatal(err)
		}
		agents[role] = p
	}
	checkpoint := func(dir, agent string) {
		t.Helper()
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "agent"), []byte(agent), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"sbsuspended", "sbplain"} {
		if _, err := disk.CreateSandboxRoot(t.Context(), id, digest); err != nil {
			t.Fatal(err)
		}
	}
	cp, _ := disk.CheckpointDir("sbsuspended")
	checkpoint(cp, agents["suspended"])
	batch, _ := disk.CloneBatchDir("sbplain", "batch1")
	checkpoint(filepath.Join(batch, "checkpoint"), agents["clone"])
	base, _ := disk.BaseSnapshotDir(digest, "m512")
	checkpoint(filepath.Join(base, "checkpoint"), agents["base"])
	named, _ := disk.SnapshotDir("snapone")
	checkpoint(filepath.Join(named, "checkpoint"), agents["named"])
	// A checkpoint naming a binary that is not among this node's agents keeps nothing.
	other, _ := disk.SnapshotDir("snaptwo")
	checkpoint(filepath.Join(other, "checkpoint"), "/elsewhere/agents/"+filepath.Base(filepath.Dir(agents["stale"]))+"/space-agent")

	// Unfinished placements: an old one goes, a recent one stays.
	oldTmp := filepath.Join(filepath.Dir(agents["own"]), ".space-agent-1")
	newTmp := filepath.Join(filepath.Dir(agents["own"]), ".space-agent-2")
	for _, p := range []string{oldTmp, newTmp} {
		if err := os.WriteFile(p, []byte("half"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	age := func(all bool) {
		for role, p := range agents {
			if role != "recent" || all {
				if err := os.Chtimes(filepath.Dir(p), old, old); err != nil && !os.IsNotExist(err) {
					t.Fatal(err)
				}
			}
		}
		if err := os.Chtimes(oldTmp, old, old); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	age(false)

	n := &Node{cfg: Config{DataDir: data, AgentPath: agents["own"]}, disk: disk, log: slog.New(slog.DiscardHandler),
		rt: mapperRuntime{running: []string{agents["running"]}}, agentHash: filepath.Base(filepath.Dir(agents["own"]))}

	// A checkpoint whose needs cannot be read stops the pass: nothing is removed.
	bad, _ := disk.SnapshotDir("snapbad")
	if err := os.MkdirAll(filepath.Join(bad, "checkpoint", "agent"), 0o755); err != nil {
		t.Fatal(err)
	}
	n.pruneAgents(t.Context())
	for role, p := range agents {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("with a checkpoint unreadable, the %s agent was removed: %v", role, err)
		}
	}
	if err := os.RemoveAll(bad); err != nil {
		t.Fatal(err)
	}

	n.pruneAgents(t.Context())
	for role, p := range agents {
		_, err := os.Stat(p)
		gone := strings.HasPrefix(role, "stale")
		if gone != (err != nil) {
			t.Errorf("agent %s: removed=%v, want %v (%v)", role, err != nil, gone, err)
		}
	}
	if _, err := os.Stat(oldTmp); err == nil {
		t.Error("an unfinished placement older than the grace period was kept")
	}
	if _, err := os.Stat(newTmp); err != nil {
		t.Errorf("a recent unfinished placement was removed: %v", err)
	}

	// Asking for an agent again (a pull of a snapshot that carries it) renews its grace.
	if err := os.Chtimes(filepath.Dir(agents["recent"]), old, old); err != nil {
		t.Fatal(err)
	}
	sum := filepath.Base(filepath.Dir(agents["recent"])) + strings.Repeat("0", 48)
	if _, err := placeAgent(data, sum, func(io.Writer) error { t.Fatal("an agent already there was written again"); return nil }); err != nil {
		t.Fatal(err)
	}
	n.pruneAgents(t.Context())
	if _, err := os.Stat(agents["recent"]); err != nil {
		t.Fatalf("an agent asked for again was removed: %v", err)
	}

	// The sandbox is deleted and its checkpoint with it: its agent goes at the next pass.
	if err := disk.DeleteSandbox(t.Context(), "sbsuspended"); err != nil {
		t.Fatal(err)
	}
	n.pruneAgents(t.Context())
	if _, err := os.Stat(agents["suspended"]); err == nil {
		t.Error("the agent of a deleted checkpoint was kept")
	}
	if _, err := os.Stat(agents["named"]); err != nil {
		t.Errorf("the named snapshot's agent was removed: %v", err)
	}

	// A runtime whose checkpoints hold their agent needs only the node's own.
	age(true)
	n.rt = nil
	n.pruneAgents(t.Context())
	for role, p := range agents {
		_, err := os.Stat(p)
		if (role == "own") != (err == nil) {
			t.Errorf("without checkpoints that need a host binary: agent %s kept=%v", role, err == nil)
		}
	}
}

// TestPruneBaseSnapshots: base snapshots of another runtime version or agent build go
// (this node never restores them again), this build's of every size class stay, and
// the agent binary only a removed one named goes with the next pass.
func TestPruneBaseSnapshots(t *testing.T) {
	data := t.TempDir()
	const digest = "sha256:" + "cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34"
	disk := diskWithRelease(t, data, digest)
	own, err := placeAgent(data, "aaaaaaaaaaaaaaaa"+strings.Repeat("0", 48), func(w io.Writer) error { _, err := io.WriteString(w, "own"); return err })
	if err != nil {
		t.Fatal(err)
	}
	older, err := placeAgent(data, "bbbbbbbbbbbbbbbb"+strings.Repeat("0", 48), func(w io.Writer) error { _, err := io.WriteString(w, "older"); return err })
	if err != nil {
		t.Fatal(err)
	}
	n := &Node{cfg: Config{DataDir: data, AgentPath: own}, disk: disk, log: slog.New(slog.DiscardHandler),
		rt: mapperRuntime{}, agentHash: "aaaaaaaaaaaaaaaa", info: runtime.Info{Name: "gvisor", Version: "v2"}}
	base := func(key, agent string) string {
		t.Helper()
		dir, err := disk.BaseSnapshotDir(digest, key)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(dir, "checkpoint"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "checkpoint", "agent"), []byte(agent), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	keep := []string{
		base(n.baseKey(store.SandboxSpec{CPU: 1, MemoryMB: 512}), own),
		base(n.baseKey(store.SandboxSpec{CPU: 2, MemoryMB: 1024}), own),
	}
	gone := []string{
		base("gvisor-v2-agentbbbbbbbb-1cpu-512mb", older), // an older agent build
		base("gvisor-v1-agentaaaaaaaa-1cpu-512mb", own),   // an older runsc
		base("qemu-7.2-agentaaaaaaaa-1cpu-512mb", own),    // another runtime
	}
	old := time.Now().Add(-2 * agentGrace)
	if err := os.Chtimes(filepath.Dir(older), old, old); err != nil {
		t.Fatal(err)
	}
	n.pruneAgents(t.Context())
	if _, err := os.Stat(older); err != nil {
		t.Fatalf("the agent a base snapshot names was removed: %v", err)
	}
	n.pruneBaseSnapshots(t.Context())
	n.pruneAgents(t.Context())
	for _, d := range keep {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("this build's base snapshot %s was removed: %v", filepath.Base(d), err)
		}
	}
	for _, d := range gone {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("the base snapshot %s of another build was kept", filepath.Base(d))
		}
	}
	if _, err := os.Stat(older); err == nil {
		t.Error("the agent only a removed base snapshot named was kept")
	}
	if _, err := os.Stat(own); err != nil {
		t.Errorf("the node's own agent was removed: %v", err)
	}
}
