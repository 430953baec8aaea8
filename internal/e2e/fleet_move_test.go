package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/testenv"
)

// moveFleet is an api+controller process and two node processes sharing one
// PostgreSQL and one registry.
type moveFleet struct {
	api  *srv
	a, b *srv
	ids  map[string]string // node name → id
	// reg is how the nodes reach the registry: a forwarder the test can cut.
	reg *forwarder
}

// forwarder forwards TCP connections to a target; while down it closes each one at
// once (the registry looks unreachable).
type forwarder struct {
	ln     net.Listener
	target string
	down   atomic.Bool
	mu     sync.Mutex
	conns  map[net.Conn]bool
}

// cut makes the registry unreachable (closing the connections kept alive, too) or
// reachable again.
func (f *forwarder) cut(on bool) {
	f.down.Store(on)
	if !on {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for c := range f.conns {
		c.Close()
	}
}

func newForwarder(t *testing.T, target string) *forwarder {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &forwarder{ln: ln, target: target, conns: map[net.Conn]bool{}}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if f.down.Load() {
				c.Close()
				continue
			}
			f.mu.Lock()
			f.conns[c] = true
			f.mu.Unlock()
			go func() {
				defer func() {
					c.Close()
					f.mu.Lock()
					delete(f.conns, c)
					f.mu.Unlock()
				}()
				u, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer u.Close()
				go func() { _, _ = io.Copy(u, c); u.(*net.TCPConn).CloseWrite() }()
				_, _ = io.Copy(c, u)
			}()
		}
	}()
	return f
}

func startMoveFleet(t *testing.T) *moveFleet {
	t.Helper()
	requireHost(t)
	db := testenv.Postgres(t)
	reg := testenv.StartRegistry(t)
	f := &moveFleet{ids: map[string]string{}, reg: newForwarder(t, reg.Addr)}
	nodeArgs := func(name string) []string {
		return []string{"--roles", "node", "--node-name", name, "--registry", f.reg.ln.Addr().String() + "/space"}
	}
	f.a = start(t, options{DBURL: db, Args: nodeArgs("a")})
	// Node b runs another space build's agent: every sandbox that moves between the
	// two restores with an agent binary the receiving node does not run (a rolling
	// upgrade), which the snapshot carries.
	f.b = start(t, options{DBURL: db, Args: nodeArgs("b"), OtherAgent: true})
	f.api = start(t, options{DBURL: db, NoBase: true, Args: []string{"--roles", "api,controller", "--node-timeout", "5s"}})
	waitFor(t, time.Minute, "both nodes to register", func() bool {
		nodes, err := f.api.C.ListNodes(ctx(t, time.Minute))
		if err != nil {
			return false
		}
		alive := 0
		for _, n := range nodes {
			f.ids[n.Name] = n.ID
			if n.State == "alive" {
				alive++
			}
		}
		return alive == 2
	})
	return f
}

