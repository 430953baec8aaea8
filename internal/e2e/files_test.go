package e2e

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/creack/pty"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// rssKB returns a process's resident set size.
func rssKB(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	return 0
}

// agentRSSKB asks the sandbox for its PID 1's (the agent's) resident set size.
func (s *srv) agentRSSKB(t testing.TB, id string) int {
	out, _, _ := s.exec(t, id, "ps", "-o", "rss=", "-p", "1")
	n, _ := strconv.Atoi(strings.TrimSpace(out))
	return n
}

func (s *srv) pid() int { return s.Pid() }

// TestBackPressure runs processes that write as fast as they can with a stalled reader
// and with no reader: agent and server memory stay bounded, the sandbox stays
// responsive, and the slow reader is told about the bytes it lost.
func TestBackPressure(t *testing.T) {
	s := start(t, options{Args: []string{"--journal-bytes", "1048576"}})
	sb := s.create(t, api.CreateSandboxRequest{MemoryMB: 1024})
	c := ctx(t, 4*time.Minute)

	stalled, err := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Command: "head -c 2G /dev/zero"})
	if err != nil {
		t.Fatal(err)
	}
	absent, err := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Command: "yes | head -c 256M"})
	if err != nil {
		t.Fatal(err)
	}
	// The absent reader: attach (which starts the process) and leave.
	st, err := s.C.Attach(c, absent, "")
	if err != nil {
		t.Fatal(err)
	}
	st.Close()
	// The stalled reader: attach, read one event, then stop reading for a while.
	slow, err := s.C.Attach(c, stalled, "")
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	if _, err := slow.Next(); err != nil {
		t.Fatal(err)
	}
	maxAgent, maxServer := 0, 0
	var echoTimes []time.Duration
	exited := map[int]bool{}
	deadline := time.Now().Add(4 * time.Minute)
	for !exited[stalled.PID] || !exited[absent.PID] {
		if time.Now().After(deadline) {
			t.Fatalf("the writers did not finish (exited: %v)", exited)
		}
		t0 := time.Now()
		out, _, _ := s.exec(t, sb.ID, "echo", "alive")
		if out != "alive\n" {
			t.Fatalf("sandbox unresponsive: %q", out)
		}
		echoTimes = append(echoTimes, time.Since(t0))
		maxAgent = max(maxAgent, s.agentRSSKB(t, sb.ID))
		maxServer = max(maxServer, rssKB(s.pid()))
		for _, pid := range []int{stalled.PID, absent.PID} {
			if p, err := s.C.GetProcess(c, sb.ID, pid); err == nil && p.State == api.ProcExited {
				exited[pid] = true
			}
		}
		time.Sleep(time.Second) // sampling period: each sample runs commands in the sandbox
	}
	slices.Sort(echoTimes)
	t.Logf("max RSS: agent %d KiB, space serve %d KiB; slowest echo round trip %v of %d", maxAgent, maxServer, echoTimes[len(echoTimes)-1], len(echoTimes))
	if maxAgent > 96*1024 {
		t.Errorf("agent RSS reached %d KiB while streaming 3 GiB", maxAgent)
	}
	if maxServer > 256*1024 {
		t.Errorf("space serve RSS reached %d KiB while streaming 3 GiB", maxServer)
	}
	// The stalled reader resumes: it must be told about the bytes that fell out.
	var gaps []api.GapEvent
	total := int64(0)
	for {
		ev, err := slow.Next()
		if err != nil {
			t.Fatalf("slow reader: %v", err)
		}
		switch ev.Name {
		case api.EventGap:
			var g api.GapEvent
			json.Unmarshal(ev.Data, &g)
			gaps = append(gaps, g)
			total += g.Dropped
		case api.EventExit:
			if len(gaps) == 0 || total < 1<<30 {
				t.Fatalf("slow reader saw gaps %+v (%d bytes dropped) for 2 GiB through a 1 MiB journal", gaps, total)
			}
			return
		}
	}
}

