package cgroupwatch

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
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
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("watch of a removed cgroup: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the watch did not end when its cgroup was removed")
	}
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
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("watch ended by its context: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the watch did not end with its context")
	}
}

// A directory that is not a memory cgroup is refused at once.
func TestNotACgroup(t *testing.T) {
	err := Memory(context.Background(), t.TempDir(), 1<<20, func(int64) {})
	if !errors.Is(err, ErrNoMemoryController) {
		t.Fatalf("got %v, want ErrNoMemoryController", err)
	}
}
