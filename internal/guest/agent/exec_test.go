package agent_test

import (
	"bytes"
	"context"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agent"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
)

// POST /v1/exec starts a process and streams its output from offset 0 in one call:
// stdout and stderr whole (binary bytes untouched), stdin fed and closed, the exit
// status last; a program that cannot be executed exits 127/126 like a gated one.
func TestExecOneCall(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 30*time.Second)
	x, err := e.c.Exec(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c", "printf '\\377\\000a'; cat >&2; exit 5"}}, []byte("from stdin"))
	if err != nil {
		t.Fatal(err)
	}
	r := consume(t, x.Out, 0)
	if exitCode(t, r.exit) != 5 || !bytes.Equal(r.stdout, []byte{0xff, 0, 'a'}) || string(r.stderr) != "from stdin" || !r.started || r.startPID != x.PID {
		t.Fatalf("exec: pid %d uid %q, %+v", x.PID, x.UID, r)
	}
	pi, err := e.c.Proc(x.PID, x.UID).Info(ctx)
	if err != nil || pi.State != wire.StateExited || pi.Written != 13 {
		t.Fatalf("process after exec: %+v %v", pi, err)
	}
	// Many short commands: each ends with its exit frame after all of its output.
	for i := 0; i < 20; i++ {
		x, err := e.c.Exec(ctx, wire.ProcessSpec{Argv: []string{"echo", "hi"}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if r := consume(t, x.Out, 0); exitCode(t, r.exit) != 0 || string(r.stdout) != "hi\n" {
			t.Fatalf("echo, run %d: %+v", i, r)
		}
	}
	x, err = e.c.Exec(ctx, wire.ProcessSpec{Argv: []string{"no-such-program-x"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r := consume(t, x.Out, 0); exitCode(t, r.exit) != 127 || !strings.Contains(r.exit.Error, "not found") {
		t.Fatalf("missing program: %+v", r.exit)
	}
	_, err = e.c.Exec(ctx, wire.ProcessSpec{Argv: []string{"true"}, User: "nobody-here"}, nil)
	wantAgentError(t, err, 400, wire.ErrCodeUnknownUser)
}

// A keyed exec sent again gets the process the first one started, its output from
// offset 0 and its exit, and starts nothing (the first answer was lost on the way:
// here, read only in part); twins sent at once start one process; the key with another
// command, or other stdin, is refused (422); another key starts another process.
func TestExecKeyed(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 30*time.Second)
	spec := wire.ProcessSpec{Argv: []string{"sh", "-c", "echo $$ >> /tmp/runs.$KEYTEST; cat; echo done"}, Env: map[string]string{"KEYTEST": t.Name()}, Key: "k1"}
	t.Cleanup(func() { _ = os.Remove("/tmp/runs." + t.Name()) })
	first, err := e.c.Exec(ctx, spec, []byte("in\n"))
	if err != nil {
		t.Fatal(err)
	}
	first.Out.Close() // the answer lost: nothing read
	var pids []int
	var wg sync.WaitGroup
	var mu sync.Mutex
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x, err := e.c.Exec(ctx, spec, []byte("in\n"))
			if err != nil {
				t.Error(err)
				return
			}
			r := consume(t, x.Out, 0)
			if exitCode(t, r.exit) != 0 || !strings.HasSuffix(string(r.stdout), "in\ndone\n") || !r.started {
				t.Errorf("repeat: %+v", r)
			}
			mu.Lock()
			pids = append(pids, x.PID)
			mu.Unlock()
		}()
	}
	wg.Wait()
	for _, pid := range pids {
		if pid != first.PID {
			t.Fatalf("repeats reached pids %v, want %d each", pids, first.PID)
		}
	}
	runs, err := os.ReadFile("/tmp/runs." + t.Name())
	if err != nil || strings.Count(string(runs), "\n") != 1 {
		t.Fatalf("the command ran %q times (%v), want once", runs, err)
	}
	other := spec
	other.Argv = []string{"true"}
	_, err = e.c.Exec(ctx, other, []byte("in\n"))
	wantAgentError(t, err, 422, wire.ErrCodeKeyReused)
	_, err = e.c.Exec(ctx, spec, []byte("other\n"))
	wantAgentError(t, err, 422, wire.ErrCodeKeyReused)
	spec.Key = "k2"
	x, err := e.c.Exec(ctx, spec, []byte("in\n"))
	if err != nil {
		t.Fatal(err)
	}
	if r := consume(t, x.Out, 0); x.PID == first.PID || exitCode(t, r.exit) != 0 {
		t.Fatalf("another key: pid %d (first %d), %+v", x.PID, first.PID, r)
	}
}

// TestStartProcessKeyed: a keyed POST /v1/processes (a command session's gated process)
// sent again gets the process the first one made, twins sent at once make one, and the
// program runs once when started; the key with another command is refused (422);
// without a key, or with another, each start makes its own process.
func TestStartProcessKeyed(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 30*time.Second)
	spec := wire.ProcessSpec{Argv: []string{"sh", "-c", "echo $$ >> /tmp/runs.$KEYTEST; echo done"}, Env: map[string]string{"KEYTEST": t.Name()},
		Gated: true, Key: "session:k1"}
	t.Cleanup(func() { _ = os.Remove("/tmp/runs." + t.Name()) })
	first, err := e.c.StartProcess(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	pids := make([]int, 4)
	for i := range pids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pi, err := e.c.StartProcess(ctx, spec)
			if err != nil {
				t.Error(err)
				return
			}
			pids[i] = pi.PID
			if pi.UID != first.UID {
				t.Errorf("repeat: uid %s, want %s", pi.UID, first.UID)
			}
		}()
	}
	wg.Wait()
	for _, pid := range pids {
		if pid != first.PID {
			t.Fatalf("repeats reached pids %v, want %d each", pids, first.PID)
		}
	}
	if err := e.c.Start(ctx, first.PID); err != nil {
		t.Fatal(err)
	}
	out, err := e.c.Output(ctx, first.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	if r := consume(t, out, 0); exitCode(t, r.exit) != 0 || string(r.stdout) != "done\n" {
		t.Fatalf("the session's process: %+v", r)
	}
	if again, err := e.c.StartProcess(ctx, spec); err != nil || again.PID != first.PID || again.State != wire.StateExited {
		t.Fatalf("sent again after the exit: %+v, %v", again, err)
	}
	runs, err := os.ReadFile("/tmp/runs." + t.Name())
	if err != nil || strings.Count(string(runs), "\n") != 1 {
		t.Fatalf("the command ran %q times (%v), want once", runs, err)
	}
	other := spec
	other.Argv = []string{"true"}
	_, err = e.c.StartProcess(ctx, other)
	wantAgentError(t, err, 422, wire.ErrCodeKeyReused)
	seen := map[int]bool{first.PID: true}
	for _, key := range []string{"session:k2", "", ""} {
		spec.Key = key
		pi, err := e.c.StartProcess(ctx, spec)
		if err != nil || seen[pi.PID] {
			t.Fatalf("key %q: %+v, %v; want a process of its own", key, pi, err)
		}
		seen[pi.PID] = true
	}
}

// A writer of many small pieces puts its output pipe in flow (read without blocking,
// in windows); a pause takes it back to blocking reads, and a second burst into flow
// again. Every byte arrives once, in order, the line after each pause included, and
// the exit comes after the last byte.
func TestExecOutputFlowAndPauses(t *testing.T) {
	e := startAgent(t, func(c *agent.Config) { c.JournalBytes = 64 << 20 })
	ctx := testCtx(t, 60*time.Second)
	script := "seq 1 300000; sleep 0.3; echo mid; seq 300001 600000; sleep 0.05; echo end; seq 600001 700000"
	x, err := e.c.Exec(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c", script}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var want bytes.Buffer
	seq := func(from, to int) {
		for i := from; i <= to; i++ {
			want.WriteString(strconv.Itoa(i))
			want.WriteByte('\n')
		}
	}
	seq(1, 300000)
	want.WriteString("mid\n")
	seq(300001, 600000)
	want.WriteString("end\n")
	seq(600001, 700000)
	r := consume(t, x.Out, 0)
	if exitCode(t, r.exit) != 0 || len(r.gaps) != 0 || !bytes.Equal(r.stdout, want.Bytes()) {
		t.Fatalf("flow: exit %+v, gaps %v, %d bytes of stdout, want %d", r.exit, r.gaps, len(r.stdout), want.Len())
	}
}

// A reader that keeps up, however slowly, gets every byte: the writer waits for it
// rather than letting bytes it has not read fall out of the (here 1 MiB) journal.
func TestSlowReaderLosesNothing(t *testing.T) {
	needTools(t, "head")
	e := startAgent(t, func(c *agent.Config) { c.JournalBytes = 1 << 20 })
	ctx := testCtx(t, 60*time.Second)
	const total = 32 << 20
	x, err := e.c.Exec(ctx, wire.ProcessSpec{Argv: []string{"head", "-c", strconv.Itoa(total), "/dev/zero"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Out.Close()
	var got, frames int64
	for {
		f, err := x.Out.Next()
		if err != nil {
			t.Fatalf("after %d bytes: %v", got, err)
		}
		if f.Type == wire.FrameGap {
			t.Fatalf("gap at offset %d after %d bytes", f.Offset, got)
		}
		if f.Type == wire.FrameExit {
			break
		}
		if f.Type == wire.FrameStdout {
			if f.Offset != got {
				t.Fatalf("frame at %d, want %d", f.Offset, got)
			}
			got += int64(len(f.Payload))
			frames++
			time.Sleep(2 * time.Millisecond) // slower than head
		}
	}
	if got != total {
		t.Fatalf("received %d bytes, want %d", got, total)
	}
	t.Logf("%d MiB in %d frames, no gap", got>>20, frames)
}

// The stream of a command started and read in one call is owed its output from the
// first byte, even when the program writes more than the journal holds before the
// stream's first read: the agent registers the reader before the program runs. (It
// once registered it after the start, and a fast writer on a loaded host could push
// the first bytes out in between: TestSlowReaderLosesNothing then began with a gap.)
// Here the first read waits until the journal is full and the writer waits for it.
func TestExecStreamIsOwedTheFirstByte(t *testing.T) {
	needTools(t, "head")
	const journal, total = 1 << 20, 4 << 20
	e := startAgent(t, func(c *agent.Config) {
		c.JournalBytes = journal
		c.ReaderStall = time.Minute // the writer waits for this reader, however long it idles
	})
	x, err := e.a.StartFollowed(wire.ProcessSpec{Argv: []string{"head", "-c", strconv.Itoa(total), "/dev/zero"}})
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		held := x.WriterHeld()
		first, end := x.Bounds()
		if first != 0 {
			t.Fatalf("bytes [0, %d) evicted before the stream's first read", first)
		}
		if held {
			break // the journal is full and the writer waits for the reader
		}
		if time.Now().After(deadline) {
			t.Fatalf("the writer did not wait for the reader within 20 s (%d bytes written)", end)
		}
		time.Sleep(5 * time.Millisecond)
	}
	buf := make([]byte, 128<<10)
	var got int64
	for got < total {
		n, gap := x.ReadAt(got, buf)
		if gap > 0 {
			t.Fatalf("gap of %d bytes at offset %d", gap, got)
		}
		if n == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%d of %d bytes after 20 s", got, total)
			}
			time.Sleep(time.Millisecond)
			continue
		}
		got += int64(n)
	}
}

// Commands one after another reuse one connection to the agent: a stream read to its
// exit frame and closed leaves its connection to the client's pool (a new connection
// costs a dial and, under gVisor, an accept in the sandbox per command).
func TestExecReusesConnections(t *testing.T) {
	e := startAgent(t, nil)
	var dials atomic.Int32
	c := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		dials.Add(1)
		conn, err := agentclient.DialUnix(e.sock)(ctx)
		return byteConn{conn}, err
	})
	defer c.CloseIdleConnections()
	ctx := testCtx(t, 30*time.Second)
	for i := 0; i < 5; i++ {
		x, err := c.Exec(ctx, wire.ProcessSpec{Argv: []string{"echo", "hi"}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		// As the host's relays do: read up to the exit frame, then close.
		for {
			f, err := x.Out.Next()
			if err != nil {
				t.Fatalf("run %d: %v before the exit frame", i, err)
			}
			if f.Type == wire.FrameExit {
				break
			}
		}
		if err := x.Out.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if n := dials.Load(); n != 1 {
		t.Fatalf("5 commands dialed the agent %d times, want 1", n)
	}
}

// byteConn reads one byte at a time: the end of an answer after its exit frame is not
// read ahead with the frame, as when it crosses into a sandbox's host socket later.
type byteConn struct{ net.Conn }

func (c byteConn) Read(p []byte) (int, error) { return c.Conn.Read(p[:min(len(p), 1)]) }
