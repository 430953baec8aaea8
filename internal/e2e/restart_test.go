package e2e

import (
	"crypto/md5"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	process "github.com/spacedev/space/internal/guest/envdpb/process"
	"github.com/spacedev/space/internal/guest/envdpb/process/processpbconnect"
	"github.com/spacedev/space/internal/runtime/gvisor"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

var execCommand = exec.Command

// runscPid returns the pid of a runsc container's sandbox process.
func (s *srv) runscPid(t testing.TB, id string) int {
	t.Helper()
	out, err := exec.Command(gvisor.DefaultRunscPath, "--root", s.RunscRoot(), "state", id).Output()
	if err != nil {
		t.Fatalf("runsc state %s: %v", id, err)
	}
	var st struct {
		Pid    int    `json:"pid"`
		Status string `json:"status"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		t.Fatal(err)
	}
	return st.Pid
}

// TestKillRestartAdopts kills space serve while a sandbox runs a long command: after a
// restart the sandbox is still running (the same instance, adopted), the command kept
// running, and new commands run.
func TestKillRestartAdopts(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	pid := s.runscPid(t, sb.ID)

	sess, err := s.C.CreateSession(ctx(t, time.Minute), sb.ID, api.CreateSessionRequest{
		Command: "i=0; while true; do echo $i; i=$((i+1)); sleep 0.05; done"})
	if err != nil {
		t.Fatal(err)
	}
	st, err := s.C.Attach(ctx(t, time.Minute), sess, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Next(); err != nil { // start event: the process is running
		t.Fatal(err)
	}
	st.Close()
	// A warm-pool member waits running under gVisor (docs/lifecycle.md): the restarted
	// server adopts it as it is and a claim gets it with its owner's identity.
	if _, err := s.C.SetPool(ctx(t, time.Minute), api.SetPoolRequest{Template: "base", Size: 1}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 2*time.Minute, "the pool to fill", func() bool {
		pools, err := s.C.ListPools(ctx(t, time.Minute))
		return err == nil && len(pools) == 1 && pools[0].Ready == 1
	})
	// The member is named by the store: runsc also lists the instance that captures the
	// template's base snapshot in the background, and a kill may find it there.
	db, err := store.Open(ctx(t, time.Minute), store.Config{URL: s.DBURL, Logger: discard()})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	members, err := db.PoolMembers(ctx(t, time.Minute), store.PoolKey("default", "base:latest", 1, 512))
	if err != nil || len(members) != 1 {
		t.Fatalf("pool members: %+v %v", members, err)
	}
	member := members[0].ID
	memberPid := s.runscPid(t, member)

	s.Kill()
	s.Restart()

	got, err := s.C.GetSandbox(ctx(t, time.Minute), sb.ID)
	if err != nil || got.State != api.StateRunning {
		t.Fatalf("after restart: %+v %v", got, err)
	}
	if p := s.runscPid(t, sb.ID); p != pid {
		t.Fatalf("sandbox was recreated (runsc pid %d, was %d), not adopted", p, pid)
	}
	out, _, code := s.exec(t, sb.ID, "python3", "-c", "print(6*7)")
	if code != 0 || out != "42\n" {
		t.Fatalf("exec after restart: %d %q", code, out)
	}
	if !strings.Contains(s.Log(), "adopted sandbox") {
		t.Fatal("the restarted server did not report adopting the sandbox")
	}
	p, err := s.C.GetProcess(ctx(t, time.Minute), sb.ID, sess.PID)
	if err != nil || p.State != api.ProcRunning {
		t.Fatalf("long command after restart: %+v %v", p, err)
	}
	claimed, err := s.C.CreateAndWait(ctx(t, time.Minute), api.CreateSandboxRequest{Env: map[string]string{"OWNER": "me"}})
	if err != nil {
		t.Fatal(err)
	}
	if claimed.StartPath != "pool" || claimed.ID != member || s.runscPid(t, member) != memberPid {
		t.Fatalf("claim after restart: %s from %s (member %s), runsc pid %d (was %d)", claimed.ID, claimed.StartPath, member, s.runscPid(t, member), memberPid)
	}
	if out, _, code := s.exec(t, claimed.ID, "sh", "-c", "echo $OWNER"); code != 0 || out != "me\n" {
		t.Fatalf("claimed member after restart: %d %q", code, out)
	}
}

// TestKillDuringCreate kills space serve while a sandbox is being created: after a
// restart the create finishes (it is resumed from the start) and nothing is left over
// from the interrupted attempt.
func TestKillDuringCreate(t *testing.T) {
	s := start(t, options{})
	sb, err := s.C.CreateSandbox(ctx(t, time.Minute), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	// Kill once the runtime instance is being set up.
	waitFor(t, time.Minute, "the runtime instance to be started", func() bool {
		_, err := os.Stat(filepath.Join(s.DataDir, "runtime", sb.ID, "config.json"))
		return err == nil
	})
	s.Kill()
	s.Restart()
	op, err := s.C.WaitOperation(ctx(t, 3*time.Minute), sb.Operation.ID)
	if err != nil {
		t.Fatal(err)
	}
	if op.State != api.OpSucceeded {
		t.Fatalf("create after restart: %+v", op)
	}
	if ids := s.runscIDs(); len(ids) != 1 || ids[0] != sb.ID {
		t.Fatalf("runsc containers after resumed create: %v", ids)
	}
	out, _, code := s.exec(t, sb.ID, "python3", "-c", "print(6*7)")
	if code != 0 || out != "42\n" {
		t.Fatalf("exec: %d %q", code, out)
	}
	// Delete cleans everything, including anything the interrupted attempt made.
	op2, err := s.C.DeleteSandbox(ctx(t, time.Minute), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if op2, err = s.C.WaitOperation(ctx(t, 2*time.Minute), op2.ID); err != nil || op2.State != api.OpSucceeded {
		t.Fatalf("delete: %+v %v", op2, err)
	}
	assertGone(t, s, sb.ID)
}

// TestEmbeddedPostgres runs the server on its own private PostgreSQL: first start
// creates it, SIGTERM stops it, and a restart finds the data again.
func TestEmbeddedPostgres(t *testing.T) {
	s := start(t, options{Embedded: true})
	sb := s.create(t, api.CreateSandboxRequest{Metadata: map[string]string{"keep": "me"}})
	sock, err := filepath.Glob(filepath.Join(s.DataDir, "postgres", "run", ".s.PGSQL.*"))
	if err != nil || len(sock) == 0 {
		t.Fatalf("no unix socket for the private PostgreSQL: %v", err)
	}
	s.Stop()
	if _, err := os.Stat(filepath.Join(s.DataDir, "postgres", "data", "postmaster.pid")); !os.IsNotExist(err) {
		t.Fatalf("PostgreSQL still running after SIGTERM (postmaster.pid: %v)", err)
	}
	s.Restart()
	list, err := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{Metadata: map[string]string{"keep": "me"}})
	if err != nil || len(list) != 1 || list[0].ID != sb.ID || list[0].State != api.StateRunning {
		t.Fatalf("after restart: %+v %v", list, err)
	}
	if strings.Contains(s.Log(), "created the operator API key") {
		t.Fatal("the restarted server created another admin key")
	}
	out, _, code := s.exec(t, sb.ID, "echo", "still here")
	if code != 0 || out != "still here\n" {
		t.Fatalf("exec: %d %q", code, out)
	}
}

// TestHostReboot: the host goes down under a node with sandboxes in every resting
// state, and comes back (e2etest.HostDown: every process killed, the mounts, cgroups
// and tmpfs state gone, the data dir kept). After the restart, each sandbox is what
// docs/operations.md promises for a host reboot: a running one is booted again from
// its disk and says that its memory was lost (its files are there, its old command's
// stream ends with "lost"); a paused one is stopped and says so; a
// suspended one whose snapshot was durable wakes with its memory; one suspended just
// before the reboot, its snapshot not yet synced, is stopped and says so; each of the
// stopped ones starts from its disk. The warm pool is full again and a claim answers;
// a deletion leaves nothing behind.
func TestHostReboot(t *testing.T) {
	s := start(t, options{Embedded: true})
	c := ctx(t, 10*time.Minute)
	names := []string{"running", "paused", "durable", "cut"}
	sbs := map[string]*api.Sandbox{}
	for _, name := range names {
		sb := s.create(t, api.CreateSandboxRequest{Metadata: map[string]string{"name": name}})
		sbs[name] = sb
		if _, stderr, code := s.exec(t, sb.ID, "sh", "-c", "echo disk-"+name+" > /root/f && sync /root/f && echo mem > /dev/shm/m"); code != 0 {
			t.Fatalf("write %s's files: %d %s", name, code, stderr)
		}
	}
	sess, err := s.C.CreateSession(c, sbs["running"].ID, api.CreateSessionRequest{
		Command: "i=0; while true; do echo $i; i=$((i+1)); sleep 0.05; done"})
	if err != nil {
		t.Fatal(err)
	}
	first, err := s.C.Attach(c, sess, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := first.Next(); err != nil { // start event: the process is running
		t.Fatal(err)
	}
	first.Close()
	s.verb(t, sbs["paused"].ID, api.OpPause)
	s.verb(t, sbs["durable"].ID, api.OpSuspend)
	s.verb(t, sbs["cut"].ID, api.OpSuspend)
	checkpoint := func(name string) string {
		return filepath.Join(s.DataDir, "store", "sandboxes", sbs[name].ID, "checkpoint")
	}
	waitFor(t, 2*time.Minute, "the suspend snapshots to be synced", func() bool {
		for _, name := range []string{"durable", "cut"} {
			if _, err := os.Stat(filepath.Join(checkpoint(name), "complete")); err != nil {
				return false
			}
		}
		return true
	})
	if _, err := s.C.SetPool(c, api.SetPoolRequest{Template: "base", Size: 1}); err != nil {
		t.Fatal(err)
	}
	poolReady := func() bool {
		pools, err := s.C.ListPools(c)
		return err == nil && len(pools) == 1 && pools[0].Ready == 1
	}
	waitFor(t, 2*time.Minute, "the pool to fill", poolReady)
	s.HostDown(checkpoint("cut"))
	s.Restart()

	settled := func(name, state string) *api.Sandbox {
		t.Helper()
		var got *api.Sandbox
		waitFor(t, 3*time.Minute, name+" to be "+state+" after the reboot", func() bool {
			got, err = s.C.GetSandbox(c, sbs[name].ID)
			return err == nil && got.State == state && got.Operation == nil
		})
		return got
	}
	files := func(name, want string) {
		t.Helper()
		if out, stderr, code := s.exec(t, sbs[name].ID, "sh", "-c", "cat /root/f; cat /dev/shm/m 2>/dev/null || echo no-mem"); code != 0 || out != want {
			t.Errorf("%s after the reboot: %d %q %s (want %q)", name, code, out, stderr, want)
		}
	}

	// A command sent at once waits while the node boots the sandbox again (it is still
	// recorded running until the node's first look; until 2026-12-07 it got a 409).
	files("running", "disk-running\nno-mem\n")
	got := settled("running", api.StateRunning)
	if !strings.Contains(got.Error, "memory") || !strings.Contains(got.Error, "lost") {
		t.Errorf("the rebooted sandbox does not say it lost its memory: %q", got.Error)
	}
	st, err := s.C.Attach(c, sess, "")
	if err != nil {
		t.Fatal(err)
	}
	// Its output journal was in the sandbox's memory (docs/dataplane.md): the stream
	// says the process is lost, and stdin to it is refused.
	for lost := false; !lost; {
		ev, err := st.Next()
		if err != nil {
			t.Fatalf("the old command's stream: %v", err)
		}
		lost = ev.Name == api.EventLost
	}
	st.Close()
	if p, err := s.C.GetProcess(c, sbs["running"].ID, sess.PID); err == nil && p.State == api.ProcRunning {
		t.Errorf("the old command is said to run after the reboot: %+v", p)
	}

	got = settled("paused", api.StateStopped)
	if !strings.Contains(got.Error, "lost") {
		t.Errorf("the paused sandbox does not say it lost its memory: %q", got.Error)
	}
	got = settled("cut", api.StateStopped)
	if !strings.Contains(got.Error, "lost") {
		t.Errorf("the sandbox suspended before its snapshot was synced does not say it lost its memory: %q", got.Error)
	}
	settled("durable", api.StateSuspended)
	files("durable", "disk-durable\nmem\n") // a command wakes it
	for _, name := range []string{"paused", "cut"} {
		s.verb(t, sbs[name].ID, api.OpStart)
		files(name, "disk-"+name+"\nno-mem\n")
	}

	waitFor(t, 3*time.Minute, "the pool to be full again", poolReady)
	claimed, err := s.C.CreateAndWait(c, api.CreateSandboxRequest{Env: map[string]string{"OWNER": "me"}})
	if err != nil {
		t.Fatal(err)
	}
	if out, _, code := s.exec(t, claimed.ID, "sh", "-c", "echo $OWNER"); code != 0 || out != "me\n" {
		t.Fatalf("a claim after the reboot: %d %q", code, out)
	}
	for _, sb := range append([]*api.Sandbox{claimed}, sbs["running"], sbs["paused"], sbs["durable"], sbs["cut"]) {
		op, err := s.C.DeleteSandbox(c, sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if op, err = s.C.WaitOperation(c, op.ID); err != nil || op.State != api.OpSucceeded {
			t.Fatalf("delete %s: %+v %v", sb.ID, op, err)
		}
		assertGone(t, s, sb.ID)
	}
}

// TestRestartWithPassedSocket: with its --listen socket passed by systemd (socket
// activation), a restart of space serve refuses no connection. Requests sent while the
// server is down (killed with SIGKILL, then stopped with SIGTERM) wait in the socket's
// queue and are answered by the next process; without the passed socket they are
// refused. A passed socket named for no flag stops space serve with an error that
// names it.
func TestRestartWithPassedSocket(t *testing.T) {
	s := start(t, options{Socket: true})
	const waiting = 6
	for _, down := range []struct {
		name string
		do   func()
	}{{"SIGKILL", s.Kill}, {"SIGTERM", s.Stop}} {
		down.do() // returns once the process is gone
		sent := time.Now()
		connected := make(chan error, waiting)
		answers := make(chan error, waiting)
		for range waiting {
			go func() {
				trace := &httptrace.ClientTrace{ConnectDone: func(_, _ string, err error) { connected <- err }}
				req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx(t, 2*time.Minute), trace), "GET", s.URL+"/v1/sandboxes", nil)
				if err != nil {
					answers <- err
					return
				}
				req.Header.Set("Authorization", "Bearer "+s.Key)
				c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
				resp, err := c.Do(req)
				if err == nil {
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						err = fmt.Errorf("status %d", resp.StatusCode)
					}
				}
				answers <- err
			}()
		}
		// Every one is connected (in the socket's queue) before the next process starts.
		for range waiting {
			if err := <-connected; err != nil {
				t.Fatalf("%s: a connection while space serve was down: %v", down.name, err)
			}
		}
		s.Restart()
		for range waiting {
			if err := <-answers; err != nil {
				t.Errorf("%s: a request sent while space serve was down: %v", down.name, err)
			}
		}
		t.Logf("%s: %d requests sent while space serve was down answered within %v", down.name, waiting, time.Since(sent).Round(time.Millisecond))
	}

	// A socket named for no flag.
	bin, _ := testenv.Binaries(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	f, err := ln.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command("/bin/sh", "-c", `export LISTEN_PID=$$ && exec "$@"`, "sh", bin, "serve", "--data-dir", t.TempDir(),
		"--database-url", "postgres://nobody@127.0.0.1:1/none", "--listen", freeAddr(t), "--e2b-listen", "")
	cmd.Env = append(os.Environ(), "LISTEN_FDS=1", "LISTEN_FDNAMES=api")
	cmd.ExtraFiles = []*os.File{f}
	out, err := cmd.CombinedOutput()
	if want := "systemd passed sockets space serve has no use for: api"; err == nil || !strings.Contains(string(out), want) {
		t.Fatalf("space serve with a socket named api: %v, want an error with %q:\n%s", err, want, out)
	}
}

// TestStopDrainsRequests: on SIGTERM, space serve stops taking connections but lets
// the requests in flight finish (--shutdown-grace) with everything they need running;
// streams that the client resumes by itself end at once and resume on the next
// process. Before 2026-12-07 every request in flight was answered 503 or cut at once.
func TestStopDrainsRequests(t *testing.T) {
	e2bAddr := freeAddr(t)
	s := start(t, options{Socket: true, Args: []string{"--e2b-listen", e2bAddr, "--shutdown-grace", "2m"}})
	out, errOut, code := s.cli(t, "apikey", "create", "drain", "--e2b", "--tenant", "default")
	if code != 0 {
		t.Fatalf("apikey create --e2b: %s", errOut)
	}
	e2bKey := strings.TrimSpace(out)
	req, _ := http.NewRequestWithContext(ctx(t, time.Minute), "POST", "http://"+e2bAddr+"/v2/sandboxes", strings.NewReader(`{"templateID":"base"}`))
	req.Header.Set("X-API-KEY", e2bKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var sb struct{ SandboxID, EnvdAccessToken string }
	err = json.NewDecoder(resp.Body).Decode(&sb)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || err != nil {
		t.Fatalf("E2B create: %d %v", resp.StatusCode, err)
	}
	id := sb.SandboxID

	// 1. An E2B commands.run stream (envd's process.Start through the gateway): the
	// E2B SDKs resume none, so it gets the grace.
	type e2bResult struct {
		stdout string
		exit   int32
		ended  bool
		at     time.Time
		err    error
	}
	e2bStarted, e2bDone := make(chan struct{}), make(chan e2bResult, 1)
	go func() {
		var r e2bResult
		defer func() { r.at = time.Now(); e2bDone <- r }()
		httpc := &http.Client{Transport: envdHeaders{id: id, token: sb.EnvdAccessToken}}
		proc := processpbconnect.NewProcessClient(httpc, "http://"+e2bAddr)
		stream, err := proc.Start(ctx(t, 2*time.Minute), connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{
			Cmd: "/bin/sh", Args: []string{"-c", "echo a; sleep 3; echo b"}}}))
		if err != nil {
			r.err = err
			return
		}
		defer stream.Close()
		var b strings.Builder
		for stream.Receive() {
			ev := stream.Msg().GetEvent()
			if d := ev.GetData().GetStdout(); len(d) > 0 {
				if b.Len() == 0 {
					close(e2bStarted)
				}
				b.Write(d)
			}
			if e := ev.GetEnd(); e != nil {
				r.exit, r.ended = e.GetExitCode(), true
			}
		}
		r.stdout, r.err = b.String(), stream.Err()
	}()

	// 2. A command run by space's own client (one-request exec): its stream ends at the
	// stop and is resumed from its last byte on the next process.
	// It runs past the stop, which waits only for the E2B command: held for the grace,
	// it would end on the stopping process, attached once.
	execStarted, execDone := make(chan struct{}), make(chan error, 1)
	var execOut strings.Builder
	var attaches atomic.Int32
	go func() {
		first := &firstWrite{w: &execOut, first: execStarted}
		x, err := s.C.Run(ctx(t, 2*time.Minute), id, api.ExecRequest{Command: "echo x; sleep 12; echo y"},
			client.Output{Stdout: first, OnStart: func(api.StartEvent) { attaches.Add(1) }})
		if err == nil && client.ExitCode(x) != 0 {
			err = fmt.Errorf("exit %+v", x)
		}
		execDone <- err
	}()

	// 3. An upload whose body is held until the stop has begun. With Expect:
	// 100-continue its body is read only once its handler runs.
	release := make(chan struct{})
	uploadStarted, uploadDone := make(chan struct{}), make(chan string, 1)
	payload := strings.Repeat("0123456789abcdef", 64<<10) // 1 MiB
	go func() {
		body := &heldBody{first: strings.NewReader(payload[:len(payload)/2]), rest: strings.NewReader(payload[len(payload)/2:]),
			started: uploadStarted, release: release}
		req, err := http.NewRequestWithContext(ctx(t, 2*time.Minute), "PUT", s.URL+"/v1/sandboxes/"+id+"/files?path=/tmp/upload", body)
		if err != nil {
			uploadDone <- err.Error()
			return
		}
		req.Header.Set("Authorization", "Bearer "+s.Key)
		req.Header.Set("Content-Type", "application/octet-stream")
		req.Header.Set("Expect", "100-continue")
		c := &http.Client{Transport: &http.Transport{ExpectContinueTimeout: time.Minute}}
		resp, err := c.Do(req)
		if err != nil {
			uploadDone <- err.Error()
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		uploadDone <- fmt.Sprintf("%d %s", resp.StatusCode, b)
	}()
	// 4. A client that keeps its connection open (opened now, before the stop).
	kept := &http.Client{Transport: &http.Transport{}}
	keptGet := func(path string) (int, error) {
		req, err := http.NewRequestWithContext(ctx(t, time.Minute), "GET", s.URL+path, nil)
		if err != nil {
			return 0, err
		}
		req.Header.Set("Authorization", "Bearer "+s.Key)
		resp, err := kept.Do(req)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if code, err := keptGet("/v1/sandboxes/" + id); code != 200 {
		t.Fatalf("kept connection: %d %v", code, err)
	}
	for name, ch := range map[string]chan struct{}{"E2B command": e2bStarted, "exec": execStarted, "upload": uploadStarted} {
		select {
		case <-ch:
		case <-time.After(time.Minute):
			t.Fatalf("the %s did not start", name)
		}
	}

	stopped := make(chan time.Time, 1)
	go func() { s.Stop(); stopped <- time.Now() }()
	waitFor(t, time.Minute, "space serve to wait for the requests in flight", func() bool {
		return strings.Contains(s.Log(), "stopping: requests in flight may finish")
	})
	// A request on the kept connection in the stop's first second is still answered,
	// also one that needs the sandbox's agent (its processes): one process reaches its
	// own node's agents directly. (Through its own listener, closed now, its call would
	// wait in the held socket's queue for the next process, and hold the stop with it:
	// 30 s here, until 2026-12-08.)
	keptAt := time.Now()
	if code, err := keptGet("/v1/sandboxes/" + id + "/processes"); code != 200 || time.Since(keptAt) > 10*time.Second {
		t.Errorf("a request on a kept connection during the stop: %d %v after %v, want 200 at once", code, err, time.Since(keptAt))
	}
	// A request sent now waits for the next process: the stopping one takes no
	// connection (here the socket systemd would hold queues it).
	queued := make(chan error, 1)
	go func() {
		_, err := s.C.ListSandboxes(ctx(t, 2*time.Minute), client.ListOptions{})
		queued <- err
	}()
	close(release)
	if got := <-uploadDone; !strings.HasPrefix(got, "200 ") && !strings.HasPrefix(got, "201 ") {
		t.Errorf("the upload in flight at the stop: %s, want it to finish", got)
	}
	r := <-e2bDone
	if r.err != nil || !r.ended || r.exit != 0 || r.stdout != "a\nb\n" {
		t.Errorf("the E2B command in flight at the stop: %+v, want a\\nb\\n and exit 0", r)
	}
	var exitAt time.Time
	select {
	case exitAt = <-stopped:
	case <-time.After(time.Minute):
		t.Fatal("space serve did not stop once its requests had finished")
	}
	if exitAt.Before(r.at) {
		t.Errorf("space serve exited (%v) before the E2B stream in flight ended (%v)", exitAt, r.at)
	}
	select {
	case err := <-queued:
		t.Fatalf("a request sent during the drain was answered by the stopping process (%v)", err)
	default:
	}
	s.Restart()
	if err := <-queued; err != nil {
		t.Errorf("the request queued during the drain, on the next process: %v", err)
	}
	if err := <-execDone; err != nil || execOut.String() != "x\ny\n" || attaches.Load() != 2 {
		t.Errorf("the exec across the restart: %v, stdout %q, %d attaches; want x\\ny\\n, resumed once on the next process",
			err, execOut.String(), attaches.Load())
	}
	got, _, code := s.exec(t, id, "sh", "-c", "wc -c < /tmp/upload; md5sum < /tmp/upload")
	want := fmt.Sprintf("%x", md5.Sum([]byte(payload)))
	if code != 0 || !strings.Contains(got, fmt.Sprint(len(payload))) || !strings.Contains(got, want) {
		t.Errorf("the uploaded file: %q, want %d bytes with md5 %s", got, len(payload), want)
	}
}

// envdHeaders routes Connect requests to a sandbox's envd as the E2B SDKs do.
type envdHeaders struct{ id, token string }

func (e envdHeaders) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", e.id)
	r.Header.Set("E2b-Sandbox-Port", "49983")
	r.Header.Set("X-Access-Token", e.token)
	return http.DefaultTransport.RoundTrip(r)
}

// firstWrite closes first on its first write.
type firstWrite struct {
	w     io.Writer
	first chan struct{}
	once  sync.Once
}

func (f *firstWrite) Write(p []byte) (int, error) {
	f.once.Do(func() { close(f.first) })
	return f.w.Write(p)
}

// heldBody is a request body whose first part is read at once (closing started on
// the first read) and whose rest only once release closes.
type heldBody struct {
	first, rest *strings.Reader
	started     chan struct{}
	release     chan struct{}
	once        sync.Once
}

func (b *heldBody) Read(p []byte) (int, error) {
	if b.first.Len() > 0 {
		b.once.Do(func() { close(b.started) })
		return b.first.Read(p)
	}
	<-b.release
	return b.rest.Read(p)
}