func (f *moveFleet) sandbox(t *testing.T, id string) *api.Sandbox {
	t.Helper()
	sb, err := f.api.C.GetSandbox(ctx(t, time.Minute), id)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

func (f *moveFleet) cordon(t *testing.T, node string, on bool) {
	t.Helper()
	if _, err := f.api.C.CordonNode(ctx(t, time.Minute), node, on); err != nil {
		t.Fatal(err)
	}
}

// TestFleetMove moves a sandbox between two node processes through a registry: a
// drain moves it, running, with a process whose attached reader loses no byte; then,
// suspended on the other node whose process is killed -9, a wake brings it back on the
// first node with its files and its processes' memory; the killed node, restarted,
// only reclaims what it held. A stopped sandbox on the dead node cannot wake elsewhere.
// The two nodes run different agent binaries (as during a rolling upgrade): each move
// restores with the binary the sandbox's checkpoint was taken with, carried by its
// snapshot.
func TestFleetMove(t *testing.T) {
	f := startMoveFleet(t)
	c := ctx(t, 5*time.Minute)
	cl := f.api.C

	// A sandbox on node a (b cordoned while it is placed).
	f.cordon(t, "b", true)
	sb := f.api.create(t, api.CreateSandboxRequest{})
	f.cordon(t, "b", false)
	if sb.Node != f.ids["a"] {
		t.Fatalf("sandbox placed on %s, want node a (%s)", sb.Node, f.ids["a"])
	}
	if out, _, code := f.api.exec(t, sb.ID, "sh", "-c", "echo kept > /root/moved.txt"); code != 0 {
		t.Fatalf("write file: %d %s", code, out)
	}

	// --- Drain: a process keeps printing; a follower attached to it loses no byte.
	const lines = 1500
	script := fmt.Sprintf(`i=0; while [ $i -lt %d ]; do echo "line $i"; i=$((i+1)); sleep 0.01; done`, lines)
	sess, err := cl.CreateSession(c, sb.ID, api.CreateSessionRequest{Command: script})
	if err != nil {
		t.Fatal(err)
	}
	var got syncBuffer
	followed := make(chan error, 1)
	var exit *api.ExitEvent
	go func() {
		var err error
		exit, err = cl.Follow(c, sess, client.Output{Stdout: &got})
		followed <- err
	}()
	waitFor(t, time.Minute, "output to flow", func() bool { return strings.Count(got.String(), "\n") > 100 })
	out, stderr, code := f.api.cli(t, "node", "drain", "a")
	if code != 0 {
		t.Fatalf("space node drain a: %d\n%s%s", code, out, stderr)
	}
	if !strings.Contains(out, sb.ID+" moved to b (downtime") {
		t.Fatalf("drain output does not report the move:\n%s", out)
	}
	moved := f.sandbox(t, sb.ID)
	if moved.Node != f.ids["b"] || moved.State != api.StateRunning || moved.MovedAt == nil || moved.MoveDowntimeMs <= 0 {
		t.Fatalf("after the drain: node %s state %s moved_at %v downtime %d", moved.Node, moved.State, moved.MovedAt, moved.MoveDowntimeMs)
	}
	t.Logf("drain: downtime %d ms (%s)", moved.MoveDowntimeMs, moved.StatusReason)
	if err := <-followed; err != nil || client.ExitCode(exit) != 0 {
		t.Fatalf("follow across the drain: %+v %v", exit, err)
	}
	var want strings.Builder
	for i := range lines {
		fmt.Fprintf(&want, "line %d\n", i)
	}
	if got.String() != want.String() {
		t.Fatalf("the follower received %d bytes (sha %s), want %d (sha %s)", len(got.String()), sha([]byte(got.String())),
			want.Len(), sha([]byte(want.String())))
	}
	if out, _, code := f.api.exec(t, sb.ID, "cat", "/root/moved.txt"); code != 0 || out != "kept\n" {
		t.Fatalf("file after the drain: %d %q", code, out)
	}
	// Node b keeps the agent binary the snapshot carried beside its own, under the
	// content-addressed name node a gave it, and restored the sandbox with it (not with
	// node a's file, which it can see only because the test runs both on one host).
	aAgents, bAgents := dirNames(t, filepath.Join(f.a.DataDir, "agents")), dirNames(t, filepath.Join(f.b.DataDir, "agents"))
	if len(aAgents) != 1 || len(bAgents) != 2 || !slices.Contains(bAgents, aAgents[0]) {
		t.Fatalf("agents: node a %v, node b %v; want b to hold a's beside its own", aAgents, bAgents)
	}
	if carried := filepath.Join(f.b.DataDir, "agents", aAgents[0], "space-agent"); !strings.Contains(f.b.Log(), "agent="+carried) {
		t.Fatalf("node b did not restore the sandbox with the agent binary it carried (%s):\n%s", carried, f.b.Log())
	}
	// The node a left holds nothing of it any more.
	waitFor(t, time.Minute, "node a to drop the moved sandbox's files", func() bool {
		return !strings.Contains(strings.Join(f.a.runscIDs(), ","), sb.ID)
	})

	// A stopped sandbox on b (a is still cordoned by the drain).
	stopped := f.api.create(t, api.CreateSandboxRequest{})
	if stopped.Node != f.ids["b"] {
		t.Fatalf("second sandbox on %s, want b", stopped.Node)
	}
	if op, err := cl.LifecycleAndWait(c, stopped.ID, api.OpStop); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("stop: %+v %v", op, err)
	}
	f.cordon(t, "a", false)

	// --- Node death: a process holds a value in memory; the sandbox is suspended, its
	// snapshot pushed, its node killed; a wake runs it on node a.
	mem, err := cl.CreateSession(c, sb.ID, api.CreateSessionRequest{Argv: []string{"python3", "-u", "-c",
		`import random, sys, time
v = random.getrandbits(62)
print("value", v)
for line in sys.stdin:
    print("still", v, line.strip())`}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	value := firstLine(t, cl, mem)
	if op, err := cl.LifecycleAndWait(c, sb.ID, api.OpSuspend); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("suspend: %+v %v", op, err)
	}
	waitFor(t, 2*time.Minute, "the suspend snapshot to be pushed", func() bool { return f.sandbox(t, sb.ID).SnapshotPushed })
	// A named snapshot taken on b is pushed too: a sandbox is made from it on a once b is gone.
	named, err := cl.CreateSnapshotAndWait(c, sb.ID, api.CreateSnapshotRequest{Name: "moved"})
	if err != nil || named.State != api.SnapshotReady {
		t.Fatalf("named snapshot: %+v %v", named, err)
	}
	waitFor(t, 2*time.Minute, "the named snapshot to be pushed", func() bool {
		return strings.Contains(f.b.Log(), "named snapshot pushed") && strings.Contains(f.b.Log(), named.ID)
	})
	// A running sandbox on b that checkpoints every 10 s: restored elsewhere when b dies
	// (its agent keeps the gated process it was asked to start, in its memory).
	f.cordon(t, "a", true)
	cps := f.api.create(t, api.CreateSandboxRequest{CheckpointInterval: "10s"})
	f.cordon(t, "a", false)
	if cps.Node != f.ids["b"] || cps.CheckpointInterval != "10s" {
		t.Fatalf("checkpointed sandbox: node %s interval %q", cps.Node, cps.CheckpointInterval)
	}
	if out, _, code := f.api.exec(t, cps.ID, "sh", "-c", "echo checkpointed > /root/cp.txt"); code != 0 {
		t.Fatalf("write file: %d %s", code, out)
	}
	sleeper, err := cl.CreateSession(c, cps.ID, api.CreateSessionRequest{Argv: []string{"sleep", "100000"}})
	if err != nil {
		t.Fatal(err)
	}
	written := time.Now()
	waitFor(t, 2*time.Minute, "a periodic checkpoint after the write to be pushed", func() bool {
		at := f.sandbox(t, cps.ID).CheckpointAt
		return at != nil && at.After(written)
	})
	f.b.Kill()
	waitFor(t, time.Minute, "node b to be marked dead", func() bool {
		nodes, err := cl.ListNodes(c)
		if err != nil {
			return false
		}
		for _, n := range nodes {
			if n.Name == "b" {
				return n.State == "dead"
			}
		}
		return false
	})
	// The checkpointed sandbox comes back on a by itself, from its last checkpoint.
	waitFor(t, 2*time.Minute, "the checkpointed sandbox to run on node a", func() bool {
		got := f.sandbox(t, cps.ID)
		return got.Node == f.ids["a"] && got.State == api.StateRunning && got.MovedAt != nil
	})
	back := f.sandbox(t, cps.ID)
	if back.CheckpointLossMs <= 0 {
		t.Fatalf("restored sandbox does not say what it lost: %+v", back)
	}
	t.Logf("restored from its checkpoint: lost %d ms; %s", back.CheckpointLossMs, back.StatusReason)
	if out, _, code := f.api.exec(t, cps.ID, "cat", "/root/cp.txt"); code != 0 || out != "checkpointed\n" {
		t.Fatalf("file in the sandbox restored from its checkpoint: %d %q", code, out)
	}
	if p, err := cl.GetProcess(c, cps.ID, sleeper.PID); err != nil || p.State == "exited" || p.Argv[0] != "sleep" {
		t.Fatalf("process in the sandbox restored from its checkpoint: %+v %v", p, err)
	}

	// Without a snapshot in the registry: a clear conflict, at once.
	var ce *client.Error
	if _, err := cl.Lifecycle(c, stopped.ID, api.OpWake); !errors.As(err, &ce) || ce.Status != http.StatusConflict || !strings.Contains(err.Error(), "kept on its node only") {
		t.Fatalf("wake of a stopped sandbox on a dead node: %v", err)
	}
	// The registry unreachable: the wake fails with the reason, the sandbox stays
	// suspended where it was.
	f.reg.cut(true)
	op, _ := cl.LifecycleAndWait(c, sb.ID, api.OpWake) // the failed wake is an error too
	if op == nil || op.State != api.OpFailed || !strings.Contains(op.Error, "could not wake on node a") ||
		!strings.Contains(op.Error, "stays suspended where it was") {
		t.Fatalf("wake with the registry unreachable: %+v", op)
	}
	t.Logf("wake with the registry unreachable: %s", op.Error)
	if back := f.sandbox(t, sb.ID); back.Node != f.ids["b"] || back.State != api.StateSuspended || !back.SnapshotPushed {
		t.Fatalf("after the failed wake: node %s state %s pushed %v", back.Node, back.State, back.SnapshotPushed)
	}
	f.reg.cut(false)
	op, err = cl.LifecycleAndWait(c, sb.ID, api.OpWake)
	if err != nil || op.State != api.OpSucceeded {
		t.Fatalf("wake on another node: %+v %v", op, err)
	}
	woken := f.sandbox(t, sb.ID)
	if woken.Node != f.ids["a"] || woken.State != api.StateRunning || woken.MovedAt == nil || !strings.Contains(woken.StatusReason, "moved from node b to node a") {
		t.Fatalf("after the wake: node %s state %s moved_at %v reason %q (want a, running, moved)", woken.Node, woken.State, woken.MovedAt, woken.StatusReason)
	}
	t.Logf("wake on another node: %s; op %s", woken.StatusReason, op.Message)
	if out, _, code := f.api.exec(t, sb.ID, "cat", "/root/moved.txt"); code != 0 || out != "kept\n" {
		t.Fatalf("file after the wake elsewhere: %d %q", code, out)
	}
	// The pulled snapshot served this sandbox only: node a dropped it once the
	// sandbox had its own disk and checkpoint.
	if left, _ := os.ReadDir(filepath.Join(f.a.DataDir, "store", "pulled")); len(left) != 0 {
		t.Errorf("node a still caches %d pulled snapshots after the move (want the moved sandbox's dropped)", len(left))
	}
	// The process is the same one, with its memory: it answers with the value it drew.
	re, err := cl.CreateSession(c, sb.ID, api.CreateSessionRequest{PID: mem.PID, ProcessUID: mem.ProcessUID})
	if err != nil {
		t.Fatalf("re-attach to the process: %v", err)
	}
	if err := cl.WriteStdin(c, re, strings.NewReader("ping\n"), false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, time.Minute, "the process to answer", func() bool {
		var buf syncBuffer
		rc, cancel := context.WithTimeout(c, 3*time.Second)
		defer cancel()
		_, _ = cl.FollowFrom(rc, re, "", client.Output{Stdout: &buf})
		return strings.Contains(buf.String(), "still "+value+" ping")
	})

	fromSnap := f.api.create(t, api.CreateSandboxRequest{Snapshot: "moved"})
	if fromSnap.Node != f.ids["a"] {
		t.Fatalf("sandbox from the dead node's snapshot placed on %s, want a", fromSnap.Node)
	}
	if out, _, code := f.api.exec(t, fromSnap.ID, "cat", "/root/moved.txt"); code != 0 || out != "kept\n" {
		t.Fatalf("file in the sandbox made from the pushed named snapshot: %d %q", code, out)
	}

	// --- The dead node returns: fenced, it only reclaims its leftovers.
	f.b.Restart()
	waitFor(t, time.Minute, "node b to reclaim the moved sandbox's storage", func() bool {
		return strings.Contains(f.b.Log(), "reclaiming orphan sandbox storage") && strings.Contains(f.b.Log(), sb.ID)
	})
	after := f.sandbox(t, sb.ID)
	if after.Node != f.ids["a"] || after.State != api.StateRunning {
		t.Fatalf("after node b returned: node %s state %s", after.Node, after.State)
	}
	if out, _, code := f.api.exec(t, sb.ID, "cat", "/root/moved.txt"); code != 0 || out != "kept\n" {
		t.Fatalf("file after node b returned: %d %q", code, out)
	}
	// No restore on either node fell back to a boot (as one with the receiving node's
	// own agent binary would).
	for name, s := range map[string]*srv{"a": f.a, "b": f.b} {
		if log := s.Log(); strings.Contains(log, "lost its memory") || strings.Contains(log, "restoring with this node's") {
			t.Errorf("node %s restored a sandbox without its agent binary:\n%s", name, log)
		}
	}
}

// dirNames lists the names in dir.
func dirNames(t testing.TB, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

// firstLine returns the value the memory process printed first.
func firstLine(t *testing.T, cl *client.Client, sess *api.CommandSession) string {
	t.Helper()
	var v string
	waitFor(t, time.Minute, "the process to print its value", func() bool {
		var buf syncBuffer
		rc, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, _ = cl.FollowFrom(rc, sess, "", client.Output{Stdout: &buf})
		line, _, _ := strings.Cut(buf.String(), "\n")
		if f := strings.Fields(line); len(f) == 2 && f[0] == "value" {
			if _, err := strconv.ParseUint(f[1], 10, 64); err == nil {
				v = f[1]
				return true
			}
		}
		return false
	})
	return v
}

// TestBenchMoveFigures measures moves for docs/benchmarks.md on a two-node fleet: it
// runs `space bench --only move` (same-node wake, drain downtime), then measures a
// wake on another node after a kill -9 of the sandbox's node (which the bench, driving
// a fleet through its API only, cannot do). It runs only when SPACE_BENCH_RUNS is set:
// SPACE_BENCH_RUNS=5 go test -run TestBenchMoveFigures -v ./internal/e2e/
func TestBenchMoveFigures(t *testing.T) {
	runs := os.Getenv("SPACE_BENCH_RUNS")
	if runs == "" {
		t.Skip("set SPACE_BENCH_RUNS to measure")
	}
	n, err := strconv.Atoi(runs)
	if err != nil || n < 1 {
		t.Fatalf("SPACE_BENCH_RUNS=%q", runs)
	}
	f := startMoveFleet(t)
	out, stderr, code := f.api.cli(t, "bench", "--runs", runs, "--only", "move")
	if code != 0 {
		t.Fatalf("space bench: exit %d\n%s%s", code, out, stderr)
	}
	t.Logf("space bench --only move:\n%s", out)

	c := ctx(t, 30*time.Minute)
	cl := f.api.C
	nodes := map[string]*srv{"a": f.a, "b": f.b}
	var wakes, sameNode []time.Duration
	for i := range n {
		victim, other := "a", "b"
		if i%2 == 1 {
			victim, other = "b", "a"
		}
		f.cordon(t, other, true)
		sb := f.api.create(t, api.CreateSandboxRequest{})
		f.cordon(t, other, false)
		hold := `python3 -c "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(10**9)" &`
		if _, _, code := f.api.exec(t, sb.ID, "sh", "-c", hold); code != 0 {
			t.Fatalf("hold memory: %d", code)
		}
		// The same sandbox woken on its own node first, for comparison.
		if op, err := cl.LifecycleAndWait(c, sb.ID, api.OpSuspend); err != nil || op.State != api.OpSucceeded {
			t.Fatalf("suspend: %+v %v", op, err)
		}
		start := time.Now()
		if op, err := cl.LifecycleAndWait(c, sb.ID, api.OpWake); err != nil || op.State != api.OpSucceeded {
			t.Fatalf("wake: %+v %v", op, err)
		}
		sameNode = append(sameNode, time.Since(start))
		if op, err := cl.LifecycleAndWait(c, sb.ID, api.OpSuspend); err != nil || op.State != api.OpSucceeded {
			t.Fatalf("suspend: %+v %v", op, err)
		}
		waitFor(t, 2*time.Minute, "the snapshot to be pushed", func() bool { return f.sandbox(t, sb.ID).SnapshotPushed })
		nodes[victim].Kill()
		waitFor(t, time.Minute, "the node to be marked dead", func() bool {
			list, err := cl.ListNodes(c)
			for _, nd := range list {
				if nd.Name == victim {
					return err == nil && nd.State == "dead"
				}
			}
			return false
		})
		start = time.Now()
		if op, err := cl.LifecycleAndWait(c, sb.ID, api.OpWake); err != nil || op.State != api.OpSucceeded {
			t.Fatalf("wake elsewhere: %+v %v", op, err)
		}
		wakes = append(wakes, time.Since(start))
		nodes[victim].Restart()
		waitFor(t, time.Minute, "the node to return", func() bool {
			list, err := cl.ListNodes(c)
			for _, nd := range list {
				if nd.Name == victim {
					return err == nil && nd.State == "alive"
				}
			}
			return false
		})
		if _, err := cl.DeleteSandbox(c, sb.ID); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("64 MiB touched, request → running, %d runs: wake on its own node %v; wake on another node after its node died %v", n, sameNode, wakes)
}
