package controller_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/controller"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
)

// A node with room for two 512 MiB sandboxes: a third waits, saying why on the
// sandbox and its create, and fails with that reason after the placement deadline;
// once a sandbox is suspended (its memory freed) the next create fits.
func TestPlacementByCapacity(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{
		Node:       func(c *node.Config) { c.Capacity = store.Resources{MemoryMB: 1024} },
		Controller: func(c *controller.Config) { c.PlaceTimeout = 3 * time.Second },
	})
	a := s.Create(api.CreateSandboxRequest{MemoryMB: 512})
	s.Create(api.CreateSandboxRequest{MemoryMB: 512})
	nodes, err := s.C.ListNodes(ctx(t))
	if err != nil || len(nodes) != 1 || nodes[0].Capacity.MemoryMB != 1024 || nodes[0].Used.MemoryMB != 1024 {
		t.Fatalf("nodes: %+v %v", nodes, err)
	}

	third, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{MemoryMB: 512}, "")
	if err != nil {
		t.Fatal(err)
	}
	const why = "waiting for a node: no node has room for 1 vCPU, 512 MiB memory, 1024 MiB disk (node-"
	s.Eventually(10*time.Second, "the create to say why it waits", func() bool {
		op, err1 := s.C.GetOperation(ctx(t), third.Operation.ID)
		sb, err2 := s.C.GetSandbox(ctx(t), third.ID)
		return err1 == nil && err2 == nil && strings.HasPrefix(op.Message, why) && strings.Contains(op.Message, "0 of 1024 MiB memory free") &&
			strings.HasPrefix(sb.StatusReason, why) && sb.State == api.StatePending
	})
	op := s.WaitOp(third.Operation.ID, api.OpFailed)
	if !strings.HasPrefix(op.Error, "no node can run it: no node has room") {
		t.Fatalf("failed create: %+v", op)
	}
	if sb, _ := s.C.GetSandbox(ctx(t), third.ID); sb.State != api.StateFailed || !strings.Contains(sb.Error, "0 of 1024 MiB memory free") {
		t.Fatalf("unplaceable sandbox: %+v", sb)
	}

	sus, err := s.C.Lifecycle(ctx(t), a.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(sus.ID, api.OpSucceeded)
	s.Create(api.CreateSandboxRequest{MemoryMB: 512})
}

// A cordoned node gets no new sandbox; uncordoned, the waiting one is placed.
func TestCordonedNodeGetsNoPlacement(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	if _, err := s.C.CordonNode(ctx(t), s.NodeID, true); err != nil {
		t.Fatal(err)
	}
	sb, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	s.Eventually(10*time.Second, "the create to wait for a node", func() bool {
		op, err := s.C.GetOperation(ctx(t), sb.Operation.ID)
		return err == nil && strings.Contains(op.Message, "cordoned")
	})
	if _, err := s.C.CordonNode(ctx(t), s.NodeID, false); err != nil {
		t.Fatal(err)
	}
	s.WaitOp(sb.Operation.ID, api.OpSucceeded)
}

