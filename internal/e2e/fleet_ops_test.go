package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/runtime/gvisor"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

// runServe runs `space serve args...` and waits (at most d) for it to exit; it returns
// the exit code (-1: still running after d, then killed) and its output.
func runServe(t *testing.T, d time.Duration, env []string, args ...string) (int, string) {
	t.Helper()
	bin, _ := testenv.Binaries(t)
	cmd := exec.Command(bin, append([]string{"serve"}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
		return cmd.ProcessState.ExitCode(), out.String()
	case <-time.After(d):
		_ = cmd.Process.Kill()
		<-done
		return -1, out.String()
	}
}

// TestServeListenerTaken: a listener that cannot bind (--listen, --e2b-listen,
// --metrics-listen on a taken address) stops space serve at once with an error naming
// the flag and the address, before anything starts.
func TestServeListenerTaken(t *testing.T) {
	testenv.RequireRoot(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	addr := taken.Addr().String()
	for _, flag := range []string{"--listen", "--e2b-listen", "--metrics-listen"} {
		t.Run(strings.TrimPrefix(flag, "--"), func(t *testing.T) {
			args := []string{"--data-dir", t.TempDir(), "--database-url", "postgres://nobody@127.0.0.1:1/none",
				"--listen", freeAddr(t), "--e2b-listen", freeAddr(t), flag, addr}
			code, out := runServe(t, 30*time.Second, nil, args...)
			if code == 0 || code == -1 {
				t.Fatalf("space serve with %s on a taken address: exit %d, want a failure\n%s", flag, code, out)
			}
			if want := flag + " " + addr + ": the address is taken"; !strings.Contains(out, want) {
				t.Fatalf("space serve's error lacks %q:\n%s", want, out)
			}
		})
	}
}

// fleetNodeMemoryMB is each fleet node's --capacity memory: room for exactly
// fleetPerNode sandboxes of fleetSandboxMB.
const (
	fleetSandboxMB     = 128
	fleetPerNode       = 5
	fleetNodeMemoryMB  = fleetPerNode * fleetSandboxMB
	fleetNodeTimeout   = 20 * time.Second
	fleetNodes         = 3
	fleetSandboxesWant = fleetNodes * fleetPerNode
)

// TestFleetOps runs a fleet of an api+controller process and three node processes on
// one PostgreSQL (the roles fleet.sh runs, without its network namespaces) and checks,
// in order:
//   - a data directory copied with its node-id file is refused, and changes nothing;
//   - a warm pool on the three nodes fills up and refills after a claim;
//   - sandboxes spread over the nodes (spread policy) and never past a node's
//     capacity: 15 fill the three nodes exactly, the 16th waits with the reason;
//   - a node that misses its heartbeats is fenced; when it comes back it changes
//     nothing (its lost sandboxes stay failed), stops, and restarted registers again
//     and reclaims them.
func TestFleetOps(t *testing.T) {
	requireHost(t)
	db := testenv.Postgres(t)
	st, err := store.Open(context.Background(), store.Config{URL: db, Logger: discard(), MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	apiSrv := start(t, options{DBURL: db, NoBase: true, Args: []string{"--roles", "api,controller",
		"--placement", "spread", "--node-timeout", fleetNodeTimeout.String()}})
	nodes := make([]*srv, fleetNodes)
	for i := range nodes {
		nodes[i] = start(t, options{DBURL: db, Args: []string{"--roles", "node", "--node-name", fmt.Sprintf("fleet-%d", i+1),
			"--capacity", fmt.Sprintf("memory=%d", fleetNodeMemoryMB)}})
	}
	c := apiSrv.C
	var byName map[string]api.Node // node name → node
	var names map[string]string    // node id → name
	listNodes := func() []api.Node {
		t.Helper()
		list, err := c.ListNodes(ctx(t, 30*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		byName, names = map[string]api.Node{}, map[string]string{}
		for _, n := range list {
			byName[n.Name], names[n.ID] = n, n.Name
		}
		return list
	}
	waitFor(t, time.Minute, "three alive nodes", func() bool {
		alive := 0
		for _, n := range listNodes() {
			if n.State == "alive" {
				alive++
			}
		}
		return alive == fleetNodes
	})
	t0 := time.Now()

	// A copied node id: fleet-1's node-id file in another data directory.
	copyDir := t.TempDir()
	id1, err := os.ReadFile(filepath.Join(nodes[0].DataDir, "node-id"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(copyDir, "node-id"), id1, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = syscall.Unmount(filepath.Join(copyDir, "store"), 0)
		sum := sha256.Sum256([]byte(copyDir))
		root := filepath.Join("/run/space", "runsc-"+hex.EncodeToString(sum[:6]))
		_ = gvisor.UnpinNullNetNS(root)
		_ = os.RemoveAll(root)
	})
	before := byName["fleet-1"]
	code, out := runServe(t, 90*time.Second, []string{"SPACE_DATABASE_URL=" + db}, "--roles", "node", "--data-dir", copyDir,
		"--node-name", "fleet-copy", "--listen", freeAddr(t), "--network", "off", "--store-size", fmt.Sprint(1<<30))
	if code == 0 || code == -1 {
		t.Fatalf("a copied node id: exit %d, want refused\n%s", code, out)
	}
	for _, want := range []string{"registered by another installation", "space node rm fleet-1", "node-id"} {
		if !strings.Contains(out, want) {
			t.Errorf("the refusal of a copied node id lacks %q:\n%s", want, out)
		}
	}
	listNodes()
	if after := byName["fleet-1"]; after.State != "alive" || after.DataPlaneURL != before.DataPlaneURL || byName["fleet-copy"].ID != "" {
		t.Fatalf("a refused copy changed the nodes: before %+v, after %+v", before, after)
	}
	if n, err := st.GetNode(context.Background(), before.ID); err != nil || n.Fingerprint == "" {
		t.Fatalf("fleet-1's row: %+v %v", n, err)
	} else if !strings.Contains(n.Fingerprint, "dir="+nodes[0].DataDir) {
		t.Fatalf("fleet-1's fingerprint %q does not name its data directory", n.Fingerprint)
	}
	t.Logf("copied node id refused (%v)", time.Since(t0).Round(time.Millisecond))

	// Every node starts base once (cordoning the others): then each holds it, and
	// the scheduler's preference for nodes holding the release does not decide.
	t1 := time.Now()
	setCordon := func(name string, on bool) {
		t.Helper()
		if _, err := c.CordonNode(ctx(t, 30*time.Second), name, on); err != nil {
			t.Fatal(err)
		}
	}
	small := api.CreateSandboxRequest{CPU: 1, MemoryMB: fleetSandboxMB}
	create := func() *api.Sandbox {
		sb := apiSrv.create(t, small)
		got, err := c.GetSandbox(ctx(t, 30*time.Second), sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	for i := 1; i <= fleetNodes; i++ {
		for j := 1; j <= fleetNodes; j++ {
			setCordon(fmt.Sprintf("fleet-%d", j), j != i)
		}
		if sb := create(); names[sb.Node] != fmt.Sprintf("fleet-%d", i) {
			t.Fatalf("with the others cordoned, a sandbox went to %s, not fleet-%d", names[sb.Node], i)
		}
	}
	for j := 1; j <= fleetNodes; j++ {
		setCordon(fmt.Sprintf("fleet-%d", j), false)
	}
	waitFor(t, 30*time.Second, "every node to hold base", func() bool {
		for _, n := range listNodes() {
			if n.Cache.Releases < 1 {
				return false
			}
		}
		return true
	})
	t.Logf("base started on every node (%v)", time.Since(t1).Round(time.Millisecond))

	// A warm pool on the three nodes fills up and stays full.
	t2 := time.Now()
	poolReq := api.SetPoolRequest{Template: "base:latest", CPU: 1, MemoryMB: fleetSandboxMB, Size: fleetNodes}
	if _, err := c.SetPool(ctx(t, 30*time.Second), poolReq); err != nil {
		t.Fatal(err)
	}
	poolReady := func() int {
		pools, err := c.ListPools(ctx(t, 30*time.Second))
		if err != nil || len(pools) != 1 {
			t.Fatalf("pools: %v %v", pools, err)
		}
		return pools[0].Ready
	}
	waitFor(t, 2*time.Minute, "the warm pool to fill", func() bool { return poolReady() == fleetNodes })
	members, err := st.ListSandboxes(context.Background(), store.SandboxFilter{IncludePool: true, States: []string{api.StatePaused}})
	if err != nil {
		t.Fatal(err)
	}
	memberNodes := map[string]bool{}
	for _, m := range members {
		if m.PoolKey != "" && m.ClaimedAt == nil {
			memberNodes[names[m.NodeID]] = true
		}
	}
	if len(memberNodes) != fleetNodes {
		t.Errorf("spread placed the pool's %d members on %v, want one on each node", fleetNodes, memberNodes)
	}
	claimed := create() // from the pool
	waitFor(t, 2*time.Minute, "the warm pool to refill after a claim", func() bool { return poolReady() == fleetNodes })
	poolReq.Size = 0
	if _, err := c.SetPool(ctx(t, 30*time.Second), poolReq); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteSandbox(ctx(t, 30*time.Second), claimed.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, time.Minute, "the pool's members and the claimed sandbox to be gone", func() bool {
		used := 0
		for _, n := range listNodes() {
			used += int(n.Used.MemoryMB)
		}
		return used == fleetNodes*fleetSandboxMB
	})
	t.Logf("warm pool filled, refilled and drained (%v)", time.Since(t2).Round(time.Millisecond))

	// Spread: with one sandbox on each node, the next three go one to each node.
	t3 := time.Now()
	seen := map[string]bool{}
	for range fleetNodes {
		seen[names[create().Node]] = true
	}
	if len(seen) != fleetNodes {
		t.Fatalf("spread placed three sandboxes on %v, want one on each node", seen)
	}
	// The rest, a node's worth at a time: the nodes fill exactly, never past their
	// capacity. (All at once, 24 gVisor restores on this 2-core machine starved a
	// node's heartbeats past --node-timeout.)
	rest := fleetSandboxesWant - 2*fleetNodes
	for rest > 0 {
		batch := min(rest, fleetNodes)
		rest -= batch
		var wg sync.WaitGroup
		errs := make(chan error, batch)
		for range batch {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := c.CreateAndWait(ctx(t, 3*time.Minute), small); err != nil {
					errs <- err
				}
			}()
		}
		wg.Wait()
		close(errs)
		if err := <-errs; err != nil {
			t.Fatalf("create: %v", err)
		}
	}
	t.Logf("%d sandboxes running on %d nodes (%v)", fleetSandboxesWant, fleetNodes, time.Since(t3).Round(time.Millisecond))
	for _, n := range listNodes() {
		if n.Used.MemoryMB != fleetNodeMemoryMB || n.Sandboxes != fleetPerNode {
			t.Errorf("node %s holds %d sandboxes using %d MiB of %d, want %d filling it", n.Name, n.Sandboxes, n.Used.MemoryMB,
				n.Capacity.MemoryMB, fleetPerNode)
		}
	}
	// One more fits nowhere: it waits, with the reason.
	extra, err := c.CreateSandbox(ctx(t, 30*time.Second), small, "")
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the sandbox that fits nowhere to say why it waits", func() bool {
		sb, err := c.GetSandbox(ctx(t, 30*time.Second), extra.ID)
		return err == nil && sb.Node == "" && strings.Contains(sb.StatusReason, "no node has room")
	})
	if _, err := c.DeleteSandbox(ctx(t, 30*time.Second), extra.ID); err != nil {
		t.Fatal(err)
	}

	// fleet-3 stops heartbeating (frozen): it is marked dead and fenced, its running
	// sandboxes are lost. Thawed, it can change nothing: its heartbeat is refused and
	// it stops; its sandboxes stay failed.
	t4 := time.Now()
	n3 := nodes[2]
	id3 := byName["fleet-3"].ID
	if err := syscall.Kill(n3.Pid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	thawed := false
	defer func() {
		if !thawed {
			_ = syscall.Kill(n3.Pid(), syscall.SIGCONT)
		}
	}()
	waitFor(t, 3*fleetNodeTimeout, "fleet-3 to be marked dead", func() bool {
		listNodes()
		return byName["fleet-3"].State == "dead"
	})
	onDead := func() []*store.Sandbox {
		list, err := st.ListSandboxes(context.Background(), store.SandboxFilter{NodeID: id3})
		if err != nil {
			t.Fatal(err)
		}
		return list
	}
	lost := onDead()
	if len(lost) != fleetPerNode {
		t.Fatalf("fleet-3 had %d sandboxes, want %d", len(lost), fleetPerNode)
	}
	for _, sb := range lost {
		if sb.State != api.StateFailed || !strings.Contains(sb.Error, "lost:") {
			t.Fatalf("sandbox %s on the dead node: %s %q, want failed and lost", sb.ID, sb.State, sb.Error)
		}
	}
	if err := syscall.Kill(n3.Pid(), syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	thawed = true
	if !n3.WaitExit(time.Minute) {
		t.Fatalf("the fenced node kept running after it was thawed:\n%s", n3.Log())
	}
	if !strings.Contains(n3.Log(), "was fenced") {
		t.Errorf("the fenced node's log does not say it was fenced:\n%s", n3.Log())
	}
	for _, sb := range onDead() {
		if sb.State != api.StateFailed {
			t.Fatalf("sandbox %s changed to %s after its fenced node returned", sb.ID, sb.State)
		}
	}
	if n, err := st.GetNode(context.Background(), id3); err != nil || n.State != store.NodeDead {
		t.Fatalf("the fenced node's row after it returned: %+v %v", n, err)
	}
	// Restarted, it registers again, logs that it returns from the dead, and reclaims
	// the lost sandboxes' instances; they stay failed.
	n3.Restart()
	waitFor(t, time.Minute, "fleet-3 to be alive again", func() bool {
		listNodes()
		return byName["fleet-3"].State == "alive"
	})
	if !strings.Contains(n3.Log(), "node returns after being marked dead") {
		t.Errorf("the returning node did not log its return:\n%s", n3.Log())
	}
	waitFor(t, time.Minute, "fleet-3 to reclaim its lost sandboxes' instances", func() bool { return len(n3.RunscIDs()) == 0 })
	for _, sb := range onDead() {
		if sb.State != api.StateFailed {
			t.Fatalf("lost sandbox %s came back to %s with its node", sb.ID, sb.State)
		}
	}
	t.Logf("fleet-3 fenced, returned refused, restarted (%v)", time.Since(t4).Round(time.Millisecond))
}

// TestFleetScript brings a local fleet up with scripts/fleet.sh (two nodes, each in
// its own network namespace, on a subnet of its own), runs `echo hi` in a sandbox
// through it, checks a node's /healthz and /metrics, and takes it down again: nothing
// of it is left.
func TestFleetScript(t *testing.T) {
	requireHost(t)
	script, err := filepath.Abs("../../scripts/fleet.sh")
	if err != nil {
		t.Fatal(err)
	}
	const subnet = "198.19.65"
	dir := fmt.Sprintf("/var/tmp/space-fleet-test-%d", os.Getpid())
	env := append(os.Environ(), "SPACE_FLEET_DIR="+dir, "SPACE_FLEET_SUBNET="+subnet, "SPACE_FLEET_PG_PORT=55433",
		"SPACE_FLEET_NODE_ARGS=--capacity memory=1024")
	fleet := func(d time.Duration, args ...string) (int, string) {
		cmd := exec.Command(script, args...)
		cmd.Env = env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		cmd.WaitDelay = time.Second
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		timer := time.AfterFunc(d, func() { _ = cmd.Process.Kill() })
		defer timer.Stop()
		_ = cmd.Wait()
		return cmd.ProcessState.ExitCode(), out.String()
	}
	downed := false
	t.Cleanup(func() {
		if !downed {
			fleet(2*time.Minute, "down")
		}
	})
	t0 := time.Now()
	code, out := fleet(5*time.Minute, "up", "2")
	if code != 0 {
		t.Fatalf("fleet.sh up 2: exit %d\n%s", code, out)
	}
	url := "http://" + subnet + ".1:7700"
	if !strings.Contains(out, "export SPACE_URL="+url) || !strings.Contains(out, "export SPACE_DATA_DIR="+dir+"/api") {
		t.Fatalf("fleet.sh up does not say how to point the CLI at the fleet:\n%s", out)
	}
	t.Logf("fleet.sh up 2: %v", time.Since(t0).Round(time.Millisecond))
	key, err := os.ReadFile(filepath.Join(dir, "api", "admin.key"))
	if err != nil {
		t.Fatal(err)
	}
	c := client.New(url, strings.TrimSpace(string(key)))
	list, err := c.ListNodes(ctx(t, 30*time.Second))
	if err != nil || len(list) != 2 {
		t.Fatalf("nodes: %v %v", list, err)
	}
	for _, n := range list {
		i := strings.TrimPrefix(n.Name, "node")
		if n.State != "alive" || n.DataPlaneURL != fmt.Sprintf("http://%s.1%s:7701", subnet, i) || n.Capacity.MemoryMB != 1024 {
			t.Fatalf("node %+v", n)
		}
	}
	sb, err := c.CreateAndWait(ctx(t, 3*time.Minute), api.CreateSandboxRequest{MemoryMB: 256})
	if err != nil {
		t.Fatal(err)
	}
	var stdout bytes.Buffer
	if code, err := c.Exec(ctx(t, time.Minute), sb.ID, api.CreateSessionRequest{Argv: []string{"echo", "hi"}}, client.Output{Stdout: &stdout}); err != nil || code != 0 || stdout.String() != "hi\n" {
		t.Fatalf("exec echo hi in the fleet: %d %q %v", code, stdout.String(), err)
	}
	if code, body := status(t, "GET", "http://"+subnet+".11:9470/healthz", "", nil); code != 200 || !strings.Contains(body, `"status":"ok"`) {
		t.Fatalf("node1 /healthz: %d %s", code, body)
	}
	if code, body := status(t, "GET", "http://"+subnet+".11:9470/metrics", "", nil); code != 200 || !strings.Contains(body, `space_node_up{node="node1"} 1`) {
		t.Fatalf("node1 /metrics: %d %s", code, body)
	}
	if code, _ := status(t, "GET", "http://"+subnet+".11:7701/metrics", "", nil); code != 401 {
		t.Fatalf("node1 /metrics on --listen without a key: %d, want 401", code)
	}
	t1 := time.Now()
	downed = true
	if code, out := fleet(2*time.Minute, "down"); code != 0 {
		t.Fatalf("fleet.sh down: exit %d\n%s", code, out)
	}
	t.Logf("fleet.sh down: %v", time.Since(t1).Round(time.Millisecond))
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("fleet.sh down left %s: %v", dir, err)
	}
	if out, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(out), "spf65-n") {
		t.Errorf("fleet.sh down left namespaces:\n%s", out)
	}
	if err := exec.Command("ip", "link", "show", "spf65br").Run(); err == nil {
		t.Error("fleet.sh down left the bridge")
	}
	if code, out := fleet(time.Minute, "down"); code != 0 {
		t.Errorf("fleet.sh down again: exit %d\n%s", code, out)
	}
}
