package adversary

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/e2e/e2etest"
)

// waitAnswers waits until sandbox id runs and answers an exec.
func (su *suite) waitAnswers(t *testing.T, id string, d time.Duration) *api.Sandbox {
	t.Helper()
	var sb *api.Sandbox
	e2etest.WaitFor(t, d, "the sandbox to run and answer", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		var err error
		if sb, err = su.s.C.GetSandbox(ctx, id); err != nil || sb.State != api.StateRunning {
			return false
		}
		var out lockedBuffer
		out.b = new(bytes.Buffer)
		code, err := su.s.C.Exec(ctx, id, api.CreateSessionRequest{Argv: []string{"echo", "alive"}}, client.Output{Stdout: &out})
		return err == nil && code == 0 && out.String() == "alive\n"
	})
	return sb
}

// attackForkBomb: a fork bomb (every process forks in a loop for 10 s) runs into the
// sandbox's task limit inside gVisor; the host's task count for the sandbox's cgroup
// stays below the host limit, and the sandbox survives it (its memory and processes are
// kept: no OOM kill of the whole instance, and the agent, PID 1, keeps the tasks it
// needs) and answers again once the bomb is over. In a 1 GiB sandbox with 2 CPUs
// (1024 tasks inside; more CPUs churn faster, and gVisor's pool of released stubs, host
// tasks, grows with the churn) and in a 256 MiB one with 1 CPU (256).
func attackForkBomb(t *testing.T, su *suite) {
	for _, tc := range []struct{ mib, cpu int }{{1024, 2}, {256, 1}} {
		t.Run(fmt.Sprintf("%dMiB", tc.mib), func(t *testing.T) { forkBomb(t, su, tc.mib, tc.cpu) })
	}
}

func forkBomb(t *testing.T, su *suite, mib, cpu int) {
	sb := su.create(t, api.CreateSandboxRequest{MemoryMB: mib, CPU: cpu})
	cur := hostCgroupFile(sb.ID, "pids", "pids.current", "pids.current")
	limit := readInt64(t, hostCgroupFile(sb.ID, "pids", "pids.max", "pids.max"))
	// User processes run in a cgroup of their own inside, whose task limit leaves some
	// to the agent.
	split := su.mustSh(t, sb.ID, `sed 's/^0:://' /proc/1/cgroup /proc/self/cgroup; cat /sys/fs/cgroup$(sed 's/^0:://' /proc/self/cgroup)/pids.max /sys/fs/cgroup$(sed 's/^0:://;s,/user$,,' /proc/self/cgroup)/pids.max`)
	t.Logf("agent's cgroup, user's cgroup, user limit, sandbox limit: %q", split)
	f := strings.Fields(split)
	userLimit := 0
	if len(f) == 4 {
		userLimit, _ = strconv.Atoi(f[2])
	}
	if len(f) != 4 || !strings.HasSuffix(f[0], "/agent") || !strings.HasSuffix(f[1], "/user") {
		t.Errorf("user processes do not run apart from the agent: %q", split)
	} else if user, err1 := strconv.Atoi(f[2]); err1 != nil {
		t.Errorf("user task limit %q", f[2])
	} else if all, err2 := strconv.Atoi(f[3]); err2 != nil || user >= all {
		t.Errorf("the user's task limit %d leaves the agent nothing of the sandbox's %q", user, f[3])
	}
	before := readInt64(t, cur)
	c := e2etest.Ctx(t, 2*time.Minute)
	sess, err := su.s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{
		Command: `end=$((SECONDS+10)); b() { while [ $SECONDS -lt $end ]; do b & done; }; b 2>/dev/null`})
	if err != nil {
		t.Fatal(err)
	}
	st, err := su.s.C.Attach(c, sess, "") // starts it
	if err != nil {
		t.Fatal(err)
	}
	st.Close()
	events := hostCgroupFile(sb.ID, "pids", "pids.events", "pids.events")
	logFile := filepath.Join(su.s.DataDir, "runtime", sb.ID, "log", "runsc.log")
	peak, refusals, logTail := before, "", ""
	for end := time.Now().Add(12 * time.Second); time.Now().Before(end); {
		if b, err := os.ReadFile(cur); err == nil {
			var n int64
			fmt.Sscan(string(b), &n)
			peak = max(peak, n)
		}
		if b, err := os.ReadFile(events); err == nil {
			refusals = strings.TrimSpace(string(b))
		}
		if b, err := os.ReadFile(logFile); err == nil && len(b) > 0 {
			logTail = string(b[max(0, len(b)-4096):])
		}
		time.Sleep(20 * time.Millisecond) // sampling period
	}
	t.Logf("host tasks of the sandbox: %d before, peak %d, host limit %d; host pids.events %q", before, peak, limit, refusals)
	su.figure(fmt.Sprintf("  fork bomb, %d MiB: host tasks", mib), fmt.Sprintf("peak %d of %d", peak, limit))
	// Each task of the guest is at least one host task (its stub under systrap): a bomb
	// that ran added at least as many host tasks as the user may have inside. (A share
	// of the host limit was the bar until 2026-12-06; the limit's factor rose to 6 and a
	// 256 MiB bomb's 438 host tasks then fell under a quarter of 1792.)
	if peak-before < int64(userLimit) {
		t.Errorf("the bomb added %d host tasks (%d to %d), fewer than the %d tasks the user may have inside: it did not run", peak-before, before, peak, userLimit)
	}
	if limit > 0 && peak >= limit || refusals != "" && refusals != "max 0" {
		t.Errorf("the bomb reached the host cgroup's limit %d (peak %d, %q)", limit, peak, refusals)
	}
	sb2 := su.waitAnswers(t, sb.ID, 90*time.Second)
	// Until 2026-12-06 the host's OOM killer ended the whole instance here (its host
	// memory limit was the guest's size, and 2048 tasks cost the Sentry and the host
	// kernel as much again as the guest's own memory), and in a small sandbox the
	// agent died when the bomb took every task (docs/runtimes.md, "Tasks").
	t.Run("SandboxSurvives", func(t *testing.T) {
		if sb2.Error != "" {
			t.Errorf("the sandbox was lost to the bomb and booted again (%s); last output of its runsc:\n%s", sb2.Error, logTail)
		}
	})
}