// A node that stops heartbeating is marked dead: its running sandbox is lost with the
// reason, its suspended one stays suspended and cannot wake, nothing waits, a delete
// completes at once, and the running gauge stops counting them. When the node comes
// back it reclaims what is left instead of resurrecting the lost sandbox.
func TestDeadNodeSandboxes(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{Controller: func(c *controller.Config) { c.NodeTimeout = time.Second }})
	running := s.Create(api.CreateSandboxRequest{})
	suspended := s.Create(api.CreateSandboxRequest{})
	op, err := s.C.Lifecycle(ctx(t), suspended.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	doomed := s.Create(api.CreateSandboxRequest{})
	expiring := s.Create(api.CreateSandboxRequest{})

	s.StopNode() // like a kill -9: its instances keep running, nobody heartbeats
	s.Eventually(20*time.Second, "the node to be marked dead", func() bool {
		n, err := s.Store.GetNode(ctx(t), s.NodeID)
		return err == nil && n.State == store.NodeDead
	})
	start := time.Now()
	lost, err := s.C.GetSandbox(ctx(t), running.ID)
	if err != nil || lost.State != api.StateFailed || !strings.HasPrefix(lost.Error, "lost: node node-") ||
		!strings.Contains(lost.Error, "stopped sending heartbeats") {
		t.Fatalf("lost sandbox: %+v %v", lost, err)
	}
	_, err = s.C.CreateSession(ctx(t), running.ID, api.CreateSessionRequest{Command: "true"})
	if !isConflict(err, "lost: node") {
		t.Fatalf("exec on a lost sandbox: %v", err)
	}
	_, err = s.C.Lifecycle(ctx(t), suspended.ID, api.OpWake)
	if !isConflict(err, "which is dead") {
		t.Fatalf("wake on a dead node: %v", err)
	}
	_, err = s.C.CreateSession(ctx(t), suspended.ID, api.CreateSessionRequest{Command: "true"})
	if !isConflict(err, "which is dead") {
		t.Fatalf("exec (waking) on a dead node: %v", err)
	}
	if sb, _ := s.C.GetSandbox(ctx(t), suspended.ID); sb.State != api.StateSuspended {
		t.Fatalf("suspended sandbox on a dead node: %+v", sb)
	}
	del, err := s.C.DeleteSandbox(ctx(t), doomed.ID)
	if err != nil {
		t.Fatal(err)
	}
	if op := s.WaitOp(del.ID, api.OpSucceeded); !strings.Contains(op.Message, "deleted at once") {
		t.Fatalf("delete on a dead node: %+v", op)
	}
	// A TTL that ends on a dead node deletes at once too.
	now := time.Now()
	if err := s.Store.SetExpiry(ctx(t), expiring.ID, &now, "delete"); err != nil {
		t.Fatal(err)
	}
	s.Eventually(10*time.Second, "the expired sandbox on the dead node to be deleted", func() bool {
		sb, err := s.C.GetSandbox(ctx(t), expiring.ID)
		return err == nil && sb.State == api.StateDeleted
	})
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("requests on a dead node's sandboxes took %s", d)
	}
	counts, err := s.Store.CountSandboxesByState(ctx(t))
	if err != nil || counts[api.StateRunning] != 0 {
		t.Fatalf("sandboxes by state: %v %v", counts, err)
	}

	// The node returns (a restart registers a new incarnation): it reclaims the deleted
	// and the lost sandboxes' instances; the lost one stays failed, the suspended one
	// wakes again.
	s.StartNode()
	s.Eventually(20*time.Second, "the returning node to reclaim the instances", func() bool {
		list, err := s.Runtime.List(ctx(t))
		if err != nil {
			return false
		}
		ids := make([]string, 0, len(list))
		for _, in := range list {
			ids = append(ids, in.ID)
		}
		return !slices.Contains(ids, running.ID) && !slices.Contains(ids, doomed.ID)
	})
	if sb, _ := s.C.GetSandbox(ctx(t), running.ID); sb.State != api.StateFailed {
		t.Fatalf("lost sandbox after its node returned: %+v", sb)
	}
	// The node may reclaim its instances before its new incarnation shows alive; a wake
	// asked before that is refused (409, the node is dead), which is right.
	s.Eventually(20*time.Second, "the returning node to show alive", func() bool {
		n, err := s.Store.GetNode(ctx(t), s.NodeID)
		return err == nil && n.State == store.NodeAlive
	})
	wake, err := s.C.Lifecycle(ctx(t), suspended.ID, api.OpWake)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(wake.ID, api.OpSucceeded)
}

func isConflict(err error, msg string) bool {
	var e *client.Error
	return errors.As(err, &e) && e.Status == 409 && strings.Contains(e.Message, msg)
}

// A controller that just became leader judges no node before it has watched them for
// NodeTimeout: a heartbeat that went stale while nobody led (the whole service was
// restarting) does not kill the node at once.
func TestNewLeaderWatchesBeforeJudging(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{NoNode: true, NoController: true})
	if err := s.Store.RegisterNode(ctx(t), &store.Node{ID: "stale", Name: "stale", Runtime: "fake", DataPlaneURL: s.URL}); err != nil {
		t.Fatal(err)
	}
	db := s.Store.DB()
	defer db.Close()
	if _, err := db.ExecContext(ctx(t), `UPDATE nodes SET heartbeat_at = now() - interval '1 hour' WHERE id='stale'`); err != nil {
		t.Fatal(err)
	}
	const timeout = 2 * time.Second
	c, cancel := context.WithCancel(ctx(t))
	done := make(chan error, 1)
	t.Cleanup(func() { cancel(); <-done })
	start := time.Now()
	go func() {
		done <- controller.New(controller.Config{Store: s.Store, NodeTimeout: timeout, Resync: 100 * time.Millisecond}).Run(c)
	}()
	s.Eventually(15*time.Second, "the stale node to be marked dead", func() bool {
		n, err := s.Store.GetNode(ctx(t), "stale")
		return err == nil && n.State == store.NodeDead
	})
	if d := time.Since(start); d < timeout {
		t.Fatalf("marked dead %s after the controller started leading, before watching for %s", d, timeout)
	}
}
