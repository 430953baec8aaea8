package cgroupwatch

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// helperEnv makes the test binary an allocator: each line on stdin makes it allocate
// and touch 8 MiB more, answered with a line; it exits at EOF.
const helperEnv = "CGROUPWATCH_TEST_ALLOCATE"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		var held [][]byte
		in, out := bufio.NewScanner(os.Stdin), bufio.NewWriter(os.Stdout)
		for in.Scan() {
			if path, ok := strings.CutPrefix(in.Text(), "write "); ok {
				// Writes 96 MiB to the file path and syncs it: file cache, clean.
				f, err := os.Create(path)
				if err == nil {
					chunk := make([]byte, 1<<20)
					for range 96 {
						if _, err = f.Write(chunk); err != nil {
							break
						}
					}
					if err == nil {
						err = f.Sync()
					}
					f.Close()
				}
				fmt.Fprintln(out, err)
				out.Flush()
				continue
			}
			b := make([]byte, 8<<20)
			for i := range len(b) / 4096 {
				b[i*4096] = 1
			}
			held = append(held, b)
			fmt.Fprintln(out, len(held)*8)
			out.Flush()
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// v1Cgroup makes a memory cgroup of its own under the host's v1 memory hierarchy, or
// skips.
func v1Cgroup(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a cgroup")
	}
	root := "/sys/fs/cgroup/memory"
	if !exists(filepath.Join(root, "cgroup.event_control")) {
		t.Skip("no cgroup v1 memory hierarchy on this host")
	}
	dir := filepath.Join(root, fmt.Sprintf("cgroupwatch-test-%d", os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// The helper's exit empties it; removal may need a moment for its charge to go.
		deadline := time.Now().Add(10 * time.Second)
		for {
			err := os.Remove(dir)
			if err == nil || errors.Is(err, os.ErrNotExist) || time.Now().After(deadline) {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	return dir
}

// allocator starts the helper inside the cgroup dir.
type allocator struct {
	cmd *exec.Cmd
	in  *os.File
	out *bufio.Scanner
}

func startAllocator(t *testing.T, dir string) *allocator {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	stdin, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdin = stdin
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stdin.Close()
	a := &allocator{cmd: cmd, in: w, out: bufio.NewScanner(out)}
	t.Cleanup(a.stop)
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0); err != nil {
		t.Fatal(err)
	}
	return a
}

// more makes the helper hold 8 MiB more and returns how much it holds.
func (a *allocator) more(t *testing.T) int {
	t.Helper()
	if _, err := a.in.WriteString("more\n"); err != nil {
		t.Fatal(err)
	}
	if !a.out.Scan() {
		t.Fatalf("allocator: %v", a.out.Err())
	}
	n, _ := strconv.Atoi(a.out.Text())
	return n
}

func (a *allocator) stop() {
	a.in.Close()
	if a.cmd.ProcessState == nil {
		_ = a.cmd.Wait()
	}
}

// Reclaim tells each reclaim of the cgroup's memory, and nothing while the cgroup rests:
// a cgroup that file cache fills to its limit is told of the cache's reclaim as a
// process grows into it (its usage stays at the limit, so no threshold would say so),
// and the watch ends with the cgroup.
func TestReclaimV1(t *testing.T) {
	dir := v1Cgroup(t)
	if err := os.WriteFile(filepath.Join(dir, "memory.limit_in_bytes"), []byte(strconv.Itoa(64<<20)), 0); err != nil {
		t.Fatal(err)
	}
	if err := CanReclaim(dir); err != nil {
		t.Skipf("no reclaim notifications: %v", err)
	}
	a := startAllocator(t, dir)
	var events atomic.Int64
	done := make(chan error, 1)
	go func() { done <- Reclaim(context.Background(), dir, func() { events.Add(1) }) }()
	file := filepath.Join(t.TempDir(), "cache")
	if _, err := a.in.WriteString("write " + file + "\n"); err != nil {
		t.Fatal(err)
	}
	if !a.out.Scan() || a.out.Text() != "<nil>" {
		t.Fatalf("write 96 MiB in a 64 MiB cgroup: %q %v", a.out.Text(), a.out.Err())
	}
	usage, _ := readFileInt(filepath.Join(dir, "memory.usage_in_bytes"))
	t.Logf("after writing 96 MiB: usage %d MiB of 64, %d reclaim notifications", usage>>20, events.Load())
	// At rest nothing is told (a notification now would be the kernel's own late one).
	time.Sleep(200 * time.Millisecond) // let a late notification of the write land
	before := events.Load()
	time.Sleep(time.Second) // at rest: a second of no reclaim
	if n := events.Load(); n != before {
		t.Errorf("%d reclaim notifications while the cgroup rested", n-before)
	}
	held := a.more(t) // 8 MiB more: the kernel takes it from the cache
	deadline := time.Now().Add(5 * time.Second)
	for events.Load() == before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond) // poll interval
	}
	if events.Load() == before {
		t.Fatalf("a process took %d MiB in a cgroup full of file cache and no reclaim was told", held)
	}
	a.stop()
	deadline = time.Now().Add(10 * time.Second)
	for err := os.Remove(dir); err != nil; err = os.Remove(dir) {
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	ended(t, done, "the removal of its cgroup")
}

// A rise above the threshold is reported with the usage; the watch ends without an
// error when its cgroup is removed.
func TestMemoryV1(t *testing.T) {
	dir := v1Cgroup(t)
	a := startAllocator(t, dir)
	base, err := readFileInt(filepath.Join(dir, "memory.usage_in_bytes"))
	if err != nil {
		t.Fatal(err)
	}
	threshold := base + 40<<20
	rises := make(chan int64, 16)
	done := make(chan error, 1)
	go func() { done <- Memory(context.Background(), dir, threshold, func(u int64) { rises <- u }) }()
	var held int
	var rise int64
	for held < 160 && rise == 0 {
		held = a.more(t)
		select {
		case rise = <-rises:
		case err := <-done:
			t.Fatalf("the watch ended: %v", err)
		default: // no rise yet: allocate more
		}
	}
	if rise == 0 {
		select { // the kernel notifies with the charge; the watch's goroutine may lag
		case rise = <-rises:
		case <-time.After(5 * time.Second):
			t.Fatalf("holding %d MiB above a %d MiB base, no rise over the threshold (base + 40 MiB) was reported", held, base>>20)
		}
	}
	if rise < threshold {
		t.Fatalf("reported %d, under the threshold %d", rise, threshold)
	}
	t.Logf("rise reported at %d MiB (threshold %d MiB) with %d MiB held", rise>>20, threshold>>20, held)
	a.stop()
	deadline := time.Now().Add(10 * time.Second)
	for err := os.Remove(dir); err != nil; err = os.Remove(dir) {
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	ended(t, done, "the removal of its cgroup")
}

// Usage that stays above the threshold is reported again once it grew by v1Growth (a
// reaction that freed too little while something goes on allocating), and not again
// while it holds still.
func TestMemoryV1GrowthAbove(t *testing.T) {
	dir := v1Cgroup(t)
	a := startAllocator(t, dir)
	base, err := readFileInt(filepath.Join(dir, "memory.usage_in_bytes"))
	if err != nil {
		t.Fatal(err)
	}
	threshold := base + 24<<20
	rises := make(chan int64, 16)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = Memory(ctx, dir, threshold, func(u int64) { rises <- u }) }()
	next := func(what string) int64 {
		t.Helper()
		select {
		case u := <-rises:
			return u
		case <-time.After(5 * time.Second):
			t.Fatalf("no report %s", what)
			return 0
		}
	}
	for held := 0; held < 40; {
		held = a.more(t)
	}
	first := next("of the rise")
	a.more(t) // 8 MiB more, still above
	second := next("of the growth above the threshold")
	if second < first+v1Growth {
		t.Fatalf("reported %d MiB, then %d MiB: want a growth of %d MiB", first>>20, second>>20, v1Growth>>20)
	}
	select {
	case u := <-rises:
		t.Fatalf("reported again at %d MiB while the usage held still", u>>20)
	case <-time.After(2*v2Quiet + v2Quiet/2):
	}
	t.Logf("reported at %d MiB, again at %d MiB (threshold %d MiB)", first>>20, second>>20, threshold>>20)
}

// A watch ends without an error when its context does.
func TestMemoryV1Cancel(t *testing.T) {
	dir := v1Cgroup(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Memory(ctx, dir, 1<<30, func(int64) {}) }()
	cancel()
	ended(t, done, "its context")
}

// ended waits for a watch to end (its result on done) and fails if it did not, or
// with an error.
func ended(t *testing.T, done <-chan error, by string) {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the watch ended by %s: %v", by, err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("the watch did not end with %s", by)
	}
}

// waitHigh waits until the watch has set dir's memory.high to threshold.
func waitHigh(t *testing.T, dir string, threshold int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(dir, "memory.high"))
		if strings.TrimSpace(string(b)) == strconv.FormatInt(threshold, 10) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("memory.high is %q, want the threshold %d", b, threshold)
		}
		time.Sleep(time.Millisecond) // poll interval
	}
}