// attackTaskCgroupRemoved: sandbox root takes the user processes' cgroup away (moves
// itself out and removes it); the next command still starts, in a user cgroup the
// agent made again, so the agent keeps its share of the sandbox's tasks.
func attackTaskCgroupRemoved(t *testing.T, su *suite) {
	sb := su.create(t, api.CreateSandboxRequest{})
	out := su.mustSh(t, sb.ID, `cg=/sys/fs/cgroup$(sed 's/^0:://;s,/user$,,' /proc/self/cgroup)
echo $$ > $cg/agent/cgroup.procs || exit 1
for i in $(seq 100); do rmdir $cg/user 2>/dev/null && break; sleep 0.05; done
test -e $cg/user && echo still there || echo removed`)
	if out != "removed\n" {
		t.Fatalf("sandbox root could not remove the user cgroup: %q", out)
	}
	got := su.mustSh(t, sb.ID, `sed 's/^0:://' /proc/self/cgroup`)
	if !strings.HasSuffix(got, "/user\n") {
		t.Errorf("after the user cgroup was removed, a command runs in %q, not in a new user cgroup", got)
	}
}

// attackMemoryHog: a process allocates and touches 2 GiB in a 256 MiB sandbox. Near the
// sandbox's host memory limit the node has the agent end it (node/memwatch.go), as a
// Linux guest's OOM killer would: the command ends by SIGKILL with an error that says
// the memory was full, the host cgroup never passes its limit, and the sandbox keeps
// its other processes and its files in memory (it was not ended whole and booted
// again: gVisor has no OOM killer inside, and the host's may end the whole Sentry).
func attackMemoryHog(t *testing.T, su *suite) {
	sb := su.create(t, api.CreateSandboxRequest{MemoryMB: 256})
	limitFile := hostCgroupFile(sb.ID, "memory", "memory.limit_in_bytes", "memory.max")
	limit := readInt64(t, limitFile)
	marker := strings.TrimSpace(su.mustSh(t, sb.ID, `sleep 100000 >/dev/null 2>&1 & echo kept > /dev/shm/kept; echo $!`))
	var buf bytes.Buffer
	w := &lockedBuffer{b: &buf}
	exit, err := su.s.C.ExecExit(e2etest.Ctx(t, 2*time.Minute), sb.ID, api.CreateSessionRequest{Command: `timeout 30 python3 -c '
import time
held = []
for i in range(128):
    b = bytearray(16 << 20)
    for j in range(0, len(b), 4096): b[j] = 1
    held.append(b)
print("allocated", len(held) * 16, "MiB")
'`}, client.Output{Stdout: w, Stderr: w})
	out := w.String()
	if err != nil {
		t.Errorf("hog: the command ended without an exit (its instance ended?): %v", err)
	} else {
		t.Logf("hog: exit %+v: %s", *exit, strings.TrimSpace(out))
		// timeout(1) runs python in its own child: the agent ends python, and timeout
		// reports it with 137; the exit's error names the process ended.
		if code := client.ExitCode(exit); code != 137 || !strings.Contains(exit.Error, "out of memory") {
			t.Errorf("hog: exit code %d, error %q; want 137 and an out-of-memory error", code, exit.Error)
		}
	}
	peakFile := hostCgroupFile(sb.ID, "memory", "memory.max_usage_in_bytes", "memory.peak")
	var peak int64 = -1
	if b, err := os.ReadFile(peakFile); err == nil { // gone if the instance was killed
		fmt.Sscan(string(b), &peak)
	}
	sb2 := su.waitAnswers(t, sb.ID, 2*time.Minute)
	t.Logf("host memory limit %d MiB, peak %d MiB; afterwards: %q", limit>>20, peak>>20, sb2.Error)
	su.figure("  memory hog", fmt.Sprintf("limit %d MiB, host peak %d MiB, exit %q", limit>>20, peak>>20, exitText(exit)))
	if strings.Contains(out, "allocated 2048") {
		t.Errorf("a 256 MiB sandbox allocated 2 GiB")
	}
	if limit <= 0 || limit > 512<<20 {
		t.Errorf("host memory limit of a 256 MiB sandbox: %d", limit)
	}
	if peak < 0 || peak > limit+1<<20 { // the kernel's charge may pass the limit by a few pages
		t.Errorf("host memory peak %d above the limit %d (or the instance was ended)", peak, limit)
	}
	if got, code := su.sh(t, sb.ID, `cat /dev/shm/kept && kill -0 `+marker+` && echo alive`); code != 0 || got != "kept\nalive\n" {
		t.Errorf("after the hog the sandbox lost its memory or processes (ended whole?): exit %d, %q", code, got)
	}
}

