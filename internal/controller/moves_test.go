package controller_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/controller"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
)

// The in-process space has one fake node and no registry; these tests stand in for
// what a registry gives (a recorded snapshot digest, a second node that shares the
// registry) to check the control plane's side of moves: re-homing on a wake, placement
// only on nodes that share the registry, the way back when no node can take it, and a
// drain's bookkeeping. The real thing runs in internal/e2e (TestFleetMove).

// otherNode registers a node row that heartbeats (nobody acts on its sandboxes).
func otherNode(t *testing.T, s *spacetest.Space, id string, registry bool) {
	t.Helper()
	if err := s.Store.RegisterNode(ctx(t), &store.Node{ID: id, Name: id, Runtime: "fake", DataPlaneURL: s.URL,
		RuntimeInfo: map[string]any{"registry": registry}}); err != nil {
		t.Fatal(err)
	}
	db := s.Store.DB()
	c, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for c.Err() == nil {
			_, _ = db.ExecContext(c, `UPDATE nodes SET heartbeat_at=now() WHERE id=$1`, id)
			select {
			case <-c.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done; db.Close() })
}

func setRegistry(t *testing.T, s *spacetest.Space, id string, on bool) {
	t.Helper()
	db := s.Store.DB()
	defer db.Close()
	if _, err := db.ExecContext(ctx(t), `UPDATE nodes SET runtime_info = runtime_info || jsonb_build_object('registry', $2::boolean) WHERE id=$1`, id, on); err != nil {
		t.Fatal(err)
	}
}

