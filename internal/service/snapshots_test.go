package service_test

import (
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
)

// Another tenant's snapshots, and snapshots and metrics of its sandboxes, answer
// exactly like ones that do not exist; admins see every tenant's.
func TestOtherTenantsSnapshotsAreNotFound(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	a := principal(t, s, s.NewKey("a", false, service.KeySpace), service.KeySpace)
	b := principal(t, s, s.NewKey("b", false, service.KeySpace), service.KeySpace)
	admin := principal(t, s, s.AdminKey, service.KeySpace)
	created, err := s.Service.Create(ctx(t), a, api.CreateSandboxRequest{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(created.Op.ID, api.OpSucceeded)
	sn, op, err := s.Service.CreateSnapshot(ctx(t), a, created.Sandbox.ID, api.CreateSnapshotRequest{Name: "mine"})
	if err != nil {
		t.Fatal(err)
	}
	if sn.Tenant != "a" || op.Tenant != "a" {
		t.Fatalf("snapshot %+v op %+v", sn, op)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	if got, err := s.Service.Operation(ctx(t), b, op.ID); !fault.Is(err, fault.NotFound) {
		t.Fatalf("other tenant's snapshot operation: %+v %v", got, err)
	}
	// b may use the same name: names are per tenant.
	bsb, err := s.Service.Create(ctx(t), b, api.CreateSandboxRequest{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(bsb.Op.ID, api.OpSucceeded)
	if _, op, err := s.Service.CreateSnapshot(ctx(t), b, bsb.Sandbox.ID, api.CreateSnapshotRequest{Name: "mine"}); err != nil {
		t.Fatalf("the same name in another tenant: %v", err)
	} else {
		s.WaitOp(op.ID, api.OpSucceeded)
	}
	checks := map[string]func(p *service.Principal, ref string) error{
		"get": func(p *service.Principal, ref string) error { _, err := s.Service.Snapshot(ctx(t), p, ref); return err },
		"delete": func(p *service.Principal, ref string) error {
			_, err := s.Service.DeleteSnapshot(ctx(t), p, ref)
			return err
		},
		"create from": func(p *service.Principal, ref string) error {
			_, err := s.Service.Create(ctx(t), p, api.CreateSandboxRequest{Snapshot: ref}, nil)
			return err
		},
	}
	for name, check := range checks {
		other := check(b, sn.ID)
		missing := check(b, "snapaaaaaaaaaaaaaaaa")
		if !fault.Is(other, fault.NotFound) || other.Error() != strings.Replace(missing.Error(), "snapaaaaaaaaaaaaaaaa", sn.ID, 1) {
			t.Errorf("%s: other tenant %v, missing %v", name, other, missing)
		}
	}
	// b's "mine" is b's own, not a's.
	if got, err := s.Service.Snapshot(ctx(t), b, "mine"); err != nil || got.ID == sn.ID {
		t.Fatalf("b's snapshot named mine: %+v %v", got, err)
	}
	for name, check := range map[string]func(p *service.Principal, id string) error{
		"snapshot of": func(p *service.Principal, id string) error {
			_, _, err := s.Service.CreateSnapshot(ctx(t), p, id, api.CreateSnapshotRequest{})
			return err
		},
		"metrics of": func(p *service.Principal, id string) error {
			_, _, err := s.Service.Metrics(ctx(t), p, id, time.Time{}, time.Time{})
			return err
		},
	} {
		other := check(b, created.Sandbox.ID)
		missing := check(b, "aaaaaaaaaaaaaaaaaaaa")
		if !fault.Is(other, fault.NotFound) || other.Error() != strings.Replace(missing.Error(), "aaaaaaaaaaaaaaaaaaaa", created.Sandbox.ID, 1) {
			t.Errorf("%s: other tenant %v, missing %v", name, other, missing)
		}
	}
	if list, err := s.Service.Snapshots(ctx(t), b, service.SnapshotFilter{}); err != nil || len(list) != 1 || list[0].Tenant != "b" {
		t.Fatalf("b lists %+v (%v)", list, err)
	}
	if list, err := s.Service.Snapshots(ctx(t), admin, service.SnapshotFilter{}); err != nil || len(list) != 2 {
		t.Fatalf("admin lists %d (%v)", len(list), err)
	}
	if got, err := s.Service.Snapshot(ctx(t), admin, sn.ID); err != nil || got.ID != sn.ID {
		t.Fatalf("admin gets a's snapshot by id: %+v %v", got, err)
	}
	if n, err := s.Service.SnapshotBytes(ctx(t), "a"); err != nil || n <= 0 {
		t.Fatalf("a's snapshot bytes: %d %v", n, err)
	}
	// A sandbox made from a's snapshot is a's.
	made, err := s.Service.Create(ctx(t), a, api.CreateSandboxRequest{Snapshot: "mine"}, nil)
	if err != nil || made.Sandbox.Tenant != "a" || made.Sandbox.Spec.Snapshot != sn.ID {
		t.Fatalf("create from snapshot: %+v %v", made, err)
	}
}