// attackDiskWriteBeyondMemory: a 256 MiB sandbox writes a file of 1 GiB, four times its
// memory, to its disk. The file passes through the host's page cache, charged to the
// sandbox's cgroup: the write must finish whole, as on a Linux machine of that size,
// with no process ended for memory (until 2026-12-07 the node took the dirty cache for
// memory the sandbox held and its agent ended the writer), a program then gets memory
// the file's cache holds, and the host's peak stays under the limit.
func attackDiskWriteBeyondMemory(t *testing.T, su *suite) {
	const memoryMB = 256
	sb := su.create(t, api.CreateSandboxRequest{MemoryMB: memoryMB})
	limit := readInt64(t, hostCgroupFile(sb.ID, "memory", "memory.limit_in_bytes", "memory.max"))
	marker := strings.TrimSpace(su.mustSh(t, sb.ID, `sleep 100000 >/dev/null 2>&1 & echo $!`))
	start := time.Now()
	out, code := su.sh(t, sb.ID, `dd if=/dev/zero of=/root/big bs=1M count=1024 2>&1 && stat -c %s /root/big`)
	took := time.Since(start)
	// The file's pages still fill the cgroup: a program taking 160 MiB, well within the
	// sandbox's size, gets it (the kernel reclaims the cache).
	alloc, acode := su.sh(t, sb.ID, `python3 -c '
b = bytearray(160 << 20)
for j in range(0, len(b), 4096): b[j] = 1
print("allocated")
' 2>&1; rm /root/big`)
	if acode != 0 || !strings.Contains(alloc, "allocated") {
		t.Errorf("with the file's cache in its memory, a 160 MiB allocation in a %d MiB sandbox: exit %d: %q", memoryMB, acode, alloc)
	}
	peakFile := hostCgroupFile(sb.ID, "memory", "memory.max_usage_in_bytes", "memory.peak")
	var peak int64 = -1
	if b, err := os.ReadFile(peakFile); err == nil {
		fmt.Sscan(string(b), &peak)
	}
	su.figure("  disk write 4x memory", fmt.Sprintf("1 GiB in %v; limit %d MiB, host peak %d MiB", took.Round(time.Millisecond), limit>>20, peak>>20))
	if code != 0 || !strings.Contains(out, fmt.Sprint(1<<30)) {
		t.Errorf("writing 1 GiB to the disk of a %d MiB sandbox: exit %d: %q", memoryMB, code, out)
	}
	if strings.Contains(out, "out of memory") {
		t.Errorf("a process was ended for memory while the sandbox wrote a file: %q", out)
	}
	if peak < 0 || peak > limit+1<<20 {
		t.Errorf("host memory peak %d above the limit %d (or the instance was ended)", peak, limit)
	}
	if got, code := su.sh(t, sb.ID, `kill -0 `+marker+` && echo alive`); code != 0 || got != "alive\n" {
		t.Errorf("after the write the sandbox lost a process: exit %d, %q", code, got)
	}
}

