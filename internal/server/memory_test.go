package server_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/testenv"
)

// Out of memory (node/memwatch.go): when the runtime reports a served sandbox near its
// memory limit, the node has the agent end the process holding the most; the command
// ends by SIGKILL with an exit error that says why, and the sandbox keeps running. The
// watch stops while the sandbox is not served: none runs once it is suspended.
func TestOutOfMemoryEndsLargestProcess(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	reg := prometheus.NewRegistry()
	s.Node.RegisterMetrics(reg)
	sb := s.Create(api.CreateSandboxRequest{MemoryMB: 256})
	c := ctx(t)
	var out testenv.Buffer
	type result struct {
		exit *api.ExitEvent
		err  error
	}
	done := make(chan result, 1)
	go func() {
		// Holds 40 MB in the shell, then waits on a FIFO nobody opens (no child left).
		exit, err := s.C.ExecExit(c, sb.ID, api.CreateSessionRequest{Command: `f=$(mktemp -u); mkfifo "$f"; ` +
			`x=$(head -c 40000000 /dev/zero | tr '\0' a); echo ready; read y < "$f"`}, client.Output{Stdout: &out, Stderr: &out})
		done <- result{exit, err}
	}()
	s.Eventually(20*time.Second, "the command to hold its memory", func() bool { return strings.Contains(out.String(), "ready") })
	s.Eventually(10*time.Second, "the node to watch the sandbox's memory", func() bool { return s.Runtime.PressMemory(sb.ID) })
	var r result
	select {
	case r = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the largest process was not ended")
	}
	if r.err != nil || r.exit == nil || r.exit.Signal != "SIGKILL" || !strings.Contains(r.exit.Error, "out of memory") {
		t.Fatalf("exit %+v, %v", r.exit, r.err)
	}
	if code := client.ExitCode(r.exit); code != 137 {
		t.Fatalf("exit code %d, want 137", code)
	}
	// The node counts the kill once the agent's answer is back, which may come after the
	// exit reached the client.
	s.Eventually(10*time.Second, "space_node_oom_kills_total to count the kill", func() bool { return oomKills(t, reg) == 1 })
	if n := oomKills(t, reg); n != 1 {
		t.Fatalf("space_node_oom_kills_total %v, want 1", n)
	}
	got, err := s.C.GetSandbox(c, sb.ID)
	if err != nil || got.State != api.StateRunning {
		t.Fatalf("sandbox after the reclaim: %+v %v", got, err)
	}
	op, err := s.C.Lifecycle(c, sb.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	s.Eventually(10*time.Second, "the watch of the suspended sandbox to stop", func() bool { return !s.Runtime.PressMemory(sb.ID) })
}

// oomKills reads space_node_oom_kills_total from reg.
func oomKills(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "space_node_oom_kills_total" && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("no space_node_oom_kills_total")
	return 0
}
