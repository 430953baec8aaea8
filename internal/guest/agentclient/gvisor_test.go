package agentclient_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
)

// TestAgentUnderGVisor runs the real space-agent binary as PID 1 of a gVisor sandbox
// and drives it with the client: the checks that only a real sandbox can answer
// (inotify, /proc/self/exe gates, PTYs, reaping as PID 1, identity, quiesce with a
// host socket).
func TestAgentUnderGVisor(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run runsc")
	}
	runsc, err := exec.LookPath("runsc")
	if err != nil {
		t.Skip("needs runsc (apt-get install runsc)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	base, err := os.MkdirTemp("", "agv")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	agentBin := filepath.Join(base, "space-agent")
	build := exec.CommandContext(ctx, "go", "build", "-o", agentBin, "github.com/spacedev/space/cmd/space-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build agent: %v\n%s", err, out)
	}
	rootfs := filepath.Join(base, "rootfs")
	runDir := filepath.Join(base, "run")
	stateDir := filepath.Join(base, "state")
	for _, d := range []string{rootfs, runDir, stateDir, filepath.Join(rootfs, "usr"), filepath.Join(rootfs, "etc"), filepath.Join(rootfs, "work")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, l := range []string{"bin", "lib", "lib64", "sbin"} {
		if target, err := os.Readlink("/" + l); err == nil {
			if err := os.Symlink(target, filepath.Join(rootfs, l)); err != nil {
				t.Fatal(err)
			}
		}
	}
	writeBundle(t, base, rootfs, runDir, agentBin)

	id := fmt.Sprintf("agenttest%d", os.Getpid())
	runscCmd := func(ctx context.Context, args ...string) *exec.Cmd {
		full := append([]string{"--root", stateDir, "--network=none", "--overlay2=none", "--host-uds=create"}, args...)
		cmd := exec.CommandContext(ctx, runsc, full...)
		cmd.WaitDelay = 5 * time.Second
		return cmd
	}
	// The detached sandbox inherits runsc's stdout and stderr: give it a file, since a
	// pipe would stay open (and Output would wait) as long as the sandbox runs.
	runLog, err := os.Create(filepath.Join(base, "runsc-run.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer runLog.Close()
	run := runscCmd(ctx, "run", "-detach", "-bundle", base, id)
	run.Stdout, run.Stderr = runLog, runLog
	if err := run.Run(); err != nil {
		out, _ := os.ReadFile(runLog.Name())
		t.Fatalf("runsc run: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		cctx, ccancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer ccancel()
		_, _ = runscCmd(cctx, "kill", id, "KILL").CombinedOutput()
		if out, err := runscCmd(cctx, "delete", "-force", id).CombinedOutput(); err != nil {
			t.Errorf("runsc delete: %v\n%s", err, out)
		}
	})

	c := agentclient.New(agentclient.DialUnix(filepath.Join(runDir, wire.AgentSocketName)))
	defer c.CloseIdleConnections()
	start := time.Now()
	rctx, rcancel := context.WithTimeout(ctx, 20*time.Second)
	h, err := c.WaitReady(rctx)
	rcancel()
	if err != nil {
		logs, _ := os.ReadFile(filepath.Join(base, "agent.log"))
		t.Fatalf("agent not ready: %v\n%s", err, logs)
	}
	t.Logf("agent ready in %v (version %s)", time.Since(start), h.Version)

	// Identity: entropy and clock may be refused by gVisor; that must not fail.
	if err := c.SetIdentity(ctx, wire.Identity{
		Generation: 1, Seed: bytes.Repeat([]byte{9}, 32), UnixNano: time.Now().UnixNano(),
		Env: map[string]string{"FROM_ID": "yes"}, Hostname: "sbx-test",
	}); err != nil {
		t.Fatal(err)
	}
	out := runIn(t, ctx, c, wire.ProcessSpec{Argv: []string{"sh", "-c", "echo $$ $FROM_ID; hostname; id -un"}})
	if f := strings.Fields(out); len(f) != 4 || f[1] != "yes" || f[2] != "sbx-test" || f[3] != "root" {
		t.Fatalf("identity in sandbox: %q", out)
	}
	// A skewed host clock: gVisor may refuse to set the clock; that is logged, not fatal.
	if err := c.SetIdentity(ctx, wire.Identity{Generation: 1, UnixNano: time.Now().Add(time.Hour).UnixNano(), Env: map[string]string{"FROM_ID": "yes"}}); err != nil {
		t.Fatal(err)
	}
	out = runIn(t, ctx, c, wire.ProcessSpec{Argv: []string{"date", "+%s"}})
	t.Logf("sandbox clock after a +1h identity: %s (host %d)", strings.TrimSpace(out), time.Now().Unix())

	// Gated start as another user.
	pi, err := c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c", "id -u; echo gated"}, User: "nobody", Gated: true})
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Start(ctx, pi.PID); err != nil {
		t.Fatal(err)
	}
	if got, ex := drain(t, s); got != "65534\ngated\n" || ex.ExitCode == nil || *ex.ExitCode != 0 {
		t.Fatalf("gated: %q %+v", got, ex)
	}

	// PTY.
	out = runIn(t, ctx, c, wire.ProcessSpec{Argv: []string{"sh", "-c", "tty; stty size"}, PTY: &wire.Size{Rows: 33, Cols: 99}})
	if !strings.Contains(out, "/dev/pts/") || !strings.Contains(out, "33 99") {
		t.Fatalf("pty: %q", out)
	}

	// A stdin request for a program that does not read is abandoned by the agent: gVisor
	// does not report the client's hang-up on a host socket, so it takes the stall
	// timeout (1 s here). A pipe: gVisor's terminals accept input without bound.
	sl, err := c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sleep", "100"}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	if err := c.WriteStdin(wctx, sl.PID, bytes.NewReader(make([]byte, 4<<20)), false); err == nil {
		t.Fatal("4 MiB written to a pipe nobody reads")
	}
	wcancel()
	for {
		wctx, wcancel := context.WithTimeout(ctx, 200*time.Millisecond)
		err := c.WriteStdin(wctx, sl.PID, nil, false)
		wcancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("stdin still held by the abandoned request")
		}
	}
	if err := c.Signal(ctx, sl.PID, "KILL"); err != nil {
		t.Fatal(err)
	}

	// Orphans are reaped by the agent as PID 1: no zombies remain.
	runIn(t, ctx, c, wire.ProcessSpec{Argv: []string{"sh", "-c", "sleep 0.1 >/dev/null 2>&1 & exit 0"}})
	for {
		out = runIn(t, ctx, c, wire.ProcessSpec{Argv: []string{"sh", "-c", "cat /proc/[0-9]*/stat 2>/dev/null; true"}})
		if !strings.Contains(out, "(sleep)") {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("orphan sleep still present: %q", out)
		case <-time.After(20 * time.Millisecond):
		}
	}
	if strings.Contains(out, ") Z ") {
		t.Fatalf("zombie in sandbox: %q", out)
	}

	// Files and a watch (inotify inside gVisor).
	w, err := c.Watch(ctx, "/work", "", true)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := c.WriteFile(ctx, "/work/a/b.txt", strings.NewReader("content"), agentclient.WriteOptions{User: "nobody"}); err != nil {
		t.Fatal(err)
	}
	for {
		ev, err := w.Next()
		if err != nil {
			t.Fatalf("watch: %v", err)
		}
		if ev.Type == wire.WatchCreate && ev.Name == "a" && ev.IsDir {
			break
		}
	}
	rc, _, err := c.ReadFile(ctx, "/work/a/b.txt", agentclient.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(rc)
	rc.Close()
	info, err := c.Stat(ctx, "/work/a/b.txt", "")
	if err != nil || string(data) != "content" || info.Owner != "nobody" {
		t.Fatalf("file: %q %+v %v", data, info, err)
	}
	w.Close()

	// Quiesce, checkpoint, restore, resume: the seam checkpoints need. runsc refuses to
	// checkpoint a sandbox holding a bound host socket; processes keep running across
	// it and their output is not lost.
	long, err := c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c", "for i in 1 2 3 4 5 6; do echo $i; sleep 0.1; done"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Quiesce(ctx, false); err != nil {
		t.Fatal(err)
	}
	if err := agentclient.WaitQuiesced(ctx, runDir); err != nil {
		t.Fatal(err)
	}
	image := filepath.Join(base, "image")
	if out, err := runscCmd(ctx, "checkpoint", "-image-path", image, id).CombinedOutput(); err != nil {
		logs, _ := os.ReadFile(filepath.Join(base, "agent.log"))
		t.Fatalf("checkpoint after quiesce: %v\n%s\nagent log:\n%s", err, out, logs)
	}
	if out, err := runscCmd(ctx, "delete", "-force", id).CombinedOutput(); err != nil {
		t.Fatalf("delete after checkpoint: %v\n%s", err, out)
	}
	restore := runscCmd(ctx, "restore", "-detach", "-image-path", image, "-bundle", base, id)
	restore.Stdout, restore.Stderr = runLog, runLog
	if err := restore.Run(); err != nil {
		out, _ := os.ReadFile(runLog.Name())
		t.Fatalf("restore: %v\n%s", err, out)
	}
	if err := agentclient.WriteResume(runDir, wire.Identity{Generation: 2, Seed: bytes.Repeat([]byte{3}, 32), UnixNano: time.Now().UnixNano()}); err != nil {
		t.Fatal(err)
	}
	if h, err = c.WaitReady(ctx); err != nil || h.Generation != 2 {
		logs, _ := os.ReadFile(filepath.Join(base, "agent.log"))
		t.Fatalf("after restore: %+v %v\n%s", h, err, logs)
	}
	s, err = c.Output(ctx, long.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := drain(t, s); got != "1\n2\n3\n4\n5\n6\n" {
		t.Fatalf("output across checkpoint/restore: %q", got)
	}
	// What gVisor refused (entropy, clock, ...) is logged, not fatal: show it.
	logs, _ := os.ReadFile(filepath.Join(base, "agent.log"))
	for _, line := range strings.Split(string(logs), "\n") {
		if strings.Contains(line, `"level":"WARN"`) {
			t.Logf("agent: %s", line)
		}
	}
}

// writeBundle writes an OCI config running the agent as PID 1 with the host's /usr
// and /etc read-only, a writable /work, and runDir at wire.RunMountDir.
func writeBundle(t *testing.T, base, rootfs, runDir, agentBin string) {
	t.Helper()
	logFile := filepath.Join(base, "agent.log")
	bind := func(src, dst string, ro bool) map[string]any {
		opts := []string{"rbind"}
		if ro {
			opts = append(opts, "ro")
		}
		return map[string]any{"destination": dst, "source": src, "type": "bind", "options": opts}
	}
	spec := map[string]any{
		"ociVersion": "1.0.2",
		"process": map[string]any{
			"user": map[string]any{"uid": 0, "gid": 0},
			"args": []string{"/bin/sh", "-c", "exec " + wire.AgentPath + " 2>>/.space-log/agent.log"},
			"env": []string{
				"SPACE_AGENT_LISTEN=unix:" + filepath.Join(wire.RunMountDir, wire.AgentSocketName),
				"SPACE_AGENT_LOG_LEVEL=debug",
				"SPACE_AGENT_STDIN_STALL=1s",
				"PATH=/usr/bin:/bin",
			},
			"cwd": "/",
			"capabilities": map[string]any{
				"bounding":  allCaps,
				"effective": allCaps,
				"permitted": allCaps,
			},
		},
		"root":     map[string]any{"path": rootfs, "readonly": false},
		"hostname": "initial",
		"mounts": []any{
			map[string]any{"destination": "/proc", "type": "proc", "source": "proc"},
			map[string]any{"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
			bind("/usr", "/usr", true),
			bind("/etc", "/etc", true),
			bind(runDir, wire.RunMountDir, false),
			bind(agentBin, wire.AgentPath, true),
			bind(filepath.Dir(logFile), "/.space-log", false),
		},
		"linux": map[string]any{
			"namespaces": []any{
				map[string]any{"type": "pid"}, map[string]any{"type": "ipc"},
				map[string]any{"type": "uts"}, map[string]any{"type": "mount"},
			},
		},
	}
	// The agent must be PID 1 itself: exec replaces the shell used for the log redirect.
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(base, "config.json"), data, 0o644); err != nil {
		t.Fatal(err)
	}
}

var allCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SYS_CHROOT",
	"CAP_MKNOD", "CAP_AUDIT_WRITE", "CAP_SETFCAP", "CAP_SYS_ADMIN", "CAP_SYS_TIME",
}

func runIn(t *testing.T, ctx context.Context, c *agentclient.Client, spec wire.ProcessSpec) string {
	t.Helper()
	pi, err := c.StartProcess(ctx, spec)
	if err != nil {
		t.Fatalf("start %v: %v", spec.Argv, err)
	}
	s, err := c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	out, ex := drain(t, s)
	if ex.ExitCode == nil || *ex.ExitCode != 0 {
		t.Fatalf("%v: exit %+v, output %q", spec.Argv, ex, out)
	}
	return out
}

func drain(t *testing.T, s *agentclient.OutputStream) (string, wire.Exit) {
	t.Helper()
	defer s.Close()
	var out strings.Builder
	for {
		f, err := s.Next()
		if err != nil {
			t.Fatalf("output ended without exit: %v (so far %q)", err, out.String())
		}
		switch f.Type {
		case wire.FrameStdout, wire.FrameStderr:
			out.Write(f.Payload)
		case wire.FrameExit:
			var ex wire.Exit
			if err := json.Unmarshal(f.Payload, &ex); err != nil {
				t.Fatal(err)
			}
			return out.String(), ex
		}
	}
}