// attackMemoryFilesFill: a 256 MiB sandbox writes 400 MiB into each of its memory file
// systems, /tmp and /dev/shm, keeping the first file while it writes the second. Their
// files are the sandbox's memory: gVisor's default bound, half of the HOST's memory,
// let them pass the host limit, where the host's OOM killer ended a process of the
// sandbox (the Sentry: the whole sandbox), and the agent's reclaim, which ends a
// process, frees nothing a file holds. Each write stops with ENOSPC at half the
// sandbox's memory, the host's peak stays under the limit, and the sandbox keeps a
// process started before and can write again once it deletes the files.
func attackMemoryFilesFill(t *testing.T, su *suite) {
	const memoryMB = 256
	sb := su.create(t, api.CreateSandboxRequest{MemoryMB: memoryMB})
	limit := readInt64(t, hostCgroupFile(sb.ID, "memory", "memory.limit_in_bytes", "memory.max"))
	marker := strings.TrimSpace(su.mustSh(t, sb.ID, `sleep 100000 >/dev/null 2>&1 & echo $!`))
	var sizes []string
	for _, dir := range []string{"/tmp", "/dev/shm"} {
		out, code := su.sh(t, sb.ID, "dd if=/dev/zero of="+dir+"/fill bs=1M count=400 2>&1; stat -c %s "+dir+"/fill")
		t.Logf("dd into %s: exit %d: %s", dir, code, strings.TrimSpace(out))
		if !strings.Contains(out, "No space left on device") {
			t.Errorf("writing 400 MiB into %s of a %d MiB sandbox: %q, want ENOSPC", dir, memoryMB, out)
		}
		f := strings.Fields(out)
		var written int64
		if len(f) > 0 {
			fmt.Sscan(f[len(f)-1], &written)
		}
		if written > memoryMB/2<<20 {
			t.Errorf("%s took %d MiB of a %d MiB sandbox, more than half", dir, written>>20, memoryMB)
		}
		sizes = append(sizes, fmt.Sprintf("%s %d MiB", dir, written>>20))
	}
	peakFile := hostCgroupFile(sb.ID, "memory", "memory.max_usage_in_bytes", "memory.peak")
	var peak int64 = -1
	if b, err := os.ReadFile(peakFile); err == nil { // gone if the instance was killed
		fmt.Sscan(string(b), &peak)
	}
	su.figure("  memory files", fmt.Sprintf("%s; limit %d MiB, host peak %d MiB", strings.Join(sizes, ", "), limit>>20, peak>>20))
	if peak < 0 || peak > limit+1<<20 {
		t.Errorf("host memory peak %d above the limit %d (or the instance was ended)", peak, limit)
	}
	sb2 := su.waitAnswers(t, sb.ID, 2*time.Minute)
	if sb2.Error != "" {
		t.Errorf("the sandbox was lost and booted again: %s", sb2.Error)
	}
	if got, code := su.sh(t, sb.ID, `kill -0 `+marker+` && rm /tmp/fill /dev/shm/fill && dd if=/dev/zero of=/tmp/again bs=1M count=64 2>/dev/null && echo wrote`); code != 0 || got != "wrote\n" {
		t.Errorf("after the fill the sandbox lost a process or cannot write again: exit %d, %q", code, got)
	}
}

