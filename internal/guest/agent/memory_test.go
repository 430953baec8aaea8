package agent_test

import (
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/wire"
)

// Out of memory (memory.go): a reclaim ends the process holding the most memory, with
// SIGKILL, and its command's exit says why; the other processes keep running; with no
// process left there is nothing to end. The agent is not PID 1 here, so only its own
// descendants are candidates (the test's other processes are not).
func TestReclaimMemory(t *testing.T) {
	needTools(t, "sh", "head", "tr")
	e := startAgent(t, nil)
	ctx := testCtx(t, 30*time.Second)
	big, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c",
		`x=$(head -c 40000000 /dev/zero | tr '\0' a); echo ready; read y; echo ${#x}`}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	fb := follow(t, e.c, big.PID)
	small, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c", "echo small; read y"}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	fs := follow(t, e.c, small.PID)
	fb.waitFor(t, "ready", 1)
	fs.waitFor(t, "small", 1)

	v, ok, err := e.c.ReclaimMemory(ctx)
	if err != nil || !ok {
		t.Fatalf("reclaim: %+v %v %v", v, ok, err)
	}
	if v.PID != big.PID || v.Name != "sh" || v.RSS < 30<<20 {
		t.Fatalf("reclaim ended %+v; want pid %d (sh) holding 40 MB", v, big.PID)
	}
	res := <-fb.res
	if res.exit == nil || res.exit.Signal != "SIGKILL" || !strings.Contains(res.exit.Error, "out of memory") {
		t.Fatalf("the ended process's exit: %+v", res.exit)
	}
	t.Logf("exit: %+v", res.exit)
	if info, err := e.c.GetProcess(ctx, small.PID); err != nil || info.State != wire.StateRunning {
		t.Fatalf("the small process after the reclaim: %+v %v", info, err)
	}
	if err := e.c.WriteStdin(ctx, small.PID, strings.NewReader("\n"), true); err != nil {
		t.Fatal(err)
	}
	if res := <-fs.res; res.exit == nil || res.exit.Error != "" || exitCode(t, res.exit) != 0 {
		t.Fatalf("the small process's exit: %+v", res.exit)
	}
	if v, ok, err := e.c.ReclaimMemory(ctx); err != nil || ok {
		t.Fatalf("reclaim with no process left: %+v %v %v", v, ok, err)
	}
}
