package server_test

import (
	"context"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/spacetest"
)

// TestOneConnectionServesEveryVerb runs the API on a pool of one database connection:
// a request that holds a transaction never waits for a second connection (the
// transaction's own checks read through it), so lifecycle verbs, snapshots, clones and
// a burst of commands that wake a paused sandbox all complete. Before, a verb checked
// the sandbox's node through the pool inside its transaction: with every connection
// held by a request queued on the tenant's lock behind it, the API stopped for good
// (seen with 200 commands sent at once to a suspended sandbox, on the default pool).
func TestOneConnectionServesEveryVerb(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{ServiceDBConns: 1})
	sb := s.Create(api.CreateSandboxRequest{})
	c, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	step := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	verb := func(kind string) {
		t.Helper()
		op, err := s.C.LifecycleAndWait(c, sb.ID, kind)
		step(kind, err)
		if op.State != api.OpSucceeded {
			t.Fatalf("%s: %+v", kind, op)
		}
	}
	verb(api.OpPause)
	var wg sync.WaitGroup
	for i := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x, err := s.C.Run(c, sb.ID, api.ExecRequest{Argv: []string{"true"}}, client.Output{Stdout: io.Discard, Stderr: io.Discard})
			if err != nil || client.ExitCode(x) != 0 {
				t.Errorf("command %d on the paused sandbox: %+v, %v", i, x, err)
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	verb(api.OpSuspend)
	verb(api.OpWake)
	_, err := s.C.CreateSnapshotAndWait(c, sb.ID, api.CreateSnapshotRequest{Name: "one-conn"})
	step("snapshot", err)
	clones, err := s.C.Clone(c, sb.ID, api.CloneRequest{Count: 2})
	step("clone", err)
	for _, cl := range clones {
		s.WaitOp(cl.Operation.ID, api.OpSucceeded)
	}
}