func exitText(x *api.ExitEvent) string {
	if x == nil {
		return "none"
	}
	return fmt.Sprintf("%d %s", client.ExitCode(x), x.Error)
}

// allocated returns the bytes the host file system holds for path.
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// diskMarginMB is the node's margin on a sandbox's quota for the runtime's own files
// (internal/node: the limit is disk_mb + memory_mb + this, room for a suspend snapshot
// of the memory included).
const diskMarginMB = 64

// attackDiskFill: a sandbox with disk_mb 256 writes 1 GiB. The write fails inside with
// EDQUOT or ENOSPC, the store's image on the host grows by no more than the sandbox's
// quota, and the sandbox keeps working: it can delete the file and write again.
func attackDiskFill(t *testing.T, su *suite) {
	const diskMB, memoryMB = 256, 256
	sb := su.create(t, api.CreateSandboxRequest{DiskMB: diskMB, MemoryMB: memoryMB})
	image := filepath.Join(su.s.DataDir, "store.img")
	before := allocated(t, image)
	out, code := su.sh(t, sb.ID, "dd if=/dev/zero of=/root/fill bs=1M count=1024 conv=fsync 2>&1; stat -c %s /root/fill")
	t.Logf("dd: exit %d: %s", code, strings.TrimSpace(out))
	if !strings.Contains(out, "Disk quota exceeded") && !strings.Contains(out, "No space left on device") {
		t.Errorf("writing 1 GiB into a %d MiB sandbox: %q, want EDQUOT or ENOSPC", diskMB, out)
	}
	lines := strings.Fields(out)
	var written int64
	if len(lines) > 0 {
		fmt.Sscan(lines[len(lines)-1], &written)
	}
	su.mustSh(t, sb.ID, "sync")
	grown := allocated(t, image) - before
	quota := int64(diskMB+memoryMB+diskMarginMB) << 20
	t.Logf("the sandbox wrote %d MiB; the store image grew by %d MiB (quota %d MiB)", written>>20, grown>>20, quota>>20)
	su.figure("  disk fill", fmt.Sprintf("disk_mb %d: wrote %d MiB, store image grew %d MiB", diskMB, written>>20, grown>>20))
	if written > quota || grown > quota+(32<<20) {
		t.Errorf("a sandbox with quota %d MiB wrote %d MiB; the store image grew by %d MiB", quota>>20, written>>20, grown>>20)
	}
	if out := su.mustSh(t, sb.ID, "rm /root/fill && echo again > /root/after && cat /root/after"); out != "again\n" {
		t.Errorf("the sandbox after filling its disk: %q", out)
	}
	t.Run("WithinDiskMB", func(t *testing.T) {
		if written > int64(diskMB+diskMarginMB)<<20 {
			t.Errorf("disk_mb %d: the sandbox wrote %d MiB", diskMB, written>>20)
		}
	})
}