// TestFiles covers the file API: streamed transfers in both directions with bounded
// memory, byte ranges, stat, list with depth, mkdir, move, remove, watch, and paths that
// try to leave the sandbox.
func TestFiles(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 4*time.Minute)

	// 1 GiB up and down, streamed (a deterministic pattern, compared by checksum).
	const size = 1 << 30
	h := sha256.New()
	up := io.TeeReader(io.LimitReader(patternReader{}, size), h)
	before := rssKB(s.pid())
	fi, err := s.C.WriteFile(c, sb.ID, "/home/user/big/blob.bin", up, client.FileOptions{User: "user", Mode: 0o640})
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size != size || fi.Owner != "user" || fi.Mode != 0o640 {
		t.Fatalf("written: %+v", fi)
	}
	rc, err := s.C.ReadFile(c, sb.ID, "big/blob.bin", client.FileOptions{User: "user"})
	if err != nil {
		t.Fatal(err)
	}
	h2 := sha256.New()
	n, err := io.Copy(h2, rc)
	rc.Close()
	if err != nil || n != size || !bytes.Equal(h.Sum(nil), h2.Sum(nil)) {
		t.Fatalf("download: %d bytes, %v, checksum match %v", n, err, bytes.Equal(h.Sum(nil), h2.Sum(nil)))
	}
	after := rssKB(s.pid())
	t.Logf("space serve RSS %d KiB before, %d KiB after moving 2 GiB", before, after)
	if after-before > 128*1024 {
		t.Errorf("space serve RSS grew by %d KiB moving a 1 GiB file", after-before)
	}
	if rss := s.agentRSSKB(t, sb.ID); rss > 96*1024 {
		t.Errorf("agent RSS %d KiB after moving a 1 GiB file", rss)
	}
	// Byte ranges.
	rc, err = s.C.ReadFile(c, sb.ID, "/home/user/big/blob.bin", client.FileOptions{Offset: 1000, Length: 10})
	if err != nil {
		t.Fatal(err)
	}
	part, _ := io.ReadAll(rc)
	rc.Close()
	want := make([]byte, 1010)
	io.ReadFull(patternReader{}, want)
	if !bytes.Equal(part, want[1000:]) {
		t.Fatalf("range read %q", part)
	}

	// mkdir, write, list with depth, stat, move, remove.
	if _, err := s.C.Mkdir(c, sb.ID, api.MkdirRequest{Path: "/work/a/b", Parents: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.C.WriteFile(c, sb.ID, "/work/a/b/c.txt", strings.NewReader("hello"), client.FileOptions{}); err != nil {
		t.Fatal(err)
	}
	list, err := s.C.ListDir(c, sb.ID, "/work", 3, client.FileOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, e := range list {
		paths = append(paths, e.Path)
	}
	slices.Sort(paths)
	if strings.Join(paths, " ") != "/work/a /work/a/b /work/a/b/c.txt" {
		t.Fatalf("list depth 3: %v", paths)
	}
	if l1, _ := s.C.ListDir(c, sb.ID, "/work", 1, client.FileOptions{}); len(l1) != 1 {
		t.Fatalf("list depth 1: %+v", l1)
	}
	if _, err := s.C.Move(c, sb.ID, api.MoveRequest{From: "/work/a/b/c.txt", To: "/work/d.txt"}); err != nil {
		t.Fatal(err)
	}
	st, err := s.C.StatFile(c, sb.ID, "/work/d.txt", client.FileOptions{})
	if err != nil || st.Size != 5 || st.Type != "file" {
		t.Fatalf("stat after move: %+v %v", st, err)
	}
	if _, err := s.C.StatFile(c, sb.ID, "/work/a/b/c.txt", client.FileOptions{}); !client.IsNotFound(err) {
		t.Fatalf("old path after move: %v", err)
	}
	if err := s.C.Remove(c, sb.ID, "/work/a", false, client.FileOptions{}); err == nil {
		t.Fatal("removing a non-empty directory without recursive succeeded")
	}
	if err := s.C.Remove(c, sb.ID, "/work/a", true, client.FileOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.C.ReadFile(c, sb.ID, "/nope/none", client.FileOptions{}); !client.IsNotFound(err) {
		t.Fatalf("read missing: %v", err)
	}
	if _, err := s.C.ReadFile(c, sb.ID, "/work", client.FileOptions{}); err == nil || err.(*client.Error).Status != 400 {
		t.Fatalf("read a directory: %v", err)
	}

	// Watch.
	var mu sync.Mutex
	var events []api.WatchEvent
	stop, err := s.C.Watch(c, sb.ID, "/work", true, func(e api.WatchEvent) {
		mu.Lock()
		events = append(events, e)
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	s.C.WriteFile(c, sb.ID, "/work/w.txt", strings.NewReader("1"), client.FileOptions{})
	s.C.Move(c, sb.ID, api.MoveRequest{From: "/work/w.txt", To: "/work/x.txt"})
	s.C.Remove(c, sb.ID, "/work/x.txt", false, client.FileOptions{})
	waitFor(t, 30*time.Second, "watch events", func() bool {
		mu.Lock()
		defer mu.Unlock()
		seen := map[string]bool{}
		for _, e := range events {
			seen[e.Type+" "+e.Name] = true
		}
		return seen["create w.txt"] && seen["rename w.txt"] && seen["create x.txt"] && seen["remove x.txt"]
	})
	stop()

	// Paths that try to leave the sandbox stay inside it.
	marker := "space-escape-" + sb.ID
	if _, err := s.C.WriteFile(c, sb.ID, "/../../../../tmp/"+marker, strings.NewReader("x"), client.FileOptions{}); err != nil {
		t.Fatal(err)
	}
	out, _, _ := s.exec(t, sb.ID, "sh", "-c", "ln -s / /tmp/hostroot; ls /tmp/"+marker)
	if strings.TrimSpace(out) != "/tmp/"+marker {
		t.Fatalf("the .. path did not land in the sandbox's /tmp: %q", out)
	}
	if _, err := os.Stat(filepath.Join("/tmp", marker)); !os.IsNotExist(err) {
		t.Fatal("a sandbox path escaped to the host's /tmp")
	}
	// Through a symlink to the sandbox's own root: the write lands inside the sandbox
	// (or is refused); either way the host is untouched.
	if _, err := s.C.WriteFile(c, sb.ID, "/tmp/hostroot/etc/"+marker, strings.NewReader("x"), client.FileOptions{}); err != nil {
		t.Logf("write through a symlink: %v", err)
	}
	if _, err := os.Stat(filepath.Join("/etc", marker)); !os.IsNotExist(err) {
		t.Fatal("a symlink in the sandbox let a write reach the host's /etc")
	}
	// Bad input.
	for _, q := range []string{"", "?path=", "?path=/x&offset=-1", "?path=/x&user=Bad%20User"} {
		if code, _ := status(t, "GET", s.URL+"/v1/sandboxes/"+sb.ID+"/files"+q, s.Key, nil); code != 400 {
			t.Errorf("GET files%s: %d, want 400", q, code)
		}
	}
}

// patternReader yields a repeating, position-dependent byte pattern.
type patternReader struct{}

func (patternReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(i*7 + i/251)
	}
	return len(p), nil
}

// TestCLIDataPlane drives exec -it, ps, logs, attach, kill and cp through the CLI.
func TestCLIDataPlane(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})

	// cp both ways, including stdin/stdout.
	local := filepath.Join(t.TempDir(), "in.txt")
	os.WriteFile(local, []byte("from the host\n"), 0o600)
	if _, e, code := s.cli(t, "cp", local, sb.ID+":/tmp/in.txt"); code != 0 {
		t.Fatal(e)
	}
	back := filepath.Join(t.TempDir(), "out.txt")
	if _, e, code := s.cli(t, "cp", sb.ID+":/tmp/in.txt", back); code != 0 {
		t.Fatal(e)
	}
	if b, _ := os.ReadFile(back); string(b) != "from the host\n" {
		t.Fatalf("cp round trip: %q", b)
	}
	if out, _, _ := s.cli(t, "cp", sb.ID+":/tmp/in.txt", "-"); out != "from the host\n" {
		t.Fatalf("cp to stdout: %q", out)
	}

	// A background process: ps lists it, logs shows its output, kill stops it.
	sess, err := s.C.CreateSession(ctx(t, time.Minute), sb.ID, api.CreateSessionRequest{Command: "echo started; exec sleep 600"})
	if err != nil {
		t.Fatal(err)
	}
	st, _ := s.C.Attach(ctx(t, time.Minute), sess, "")
	st.Next()
	st.Close()
	pid := strconv.Itoa(sess.PID)
	waitFor(t, 30*time.Second, "logs to show the output", func() bool {
		out, _, _ := s.cli(t, "logs", sb.ID, pid)
		return out == "started\n"
	})
	out, _, _ := s.cli(t, "ps", sb.ID)
	if !strings.Contains(out, pid) || !strings.Contains(out, "running") {
		t.Fatalf("ps:\n%s", out)
	}
	if _, e, code := s.cli(t, "kill", sb.ID, pid, "KILL"); code != 0 {
		t.Fatal(e)
	}
	out, _, code := s.cli(t, "attach", sb.ID, pid)
	if out != "started\n" || code != 137 {
		t.Fatalf("attach after kill: %q exit %d", out, code)
	}
	if _, e, code := s.cli(t, "kill", sb.ID, pid, "NOTASIGNAL"); code == 0 || !strings.Contains(e, "signal") {
		t.Fatalf("bad signal name: %d %s", code, e)
	}
	if _, _, code := s.cli(t, "logs", sb.ID, "99999"); code == 0 {
		t.Fatal("logs of an unknown pid succeeded")
	}

	// exec -it on a real terminal: type into bash, see the echo, get its exit code.
	cmd := execCommand(s.Bin, "exec", "-it", sb.ID, "--", "bash", "--norc", "-i")
	cmd.Env = append(os.Environ(), "SPACE_URL="+s.URL, "SPACE_DATA_DIR="+s.DataDir, "SPACE_API_KEY=")
	ptmx, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 40, Cols: 120})
	if err != nil {
		t.Fatal(err)
	}
	defer ptmx.Close()
	var screen syncBuffer
	go io.Copy(&screen, ptmx)
	ptmx.Write([]byte("stty size; echo marker-$((6*7))\n"))
	waitFor(t, 30*time.Second, "the interactive shell to answer", func() bool {
		return strings.Contains(screen.String(), "marker-42") && strings.Contains(screen.String(), "40 120")
	})
	pty.Setsize(ptmx, &pty.Winsize{Rows: 50, Cols: 132})
	waitFor(t, 30*time.Second, "the resize to reach the sandbox", func() bool {
		ptmx.Write([]byte("stty size\n"))
		time.Sleep(200 * time.Millisecond) // pacing the polling loop, not waiting for readiness
		return strings.Contains(screen.String(), "50 132")
	})
	ptmx.Write([]byte("exit 5\n"))
	err = cmd.Wait()
	if ee, ok := err.(interface{ ExitCode() int }); !ok || ee.ExitCode() != 5 {
		t.Fatalf("exec -it exit: %v\n%s", err, screen.String())
	}
}