const fakeDigest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// A wake of a suspended sandbox whose node is dead: without a pushed snapshot it is a
// conflict at once; with one it is re-homed, waits while no other node shares the
// registry, goes back to the dead node (still suspended, the wake failed with the
// reason) after the placement deadline, and is placed on a node that shares the
// registry once there is one.
func TestDeadNodeWakeRehomes(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{Controller: func(c *controller.Config) {
		c.NodeTimeout, c.PlaceTimeout = time.Second, 3*time.Second
	}})
	sb := s.Create(api.CreateSandboxRequest{})
	op, err := s.C.Lifecycle(ctx(t), sb.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	// A running sandbox whose node pushed a periodic checkpoint 5 s ago (stood in).
	cp := s.Create(api.CreateSandboxRequest{})
	{
		db := s.Store.DB()
		_, err := db.ExecContext(ctx(t), `UPDATE sandboxes SET checkpoint_digest=$2, checkpoint_at=now()-interval '5 seconds' WHERE id=$1`, cp.ID, fakeDigest)
		db.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	otherNode(t, s, "other", false)
	s.StopNode()
	s.Eventually(20*time.Second, "the node to be marked dead", func() bool {
		n, err := s.Store.GetNode(ctx(t), s.NodeID)
		return err == nil && n.State == store.NodeDead
	})
	// The checkpointed one is not lost: it is to be restored elsewhere from its checkpoint.
	if got, err := s.C.GetSandbox(ctx(t), cp.ID); err != nil || got.State != api.StateSuspended || got.DesiredState != api.StateRunning ||
		got.CheckpointLossMs < 4000 || !got.SnapshotPushed {
		t.Fatalf("checkpointed sandbox on the dead node: %+v %v", got, err)
	}
	if _, err := s.C.Lifecycle(ctx(t), sb.ID, api.OpWake); !isConflict(err, "its snapshot is not in a registry") {
		t.Fatalf("wake without a pushed snapshot: %v", err)
	}
	// Its node pushed the snapshot before it died (what store.RecordSnapshotPush records).
	db := s.Store.DB()
	defer db.Close()
	if _, err := db.ExecContext(ctx(t), `UPDATE sandboxes SET snapshot_digest=$2 WHERE id=$1`, sb.ID, fakeDigest); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.C.GetSandbox(ctx(t), sb.ID); !got.SnapshotPushed {
		t.Fatalf("snapshot_pushed not shown: %+v", got)
	}
	wake, err := s.C.Lifecycle(ctx(t), sb.ID, api.OpWake)
	if err != nil {
		t.Fatal(err)
	}
	s.Eventually(10*time.Second, "the wake to say why it waits", func() bool {
		o, err := s.C.GetOperation(ctx(t), wake.ID)
		return err == nil && strings.Contains(o.Message, "no other alive node shares the registry")
	})
	failed := s.WaitOp(wake.ID, api.OpFailed)
	if !strings.Contains(failed.Error, "no other node can take it") {
		t.Fatalf("wake that no node can take: %+v", failed)
	}
	back, err := s.C.GetSandbox(ctx(t), sb.ID)
	if err != nil || back.Node != s.NodeID || back.State != api.StateSuspended || back.DesiredState != api.StateSuspended || !back.SnapshotPushed {
		t.Fatalf("after the failed move: %+v %v", back, err)
	}

	setRegistry(t, s, "other", true)
	wake, err = s.C.Lifecycle(ctx(t), sb.ID, api.OpWake)
	if err != nil {
		t.Fatal(err)
	}
	s.Eventually(10*time.Second, "the sandbox to be placed on the other node", func() bool {
		got, err := s.C.GetSandbox(ctx(t), sb.ID)
		return err == nil && got.Node == "other"
	})
	s.Eventually(10*time.Second, "the wake to say where it goes", func() bool {
		o, err := s.C.GetOperation(ctx(t), wake.ID)
		return err == nil && !o.Done() && strings.Contains(o.Message, "moving to node other")
	})
	// The other node restores it and records the move.
	moved, note, err := s.Store.FinishMove(ctx(t), sb.ID, "other")
	if err != nil || moved < 0 || !strings.Contains(note, "moved from node ") || !strings.Contains(note, "to node other") {
		t.Fatalf("finish move: %d %q %v", moved, note, err)
	}
	if got, _ := s.C.GetSandbox(ctx(t), sb.ID); got.MovedAt == nil || got.StatusReason != note {
		t.Fatalf("moved sandbox: %+v", got)
	}
}

// A drain of a node without a registry fails at once with the reason and leaves the
// node cordoned and its sandbox running; a drain's moves are recorded as they happen
// (here the snapshot push and the other node's restore are stood in for).
func TestDrain(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	op, err := s.C.DrainNode(ctx(t), s.NodeID)
	if err != nil {
		t.Fatal(err)
	}
	if op.Kind != api.OpNodeDrain || op.Node == "" {
		t.Fatalf("drain operation: %+v", op)
	}
	failed := s.WaitOp(op.ID, api.OpFailed)
	if !strings.Contains(failed.Error, "has no registry") {
		t.Fatalf("drain without a registry: %+v", failed)
	}
	nodes, _ := s.C.ListNodes(ctx(t))
	if len(nodes) != 1 || !nodes[0].Cordoned {
		t.Fatalf("drained node not cordoned: %+v", nodes)
	}
	if got, _ := s.C.GetSandbox(ctx(t), sb.ID); got.State != api.StateRunning || got.Node != s.NodeID {
		t.Fatalf("sandbox after a failed drain: %+v", got)
	}

	setRegistry(t, s, s.NodeID, true)
	otherNode(t, s, "other", true)
	op, err = s.C.DrainNode(ctx(t), s.NodeID)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := s.C.DrainNode(ctx(t), s.NodeID); err != nil || again.ID != op.ID {
		t.Fatalf("a second drain of a node being drained: %+v %v", again, err)
	}
	// The sandbox is suspended for its move; its node pushes the snapshot (stood in).
	s.Eventually(10*time.Second, "the sandbox to be suspended for its move", func() bool {
		got, err := s.C.GetSandbox(ctx(t), sb.ID)
		return err == nil && got.State == api.StateSuspended
	})
	row, err := s.Store.GetSandbox(ctx(t), sb.ID)
	if err != nil || row.MoveFrom != s.NodeID {
		t.Fatalf("moving sandbox: %+v %v", row, err)
	}
	if ok, err := s.Store.RecordSnapshotPush(ctx(t), sb.ID, s.NodeID, row.ObservedGeneration, fakeDigest); err != nil || !ok {
		t.Fatalf("record push: %v %v", ok, err)
	}
	s.Eventually(10*time.Second, "the sandbox to be re-homed onto the other node", func() bool {
		got, err := s.C.GetSandbox(ctx(t), sb.ID)
		return err == nil && got.Node == "other"
	})
	if o, _ := s.C.GetOperation(ctx(t), op.ID); o.Done() || len(o.Moves) != 1 || o.Moves[0].State != "moving" {
		t.Fatalf("drain while the sandbox moves: %+v", o)
	}
	// The other node restores it.
	row, _ = s.Store.GetSandbox(ctx(t), sb.ID)
	if _, err := s.Store.ReportObserved(ctx(t), sb.ID, "other", store.Observed{State: api.StateRunning, ObservedGeneration: row.Generation}); err != nil {
		t.Fatal(err)
	}
	if ms, _, err := s.Store.FinishMove(ctx(t), sb.ID, "other"); err != nil || ms < 0 {
		t.Fatalf("finish move: %d %v", ms, err)
	}
	done := s.WaitOp(op.ID, api.OpSucceeded)
	if len(done.Moves) != 1 || done.Moves[0].State != "moved" || done.Moves[0].To != "other" || !strings.Contains(done.Message, "1 moved") {
		t.Fatalf("finished drain: %+v", done)
	}
	// Nothing of it is left on the drained node.
	s.Eventually(10*time.Second, "the drained node to drop the sandbox", func() bool {
		list, err := s.Runtime.List(ctx(t))
		if err != nil {
			return false
		}
		for _, in := range list {
			if in.ID == sb.ID {
				return false
			}
		}
		return true
	})
}

// A drain whose move's checkpoint fails with the sandbox running on (here: no room for
// its snapshot) finishes, failed, naming the sandbox and why; the sandbox stays on its
// node, running and meant to run, no longer moving. Before, the drain waited for it
// forever.
func TestDrainMoveRefused(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	s.Disk.SetFree(1 << 20) // no room for a snapshot of its memory
	setRegistry(t, s, s.NodeID, true)
	otherNode(t, s, "other", true)
	op, err := s.C.DrainNode(ctx(t), s.NodeID)
	if err != nil {
		t.Fatal(err)
	}
	failed := s.WaitOp(op.ID, api.OpFailed)
	if len(failed.Moves) != 1 || failed.Moves[0].State != "failed" || !strings.Contains(failed.Moves[0].Error, "free above the reserve") ||
		!strings.Contains(failed.Error, sb.ID) {
		t.Fatalf("drain of a sandbox whose checkpoint fails: %+v", failed)
	}
	s.Eventually(10*time.Second, "the sandbox to be meant to run again", func() bool {
		row, err := s.Store.GetSandbox(ctx(t), sb.ID)
		return err == nil && row.State == api.StateRunning && row.DesiredState == api.StateRunning &&
			row.ObservedGeneration >= row.Generation && row.MoveFrom == "" && row.NodeID == s.NodeID
	})
	var out strings.Builder
	if code, err := s.C.Exec(ctx(t), sb.ID, api.CreateSessionRequest{Argv: []string{"echo", "here"}}, client.Output{Stdout: &out}); err != nil || code != 0 || out.String() != "here\n" {
		t.Fatalf("exec after the failed drain: %d %q %v", code, out.String(), err)
	}
}