// attackOutputFlood: a process writes as fast as it can for 10 s while its reader reads
// the first MiB and then stalls (a slow or gone client): the server's memory stays
// bounded (the relay waits, the agent's journal drops what no one read), the neighbour
// is unaffected, and the reader, resuming, is told about the bytes it lost.
func attackOutputFlood(t *testing.T, su *suite) {
	sb := su.create(t, api.CreateSandboxRequest{})
	rssBefore := rssKB(su.s.Pid())
	stopRSS := su.rssWatch()
	c := e2etest.Ctx(t, 2*time.Minute)
	sess, err := su.s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Command: "timeout 10 yes 0123456789abcdefghijklmnopqrstuvwxyz"})
	if err != nil {
		t.Fatal(err)
	}
	st, err := su.s.C.Attach(c, sess, "")
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	var read int64
	for read < 1<<20 {
		ev, err := st.Next()
		if err != nil {
			t.Fatal(err)
		}
		read += int64(len(ev.Data))
	}
	// Stalled until the writer is done.
	e2etest.WaitFor(t, time.Minute, "the flood to end", func() bool {
		p, err := su.s.C.GetProcess(c, sb.ID, sess.PID)
		return err == nil && p.State == api.ProcExited
	})
	peak := stopRSS()
	var dropped, written int64
	exited := false
	for !exited {
		ev, err := st.Next()
		if err != nil {
			t.Fatalf("resuming reader: %v", err)
		}
		switch ev.Name {
		case api.EventGap:
			var g api.GapEvent
			_ = json.Unmarshal(ev.Data, &g)
			dropped += g.Dropped
		case api.EventExit:
			var e api.ExitEvent
			_ = json.Unmarshal(ev.Data, &e)
			written, exited = e.Offset, true
		}
	}
	t.Logf("flood: %d MiB written, %d MiB dropped for the stalled reader; server RSS %d KiB before, peak %d KiB", written>>20, dropped>>20, rssBefore, peak)
	su.figure("  output flood", fmt.Sprintf("%d MiB written in 10 s, server RSS %d→%d KiB", written>>20, rssBefore, peak))
	if written < 100<<20 || dropped == 0 {
		t.Errorf("written %d bytes, %d dropped: the flood did not run", written, dropped)
	}
	if peak-rssBefore > 32<<10 {
		t.Errorf("space serve RSS grew by %d KiB during an output flood", peak-rssBefore)
	}
}

