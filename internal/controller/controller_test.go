package controller_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/controller"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

func TestTTLAndIdleSuspend(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	short := s.Create(api.CreateSandboxRequest{TTL: "1s"})
	idle := s.Create(api.CreateSandboxRequest{IdleTimeout: "1s"})
	s.Eventually(30*time.Second, "the TTL to delete the sandbox", func() bool {
		sb, err := s.C.GetSandbox(ctx(t), short.ID)
		return err == nil && sb.State == api.StateDeleted
	})
	s.Eventually(30*time.Second, "the idle sandbox to be suspended", func() bool {
		sb, err := s.C.GetSandbox(ctx(t), idle.ID)
		return err == nil && sb.State == api.StateSuspended && strings.Contains(sb.StatusReason, "idle for 1s")
	})
}

// TestIdleSuspendAsksAgain: a sandbox whose idle suspend failed (here: no room for
// its snapshot) runs on with its desired state suspended; once it has been idle for
// its timeout again the controller asks again, and that suspend works.
func TestIdleSuspendAsksAgain(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	s.Disk.SetFree(1 << 20) // room for a create, not for a snapshot of the memory
	sb := s.Create(api.CreateSandboxRequest{IdleTimeout: "1s"})
	s.Eventually(30*time.Second, "the idle suspend to fail", func() bool {
		got, err := s.Store.GetSandbox(ctx(t), sb.ID)
		return err == nil && got.State == api.StateRunning && got.DesiredState == api.StateSuspended &&
			got.ObservedGeneration >= got.Generation && strings.Contains(got.Error, "free above the reserve")
	})
	s.Eventually(30*time.Second, "a second idle suspend to fail", func() bool {
		ops, err := s.Store.SandboxOperations(ctx(t), sb.ID, 100) // the API's reads are activity
		failed := 0
		for _, op := range ops {
			if op.Kind == api.OpSuspend && op.State == api.OpFailed {
				failed++
			}
		}
		return err == nil && failed >= 2
	})
	s.Disk.SetFree(-1)
	s.Eventually(30*time.Second, "the idle suspender to ask again and the suspend to work", func() bool {
		got, err := s.Store.GetSandbox(ctx(t), sb.ID)
		return err == nil && got.State == api.StateSuspended && strings.Contains(got.StatusReason, "asking again")
	})
}

func TestUnplaceableFailsWithTheReason(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{Controller: func(c *controller.Config) { c.PlaceTimeout = 2 * time.Second }})
	// The API refuses a runtime no live node offers; a sandbox still becomes unplaceable
	// when the node that offered its runtime goes away after the create. Recorded here
	// directly, as the API did then.
	sb := &store.Sandbox{ID: ids.Sandbox(), Tenant: "default", TemplateRef: "base:latest", DesiredState: api.StateRunning,
		State: api.StatePending, Spec: store.SandboxSpec{CPU: 1, MemoryMB: 512, Runtime: "qemu"}}
	created := &store.Operation{ID: ids.Operation(), Kind: api.OpCreate, Tenant: "default"}
	if err := s.Store.InTx(ctx(t), func(tx *store.Tx) error { return tx.CreateSandbox(ctx(t), sb, created) }); err != nil {
		t.Fatal(err)
	}
	op := s.WaitOp(created.ID, api.OpFailed)
	if !strings.Contains(op.Error, `runtime "qemu"`) {
		t.Fatalf("op %+v", op)
	}
	got, _ := s.C.GetSandbox(ctx(t), sb.ID)
	if got.State != api.StateFailed || !strings.Contains(got.Error, "qemu") {
		t.Fatalf("sandbox %+v", got)
	}
}

func TestDeleteBeforeScheduling(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{NoNode: true})
	sb, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	// No node is alive: it waits, saying why.
	s.Eventually(30*time.Second, "the create to say it waits for a node", func() bool {
		op, err := s.C.GetOperation(ctx(t), sb.Operation.ID)
		return err == nil && strings.Contains(op.Message, "waiting for a node")
	})
	del, err := s.C.DeleteSandbox(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(del.ID, api.OpSucceeded)
	s.WaitOp(sb.Operation.ID, api.OpFailed)
}

func TestDeadNodes(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{NoNode: true, Controller: func(c *controller.Config) { c.NodeTimeout = time.Second }})
	// A node registers and never heartbeats.
	if err := s.Store.RegisterNode(ctx(t), &store.Node{ID: s.NodeID, Name: "silent", Runtime: "fake", DataPlaneURL: s.URL}); err != nil {
		t.Fatal(err)
	}
	s.Eventually(30*time.Second, "the silent node to be marked dead", func() bool {
		n, err := s.Store.GetNode(ctx(t), s.NodeID)
		return err == nil && n.State == store.NodeDead
	})
}