// A directory that is not a memory cgroup is refused at once.
func TestNotACgroup(t *testing.T) {
	err := Memory(context.Background(), t.TempDir(), 1<<20, func(int64) {})
	if !errors.Is(err, ErrNoMemoryController) {
		t.Fatalf("got %v, want ErrNoMemoryController", err)
	}
}

// v2Files is a directory that looks like a cgroup v2 memory cgroup to watchV2: the
// kernel's files as regular files, which the test rewrites in place (one pwrite of a
// fixed width, so that the watch never reads one half-written) to play the kernel's
// part. This host's memory controller is bound to cgroup v1, so v2's path runs
// against the real kernel only in TestMemoryV2Kernel, on a host whose memory
// controller is on cgroup v2.
type v2Files struct {
	t   *testing.T
	dir string
}

func newV2Files(t *testing.T) v2Files {
	f := v2Files{t: t, dir: t.TempDir()}
	f.set(0, 1<<20)
	if err := os.WriteFile(filepath.Join(f.dir, "memory.high"), []byte("max\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

// set writes the usage, then the "high" count (the kernel counts after it charges).
func (f v2Files) set(high, current int64) {
	f.t.Helper()
	write := func(name, content string) {
		file, err := os.OpenFile(filepath.Join(f.dir, name), os.O_WRONLY|os.O_CREATE, 0o644)
		if err != nil {
			f.t.Fatal(err)
		}
		defer file.Close()
		if _, err := file.WriteAt([]byte(content), 0); err != nil {
			f.t.Fatal(err)
		}
	}
	write("memory.current", fmt.Sprintf("%020d\n", current))
	write("memory.events", fmt.Sprintf("low 0\nhigh %020d\nmax 0\noom 0\noom_kill 0\n", high))
}

func (f v2Files) high() string {
	f.t.Helper()
	b, err := os.ReadFile(filepath.Join(f.dir, "memory.high"))
	if err != nil {
		f.t.Fatal(err)
	}
	return string(b)
}

// On cgroup v2 the watch sets memory.high to the threshold, reports a rise of the
// "high" count with the usage, at most once a v2Quiet while the usage stays above, not
// when the usage is back under the threshold, ends without an error when the cgroup is
// removed, and sets memory.high back to "max".
func TestMemoryV2(t *testing.T) {
	f := newV2Files(t)
	const threshold = 64 << 20
	rises := make(chan int64, 16)
	done := make(chan error, 1)
	go func() { done <- Memory(context.Background(), f.dir, threshold, func(u int64) { rises <- u }) }()
	waitHigh(t, f.dir, threshold)
	next := func(what string) int64 {
		t.Helper()
		select {
		case u := <-rises:
			return u
		case err := <-done:
			t.Fatalf("the watch ended (%v) before the report %s", err, what)
		case <-time.After(5 * time.Second):
			t.Fatalf("no report %s", what)
		}
		return 0
	}
	none := func(what string, d time.Duration) {
		t.Helper()
		select {
		case u := <-rises:
			t.Fatalf("reported %d %s", u, what)
		case <-time.After(d):
		}
	}
	f.set(3, 70<<20)
	start := time.Now()
	if u := next("of the rise"); u != 70<<20 {
		t.Fatalf("reported %d, want the usage %d", u, 70<<20)
	}
	f.set(4, 72<<20)
	none("again within v2Quiet", v2Quiet/2)
	for time.Since(start) < v2Quiet+v2Quiet/10 {
		time.Sleep(10 * time.Millisecond) // until the quiet time has passed
	}
	f.set(5, 74<<20)
	if u := next("of usage that stays above after v2Quiet"); u != 74<<20 {
		t.Fatalf("reported %d, want %d", u, 74<<20)
	}
	time.Sleep(v2Quiet + v2Quiet/10) // the quiet time, so that only the usage holds it back
	f.set(6, 60<<20)
	none("while the usage is under the threshold", v2Quiet/2)
	f.set(6, 60<<20) // an unchanged count: nothing to report either
	none("for an unchanged count", v2Quiet/4)
	if err := os.Remove(filepath.Join(f.dir, "memory.events")); err != nil {
		t.Fatal(err)
	}
	ended(t, done, "the removal of its cgroup")
	if got := f.high(); got != "max" {
		t.Fatalf("memory.high after the watch: %q, want max", got)
	}
}

// A v2 watch ends without an error when its context does, and sets memory.high back.
func TestMemoryV2Cancel(t *testing.T) {
	f := newV2Files(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Memory(ctx, f.dir, 1<<30, func(int64) {}) }()
	waitHigh(t, f.dir, 1<<30)
	cancel()
	ended(t, done, "its context")
	if got := f.high(); got != "max" {
		t.Fatalf("memory.high after the watch: %q, want max", got)
	}
}

// TestMemoryV2Kernel runs the v2 watch against the kernel: a cgroup of its own under
// a cgroup v2 hierarchy whose root delegates the memory controller, and the allocator
// in it. It skips on hosts whose memory controller is on cgroup v1 (as this project's
// CI machines').
func TestMemoryV2Kernel(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a cgroup")
	}
	root := ""
	for _, r := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"} {
		if b, err := os.ReadFile(filepath.Join(r, "cgroup.subtree_control")); err == nil && slices.Contains(strings.Fields(string(b)), "memory") {
			root = r
			break
		}
	}
	if root == "" {
		t.Skip("no cgroup v2 hierarchy with the memory controller on this host")
	}
	dir := filepath.Join(root, fmt.Sprintf("cgroupwatch-test-%d", os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		deadline := time.Now().Add(10 * time.Second)
		for err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) && time.Now().Before(deadline); err = os.Remove(dir) {
			time.Sleep(10 * time.Millisecond)
		}
	})
	a := startAllocator(t, dir)
	base, err := readFileInt(filepath.Join(dir, "memory.current"))
	if err != nil {
		t.Fatal(err)
	}
	threshold := base + 40<<20
	rises := make(chan int64, 16)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = Memory(ctx, dir, threshold, func(u int64) { rises <- u }) }()
	waitHigh(t, dir, threshold)
	var rise int64
	for held := 0; held < 160 && rise == 0; {
		held = a.more(t)
		select {
		case rise = <-rises:
		default: // no rise yet: allocate more
		}
	}
	if rise == 0 {
		select {
		case rise = <-rises:
		case <-time.After(5 * time.Second):
			t.Fatalf("no rise over the threshold (base %d MiB + 40 MiB) was reported", base>>20)
		}
	}
	if rise < threshold {
		t.Fatalf("reported %d, under the threshold %d", rise, threshold)
	}
}