type writerFunc func(p []byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// logTmpfsCap is the size of the gVisor runtime's log tmpfs (4 MiB).
const logTmpfsCap = 4 << 20

// attackLogFlood: sandbox root writes to PID 1's (the agent's) stdout and stderr, which
// runsc sends to the sandbox's log on the host, as fast as it can for 8 s; the log's
// file system on the host never holds more than its cap, and the sandbox keeps working.
// Each writer starts again when a write fails: `yes` exits on ENOSPC, and a one-shot
// flood that filled the log once could be rotated away within one sampling period
// (the log is rotated every 5 s), which made the test fail about once in a hundred runs.
func attackLogFlood(t *testing.T, su *suite) {
	sb := su.create(t, api.CreateSandboxRequest{})
	dir := filepath.Join(su.s.DataDir, "runtime", sb.ID, "log")
	c := e2etest.Ctx(t, 2*time.Minute)
	sess, err := su.s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{
		Command: "timeout 8 sh -c 'while :; do yes flood-flood-flood-flood-flood; done 2>/dev/null >/proc/1/fd/2 & " +
			"while :; do yes flood; done 2>/dev/null >/proc/1/fd/1 & wait'"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var out bytes.Buffer // the flood's own words, if it fails (stdout and stderr go to the log)
	var exit *api.ExitEvent
	var followErr error
	go func() {
		defer close(done)
		exit, followErr = su.s.C.Follow(c, sess, client.Output{Stdout: &out, Stderr: &out})
	}()
	var peak uint64
	var samples, full int
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); {
		var fs unix.Statfs_t
		if err := unix.Statfs(dir, &fs); err != nil {
			t.Fatal(err)
		}
		used := (fs.Blocks - fs.Bfree) * uint64(fs.Bsize)
		peak = max(peak, used)
		samples++
		if used >= 512<<10 {
			full++
		}
		time.Sleep(50 * time.Millisecond) // sampling period
	}
	<-done
	fi, err := os.Stat(filepath.Join(dir, "runsc.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("log file system: peak %d KiB used (cap %d KiB), %d of %d samples above 512 KiB; runsc.log now %d KiB",
		peak>>10, logTmpfsCap>>10, full, samples, fi.Size()>>10)
	su.figure("  log flood", fmt.Sprintf("log tmpfs peak %d KiB of %d KiB", peak>>10, logTmpfsCap>>10))
	if peak < 512<<10 {
		t.Errorf("the log held at most %d bytes: the flood did not reach it (session exit %+v, follow error %v, output %q)",
			peak, exit, followErr, out.String())
	}
	if peak > logTmpfsCap {
		t.Errorf("the log's file system held %d bytes, above its %d cap", peak, logTmpfsCap)
	}
	if out := su.mustSh(t, sb.ID, "echo alive"); out != "alive\n" {
		t.Errorf("the sandbox after the log flood: %q", out)
	}
}

// attackSessions: one key opens 2,000 command sessions in one sandbox, 8 at a time:
// 1,900 run to completion (exec) and 100 are created and never attached (each holds
// a gated process in the sandbox until the sandbox ends). The server
// keeps answering (the prober; /healthz each round), its memory stays bounded, and the
// sandbox answers afterwards.
func attackSessions(t *testing.T, su *suite) {
	const ran, idle, workers = 1900, 100, 8
	sb := su.create(t, api.CreateSandboxRequest{MemoryMB: 1024})
	rssBefore := rssKB(su.s.Pid())
	stopRSS := su.rssWatch()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	var next, okRan, okIdle, failed atomic.Int64
	var firstErr sync.Once
	var wg sync.WaitGroup
	t0 := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				i := next.Add(1)
				if i > ran+idle {
					return
				}
				var err error
				if i%20 == 0 { // every twentieth is left unattached
					_, err = su.s.C.CreateSession(ctx, sb.ID, api.CreateSessionRequest{Argv: []string{"true"}})
					if err == nil {
						okIdle.Add(1)
					}
				} else {
					var code int
					code, err = su.s.C.Exec(ctx, sb.ID, api.CreateSessionRequest{Argv: []string{"true"}}, client.Output{})
					if err == nil && code == 0 {
						okRan.Add(1)
					} else if err == nil {
						err = fmt.Errorf("exit %d", code)
					}
				}
				if err != nil {
					failed.Add(1)
					firstErr.Do(func() { t.Logf("first failed session (#%d): %v", i, err) })
				}
			}
		}()
	}
	// The server's own health endpoint answers throughout.
	var healthMax time.Duration
	healthDone := make(chan struct{})
	go func() {
		defer close(healthDone)
		for ctx.Err() == nil && next.Load() <= ran+idle {
			h0 := time.Now()
			resp, err := http.Get(su.s.URL + "/healthz")
			if err == nil {
				resp.Body.Close()
			}
			healthMax = max(healthMax, time.Since(h0))
			time.Sleep(100 * time.Millisecond) // sampling period
		}
	}()
	wg.Wait()
	took := time.Since(t0)
	<-healthDone
	peak := stopRSS()
	t.Logf("%d sessions ran, %d left unattached, %d failed in %v; slowest /healthz %v; server RSS %d KiB before, peak %d KiB",
		okRan.Load(), okIdle.Load(), failed.Load(), took.Round(time.Millisecond), healthMax.Round(time.Millisecond), rssBefore, peak)
	su.figure("  sessions", fmt.Sprintf("%d ran + %d idle, %d failed in %v; RSS %d→%d KiB", okRan.Load(), okIdle.Load(), failed.Load(), took.Round(time.Second), rssBefore, peak))
	if ctx.Err() != nil {
		t.Errorf("2,000 sessions did not finish within 150 s (%d done)", next.Load())
	}
	if okRan.Load() < ran*9/10 {
		t.Errorf("only %d of %d sessions ran", okRan.Load(), ran)
	}
	if peak-rssBefore > 64<<10 {
		t.Errorf("space serve RSS grew by %d KiB for 2,000 sessions", peak-rssBefore)
	}
	if healthMax > 2*time.Second {
		t.Errorf("/healthz took %v while sessions were opened", healthMax)
	}
	su.waitAnswers(t, sb.ID, time.Minute)
	// Every session's process is visible (bounded retention) and the list is served.
	if procs, err := su.s.C.ListProcesses(e2etest.Ctx(t, time.Minute), sb.ID); err != nil {
		t.Errorf("list processes after 2,000 sessions: %v", err)
	} else {
		b, _ := json.Marshal(len(procs))
		t.Logf("processes listed afterwards: %s", b)
	}
}
